"""The Sampler actor with `backend: vllm`: built from a converted model, synced by buckets and by tensors.

Run: bash scripts/test_vllm.sh
"""

from __future__ import annotations

import pytest
import torch

from rl4bit.config import SamplerConfig
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler.types import Request, SamplingParams, WeightUpdate
from rl4bit.trainer.tokenizer import build_tokenizer
from rl4bit.trainer.weight_sync import WeightSender, WeightSyncError

from .conftest import ALIVE, ON_GPU, SAMPLER_GPU_MEMORY, make_model, prompts

KV_GIB = 0.25 if ON_GPU else 0.125
CONFIG = SamplerConfig(backend="vllm", max_batch_size=8, gpu_memory_utilization=SAMPLER_GPU_MEMORY,
                       kv_cache_gib=KV_GIB)
"""A small KV cache each, as beside a trainer on one GPU: the session's other engines hold theirs
(conftest.GPU_ENGINE_KW). 0.125 GiB on the CPU: not the engine's CPU default (64 MiB), so the setting shows."""


def _greedy(s, ps):
    return [r.completion_ids for r in s.generate(
        [Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=8)) for i, p in enumerate(ps)])]


def test_vllm_sampler_syncs_buckets_from_the_trainer(engine, engine_b, models, tmp_path):
    ps = prompts(4, seed=17)
    model_a, _ = make_model(0)
    s = Sampler(model_a, build_tokenizer(), CONFIG, max_seq_len=128, workdir=str(tmp_path / "sampler"))
    ALIVE.append(s)
    assert _greedy(s, ps) == _greedy(engine, ps)  # its own export of A = the fixture's (every test leaves A served)
    h = s.health()
    assert h["backend"] == "vllm" and h["ok"] and h["version"] == 0 and h["tokens_generated"] > 0
    assert s.engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == int(KV_GIB * 2**30)

    trainer_b, plan_b = models["B"]
    sender = WeightSender(trainer_b, plan_b, bucket_bytes=40_000)
    assert sender.num_buckets > 1
    s.begin_update(1, sender.num_buckets, sender.layout())
    for b in sender.buckets(1):
        s.receive_bucket(b)
    assert s.commit_update(1) == 1
    assert _greedy(s, ps) == _greedy(engine_b, ps)
    phases = s.update_phases()  # what the driver logs as sync/<phase>_s
    assert {"check", "reload", "repack", "reset"} <= set(phases) and all(v >= 0 for v in phases.values()), phases
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
    s = Sampler(model, build_tokenizer(), CONFIG, max_seq_len=128)
    ALIVE.append(s)
    owned = [Path(t.name) for t in s.engine.temp_dirs if isinstance(t, tempfile.TemporaryDirectory)]
    assert any((d / "export" / "config.json").is_file() for d in owned)
    assert s.engine.workdir.parent in owned  # vLLM's model directories inside it too


def test_vllm_sampler_takes_the_trainers_tensors_and_keeps_its_own_copy(engine_b, models, tmp_path):
    """The direct path (`Sampler.apply_tensors`; `WeightSender.tensors` hands over the trainer's live parameters
    as its dense tensors): vLLM serves B, and a later change to the sender's tensors (the trainer's next
    optimizer step) does not leak into what the engine keeps: a later partial update re-encodes the untouched
    weights from the engine's own copy, so it still serves B."""
    import copy

    ps = prompts(4, seed=23)
    model_a, _ = make_model(0)
    s = Sampler(model_a, build_tokenizer(), CONFIG, max_seq_len=128, workdir=str(tmp_path / "sampler"))
    ALIVE.append(s)
    assert s.accepts_tensors()
    trainer_b = copy.deepcopy(models["B"][0])
    update, quantized = WeightSender(trainer_b, models["B"][1]).tensors(1)
    assert s.apply_tensors(update, quantized) == 1
    want_b = _greedy(engine_b, ps)
    assert _greedy(s, ps) == want_b
    name = "model.norm.weight"
    kept = update.tensors[name].detach().clone()
    with torch.no_grad():  # the trainer moves on: its live parameters change
        for t in update.tensors.values():
            t.mul_(-1)
    s.engine.update_weights(WeightUpdate(2, {name: kept}))  # partial: the rest from the engine's own copy
    assert s.version == 2 and _greedy(s, ps) == want_b
