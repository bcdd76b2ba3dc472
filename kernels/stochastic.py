"""The stochastic-rounding rule shared by every format (reference and Triton alike).

For a magnitude y (fp32, already scaled; the caller handles the sign) between grid neighbours lo <= y < hi,
step = hi - lo (a power of two), and n the bits an element of the target format takes (8 E2M1, 16 E4M3):

    r    = element_bits(seed, shape, n)       # sr_bits of each element's flat output index (philox.py)
    frac = (y - lo) / step                    # fp32, exact on the E2M1/E4M3 grids
    up   = round_up(r, frac, n)               # floor(2**n * frac) + r >= 2**n; y on the grid never goes up

TransformerEngine's software SR ("u = r / 2**n, add u * step, truncate") written exactly; ``round_up`` gives
its bias, docs/numerics.md ("Stochastic rounding") the bit layout.

Leaves out: hardware SR (``cvt.rs``, sm_100a only); the lane order of its ``rbits`` operand is not public, so
a Blackwell kernel would permute bytes to reproduce these bits.
"""

from __future__ import annotations

import torch

from rl4bit.kernels.philox import sr_bits_range

E2M1_SR_BITS = 8  # random bits an E2M1 element takes (NVFP4 SR)
E4M3_SR_BITS = 16  # random bits an E4M3 element takes (MXFP8 SR, the backward's requantize)


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


def element_bits(seed: int, shape: torch.Size, n_bits: int, device: torch.device) -> torch.Tensor:
    """int64 r = sr_bits(seed, offset, n_bits) for every element of an output of `shape`.

    The offset of an element is its flat row-major index in that output (for requantize: in the transposed
    output), so the bits do not depend on the launch geometry and the Triton kernels reproduce them exactly.
    One Philox call serves 16 consecutive E2M1 elements (four bytes of each of its four words) or 8
    consecutive E4M3 elements (two 16-bit halves of each word).
    """
    return sr_bits_range(seed, int(torch.Size(shape).numel()), n_bits, device).reshape(shape)


def round_up(r: torch.Tensor, frac: torch.Tensor, n_bits: int) -> torch.Tensor:
    """True where the value goes to the upper neighbour: floor(2**n * frac) + r >= 2**n.

    frac (fp32, in [0, 1)) times 2**n is exact, so its floor is the first n bits of frac. This rounds up with
    probability floor(2**n * frac) / 2**n, so E[SR(y)] - y lies in (-step / 2**n, 0]: at most 1/256 of a step
    for E2M1 and 2**-16 for E4M3.
    """
    kept = torch.floor(frac * float(2**n_bits)).to(torch.int64)
    return kept + r.to(torch.int64) >= 2**n_bits
