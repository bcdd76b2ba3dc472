"""S2F6 quantize / dequantize in plain PyTorch: int8 elements (value = int8/64), E8M0 scale per 32.

S2F6 (PTX ISA 9.1 ``cvt.*.s2f6x2``, sm_100a+) is the same element as OCP
MXINT8 (microxcaling ``formats.py``: int8 with emax 0); used for the MoE
combine after a 32-dim random Hadamard transform (hadamard.py). Spec
``shared/docs/numerics.md``. Per block of 32 along the last dim, fp32:

    b     = amax(|x|)
    e     = rceil_biased(b / f32(127/64))      # smallest 2**k >= b*64/127: no positive saturation
    y     = x * 2**(127 - e)                   # exact power-of-two scaling, |y| <= 127/64
    data  = int8(clamp(round_half_even(y * 64), -128, 127))
    x_hat = (f32(data) * f32(1/64)) * 2**(e - 127)

Leaves out: stochastic rounding (the combine rounds to nearest) and NaN/Inf,
which int8 cannot hold (ValueError; inside `checks.host_deferred()` recorded
instead, and the output is then garbage).
"""

from __future__ import annotations

import torch

from rl4bit.kernels.checks import check_choice, check_input
from rl4bit.kernels.e8m0 import encode_multiplier, rceil_biased, to_e8m0
from rl4bit.kernels.qtensor import QTensor

BLOCK = 32
S2F6_MAX = 127.0 / 64.0  # exact in fp32
FRACTION_SCALE = 64.0


def quantize_s2f6(x: torch.Tensor, *, rounding: str = "nearest") -> QTensor:
    """S2F6 QTensor of x, blocks of 32 along the last dim; round to nearest even."""
    check_input(x, "s2f6", BLOCK, allow_nan=False)
    check_choice("rounding (s2f6 supports nearest only)", rounding, ("nearest",))
    x32 = x.to(torch.float32)
    k = x32.shape[-1]
    xb = x32.unflatten(-1, (k // BLOCK, BLOCK))
    b = xb.abs().amax(dim=-1)
    e = rceil_biased(b / torch.tensor(S2F6_MAX, dtype=torch.float32, device=b.device))
    y = xb * encode_multiplier(e).unsqueeze(-1)
    q = torch.clamp(torch.round(y * FRACTION_SCALE), -128.0, 127.0).to(torch.int8)
    outer = torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
    return QTensor(data=q.flatten(-2), scale=to_e8m0(e), outer=outer, fmt="s2f6", shape=x.shape)


def dequantize_s2f6(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = (f32(int8) * 1/64) * f32(e8m0 scale)."""
    k = q.data.shape[-1]
    v = q.data.to(torch.float32) * (1.0 / FRACTION_SCALE)
    blocks = v.unflatten(-1, (k // BLOCK, BLOCK)) * q.scale.to(torch.float32).unsqueeze(-1)
    return blocks.flatten(-2).reshape(q.shape).to(dtype)
