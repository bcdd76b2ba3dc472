"""requantize: saved NVFP4 [..., M, K] -> dequantize -> transpose -> MXFP8 along M with SR.

The backward's key op (spec ``shared/docs/numerics.md``, "Requantizing a saved
NVFP4 tensor"; TetraJet-v2 and Quartet-II do the same): the dgrad/wgrad GEMM
reduces over the other dimension, so the saved forward tensor must be blocked
along M. Its dequantized values (E2M1 x E4M3 x FP32) are generally not E4M3
values, so rounding them to nearest would bias the gradient; stochastic
rounding keeps E[requantize(q)] = dequantize(q)^T exactly (RCEIL: no clamp).

Op order (fp32): x_hat = nvfp4.dequantize(q) (= (q * s_b) * S_dec), then
t = x_hat.transpose(-1, -2) ([..., K, M]), then mxfp8.quantize_mxfp8(t) with
the SR offset = flat row-major index in the transposed [..., K, M] output
(16 random bits an element, stochastic.py).

Leaves out: requantizing MXFP8 or S2F6 inputs (nothing in the recipe does).
"""

from __future__ import annotations

import torch

from rl4bit.kernels.checks import check_choice
from rl4bit.kernels.mxfp8 import BLOCK, quantize_mxfp8
from rl4bit.kernels.nvfp4 import dequantize_nvfp4
from rl4bit.kernels.qtensor import QTensor


def requantize_nvfp4_to_mxfp8(q: QTensor, *, seed=None, rounding: str = "stochastic") -> QTensor:
    """MXFP8 QTensor of dequantize(q).transpose(-1, -2), blocks of 32 along the old M dim."""
    if not isinstance(q, QTensor) or q.fmt != "nvfp4":
        raise ValueError(f"requantize expects an NVFP4 QTensor, got {getattr(q, 'fmt', type(q).__name__)!r}")
    check_choice("rounding", rounding, ("nearest", "stochastic"))
    if len(q.shape) < 2:
        raise ValueError(f"requantize needs a [..., M, K] tensor (at least 2 dims), got shape {tuple(q.shape)}")
    m = q.shape[-2]
    if m % BLOCK:
        raise ValueError(
            f"requantize: dimension M={m} of shape {tuple(q.shape)} is not a multiple of {BLOCK} "
            f"(MXFP8 block after the transpose); pad M (tokens) to {(m + BLOCK - 1) // BLOCK * BLOCK}"
        )
    t = dequantize_nvfp4(q, torch.float32).transpose(-1, -2).contiguous()
    return quantize_mxfp8(t, rounding=rounding, seed=seed)
