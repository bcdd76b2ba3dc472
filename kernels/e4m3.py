"""FP8 E4M3 (float8_e4m3fn) casts: nearest-even with an explicit clamp, and stochastic rounding.

E4M3: max 448, smallest normal 2**-6, subnormal step 2**-9, no Inf, NaN = 0x7F/0xFF.
``cast_rn`` clamps to [-448, 448] before ``.to(torch.float8_e4m3fn)``: eager
casts saturate only from torch 2.13 (older ones give NaN above 464), and the
clamp also matches TE's ``fminf(v, 448)`` / the satfinite cvt. The cast itself
is IEEE round-to-nearest-even, subnormals included.

``round_stochastic`` follows the rule in stochastic.py with the E4M3 grid:
step = 2**(max(floor(log2 |y|), -6) - 3), lo = floor(|y| / step) * step. Every
op is exact (power-of-two scalings of an fp32 value), so frac is exact.

Leaves out: E5M2, and NaN handling (callers decide what a NaN block becomes).
"""

from __future__ import annotations

import torch

from rl4bit.kernels.stochastic import E4M3_SR_BITS, round_up

E4M3_MAX = 448.0
E4M3_MIN_NORMAL_EXP = -6
E4M3_MANTISSA_BITS = 3


def cast_rn(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, clamp to +-448 first, then round-to-nearest-even."""
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2**exponent for an integer tensor (exact, subnormal results included)."""
    return torch.exp2(exponent.to(torch.float32))


def fp32_exponent(a: torch.Tensor) -> torch.Tensor:
    """Unbiased exponent field of fp32 a as int32 (a subnormal or zero gives -127)."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def round_stochastic(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn of fp32 y (|y| <= 448 after the clamp) with stochastic rounding.

    r: the element's 16 random bits (integers 0..65535, ``stochastic.element_bits(..., E4M3_SR_BITS, ...)``).
    a = min(|y|, 448); e = max(exponent(a), -6); step = 2**(e - 3);
    lo = floor(a / step) * step; frac = (a - lo) / step; up iff floor(65536 * frac) + r >= 65536;
    magnitude = lo + up * step (exactly representable in E4M3); sign of y kept.
    """
    a = torch.clamp(y.abs(), max=E4M3_MAX)
    e = torch.clamp(fp32_exponent(a), min=E4M3_MIN_NORMAL_EXP)
    step = pow2(e - E4M3_MANTISSA_BITS)
    lo = torch.floor(a / step) * step
    frac = (a - lo) / step
    mag = torch.where(round_up(r, frac, E4M3_SR_BITS), lo + step, lo)
    mag = torch.clamp(mag, max=E4M3_MAX)  # lo = 448 has frac = 0; kept as a guard
    return torch.where(torch.signbit(y), -mag, mag).to(torch.float8_e4m3fn)
