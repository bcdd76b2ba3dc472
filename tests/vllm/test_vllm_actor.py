"""The Sampler actor with `backend: vllm`: built from a converted model, synced through rl4bit.trainer.weight_sync
buckets.

Run: bash scripts/test_vllm.sh
"""

from __future__ import annotations

import pytest

from rl4bit.config import SamplerConfig
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.trainer.tokenizer import build_tokenizer
from rl4bit.trainer.weight_sync import WeightSender, WeightSyncError

from .conftest import ALIVE, make_model, prompts


def _greedy(s, ps):
    return [r.completion_ids for r in s.generate(
        [Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=8)) for i, p in enumerate(ps)])]


def test_vllm_sampler_syncs_buckets_from_the_trainer(engine, engine_b, models, tmp_path):
    ps = prompts(4, seed=17)
    model_a, _ = make_model(0)
    s = Sampler(model_a, build_tokenizer(), SamplerConfig(backend="vllm", max_batch_size=8), max_seq_len=128,
                workdir=str(tmp_path / "sampler"))
    ALIVE.append(s)
    assert _greedy(s, ps) == _greedy(engine, ps)  # its own export of A = the fixture's (every test leaves A served)
    h = s.health()
    assert h["backend"] == "vllm" and h["ok"] and h["version"] == 0 and h["tokens_generated"] > 0

    trainer_b, plan_b = models["B"]
    sender = WeightSender(trainer_b, plan_b, bucket_bytes=40_000)
    assert sender.num_buckets > 1
    s.begin_update(1, sender.num_buckets, sender.layout())
    for b in sender.buckets(1):
        s.receive_bucket(b)
    assert s.commit_update(1) == 1
    assert _greedy(s, ps) == _greedy(engine_b, ps)
    assert s.generate([Request("v", ps[0], SamplingParams(max_new_tokens=2))])[0].policy_version == 1

    # a corrupt bucket drops the update; v1 keeps serving
    s.begin_update(2, sender.num_buckets, sender.layout())
    bad = next(iter(sender.buckets(2)))
    bad.payload = bad.payload[:-1] + bytes([bad.payload[-1] ^ 1])
    with pytest.raises(WeightSyncError):
        s.receive_bucket(bad)
    assert s.version == 1 and _greedy(s, ps) == _greedy(engine_b, ps)


def test_a_sampler_without_workdir_owns_its_temporary_export():
    """Without a workdir (the driver passes none) the export and vLLM's model directories go in a temporary
    directory the engine owns, removed with it; before, a `mkdtemp` per sampler (two copies of the model) stayed
    behind in /tmp for every replica, run and restart."""
    import tempfile
    from pathlib import Path

    model, _ = make_model(0)
    s = Sampler(model, build_tokenizer(), SamplerConfig(backend="vllm", max_batch_size=8), max_seq_len=128)
    ALIVE.append(s)
    owned = [Path(t.name) for t in s.engine.temp_dirs if isinstance(t, tempfile.TemporaryDirectory)]
    assert any((d / "export" / "config.json").is_file() for d in owned)
    assert s.engine.workdir.parent in owned  # vLLM's model directories inside it too
