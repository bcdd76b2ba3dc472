"""SwiGLU of a gate-up product in one kernel: y = act(gate) * up for h = [gate | up], act = SiLU.

    y = swiglu(h)        # h [R, 2I] (gate columns first, HF's concatenated layout) -> y [R, I], h's dtype

HF's MoE experts run `act_fn(gate) * up` as two elementwise kernels between the two expert GEMMs; here one
launch, and the NVFP4 quantize kernel runs the same `swiglu_values` on its loads
(`nvfp4_triton.quantize_nvfp4(swiglu=True)`), so serving never stores the SwiGLU tensor and the down
projection's input is quantized from exactly the values this kernel would write. `swiglu_values` states the
roundings: HF's two ops at h's dtype, but Triton's `tl.exp`, so y can differ from HF's in the last bit; the
trainer's forward, its logprob recompute and the samplers all run this kernel (`rl4bit.trainer.fused_swiglu`),
so they agree bitwise.

Leaves out: other activations (GELU, ...), interleaved gate/up layouts, the backward (`fused_swiglu`
differentiates the torch formula).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.rmsnorm_triton import FLOAT_TL, round_to


@triton.jit
def swiglu_values(g, u, T: tl.constexpr):
    """FP32 gate and up -> FP32 holding T(T(silu(g)) * u): per element, in the order of HF's two torch ops at T:

        s = T(g / (1 + exp(-g)))        (FP32 arithmetic; Triton's exp, IEEE division)
        y = T(s * u)

    Triton's `tl.exp` is not torch's `expf` (on the GPU it is an `ex2.approx` of a scaled argument), so y can
    differ from HF's ops in the last bit of T. An element's value depends on its own gate and up alone (no
    reduction): the same in any kernel that computes it with these ops, whatever the tile (launches use
    `enable_fp_fusion=False`, so no FMA contraction either)."""
    s = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), T)
    return round_to(s * u, T)


@triton.jit(do_not_specialize=["R"])  # see formats_triton.NO_SPECIALIZE
def _swiglu_kernel(h_ptr, y_ptr, R, I, s_h, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):  # noqa: E741 (I: width)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    ok = (rows < R)[:, None] & (cols < I)[None, :]
    r = rows.to(tl.int64)[:, None]
    g = tl.load(h_ptr + r * s_h + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + r * s_h + I + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    y = swiglu_values(g, u, h_ptr.dtype.element_ty)
    tl.store(y_ptr + r * I + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """y [R, I] = SiLU(h[:, :I]) * h[:, I:] in h's dtype (FP32, BF16 or FP16), h [R, 2I] with a contiguous last
    dim (module docstring)."""
    if h.dim() != 2 or h.shape[1] % 2 or h.dtype not in FLOAT_TL:
        raise ValueError(f"swiglu: need h [R, 2I] in FP32/BF16/FP16, got {h.dtype} {tuple(h.shape)}")
    if h.stride(-1) != 1:
        h = h.contiguous()
    rows, inner = h.shape[0], h.shape[1] // 2
    y = torch.empty((rows, inner), dtype=h.dtype, device=h.device)
    if rows == 0 or inner == 0:
        return y
    block_i = min(1024, triton.next_power_of_2(inner))
    block_r = max(1, 2048 // block_i)
    with _on_device(h):
        _swiglu_kernel[(triton.cdiv(rows, block_r), triton.cdiv(inner, block_i))](
            h, y, rows, inner, h.stride(0), BLOCK_R=block_r, BLOCK_I=block_i, num_warps=4, enable_fp_fusion=False)
    return y
