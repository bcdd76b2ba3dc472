"""RMSNorm in one Triton kernel: Hugging Face's six-op RMSNorm forward, same roundings, one pass per row.

    y = weight * (x_fp32 * rsqrt(mean(x_fp32²) + eps)).to(x.dtype)      (HF Qwen3/Llama/Mixtral/OLMoE RMSNorm)

One program per row. The sum of squares runs like the invariant mode's mean
(`invariant_triton._row_mean_kernel`): FP32 lanes over BLOCK-wide chunks in
order (BLOCK from the row length only), each square rounded to FP32 before it
is added (no FMA: `enable_fp_fusion=False`), one tree sum, then `div_rn` by the
row length. The rest is elementwise with HF's roundings: the normalized value
rounded to the input dtype, then one FP32 product with the weight rounded to
the output dtype (torch's type promotion of weight and input: a BF16 x BF16 or
FP32 x BF16 product is exact in FP32, so that is torch's one rounding too).

So a row's bits depend on that row, its weight and eps alone (never on the row
count: batch-invariant by construction), and on the GPU they equal HF's own
forward run in the invariant mode, whose mean is that same order (tested on the
H200); against plain ATen, whose reduction order differs, they agree to
rounding. Trainer and embedded samplers both run this kernel (`rmsnorm.py`),
which is what makes their norms agree bitwise.

Leaves out: the backward (`rmsnorm.py` recomputes HF's eager ops for it), rows
whose elements are not contiguous (the caller copies), fused residual adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """FP32 `v` rounded to `dtype` (to nearest, ties to even), returned as FP32. BF16 by integer ops: the same
    bits as the GPU's conversion, and also under TRITON_INTERPRET=1, whose FP32 -> BF16 cast truncates."""
    if dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    else:
        return v.to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["C"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, C, eps, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        v = tl.load(x_ptr + r * C + c0 + offs, mask=c0 + offs < C, other=0.0).to(tl.float32)
        acc += v * v
    rstd = tl.math.rsqrt(tl.div_rn(tl.sum(acc, axis=0), C.to(tl.float32)) + eps)
    for c0 in range(0, C, BLOCK):
        m = c0 + offs < C
        v = tl.load(x_ptr + r * C + c0 + offs, mask=m, other=0.0).to(tl.float32)
        h = round_to(v * rstd, x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + c0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + r * C + c0 + offs, round_to(w * h, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm over the last dim of `x` (float32/bfloat16/float16) with a 1-D `weight`; output dtype is
    torch's promotion of the two. `x` is copied first if its rows are not contiguous."""
    c = x.shape[-1]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    x2 = x.reshape(-1, c)
    if x2.numel() and (x2.stride(-1) != 1 or x2.stride(0) != c):
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.numel():
        block = min(1024, triton.next_power_of_2(c))
        with _on_device(x2):
            _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, c, float(eps), BLOCK=block, num_warps=4,
                                             enable_fp_fusion=False)
    return y.reshape(x.shape)
