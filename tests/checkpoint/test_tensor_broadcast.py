"""Weight updates as tensors over torch.distributed (`rl4bit.trainer.tensor_broadcast`), gloo, 3 processes: a
trainer's update reaches two embedded samplers bit for bit and serves what the direct path serves; a refused,
failed or unallocatable update, and a sender that cannot describe its own, fail-stop on every rank.

The NCCL form (a GPU a rank, three GPUs) has not run: the project's machines lend one GPU at most."""

from __future__ import annotations

import pytest
import torch
from tensor_broadcast_helpers import worker


def test_gloo_tensor_broadcast_three_processes(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(3, str(tmp_path / "pg")), nprocs=3, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA devices (nccl, a GPU a rank)")
def test_nccl_tensor_broadcast_three_gpus(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(3, str(tmp_path / "pg"), "nccl"), nprocs=3, join=True)
