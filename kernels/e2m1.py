"""FP4 E2M1 element rounding (nearest-even with saturation, stochastic) and nibble packing.

Codes: sign in bit 3, magnitude index 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Round to nearest, ties to the even code, |y| > 6 saturates to 6 (satfinite).
Matches TransformerEngine ``custom_recipes/reference_nvfp4.py`` /
``cvt.rn.satfinite.e2m1x2.f32``, torchao ``_f32_to_floatx_unpacked`` and
compressed-tensors ``fp4_utils.cast_to_fp4``. The sign bit is the sign bit of
the fp32 input, so -0.1 gives code 8 (-0), as all three peers do.
Packing: element 2i in the low nibble, 2i+1 in the high one (torchao
``pack_uint4``, compressed-tensors ``pack_fp4_to_uint8``).

Leaves out: NaN/Inf (E2M1 holds neither; callers reject them before rounding)
and Quartet-II's ties-away-from-zero ``rtn_fp4``.
"""

from __future__ import annotations

import functools

import torch

from rl4bit.kernels.stochastic import E2M1_SR_BITS, round_up

E2M1_MAX = 6.0
# Magnitude of each code 0..7 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Grid spacing above each magnitude (the last entry is never used: 6 never rounds up).
E2M1_STEPS = (0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0)
# Value of each code 0..15: the magnitudes, then their negations (code 8 is -0.0).
E2M1_SIGNED = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)


def _table(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _sign_bit(y: torch.Tensor) -> torch.Tensor:
    """Bit 31 of fp32 y as uint8 0/1 (so -0.0 counts as negative)."""
    return torch.signbit(y).to(torch.uint8)


def round_nearest(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) of fp32 y, round-to-nearest-even, saturating at 6.

    The magnitude index counts the decision thresholds |y| passes; at a tie the
    comparison is strict when the lower code is even (0.25, 1.25, 2.5, 5 stay
    down) and non-strict when the upper code is even (0.75, 1.75, 3.5 go up).
    """
    a = y.abs()
    idx = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return idx | (_sign_bit(y) << 3)


def round_stochastic(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of fp32 y with stochastic rounding (rule in stochastic.py), saturating at 6.

    r: the element's 8 random bits (integers 0..255, ``stochastic.element_bits(..., E2M1_SR_BITS, ...)``).
    a = min(|y|, 6); lo = largest grid magnitude <= a (index from thresholds);
    frac = (a - lo) / step(lo) is exact (Sterbenz, power-of-two steps); the
    index goes up by one iff floor(256 * frac) + r >= 256. At a = 6, frac = 0: never up.
    """
    a = torch.clamp(y.abs(), max=E2M1_MAX)
    idx = (
        (a >= 0.5).to(torch.uint8)
        + (a >= 1.0).to(torch.uint8)
        + (a >= 1.5).to(torch.uint8)
        + (a >= 2.0).to(torch.uint8)
        + (a >= 3.0).to(torch.uint8)
        + (a >= 4.0).to(torch.uint8)
        + (a >= 6.0).to(torch.uint8)
    )
    lo = _table(E2M1_VALUES, y.device)[idx.long()]
    step = _table(E2M1_STEPS, y.device)[idx.long()]
    frac = (a - lo) / step
    idx = idx + round_up(r, frac, E2M1_SR_BITS).to(torch.uint8)
    return idx | (_sign_bit(y) << 3)


def codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8 0..15); code 8 decodes to -0.0. One gather from the 16 values."""
    return _table(E2M1_SIGNED, codes.device)[codes.long()]


@functools.lru_cache(maxsize=None)
def _pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the values of a packed byte's low and high nibble (pack's order)."""
    signed = _table(E2M1_SIGNED, device)
    byte = torch.arange(256, device=device)
    return torch.stack((signed[byte & 0x0F], signed[byte >> 4]), dim=-1).contiguous()


def unpack_to_float(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] packed codes -> fp32 values [..., K]: `codes_to_float(unpack(packed))` as one row gather
    per byte from a 256-entry table (same values, -0.0 included; ~12x faster on a CPU)."""
    pairs = torch.nn.functional.embedding(packed.long(), _pair_table(packed.device))
    return pairs.flatten(-2)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes -> uint8 [..., K/2]: element 2i low nibble, 2i+1 high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack {codes.shape[-1]} E2M1 codes into bytes: the last dimension must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of pack)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
