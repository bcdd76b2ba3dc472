"""Ranks of tests/checkpoint/test_tensor_broadcast.py (spawned processes import them from here): rank 0 a trainer,
the others embedded samplers, one group (gloo on CPU; NCCL with a GPU a rank)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from rl4bit.config import load_config, trainer_args
from rl4bit.sampler.actor import Sampler
from rl4bit.trainer.actor import TrainBatch, Trainer
from rl4bit.trainer.models import build_policy_model
from rl4bit.trainer.surgery import quant_modules
from rl4bit.trainer.tensor_broadcast import broadcast_tensors, group_backend
from rl4bit.trainer.weight_sync import WeightSyncError

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
        "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32", "run.cpu_threads=1",
        "run.warmup_sft_steps=0", "rl.ppo_epochs=1", "ray.mode=local", "trainer.device=cpu", "recipe.name=nvfp4"]


def _config(device: str):
    return load_config(QUICKSTART, TINY + [f"trainer.device={device}"])


def trained(device: str = "cpu") -> Trainer:
    """The same trainer on every rank (fixed seed): one optimizer step past its start, version 2."""
    trainer = Trainer(**trainer_args(_config(device)))
    trainer.setup_rl()
    batch = TrainBatch([[5, 6, 7], [8, 9]], [[10, 11], [12]], [[-1.0, -1.0], [-1.0]], [1.0, -1.0])
    trainer.train_step(batch)
    return trainer


def sampler(trainer: Trainer, device: str = "cpu") -> Sampler:
    """An embedded sampler built from another seed: a sync must change its weights."""
    cfg = _config(device)
    return Sampler(lambda: build_policy_model(cfg.model, cfg.recipe, cfg.run.seed + 1), trainer.tokenizer,
                   cfg.sampler, device=device, max_seq_len=cfg.model.max_seq_len)


def served(s: Sampler) -> dict[str, torch.Tensor]:
    """Everything a sampler serves, copied: QTensor fields `q.{module}.{param}.{field}` and the dense state dict."""
    out = {f"dense.{k}": v.detach().clone() for k, v in s.engine.model.state_dict().items()}
    for name, m in quant_modules(s.engine.model).items():
        for param, q in (m.served or {}).items():
            for field in ("data", "scale", "outer"):
                out[f"q.{name}.{param}.{field}"] = getattr(q, field).clone()
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def worker(rank: int, world: int, init_file: str, backend: str = "gloo") -> None:
    import torch.distributed as dist

    from rl4bit.trainer.sharding import bind_world_defaults_early

    device = "cpu"
    if backend == "nccl":  # a GPU a rank
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    bind_world_defaults_early()
    dist.init_process_group(group_backend(backend), init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        trainer = trained("cuda" if backend == "nccl" else "cpu")
        update, quantized = trainer.weight_tensors()
        if rank == 0:
            assert broadcast_tensors(0, update=update, quantized=quantized) == trainer.version
            # a receiver's checks refuse the update, another's apply fails: every rank hears of the first
            with pytest.raises(WeightSyncError, match="failed on rank 1.*refused by the test"):
                broadcast_tensors(0, update=update, quantized=quantized)
            # a receiver cannot allocate: nothing moves
            with pytest.raises(WeightSyncError, match="rank 2 could not take the update.*MemoryError"):
                broadcast_tensors(0, update=update, quantized=quantized)
            # the sender cannot describe its update: the receivers get the abort marker
            bad = {**quantized, "oops": {"weight": torch.zeros(2)}}
            with pytest.raises(WeightSyncError, match="sender failed before the header.*oops.weight.*not a QTensor"):
                broadcast_tensors(0, update=update, quantized=bad)
            # gloo moves CPU tensors: a tensor on another device is refused before the header
            update.tensors["lm_head.weight"] = update.tensors["lm_head.weight"].to("meta")
            with pytest.raises(WeightSyncError, match="sender failed before the header.*lm_head.weight is on meta"):
                broadcast_tensors(0, update=update, quantized=quantized)
        else:
            s = sampler(trainer, device)
            got = []

            def apply(u, q):
                got.append((u, q))
                return s.apply_tensors(u, q)

            assert broadcast_tensors(0, apply=apply, device=device) == trainer.version == s.version
            u, q = got[0]
            assert u.version == update.version and u.tensors.keys() == update.tensors.keys()
            assert all(bits_equal(u.tensors[k], v) for k, v in update.tensors.items())
            for module, params in quantized.items():
                for param, want in params.items():
                    have = q[module][param]
                    assert (have.fmt, have.shape) == (want.fmt, want.shape)
                    assert all(bits_equal(getattr(have, f), getattr(want, f)) for f in ("data", "scale", "outer"))
            # what it serves is what the direct in-process path serves
            direct = sampler(trainer, device)
            direct.apply_tensors(update, quantized)
            want = served(direct)
            assert all(bits_equal(v, want[k]) for k, v in served(s).items())

            def refuse(u, q):
                raise WeightSyncError("refused by the test")

            def broken(u, q):
                raise RuntimeError("copy failed")

            mine = "refused by the test" if rank == 1 else "failed on rank 2 while applying v2.*copy failed.*partly"
            with pytest.raises(WeightSyncError, match=mine):  # each failing rank raises its own error
                broadcast_tensors(0, apply=refuse if rank == 1 else broken, device=device)
            if rank == 2:
                import unittest.mock as mock

                from rl4bit.trainer import tensor_broadcast

                with mock.patch.object(tensor_broadcast, "_allocate", side_effect=MemoryError("no room")):
                    with pytest.raises(WeightSyncError, match="could not take the update.*keeps serving"):
                        broadcast_tensors(0, apply=apply, device=device)
            else:
                with pytest.raises(WeightSyncError, match="rank 2 could not take the update"):
                    broadcast_tensors(0, apply=apply, device=device)
            for _ in range(2):
                with pytest.raises(WeightSyncError, match="sender failed before the header"):
                    broadcast_tensors(0, apply=apply, device=device)
            assert s.version == trainer.version and len(got) == 1  # nothing applied after the first update
        dist.barrier()
    finally:
        dist.destroy_process_group()
