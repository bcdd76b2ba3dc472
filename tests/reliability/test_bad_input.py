"""Bad input refused at load: every config field rejects a value of the wrong type, naming its key path.

(Per-field ranges, prompt files with file:line, per-request sampling parameters and the 16/32 shape rules
have their own tests: tests/foundation/test_config.py, tests/rl/test_rewards_tasks.py::test_prompt_files,
tests/sampler/test_engine.py::test_bad_requests_fail_alone, tests/kernels/test_api.py.)
"""

import dataclasses
import typing

import pytest

from rl4bit.config import ConfigError, JobConfig, load_config


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


LEAVES = list(_leaves(JobConfig))


def test_there_are_many_fields():
    assert len(LEAVES) > 40 and "trainer.lr" in LEAVES and "rewards.timeout_s" in LEAVES


@pytest.mark.parametrize("key", LEAVES)
def test_every_field_rejects_a_mapping_naming_its_key(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={{bogus: 1}}"])
    assert key in str(e.value), f"the error must name {key}: {e.value}"
