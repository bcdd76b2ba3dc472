"""NVFP4 with "Four Over Six" block-scale selection (MSE, ties to 6), plain PyTorch: the reference.

    q = quantize_nvfp4_4over6(x, outer="row")     # activations: one outer scale per token

Cook et al., arXiv 2512.02010, repo mit-han-lab/fouroversix (MSE is its default; TE's is MAE). The outer
bound is 256 instead of 448, so the 1.5x ("scale to 4") block scale still fits E4M3; each block tries both
scales and keeps the one with the smaller squared error, summed in ``pairwise_sum16``'s fixed order so a kernel
reproduces it bit for bit. The fp32 op order: ``quantize_nvfp4_4over6``; docs/numerics.md, "4/6".

Leaves out: MAE/abs-max selection, stochastic rounding with 4/6 (the recipe uses 4/6 only for forward
activations, round-to-nearest), and 16x16 tiles.
"""

from __future__ import annotations

import torch

from rl4bit.kernels import e2m1
from rl4bit.kernels.checks import check_choice, check_input
from rl4bit.kernels.nvfp4 import (
    BLOCK,
    block_amax,
    block_encode_multiplier,
    block_scale,
    decode_blocks,
    encode_codes,
    encode_scale,
    f32,
    outer_amax,
)
from rl4bit.kernels.qtensor import QTensor

OUTER_BOUND = 256.0
SCALE_TO_4 = 1.5


def pairwise_sum16(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) as a fixed binary tree of fp32 additions: (t0+t1)+(t2+t3)...

    Adjacent pairs (0+1, 2+3, ...), then pairs of those, four levels: the order a kernel reproduces bit for bit."""
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t.squeeze(-1)


def quantize_nvfp4_4over6(x: torch.Tensor, *, outer: str = "tensor") -> QTensor:
    """NVFP4 QTensor of x with 4/6 block-scale selection (round-to-nearest).

    Per block, fp32 throughout, in this order:

        S_enc = 1536 / A  (same clamps as nvfp4.encode_scale);  S_dec = 1 / S_enc
        v     = b * (S_enc * f32(1/6))
        s6    = e4m3_RN(min(v, 448));   s4 = e4m3_RN(min(v * 1.5, 448))
        q_k   = e2m1_RN(x * enc(s_k));  x_hat_k = (q_k * f32(s_k)) * S_dec   (nvfp4.py helpers)
        err_k = pairwise_sum16((x - x_hat_k) * (x - x_hat_k))
        pick s4 iff err4 < err6          (ties -> 6)
    """
    check_input(x, "nvfp4", BLOCK, allow_nan=False)
    check_choice("outer", outer, ("tensor", "row", "group"))
    x32 = x.to(torch.float32)
    k = x32.shape[-1]
    s_enc = encode_scale(outer_amax(x32, outer), bound=OUTER_BOUND)
    s_dec = f32(1.0, x32.device) / s_enc
    b = block_amax(x32, tiles_16x16=False)
    xb = x32.unflatten(-1, (k // BLOCK, BLOCK))

    def candidate(factor: float):
        s = block_scale(b, s_enc, factor=factor)
        codes = encode_codes(xb, s, block_encode_multiplier(s, s_dec))
        d = xb - decode_blocks(codes, s, s_dec)
        return s, codes, pairwise_sum16(d * d)

    s6, codes6, err6 = candidate(1.0)
    s4, codes4, err4 = candidate(SCALE_TO_4)
    pick4 = err4 < err6
    s_b = torch.where(pick4, s4.view(torch.uint8), s6.view(torch.uint8)).view(torch.float8_e4m3fn)
    codes = torch.where(pick4.unsqueeze(-1), codes4, codes6).flatten(-2)
    return QTensor(data=e2m1.pack(codes), scale=s_b, outer=s_dec, fmt="nvfp4", shape=x.shape)
