"""E8M0 block-scale exponents (OCP MX v1.0): RCEIL and FLOOR, and power-of-two scalings.

E8M0 byte e encodes 2**(e - 127); 0xFF is NaN; there is no zero and no Inf. Both modes clamp to [0, 254].

- ``rceil_biased(d)``: smallest power of two >= d (cuBLAS / TE ``cvt.rp.satfinite.ue8m0``); d = amax /
  element_max, one fp32 division by the caller (torchao ``_to_mx_rceil``: ``max_abs / max_pos``).
- ``floor_biased(amax, emax)``: OCP ``floor(log2 amax) - emax`` (torchao ``ScaleCalculationMode.FLOOR``).
- ``encode_multiplier(e)``: 2**(127 - e); multiplying by it is exact in fp32.

Formulas: docs/numerics.md, "Element formats". Leaves out: NaN/Inf amax (callers map NaN blocks to 0xFF and
reject Inf), and torchao's RCEIL fallback quirks (log2 in fp32; scale 1 for e = 0), which differ only on
blocks with amax/448 below the fp32 normal range.
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_FINITE = 254


def rceil_biased(d: torch.Tensor) -> torch.Tensor:
    """int32 biased E8M0 exponent of the smallest power of two >= d (fp32, finite, >= 0).

    The biased exponent field of fp32 d plus 1 if its mantissa is non-zero, clamped to [0, 254] (cuBLAS / TE
    ``cvt.rp.satfinite.ue8m0``). d = amax / element_max is one fp32 division done by the caller.

    A subnormal d has exponent field 0: E8M0's smallest scale, 2**-127 (byte 0, fp32 bits 0x400000), covers
    d <= 2**-127, and 2**-126 (byte 1) the rest (TE's ``float_to_e8m0``: 0 where exponent == 0 and mantissa
    <= 0x400000)."""
    bits = d.view(torch.int32)
    field = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    e = torch.where(field == 0, (man > 0x400000).to(torch.int32), field + (man != 0).to(torch.int32))
    return torch.clamp(e, 0, E8M0_MAX_FINITE)


def floor_biased(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """int32 biased E8M0 exponent floor(log2 amax) - emax (fp32 amax, finite, >= 0).

    Read from the exponent field of amax, clamped to [0, 254] (OCP; torchao ``ScaleCalculationMode.FLOOR``)."""
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - emax
    return torch.clamp(e, 0, E8M0_MAX_FINITE)


def to_e8m0(biased: torch.Tensor) -> torch.Tensor:
    """int biased exponents (0..255) -> float8_e8m0fnu."""
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def encode_multiplier(biased: torch.Tensor) -> torch.Tensor:
    """fp32 2**(127 - e): multiplying by it divides by the block scale exactly.

    torch.exp2 of an integer is exact in fp32, e = 254 (2**-127, subnormal) included."""
    return torch.exp2((E8M0_BIAS - biased).to(torch.float32))
