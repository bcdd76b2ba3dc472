"""Public kernel API: quantize / dequantize / requantize, dispatching to Triton on CUDA.

    q = quantize(x, "nvfp4", outer="row", four_over_six=True)   # -> QTensor
    x_hat = dequantize(q)                                        # fp32
    g = requantize(q_saved, seed=derive_seed(seed, step, layer, 0))   # NVFP4 -> MXFP8^T, SR

On CUDA, unless env RL4BIT_KERNELS=reference, ``quantize``/``requantize`` first
ask ``rl4bit.kernels.triton_dispatch`` (if it imports); it returns None where it
has no kernel, and then the plain-PyTorch reference runs. The kernels are bitwise
equal to the reference (tests/kernels), SR included. On CPU the reference runs.

Leaves out: autograd (the trainer's linear layers own that) and padding.
"""

from __future__ import annotations

import os

import torch

from rl4bit.kernels.checks import check_choice
from rl4bit.kernels.four_over_six import quantize_nvfp4_4over6
from rl4bit.kernels.mxfp8 import dequantize_mxfp8, quantize_mxfp8, quantize_mxfp8_columnwise
from rl4bit.kernels.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from rl4bit.kernels.qtensor import FORMATS, QTensor
from rl4bit.kernels.requant import requantize_nvfp4_to_mxfp8
from rl4bit.kernels.s2f6 import dequantize_s2f6, quantize_s2f6


def _triton_dispatch():
    """The triton_dispatch module when a kernel may be used here, else None."""
    if os.environ.get("RL4BIT_KERNELS", "") == "reference" or not torch.cuda.is_available():
        return None
    try:
        from rl4bit.kernels import triton_dispatch
    except ImportError:  # triton not installed, or the kernels not built in this checkout
        return None
    return triton_dispatch


def quantize_reference(
    x: torch.Tensor,
    fmt: str,
    *,
    rounding: str = "nearest",
    outer: str = "tensor",
    four_over_six: bool = False,
    seed=None,
    tiles_16x16: bool = False,
) -> QTensor:
    """The plain-PyTorch quantize (what `quantize` runs on CPU); same arguments as `quantize`."""
    check_choice("fmt", fmt, FORMATS)
    check_choice("rounding", rounding, ("nearest", "stochastic"))
    if fmt != "nvfp4":
        for name, value, default in (("outer", outer, "tensor"), ("four_over_six", four_over_six, False),
                                     ("tiles_16x16", tiles_16x16, False)):
            if value != default:
                raise ValueError(f"{name}={value!r} applies to nvfp4 only; {fmt} has no such option")
    if fmt == "mxfp8":
        return quantize_mxfp8(x, rounding=rounding, seed=seed)
    if fmt == "s2f6":
        return quantize_s2f6(x, rounding=rounding)
    if four_over_six:
        if rounding != "nearest" or tiles_16x16:
            raise ValueError(
                "nvfp4 four_over_six supports rounding='nearest' with 1x16 blocks only "
                "(the recipe uses 4/6 for forward activations); drop four_over_six or the other option"
            )
        return quantize_nvfp4_4over6(x, outer=outer)
    return quantize_nvfp4(x, rounding=rounding, outer=outer, seed=seed, tiles_16x16=tiles_16x16)


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    rounding: str = "nearest",
    outer: str = "tensor",
    four_over_six: bool = False,
    seed=None,
    tiles_16x16: bool = False,
) -> QTensor:
    """Quantize x to fmt ("nvfp4" | "mxfp8" | "s2f6") with blocks along the last dim.

    rounding: "nearest" | "stochastic" (needs `seed`; same seed, same bits).
    outer: NVFP4 outer-scale granularity, "tensor" | "row" (per token) | "group" (per expert, 3D).
    four_over_six: NVFP4 4/6 block-scale selection. tiles_16x16: NVFP4 16x16 block amax (ablation).
    """
    kw = dict(rounding=rounding, outer=outer, four_over_six=four_over_six, seed=seed, tiles_16x16=tiles_16x16)
    dispatch = _triton_dispatch() if isinstance(x, torch.Tensor) and x.is_cuda else None
    if dispatch is not None:
        q = dispatch.quantize(x, fmt, **kw)
        if q is not None:
            return q
    return quantize_reference(x, fmt, **kw)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decoded values of q (code x block scale x outer, computed in fp32) as `dtype`."""
    if not isinstance(q, QTensor):
        raise ValueError(f"dequantize expects a QTensor, got {type(q).__name__}")
    if q.fmt == "nvfp4":
        return dequantize_nvfp4(q, dtype)
    if q.fmt == "mxfp8":
        return dequantize_mxfp8(q, dtype)
    return dequantize_s2f6(q, dtype)


def quantize_columnwise(x: torch.Tensor, *, rounding: str = "nearest", seed=None) -> QTensor:
    """MXFP8 of x [..., M, K] with blocks of 32 along M: `quantize(x.transpose(-1, -2).contiguous(), "mxfp8")`
    bitwise (SR offsets in the transposed [..., K, M] tensor), on CUDA in one transposing pass (no copy of x)."""
    dispatch = _triton_dispatch() if isinstance(x, torch.Tensor) and x.is_cuda else None
    if dispatch is not None:
        q = dispatch.quantize_mxfp8_columnwise(x, rounding=rounding, seed=seed)
        if q is not None:
            return q
    return quantize_mxfp8_columnwise(x, rounding=rounding, seed=seed)


def requantize(q: QTensor, *, seed=None, rounding: str = "stochastic") -> QTensor:
    """NVFP4 [..., M, K] -> MXFP8 of its dequantized transpose [..., K, M] (blocks along M), SR by default."""
    dispatch = _triton_dispatch() if isinstance(q, QTensor) and q.data.is_cuda else None
    if dispatch is not None:
        out = dispatch.requantize(q, seed=seed, rounding=rounding)
        if out is not None:
            return out
    return requantize_nvfp4_to_mxfp8(q, seed=seed, rounding=rounding)
