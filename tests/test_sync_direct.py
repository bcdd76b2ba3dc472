"""The direct (in-process) weight sync: bitwise the bucket sync's served weights and rollouts, fail-stop on a bad
update, and the path the driver takes in local mode (a real run, compared metric by metric with a bucket run).

Run: .venv/bin/python -P -m pytest tests/test_sync_direct.py -q
"""

import dataclasses

import pytest
import torch

from rl4bit import driver, sampler_sync
from rl4bit.actors import Cluster
from rl4bit.config import ConfigError, load_config, trainer_args
from rl4bit.metrics import read_metrics
from rl4bit.rundir import create_run_dir
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler.types import Request, SamplingParams, WeightUpdate
from rl4bit.trainer.actor import TrainBatch, Trainer
from rl4bit.trainer.models import build_policy_model
from rl4bit.trainer.surgery import quantized_weights
from rl4bit.trainer.tokenizer import build_tokenizer
from rl4bit.trainer.weight_sync import WeightSyncError, update_bytes

from .checkpoint.tensor_broadcast_helpers import served
from .rl.conftest import QUICKSTART, SMALL, deadline_of, learned

RECIPES = ["nvfp4", "bf16", "mxfp8"]


def _cfg(recipe: str, *extra: str):
    return load_config(QUICKSTART, SMALL + ["ray.mode=local", "rl.ppo_epochs=1", "run.warmup_sft_steps=0",
                                            f"recipe.name={recipe}", *extra])


def _train_step(trainer: Trainer) -> None:
    """One optimizer step on a fixed batch: new masters, version + 1."""
    version = trainer.version
    batch = TrainBatch([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], [[10, 11], [12, 13], [14], [15, 16]],
                       [[-1.0, -1.0], [-1.0, -1.0], [-1.0], [-1.0, -1.0]], [1.0, -1.0, 0.5, -0.5])
    trainer.train_step(batch)
    assert trainer.version == version + 1


def _trained(recipe: str) -> Trainer:
    """A trainer one optimizer step past its start (version 2): masters no longer the samplers' built-in weights."""
    trainer = Trainer(**trainer_args(_cfg(recipe)))
    trainer.setup_rl()
    _train_step(trainer)
    return trainer


def _sampler(trainer: Trainer) -> Sampler:
    """An embedded sampler whose own weights (another seed) differ from the trainer's: a sync must change them."""
    cfg = _cfg(trainer.recipe.name)
    return Sampler(lambda: build_policy_model(cfg.model, cfg.recipe, cfg.run.seed + 1), trainer.tokenizer, cfg.sampler,
                   device="cpu", max_seq_len=cfg.model.max_seq_len)


def _bucket_sync(trainer: Trainer, sampler: Sampler) -> None:
    version, count, layout = trainer.weight_header()
    sampler.begin_update(version, count, layout)
    for i in range(count):
        sampler.receive_bucket(trainer.weight_bucket(i))
    assert sampler.commit_update(version) == version


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_bitwise(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        n = int((_bits(got[k]) != _bits(want[k])).sum())
        assert n == 0, f"{k}: {n} of {want[k].numel()} values differ"


def _rollouts(sampler: Sampler):
    ids = sampler.engine.tokenizer
    reqs = [Request(str(i), ids(p, add_special_tokens=False).input_ids, SamplingParams(max_new_tokens=6, n=3, seed=i))
            for i, p in enumerate(["1+2=", "33+4=", "9+90="])]
    return [(r.completion_ids, r.logprobs, r.policy_version) for r in sampler.generate(reqs)]


# --------------------------------------------------------------------------- bitwise the bucket path


@pytest.mark.parametrize("recipe", RECIPES)
def test_direct_sync_serves_bitwise_what_the_bucket_sync_serves(recipe):
    trainer = _trained(recipe)
    by_buckets, direct = _sampler(trainer), _sampler(trainer)
    before = served(direct)
    _bucket_sync(trainer, by_buckets)
    update, quantized = trainer.weight_tensors()
    assert direct.apply_tensors(update, quantized) == trainer.version == by_buckets.version == direct.version
    got = served(direct)
    _assert_bitwise(got, served(by_buckets))
    changed = [k for k in got if not torch.equal(_bits(got[k]), _bits(before[k]))]
    assert len(changed) > len(got) // 2, "the sync replaced the sampler's own weights"

    want_q = quantized_weights(trainer.model)  # and these are the trainer forward's own QTensors
    assert {m: set(p) for m, p in quantized.items()} == {m: set(p) for m, p in want_q.items()}
    assert bool(quantized) == (recipe != "bf16")
    for module, params in want_q.items():
        for param, q in params.items():
            for field in ("data", "scale", "outer"):
                assert torch.equal(_bits(getattr(quantized[module][param], field)), _bits(getattr(q, field)))
    assert _rollouts(direct) == _rollouts(by_buckets)


# --------------------------------------------------------------------------- fail-stop


@pytest.fixture(scope="module")
def synced():
    """(trainer, sampler) with the sampler serving the trainer's version 2 through the direct path."""
    trainer = _trained("nvfp4")
    sampler = _sampler(trainer)
    sampler.apply_tensors(*trainer.weight_tensors())
    return trainer, sampler


def _damaged(update: WeightUpdate, quantized: dict, damage: str, version: int):
    """A copy of the update stamped `version`, with one tensor made bad (the trainer's own tensors untouched)."""
    dense, q = dict(update.tensors), {m: dict(p) for m, p in quantized.items()}
    last_dense = [k for k, v in dense.items() if v.is_floating_point() and v.dim() == 2][-1]
    module = list(q)[-1]  # the last module: nothing before it may be applied either
    param = sorted(q[module])[-1]
    if damage == "nan_dense":
        t = dense[last_dense].clone()
        t.view(-1)[t.numel() // 2] = float("nan")
        dense[last_dense] = t
    elif damage == "shape_dense":
        dense[last_dense] = dense[last_dense][:-1]
    elif damage == "inf_outer":
        old = q[module][param]
        q[module][param] = dataclasses.replace(old, outer=torch.full_like(old.outer, float("inf")))
    elif damage == "shape_codes":
        qt = q[module][param]
        q[module][param] = dataclasses.replace(qt, data=qt.data[..., :-1].contiguous())
    elif damage == "missing":
        del dense[last_dense]
    elif damage == "not_a_qtensor":
        q[module][param] = q[module][param].data
    return WeightUpdate(version, dense), q


BAD = {"nan_dense": "NaN/Inf", "shape_dense": "shape", "inf_outer": "NaN/Inf", "shape_codes": "shape",
       "missing": "lacks 1 tensor", "not_a_qtensor": "not a QTensor"}
"""damage -> what the WeightSyncError names."""


@pytest.mark.parametrize("damage", list(BAD))
def test_rejected_direct_update_keeps_the_old_version_serving(synced, damage):
    trainer, sampler = synced
    version, before = sampler.version, served(sampler)
    masters = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    update, quantized = trainer.weight_tensors()
    bad, bad_q = _damaged(update, quantized, damage, version + 1)
    with pytest.raises(WeightSyncError, match=rf"v{version + 1} does not fit this model: .*{BAD[damage]}.*"
                                              rf"v{version} keeps serving"):
        sampler.apply_tensors(bad, bad_q)
    assert sampler.version == version
    _assert_bitwise(served(sampler), before)
    assert all(torch.equal(v, masters[k]) for k, v in trainer.model.state_dict().items()), "the trainer is untouched"
    assert _rollouts(sampler)  # and still serves


def test_stale_direct_update_is_refused_and_the_next_good_one_applies(synced):
    trainer, sampler = synced
    version, before = sampler.version, served(sampler)
    update, quantized = trainer.weight_tensors()
    with pytest.raises(WeightSyncError, match=rf"v{version} is not newer than the serving v{version}"):
        sampler.apply_tensors(update, quantized)
    _assert_bitwise(served(sampler), before)
    newer = WeightUpdate(version + 1, update.tensors)
    assert sampler.apply_tensors(newer, quantized) == version + 1 == sampler.version
    _assert_bitwise(served(sampler), before)  # the same weights, now stamped v+1


def test_a_vllm_sampler_takes_the_direct_path_too(synced, monkeypatch, tmp_path):
    """vLLM samplers check a whole update and keep their own copy (`VLLMEngine.update_weights`), as the embedded
    engine does: accepts_tensors() holds and the driver hands tensors over directly in local mode (what vLLM
    then serves: tests/vllm/test_vllm_actor.py, in the vLLM venv)."""
    from rl4bit.sampler.vllm_engine import VLLMEngine

    trainer, sampler = synced
    engine = VLLMEngine.__new__(VLLMEngine)  # its type is what counts; building one needs vLLM
    engine._version = sampler.version
    monkeypatch.setattr(sampler, "engine", engine)
    assert sampler.accepts_tensors()
    local = Cluster(_cfg(trainer.recipe.name), tmp_path)
    assert local.mode == "local"
    assert sampler_sync.direct_sync(local.actor(lambda: trainer), [local.actor(lambda: sampler)])


def test_direct_sync_predicate(synced, monkeypatch, tmp_path):
    trainer, sampler = synced
    local = Cluster(_cfg(trainer.recipe.name), tmp_path)
    t, s = local.actor(lambda: trainer), local.actor(lambda: sampler)
    assert sampler_sync.direct_sync(t, [s])
    assert not sampler_sync.direct_sync(trainer, [sampler]), "plain objects are not in-process actors"
    monkeypatch.setenv(sampler_sync.WEIGHT_SYNC_ENV, "buckets")
    assert not sampler_sync.direct_sync(t, [s])
    monkeypatch.setenv(sampler_sync.WEIGHT_SYNC_ENV, "fast")
    with pytest.raises(ConfigError, match="RL4BIT_WEIGHT_SYNC='fast'"):
        sampler_sync.direct_sync(t, [s])


def test_shared_sync_predicate(synced, monkeypatch, tmp_path):
    """CUDA IPC only where the trainer's GPU is every sampler's (by UUID), never on the CPU or with buckets asked
    for. (The IPC itself runs on a GPU: tests/trainer/test_cuda_ipc.py.)"""
    trainer, sampler = synced
    local = Cluster(_cfg(trainer.recipe.name), tmp_path)
    t, s = local.actor(lambda: trainer), local.actor(lambda: sampler)
    assert trainer.gpu_uuid() is None and not sampler_sync.shared_sync(t, [s])  # CPU here
    monkeypatch.setattr(trainer, "gpu_uuid", lambda: "GPU-a")
    monkeypatch.setattr(sampler, "gpu_uuid", lambda: "GPU-a")
    assert sampler_sync.shared_sync(t, [s])
    monkeypatch.setattr(sampler, "gpu_uuid", lambda: "GPU-b")
    assert not sampler_sync.shared_sync(t, [s])
    monkeypatch.setattr(sampler, "gpu_uuid", lambda: "GPU-a")
    monkeypatch.setenv(sampler_sync.WEIGHT_SYNC_ENV, "buckets")
    assert not sampler_sync.shared_sync(t, [s])


# --------------------------------------------------------------------------- the driver


def _spy(monkeypatch) -> dict:
    """Count the real calls of the sampler's two ways in (they still run)."""
    calls = {"apply_tensors": 0, "receive_bucket": 0}
    for name in calls:
        real = getattr(Sampler, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(Sampler, name, counted)
    return calls


def test_sync_weights_fails_stop_on_a_bad_direct_update(tmp_path, monkeypatch):
    cfg = _cfg("nvfp4")
    cluster = Cluster(cfg, tmp_path)
    trainer_p = cluster.actor(Trainer, **trainer_args(cfg))
    sampler_p = cluster.actor(Sampler, lambda: build_policy_model(cfg.model, cfg.recipe, cfg.run.seed + 1),
                              build_tokenizer(), cfg.sampler, device="cpu", max_seq_len=cfg.model.max_seq_len)
    trainer, sampler = trainer_p._obj, sampler_p._obj
    trainer.setup_rl()
    calls = _spy(monkeypatch)
    shipped, seconds = sampler_sync.sync_weights(trainer_p, [sampler_p])
    assert calls == {"apply_tensors": 1, "receive_bucket": 0}
    update, quantized = trainer.weight_tensors()
    fp32_bytes = sum(v.numel() * 4 for v in trainer.model.state_dict().values())
    assert shipped == update_bytes(update, quantized) and seconds > 0
    assert 0 < shipped < fp32_bytes, "the experts go as NVFP4 codes, the rest as FP32 masters"
    assert sampler.version == trainer.version == 1

    _train_step(trainer)
    before = served(sampler)
    good = trainer.weight_tensors
    monkeypatch.setattr(trainer, "weight_tensors", lambda: _damaged(*good(), "nan_dense", trainer.version))
    with pytest.raises(WeightSyncError, match=r"v2 does not fit .*NaN/Inf.*v1 keeps serving.*the job stops"):
        sampler_sync.sync_weights(trainer_p, [sampler_p])
    assert sampler.version == 1
    _assert_bitwise(served(sampler), before)
    monkeypatch.setattr(trainer, "weight_tensors", good)
    sampler_sync.sync_weights(trainer_p, [sampler_p])  # the next good update goes through
    assert sampler.version == 2


def test_local_run_syncs_directly_with_the_metrics_of_a_bucket_run(tmp_path, monkeypatch):
    """A real local-mode job takes the direct path (sync/direct = 1, the sampler's apply_tensors called, no bucket);
    forced onto buckets, the same job logs the same metrics (rewards, losses, k3 == 0, eval), bytes and path aside."""
    cfg = load_config(QUICKSTART, SMALL + ["ray.mode=local", "run.tensorboard=false"])
    calls = _spy(monkeypatch)
    syncs = cfg.rl.steps + 1  # before step 1, then after every step
    for path in ("direct", "buckets"):
        if path == "buckets":
            monkeypatch.setenv(sampler_sync.WEIGHT_SYNC_ENV, "buckets")
        calls.update(apply_tensors=0, receive_bucket=0)
        with deadline_of(240, f"{path} RL run"):
            driver.run(cfg, create_run_dir(cfg, tmp_path / path))
        if path == "direct":
            assert calls == {"apply_tensors": syncs, "receive_bucket": 0}
        else:
            assert calls["apply_tensors"] == 0 and calls["receive_bucket"] >= syncs
    steps = {p: [r for r in read_metrics(tmp_path / p) if r["step"] >= 1] for p in ("direct", "buckets")}
    assert [r["sync/direct"] for r in steps["direct"]] == [1.0] * cfg.rl.steps
    assert [r["sync/direct"] for r in steps["buckets"]] == [0.0] * cfg.rl.steps
    assert all(r["mismatch/k3"] == 0.0 for r in steps["direct"])
    assert learned(read_metrics(tmp_path / "direct")) == learned(read_metrics(tmp_path / "buckets"))
