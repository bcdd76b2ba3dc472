"""Host -> device copies that do not stop the host: `to_device(cpu_tensor, device)`.

A tensor built on the host (index lists, padded rollout values) copied to the
GPU from pageable memory makes the host wait until the GPU has finished the
work queued before it, so the host cannot queue the next kernels while the
GPU runs: each such copy inside a training step serialized host and device.
From pinned memory the copy is queued like a kernel (non_blocking) and the
host runs on; PyTorch's pinned-memory allocator keeps the staging block
alive until the copy has completed. Values are unchanged.

In the kernels layer because the kernels' launchers make such copies too
(the wgrad segment table, the attention tables); every layer above imports it
from here.

Leaves out: device -> host reads (`.item()`, `.tolist()`), which must wait.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t.to(device)`; a CPU tensor bound for CUDA goes through pinned memory, queued without a host wait."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
