"""Fused RMSNorm for trainer and embedded samplers: HF's formula, one kernel on CUDA, HF's own ops elsewhere.

    fuse_norm(module)          # by `trainer.surgery.convert_model`, for every HF RMSNorm it reproduces
    y = module(x)              # CUDA: rmsnorm_triton (autograd: HF's eager backward); CPU: HF's forward

Why: a decoder layer's four RMSNorms (input, post-attention, q and k) are six to eight small kernels each in
HF's eager form: ~30 of the ~95 kernels of a batch-1 decode step's layer, which is bound by its kernel count,
not by reading weights. One kernel each instead. Every process of a job converts its model with the same
`convert_model`, so trainer and samplers run the same kernel on the same rows and their norms agree bitwise
(`rmsnorm_triton` documents the order). `fuse_norm` replaces only forwards that are bitwise `reference` on
probes (`reproduces`); the backward recomputes `reference` (`_FusedRMSNorm`). `add_rms_norm` also takes a
decoder layer's residual add. `rl4bit.kernels.fused` holds the process-global switch (off: HF's forward).

Leaves out: LayerNorm, vLLM (its own kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from rl4bit.kernels.fused import enabled, install


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm forward (Qwen3-MoE 5.x), op for op."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


class _FusedRMSNorm(torch.autograd.Function):
    """The kernel forward; the backward recomputes `reference` under autograd from the saved input (HF's own
    gradient up to the rounding of the recomputed rstd): correct, not fused."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        from rl4bit.kernels.rmsnorm_triton import rms_norm

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(need_x), weight.detach().requires_grad_(need_w)
            y = reference(xd, wd, ctx.eps)
        wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
        grads = iter(torch.autograd.grad(y, wanted, dy))
        return (next(grads) if need_x else None), (next(grads) if need_w else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm of `x` (kernel when enabled for x's device, else `reference`)."""
    if not enabled(x.device.type):
        return reference(x, weight, eps)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"fused RMSNorm: input {tuple(x.shape)}, weight {tuple(weight.shape)}; the input's last "
                         "dim must be the 1-D weight's length")
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if x.dtype not in floats or weight.dtype not in floats:
        return reference(x, weight, eps)  # FP64 and the like: HF's ops (the kernel computes in FP32)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedRMSNorm.apply(x, weight, eps)
    from rl4bit.kernels.rmsnorm_triton import rms_norm as kernel

    return kernel(x, weight, eps)  # no autograd node: the serving path's host cost is one launch


class _FusedAddRMSNorm(torch.autograd.Function):
    """Saves the sum alone (what HF's add + norm would save): the backward differentiates `reference` at it, and
    the add's gradient is the sum's, cast to each operand's dtype (as autograd does for torch's add)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        from rl4bit.kernels.rmsnorm_triton import add_rms_norm as kernel

        s, y = kernel(x, residual, weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.dtypes = eps, (x.dtype, residual.dtype)
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight = ctx.saved_tensors
        need_x, need_r, need_w = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            sd, wd = s.detach().requires_grad_(), weight.detach().requires_grad_(need_w)
            y = reference(sd, wd, ctx.eps)
        g = torch.autograd.grad(y, [sd, wd] if need_w else [sd], dy)
        d_sum = g[0] if ds is None else ds + g[0]
        return (d_sum.to(ctx.dtypes[0]) if need_x else None, d_sum.to(ctx.dtypes[1]) if need_r else None,
                g[1] if need_w else None, None)


def add_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """HF's decoder-layer residual add and the next RMSNorm as torch ops: (residual + x, reference(that))."""
    s = residual + x
    return s, reference(s, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(residual + x, HF's RMSNorm of it) in one kernel when enabled for x's device and the dtypes suit it, else
    `add_reference`; the kernel is the plain norm's own (`rmsnorm_triton.add_rms_norm`). `trainer.fused_layer`
    calls it for the post-attention norm."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if not enabled(x.device.type) or any(t.dtype not in floats for t in (x, residual, weight)) \
            or x.shape != residual.shape or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return add_reference(x, residual, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad):
        return _FusedAddRMSNorm.apply(x, residual, weight, eps)
    from rl4bit.kernels.rmsnorm_triton import add_rms_norm as kernel

    return kernel(x, residual, weight, eps)


def _fused_forward(module: nn.Module, orig_forward, hidden_states: torch.Tensor) -> torch.Tensor:
    if not enabled(hidden_states.device.type):
        return orig_forward(hidden_states)
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def reproduces(module: nn.Module) -> bool:
    """True when `module`'s forward is bitwise `reference` on probes: FP32 and BF16 rows, a random weight in
    the module's weight dtype (all-ones, HF's init, would hide where the weight product is rounded), on the
    module's device. The module must hold exactly one tensor, `weight`, and a float `variance_epsilon`.
    `reference` is HF's formula as torch ops, so a norm with another formula (Gemma's `1 + weight`, an FP32
    output cast, no weight) keeps its own forward."""
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    state = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not isinstance(eps, float) or w.device.type == "meta" \
            or state != ["weight"]:
        return False
    g = torch.Generator().manual_seed(0)
    probe_w = (torch.randn(w.shape[0], generator=g) * 2).to(w.dtype).to(w.device)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(3, w.shape[0], generator=g) * 3).to(dtype).to(w.device)
            try:
                got = torch.func.functional_call(module, {"weight": probe_w}, (x,))
            except Exception:  # noqa: BLE001 - a forward that needs more arguments is not HF's plain RMSNorm
                return False
            want = reference(x, probe_w, eps)
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
                return False
    return True


def fuse_norm(module: nn.Module) -> bool:
    """Route `module`'s forward through `rms_norm` if it reproduces HF's RMSNorm (see `reproduces`); idempotent.
    Returns whether the module is fused."""
    return install(module, "_rl4bit_fused_norm", "RMSNorm", reproduces, _fused_forward)


def fuse_norms(model: nn.Module) -> list[str]:
    """`fuse_norm` on every module of `model`; returns the names of the fused ones."""
    return [name for name, m in model.named_modules() if fuse_norm(m)]
