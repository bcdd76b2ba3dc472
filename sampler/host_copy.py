"""Small host-to-device copies that do not make the host wait for the GPU.

`torch.tensor(values, device="cuda")`, `.to("cuda")` and `copy_` from pageable
host memory end with a stream synchronize (torch's blocking copy), so each one
waits for every kernel queued before it. The engine's decode step makes a few
such copies (token ids, positions, temperatures, noise keys), and with the next
step already queued (`EmbeddedEngine._decode_ahead`) each would wait for it.
Here the values go through pinned memory with `non_blocking=True`; torch's
caching host allocator holds the pinned block until the copy has run.

Leaves out: device-to-host reads (the engine reads those behind an event).
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of `values` (a list, nested lists, or a CPU tensor) on `device`, copied without a host wait."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device=device, dtype=dtype)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)
