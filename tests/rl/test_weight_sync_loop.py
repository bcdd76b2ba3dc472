"""The RL loop's weight sync (sampler_sync.sync_weights, local mode, forced onto buckets): quantized bytes, bitwise
serving, k3 == 0, fail-stop. The direct in-process path local mode takes by default: tests/test_sync_direct.py.

Run: /work/venv-probe/bin/python -P -m pytest tests/rl/test_weight_sync_loop.py -q
"""

import dataclasses

import pytest
import torch
from safetensors.torch import load

from rl4bit.actors import Cluster
from rl4bit.config import load_config, trainer_args
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.sampler_sync import WEIGHT_SYNC_ENV, sync_weights
from rl4bit.trainer.actor import TrainBatch, Trainer
from rl4bit.trainer.models import build_policy_model
from rl4bit.trainer.surgery import quant_modules, quantized_weights
from rl4bit.trainer.tokenizer import build_tokenizer
from rl4bit.trainer.weight_sync import WeightSyncError

from .conftest import QUICKSTART

MAX_SYNC_FRACTION_OF_FP32 = 0.5
"""nvfp4: bytes shipped per sampler / FP32 bytes of the same model (expert weights ~4.5 of 32 bits, the rest FP32)."""
MAX_EXPERT_FRACTION_OF_BF16 = 0.3
"""nvfp4: stored expert bytes (codes + E4M3 scales + global scales) / their BF16 bytes (4.5 / 16 = 0.28)."""


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_serves_trainer(sampler, trainer):
    want = quantized_weights(trainer.model)
    assert want, "the nvfp4 recipe quantizes the experts"
    served = {n: m.served for n, m in quant_modules(sampler.engine.model).items() if m.served is not None}
    assert set(served) == set(want)
    for module, params in want.items():
        for param, q in params.items():
            for f in ("data", "scale", "outer"):
                mine, theirs = _bits(getattr(q, f)), _bits(getattr(served[module][param], f))
                n = int((mine != theirs).sum())
                assert n == 0, f"{module}.{param}.{f}: {n} values differ"
    sd = trainer.model.state_dict()
    for k, v in sampler.engine.model.state_dict().items():
        assert torch.equal(v, sd[k]), k


def _rollouts_and_train(trainer, sampler, seed):
    reqs = [Request(str(i), trainer.tokenizer(p, add_special_tokens=False).input_ids,
                    SamplingParams(max_new_tokens=6, n=3, seed=seed + i))
            for i, p in enumerate(["1+2=", "33+4=", "9+90="])]
    outs = sampler.generate(reqs)
    assert {o.policy_version for o in outs} == {sampler.version}
    batch = TrainBatch([o.prompt_ids for o in outs], [o.completion_ids for o in outs], [o.logprobs for o in outs],
                       [1.0, -1.0, 0.5] * 3)
    return trainer.train_step(batch)


def test_nvfp4_sync_ships_quantized_tensors_and_k3_stays_zero(tmp_path, small, monkeypatch):
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "buckets")  # the bucket protocol, corrupt buckets included
    # experts a bit wider than `small`'s, so they (not safetensors headers) dominate the bytes, as in real models
    cfg = load_config(QUICKSTART, small + ["ray.mode=local", "rl.ppo_epochs=1", "model.num_experts=8",
                                           "model.expert_intermediate_size=64"])
    cluster = Cluster(cfg, tmp_path)
    trainer_p = cluster.actor(Trainer, **trainer_args(cfg))
    sampler_p = cluster.actor(Sampler, lambda: build_policy_model(cfg.model, cfg.recipe, cfg.run.seed),
                              build_tokenizer(), cfg.sampler, device="cpu", max_seq_len=cfg.model.max_seq_len)
    trainer, sampler = trainer_p._obj, sampler_p._obj  # local mode: the plain objects behind the proxies
    trainer.setup_rl()
    experts = [n for n, _ in sampler.engine.model.named_parameters() if "experts" in n]
    assert not experts, f"the sampler holds master copies of quantized weights: {experts[:2]}"

    sd = trainer.model.state_dict()
    fp32_bytes = sum(v.numel() * 4 for v in sd.values())
    bf16_expert_bytes = sum(v.numel() * 2 for k, v in sd.items() if ".experts." in k)
    _, count, _ = trainer.weight_header()
    stored = [load(trainer.weight_bucket(i).payload) for i in range(count)]
    expert_bytes = sum(t.nbytes for b in stored for k, t in b.items() if ".experts." in k)
    assert 0 < expert_bytes < MAX_EXPERT_FRACTION_OF_BF16 * bf16_expert_bytes, (expert_bytes, bf16_expert_bytes)
    for step in (1, 2):
        shipped, seconds = sync_weights(trainer_p, [sampler_p])
        assert 0 < shipped < MAX_SYNC_FRACTION_OF_FP32 * fp32_bytes, (shipped, fp32_bytes)
        assert seconds > 0 and sampler.version == trainer.version == step
        _assert_serves_trainer(sampler, trainer)
        m = _rollouts_and_train(trainer, sampler, seed=10 * step)
        assert m["mismatch/k3"] == 0.0  # the sampler served the trainer's QTensors bit for bit
        assert trainer.version == step + 1

    # fail-stop: a corrupt bucket is rejected, the previous version keeps serving, bit for bit
    served_before = {k: v.clone() for k, v in sampler.engine.model.state_dict().items()}
    q_before = {n: {p: q.data.clone() for p, q in m.served.items()}
                for n, m in quant_modules(sampler.engine.model).items()}
    good = trainer.weight_bucket

    def corrupt(i):
        b = good(i)
        blob = bytearray(b.payload)
        blob[len(blob) // 2] ^= 0x01
        return dataclasses.replace(b, payload=bytes(blob))

    trainer.weight_bucket = corrupt
    with pytest.raises(WeightSyncError, match=r"bucket 0.*job stops"):
        sync_weights(trainer_p, [sampler_p])
    assert sampler.version == 2
    assert all(torch.equal(v, served_before[k]) for k, v in sampler.engine.model.state_dict().items())
    for n, m in quant_modules(sampler.engine.model).items():
        assert all(torch.equal(q.data, q_before[n][p]) for p, q in m.served.items())
    trainer.weight_bucket = good
    sync_weights(trainer_p, [sampler_p])  # the next good update still goes through
    assert sampler.version == 3
    _assert_serves_trainer(sampler, trainer)
