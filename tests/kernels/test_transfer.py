"""kernels.transfer.to_device: the same values on the target device; CPU tensors reach CUDA through pinned memory."""

import pytest
import torch

from rl4bit.kernels.transfer import to_device


def test_cpu_to_cpu_is_a_plain_move():
    t = torch.arange(10, dtype=torch.int64)
    out = to_device(t, "cpu")
    assert out.device.type == "cpu" and out.dtype == t.dtype and torch.equal(out, t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tensors_reach_the_gpu_intact_while_the_host_runs_on():
    g = torch.Generator().manual_seed(0)
    outs, wants = [], []
    busy = torch.randn(4096, 4096, device="cuda")
    for i in range(50):  # the staging blocks are freed right away; the copies must still read them intact
        busy = busy @ busy.T / 4096  # keep the GPU busy so the copies queue behind it
        t = torch.randint(0, 2**40, (1000 + i,), generator=g)
        wants.append(t.clone())
        outs.append(to_device(t, "cuda"))
        del t
    torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), w) for o, w in zip(outs, wants))
