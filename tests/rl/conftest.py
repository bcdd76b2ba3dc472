"""Shared pieces of the RL-loop tests (tests/reliability imports them too): a small, fast variant of the
quickstart config, a deadline for test bodies, metrics without their timing keys."""

import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")

SMALL = [
    "model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
    "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32",
    "rl.steps=2", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.ppo_epochs=2",
    "run.warmup_sft_steps=3", "run.warmup_batch_size=8", "run.cpu_threads=1", "run.progress=false",
    "data.eval_size=8", "data.eval_every=2", "run.checkpoint_every=2", "sampler.max_new_tokens=6",
    "trainer.device=cpu",
]
"""Overrides that shrink the quickstart to seconds per step (same code paths: nvfp4 recipe, embedded sampler)."""


@pytest.fixture
def small():
    return list(SMALL)

TIMING = ("time/", "rollout/tokens_per_s", "sync/seconds")
"""Prefixes of the metrics that measure time: they differ between two otherwise equal runs."""


def strip_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


TRANSPORT = ("sync/bytes", "sync/direct")
"""Metrics that say how the weights travelled (direct in-process or buckets), not what was learned."""


def learned(records: list[dict], also: tuple = ()) -> list[dict]:
    """The records without timing, transport and the `also` keys: what two equal runs must agree on."""
    return [{k: v for k, v in r.items() if k not in TRANSPORT and k not in also} for r in strip_timing(records)]


@contextmanager
def deadline_of(seconds: int, what: str):
    """Raise TimeoutError (instead of hanging CI) if the block runs more than `seconds` (SIGALRM: main thread)."""
    def boom(*_):
        raise TimeoutError(f"{what} exceeded its {seconds} s deadline")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
