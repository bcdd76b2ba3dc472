"""RMSNorm in one Triton kernel: Hugging Face's six-op RMSNorm forward, same roundings, one pass per row.

    y = rms_norm(x, weight, eps)                     # HF Qwen3/Llama/Mixtral/OLMoE RMSNorm, over the last dim
    s, y = add_rms_norm(x, residual, weight, eps)    # with the decoder layer's residual add: s = residual + x

computes y = weight * (x_fp32 * rsqrt(mean(x_fp32²) + eps)).to(x.dtype) with HF's elementwise roundings and a
fixed sum order a row (`_rms_norm_kernel` states both), so a row's bits depend on that row, its weight and eps
alone (never on the row count: batch-invariant by construction). The trainer and the embedded samplers run
this kernel (`rmsnorm.py`), which is what makes their norms agree bitwise. On the GPU it agrees with HF's
forward to rounding; it is not bitwise any other kernel's reduction (`tl.sum`'s tree is per kernel).

Leaves out: the backward (`rmsnorm.py` recomputes HF's eager ops for it), rows whose elements are not
contiguous (the caller copies).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.qgemm_triton import interpret


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """FP32 `v` rounded to `dtype` (to nearest, ties to even), returned as FP32. BF16 by integer ops: the same
    bits as the GPU's conversion, and also under TRITON_INTERPRET=1, whose FP32 -> BF16 cast truncates. NaN
    stays NaN (the integer carry would turn the GPU's 0x7FFFFFFF into -0.0); overflow rounds to Inf."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, b.to(tl.float32, bitcast=True))
    else:
        return v.to(dtype).to(tl.float32)


FLOAT_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
"""The float dtypes the fused kernels take, as Triton dtypes."""


@triton.jit
def to_compute(x, C: tl.constexpr, IS_C: tl.constexpr, UPCAST: tl.constexpr):
    """A loaded tile rounded to C (`round_to`; nothing to do when it is stored in C already): C, or (UPCAST)
    FP32 holding the C values."""
    if not IS_C:
        x = round_to(x.to(tl.float32), C)
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x.to(C)


@triton.jit
def square_rn(v, ASM: tl.constexpr):
    """v * v rounded to FP32 by itself (an opaque `mul.rn`, never contracted into an FMA with the sum it feeds,
    whatever the Triton version's contraction setting), as torch's `pow(2)` materializes it. ASM off (the
    interpreter, which has no FMA contraction): a plain product."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return v * v


@triton.jit
def rsqrt_f32(v, ASM: tl.constexpr):
    """torch.rsqrt's FP32 result on CUDA (`rsqrt.approx.f32`, without flush-to-zero: the H200 gave torch's bits
    on 6.3M inputs); the interpreter: tl.math.rsqrt."""
    if ASM:
        return tl.inline_asm_elementwise("rsqrt.approx.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.math.rsqrt(v)


@triton.jit(do_not_specialize=["C", "HAS_R"])
def _rms_norm_kernel(x_ptr, r_ptr, s_ptr, w_ptr, y_ptr, C, HAS_R, eps, ASM: tl.constexpr, BLOCK: tl.constexpr):
    """y = RMSNorm of row v; v = x (HAS_R 0; s_ptr is x_ptr, r_ptr unused), or v = x + r rounded to s's dtype,
    also stored at s (HAS_R 1). HAS_R is a run-time argument, never specialized: both modes are one compiled
    kernel when the pointers' dtypes agree. With HAS_R 1 the sum is rounded once to its dtype, as torch's add.

    One program per row. The sum of squares: FP32 lanes over BLOCK-wide chunks in order (BLOCK from the row
    length only), each square rounded to FP32 by itself (`square_rn`: no compiler may contract it with the add),
    one tree sum (`tl.sum`), then `div_rn` by the row length; `rsqrt_f32` is the instruction torch.rsqrt runs.
    The rest is elementwise with HF's roundings: the normalized value rounded to the input dtype, then one FP32
    product with the weight rounded to the output dtype (torch's type promotion of weight and input; torch too
    computes that product in FP32 and rounds it once).

    `tl.sum`'s tree follows the layout the compiler picks for this kernel, so even the invariant mode's mean
    kernel, with the same loop, can sum in another order (on the H200, FP32 rows of 1100 differed from HF's
    forward in the invariant mode in the last bit of rstd in some rows; BF16 rows and the 128/1024/2048 lengths
    tried were equal). Under the interpreter (numpy sums) it is bitwise HF's forward in the invariant mode,
    which checks the elementwise formula."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    s_ty = s_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        m = c0 + offs < C
        v = tl.load(x_ptr + r * C + c0 + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_R != 0:
            v = round_to(v + tl.load(r_ptr + r * C + c0 + offs, mask=m, other=0.0).to(tl.float32), s_ty)
            tl.store(s_ptr + r * C + c0 + offs, v.to(s_ty), mask=m)
        acc += square_rn(v, ASM)
    rstd = rsqrt_f32(tl.div_rn(tl.sum(acc, axis=0), C.to(tl.float32)) + eps, ASM)
    for c0 in range(0, C, BLOCK):
        m = c0 + offs < C
        v = tl.load(x_ptr + r * C + c0 + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_R != 0:  # the sum again from its operands (not read back from s: no dependence on the store)
            v = round_to(v + tl.load(r_ptr + r * C + c0 + offs, mask=m, other=0.0).to(tl.float32), s_ty)
        h = round_to(v * rstd, s_ty)
        w = tl.load(w_ptr + c0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * C + c0 + offs, round_to(w * h, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, c: int) -> torch.Tensor:
    """t as contiguous rows of c (a copy only when its rows are not contiguous already)."""
    t2 = t.reshape(-1, c)
    if t2.numel() and (t2.stride(-1) != 1 or t2.stride(0) != c):
        t2 = t2.contiguous()
    return t2


def _launch(x2, r2, s2, weight, y, has_r: bool, eps: float) -> None:
    c = x2.shape[1]
    block = min(1024, triton.next_power_of_2(c))
    with _on_device(x2):
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, s2, weight.contiguous(), y, c, int(has_r), float(eps),
                                         ASM=not interpret(), BLOCK=block, num_warps=4, enable_fp_fusion=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim of `x` (float32/bfloat16/float16) with a 1-D `weight`; output dtype is
    torch's promotion of the two. `x` is copied first if its rows are not contiguous."""
    c = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if c == 0 or x.numel() == 0:
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)
    x2 = _rows(x, c)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    _launch(x2, x2, x2, weight, y, False, eps)
    return y.reshape(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, y): s = residual + x in torch's promoted dtype (one rounding of the FP32 sum, as torch's add), y =
    `rms_norm(s, weight, eps)`, in one launch. x and residual of one shape; rows copied if not contiguous.
    Bitwise the add followed by `rms_norm` when x, residual and s share a dtype (one compiled kernel); with
    mixed dtypes (an FP32 residual stream, BF16 sublayer outputs) the kernel is another compilation, whose
    sum-of-squares tree Triton may lay out otherwise: equal to rounding, and the same in every pass that
    takes it."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ; they "
                         "must be one shape (the decoder layer's residual stream and its sublayer's output)")
    c = x.shape[-1]
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, s_dtype), device=x.device)
    if c and x.numel():
        _launch(_rows(x, c), _rows(residual, c), s.view(-1, c), weight, y.view(-1, c), True, eps)
    return s, y
