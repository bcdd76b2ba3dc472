"""MoE experts' `act_fn(gate) * up` (SiLU) through one kernel (`kernels.swiglu_triton`), trainer and samplers alike.

    y = swiglu(h, act_fn)        # h = [gate | up] [R, 2I] -> [R, I]

HF's experts (and rl4bit's `QuantExperts`, `invariant_experts`, the expert-parallel layer) run two elementwise
launches between their GEMMs. `swiglu` runs the kernel when the fused kernels are on for h's device
(`rl4bit.kernels.fused`), `act_fn` is SiLU (`is_silu`: nn.SiLU, or HF's SiLUActivation equal to F.silu on a
probe) and h is a 2D float tensor; else HF's two ops, decided the same way in every pass. A forward that
needs gradients (training) runs the kernel too (`_SwiGLU`, whose backward differentiates the torch formula),
so the training forward, the trainer's logprob recompute and the samplers compute the same values; serving
NVFP4 experts take them inside the down projection's quantize (`qgemm.served_product(swiglu=True)`), bitwise
the same (an elementwise formula: no reduction whose order a kernel could change).

The kernel's exp is Triton's, not torch's: with the fused kernels on, a value can differ from HF's ops in the
last bit of the dtype (every pass of a job runs the same path, so trainer and samplers still agree).

Leaves out: GELU and other activations, interleaved gate/up layouts (GPT-OSS), a backward kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rl4bit.kernels import fused

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def is_silu(act_fn) -> bool:
    """Whether `act_fn` is SiLU: nn.SiLU, F.silu, or a module named SiLUActivation (HF's) that equals F.silu
    bitwise on a probe (checked once per object)."""
    if act_fn is F.silu or type(act_fn) is nn.SiLU:
        return True
    if type(act_fn).__name__ != "SiLUActivation" or not isinstance(act_fn, nn.Module):
        return False
    known = getattr(act_fn, "_rl4bit_is_silu", None)
    if known is None:
        probe = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4
        with torch.no_grad():
            try:
                out = act_fn(probe)
                known = isinstance(out, torch.Tensor) and torch.equal(out, F.silu(probe))
            except Exception:  # noqa: BLE001 - a forward of another signature is not SiLU
                known = False
        act_fn._rl4bit_is_silu = known
    return known


def applies(h: torch.Tensor, act_fn) -> bool:
    """Whether `swiglu` takes the kernel for h (see module docstring); the same answer in every pass."""
    return (fused.enabled(h.device.type) and h.dim() == 2 and h.shape[-1] % 2 == 0 and h.dtype in _FLOATS
            and is_silu(act_fn))


def reference(h: torch.Tensor, act_fn) -> torch.Tensor:
    """HF's `_default_apply_gate`: the two torch ops."""
    gate, up = h.chunk(2, dim=-1)
    return act_fn(gate) * up


class _SwiGLU(torch.autograd.Function):
    """The kernel's forward; the backward differentiates `reference` (F.silu) recomputed from the saved h."""

    @staticmethod
    def forward(ctx, h):
        from rl4bit.kernels.swiglu_triton import swiglu as kernel

        ctx.save_for_backward(h)
        return kernel(h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        with torch.enable_grad():
            hr = h.detach().requires_grad_(True)
            y = reference(hr, F.silu)
        (dh,) = torch.autograd.grad(y, hr, dy)
        return dh


def swiglu(h: torch.Tensor, act_fn) -> torch.Tensor:
    """act_fn(gate) * up for h = [gate | up]: the kernel where `applies`, else `reference`."""
    if not applies(h, act_fn):
        return reference(h, act_fn)
    if torch.is_grad_enabled() and h.requires_grad:
        return _SwiGLU.apply(h)
    from rl4bit.kernels.swiglu_triton import swiglu as kernel

    return kernel(h)
