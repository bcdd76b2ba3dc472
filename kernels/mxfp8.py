"""MXFP8 quantize / dequantize in plain PyTorch: E4M3 elements, E8M0 scale per 32 (OCP MX v1.0), the reference.

    q = quantize_mxfp8(x, rounding="nearest", scale_mode="rceil")   # or rounding="stochastic", seed=...
    q = quantize_mxfp8_columnwise(x)    # 32x1 blocks: a [..., K, M] QTensor from x [..., M, K] itself
    x_hat = dequantize_mxfp8(q)

Peers: torchao ``prototype/mx_formats/mx_tensor.py`` (``to_mx``, ``_to_mx_rceil``), TE ``mxfp8.rst`` /
``util/ptx.cuh``, cuBLAS block scaling. ``quantize_mxfp8`` states the per-block formula, NaN/Inf handling
and the SR bits (also docs/numerics.md, "MXFP8"). Columnwise MXFP8 comes from high precision, never from the
rowwise codes (TE ``mxfp8.rst``).

Leaves out: E5M2/FP6/FP4 elements, torchao's EVEN/CEIL modes, swizzled scales.
"""

from __future__ import annotations

import torch

from rl4bit.kernels import e4m3
from rl4bit.kernels.checks import check_choice, check_input
from rl4bit.kernels.e8m0 import E8M0_NAN, encode_multiplier, floor_biased, rceil_biased, to_e8m0
from rl4bit.kernels.qtensor import QTensor
from rl4bit.kernels.stochastic import E4M3_SR_BITS, check_seed, element_bits

BLOCK = 32
E4M3_EMAX = 8  # floor(log2(448))
E4M3_NAN_BYTE = 0x7F
SCALE_MODES = ("rceil", "floor")


def block_exponent(b: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """int32 biased E8M0 exponent per block from fp32 block amax b (finite; NaN handled by caller)."""
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if scale_mode == "rceil":
        d = b / torch.tensor(e4m3.E4M3_MAX, dtype=torch.float32, device=b.device)
        return rceil_biased(d)
    return floor_biased(b, E4M3_EMAX)


def quantize_mxfp8(
    x: torch.Tensor, *, rounding: str = "nearest", seed=None, scale_mode: str = "rceil"
) -> QTensor:
    """MXFP8 QTensor of x, blocks of 32 along the last dim.

    Per block of 32, fp32:

        b     = amax(|x|)
        RCEIL (default): e = rceil_biased(b / 448)           # smallest 2**k >= b/448: no saturation
        FLOOR:           e = floor_biased(b, 8)              # OCP floor(log2 b) - 8: values > 448 saturate
        y     = x * 2**(127 - e)                             # exact power-of-two scaling
        data  = e4m3_RN(clamp(y, -448, 448))                 # or SR (e4m3.round_stochastic)
        x_hat = f32(data) * 2**(e - 127)

    NaN in a block -> scale byte 0xFF and every element byte 0x7F (canonical NaN), so the block decodes to NaN.
    Inf -> ValueError (a non-finite activation or gradient in a training path is a bug to surface, not a value;
    TE maps it to 0xFE, torchao HEAD to 0xFF). SR needs no scale shrink with RCEIL: |y| <= 448 and 448 is on
    the grid. SR takes 16 random bits an element: element o (its flat index in x) takes half o % 2 of word
    (o // 2) % 4 of the Philox call for counter o // 8 (stochastic.py).
    """
    check_input(x, "mxfp8", BLOCK, allow_nan=True)
    check_choice("rounding", rounding, ("nearest", "stochastic"))
    x32 = x.to(torch.float32)
    k = x32.shape[-1]
    xb = x32.unflatten(-1, (k // BLOCK, BLOCK))
    b = xb.abs().amax(dim=-1)
    nan_block = torch.isnan(b)
    e = block_exponent(torch.where(nan_block, torch.zeros_like(b), b), scale_mode)
    y = xb * encode_multiplier(e).unsqueeze(-1)
    y = torch.where(nan_block.unsqueeze(-1), torch.zeros_like(y), y)  # NaN blocks are overwritten below
    if rounding == "nearest":
        data = e4m3.cast_rn(y)
    else:
        r = element_bits(check_seed(seed, "mxfp8"), x32.shape, E4M3_SR_BITS, x32.device)
        data = e4m3.round_stochastic(y, r.unflatten(-1, (k // BLOCK, BLOCK)))
    data = torch.where(nan_block.unsqueeze(-1), torch.full_like(data.view(torch.uint8), E4M3_NAN_BYTE),
                       data.view(torch.uint8))
    e = torch.where(nan_block, torch.full_like(e, E8M0_NAN), e)
    outer = torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
    return QTensor(
        data=data.view(torch.float8_e4m3fn).flatten(-2), scale=to_e8m0(e), outer=outer, fmt="mxfp8", shape=x.shape
    )


def quantize_mxfp8_columnwise(x: torch.Tensor, **kw) -> QTensor:
    """MXFP8 of x with blocks of 32 along dim -2: quantizes x.transpose(-1, -2) from high precision.

    Returns a [..., K, M] QTensor; never derived from the rowwise codes (TE ``mxfp8.rst``)."""
    if x.dim() < 2:
        raise ValueError(f"mxfp8 columnwise needs at least 2 dims, got shape {tuple(x.shape)}")
    return quantize_mxfp8(x.transpose(-1, -2).contiguous(), **kw)


def dequantize_mxfp8(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = f32(e4m3 data) * f32(e8m0 scale); a 0xFF scale gives NaN."""
    k = q.data.shape[-1]
    blocks = q.data.to(torch.float32).unflatten(-1, (k // BLOCK, BLOCK)) * q.scale.to(torch.float32).unsqueeze(-1)
    return blocks.flatten(-2).reshape(q.shape).to(dtype)
