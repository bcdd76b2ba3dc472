"""Weight updates as tensors over torch.distributed (`rl4bit.trainer.tensor_broadcast`), gloo, 3 processes: a
trainer's update reaches two embedded samplers bit for bit and serves what the direct path serves; a refused,
failed or unallocatable update, and a sender that cannot describe its own, fail-stop on every rank.

The same code moves CUDA tensors over NCCL (trainer and samplers on different GPUs); that has not run here
(one GPU at most)."""

from __future__ import annotations

from tensor_broadcast_helpers import worker


def test_gloo_tensor_broadcast_three_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(3, str(tmp_path / "pg")), nprocs=3, join=True)
