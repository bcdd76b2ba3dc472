"""The stochastic-rounding rule shared by every format (reference and Triton alike).

For a magnitude y (fp32, already scaled; the sign is handled by the caller) with
grid neighbours lo <= y <= hi, and step = hi - lo:

    r    = random_bits4(seed, offset)         # philox4x32(seed, offset // 4)[offset % 4]; uint32
    u    = float32(r >> 8)                    # exact: < 2**24
    frac = (y - lo) / step                    # fp32, exact on the E2M1/E4M3 grids
    up   = u < frac * 16777216.0              # P(up) = frac, so E[result] = y

``offset`` is the element's flat row-major index in the OUTPUT tensor of the
quantize (for requantize: in the transposed output). This makes the bits
independent of launch geometry, so the Triton kernels reproduce them exactly.
Each Philox4x32-10 call (counter = offset // 4) yields four uint32 streams;
stream offset % 4 goes to the element, so four consecutive elements share one
call (``philox.random_bits4``; ``philox_triton.philox_bits4`` in kernels).

Leaves out: hardware SR (``cvt.rs``, sm_100a only) and TE's add-and-truncate
emulation, whose random-bit usage differs.
"""

from __future__ import annotations

import torch

from rl4bit.kernels.philox import random_bits4_range

TWO_POW_24 = 16777216.0


def check_seed(seed, what: str) -> int:
    """The seed as a Python int, or a ValueError saying how to pass one."""
    if seed is None:
        raise ValueError(
            f"{what}: rounding='stochastic' needs a seed (an int in [0, 2**64)); pass seed=..., "
            "e.g. rl4bit.kernels.philox.derive_seed(run_seed, step, layer, tensor_id)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"{what}: seed must be an int in [0, 2**64), got {seed!r}")
    return int(seed)


def uniform24(seed: int, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """u = float32(random_bits4(seed, offset) >> 8) for every element of an output of `shape`.

    The offset of an element is its flat row-major index in that output.
    """
    r = random_bits4_range(seed, int(torch.Size(shape).numel()), device)
    return (r >> 8).to(torch.float32).reshape(shape)


def round_up(u: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """True where the value goes to the upper neighbour: u < frac * 2**24 (both fp32)."""
    return u < frac * TWO_POW_24
