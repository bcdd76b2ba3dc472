"""MoE routers of the softmax -> top-k -> (renormalize) kind through one kernel (`kernels.router_triton`).

    fuse_router(module)     # by `trainer.surgery.convert_model` (before its FP32 wrap), trainer and samplers alike

Qwen3-MoE's router (`Qwen3MoeTopKRouter`) is about seven small launches a layer on a decode step: rl4bit's FP32
input cast, the GEMM and its split-K reduce, softmax, top-k (two kernels), the sum and the division. The
replacement forward runs them as two launches when the fused kernels are on for the tensors' device
(`rl4bit.kernels.fused`) and the shapes suit the kernel; else the module's own forward, decided from shapes and
dtypes alone, the same way in every pass. A forward that needs gradients (training) runs the kernel too
(`_Router`, whose backward differentiates the torch formula at the kernel's chosen experts), so the training
forward, the trainer's logprob recompute and the samplers run the same forward bits.

`fuse_router` installs it only where the replacement's torch-op path (`reference`: `F.linear`, softmax in FP32,
`topk`, with or without the renormalization) reproduces the module's forward bitwise on a probe (a copy with
random weights: a zero weight would hide the formula), and `weight` is the module's only tensor (a bias, a
correction buffer: another formula); a router of another formula (Mixtral's softmax over the top-k logits,
DeepSeek's grouped routing, GPT-OSS's bias) keeps its forward. It is installed under rl4bit's FP32 wrap
(`surgery._make_router_fp32`), never over it: the wrap's autocast switch must stay outside. The wrap hands a BF16
residual stream's rows to the kernel uncast (`kernel_forward` with the GEMM in FP32: the kernel rounds them to
FP32 itself, the cast's bits) and casts only for the module's own forward.

Leaves out: the kernel under other routers' formulas; a backward kernel.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from rl4bit.kernels import fused
from rl4bit.kernels.attention import compute_dtype
from rl4bit.trainer import padding


def reference(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype,
              index: torch.Tensor | None = None):
    """(logits, weights, index) in torch ops, the GEMM in `dtype` (explicit casts, autocast off); with `index`
    given, the weights of those experts instead of torch.topk's choice (the backward's formula)."""
    with torch.autocast(x.device.type, enabled=False):
        logits = F.linear(x.to(dtype), weight.to(dtype))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if index is None:
            top, index = torch.topk(probs, top_k, dim=-1)
        else:
            top = probs.gather(1, index)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


class _Router(torch.autograd.Function):
    """The kernel's forward; the backward differentiates `reference` at the chosen experts, recomputed from the
    saved input and weight."""

    @staticmethod
    def forward(ctx, x, weight, top_k, normalize, dtype):
        from rl4bit.kernels.router_triton import route_topk

        logits, weights, index = route_topk(x, weight, top_k, normalize, dtype)
        ctx.save_for_backward(x, weight, index)
        ctx.args = (top_k, normalize, dtype)
        ctx.mark_non_differentiable(index)
        return logits, weights, index

    @staticmethod
    def backward(ctx, d_logits, d_weights, _):
        x, weight, index = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            xr, wr = (t.detach().requires_grad_(n) for t, n in zip((x, weight), need))
            logits, weights, _ = reference(xr, wr, *ctx.args, index=index)
        outs = [(o, g) for o, g in ((logits, d_logits), (weights, d_weights)) if g is not None]
        wanted = [t for t, n in zip((xr, wr), need) if n]
        grads = iter(torch.autograd.grad([o for o, _ in outs], wanted, [g for _, g in outs], allow_unused=True))
        return (*(next(grads) if n else None for n in need), None, None, None)


def _kernel_ok(x: torch.Tensor, weight: torch.Tensor, top_k: int, dtype: torch.dtype) -> bool:
    from rl4bit.kernels.router_triton import MAX_EXPERTS

    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (x.dtype in floats and weight.dtype in floats and dtype in floats and weight.dim() == 2
            and 1 <= top_k <= weight.shape[0] <= MAX_EXPERTS)


def kernel_forward(module: nn.Module, hidden_states: torch.Tensor, dtype: torch.dtype | None = None):
    """The fused router's (logits, weights, index) of `hidden_states` with the GEMM in `dtype` (None: what the
    module's `F.linear` would run in, `compute_dtype`), or None where the kernel does not take the call (kernels
    off for the device, shapes or dtypes it does not cover: the caller runs the module's own forward). The
    kernel rounds x to `dtype` itself, so rl4bit's FP32 wrap passes a BF16 stream's rows uncast (`dtype` FP32:
    the cast's bits, one launch less; the backward casts x's gradient back as the cast's would)."""
    if not getattr(module, "_rl4bit_fused_router", False) or not fused.enabled(hidden_states.device.type):
        return None
    x = hidden_states.reshape(-1, module.hidden_dim)
    weight = module.weight
    dtype = dtype or compute_dtype(x, weight)
    if not _kernel_ok(x, weight, module.top_k, dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Router.apply(x, weight, module.top_k, module._rl4bit_router_normalize, dtype)
    from rl4bit.kernels.router_triton import route_topk

    return route_topk(x, weight, module.top_k, module._rl4bit_router_normalize, dtype,
                      live=padding.current(x.shape[0], x.device))  # the engine's padding rows: row 0's experts


def _forward(module: nn.Module, orig_forward, normalize: bool, hidden_states, *args, use_reference: bool = False,
             **kwargs):
    if args or kwargs:
        return orig_forward(hidden_states, *args, **kwargs)
    if use_reference:
        x = hidden_states.reshape(-1, module.hidden_dim)
        return reference(x, module.weight, module.top_k, normalize, compute_dtype(x, module.weight))
    out = kernel_forward(module, hidden_states)
    return padding_on_row_0(orig_forward(hidden_states), hidden_states) if out is None else out


def padding_on_row_0(out, hidden_states: torch.Tensor):
    """The torch path's (logits, weights, index) with the engine's padding rows (`trainer.padding`) given row 0's,
    as the kernel gives them (`route_topk(live=)`); unchanged outside the engine's forwards."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    live = padding.current(x.shape[0], x.device)
    if live is None or not isinstance(out, tuple) or any(t.shape[0] != x.shape[0] for t in out):
        return out
    keep = (live != 0)[:, None]
    return tuple(torch.where(keep, t, t[:1]) for t in out)


def reproduces(module: nn.Module) -> bool | None:
    """The `normalize` setting under which `reference` equals `module.forward` bitwise on a probe (a copy of the
    module, kernels off, random input), or None when neither does (another formula or signature)."""
    w = getattr(module, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type != "meta"
            and isinstance(getattr(module, "top_k", None), int) and getattr(module, "hidden_dim", None) == w.shape[1]
            and [n for n, _ in module.named_parameters()] == ["weight"] and not list(module.buffers())):
        return None
    probe = copy.deepcopy(module)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(w.shape, generator=g).to(w.dtype))
    x = torch.randn(7, w.shape[1], generator=g).to(w.dtype).to(w.device)
    for normalize in (True, False):
        try:
            with torch.no_grad(), fused.disabled():
                want = probe.forward(x)
                got = _forward(probe, probe.forward, normalize, x, use_reference=True)
        except Exception:  # noqa: BLE001 - a forward of another signature is not the one this replaces
            return None
        if (isinstance(want, tuple) and len(want) == 3
                and all(isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
                        for a, b in zip(got, want))):
            return normalize
    return None


def fuse_router(module: nn.Module) -> bool:
    """Route `module`'s forward through `_forward` if it reproduces it (see `reproduces`); idempotent."""
    if getattr(module, "_rl4bit_fused_router", False):
        return True
    if getattr(module, "_rl4bit_fp32_router", False):
        return False  # over the FP32 wrap the kernel would run in the autocast dtype: fuse before wrapping
    normalize = reproduces(module)
    if normalize is None:
        return False
    module.forward = functools.partial(_forward, module, module.forward, normalize)
    module._rl4bit_router_normalize = normalize
    module._rl4bit_fused_router = True
    return True


def fuse_routers(model: nn.Module) -> list[str]:
    """`fuse_router` on every router of `model` (`plan._is_router`); returns the names of the fused ones."""
    from rl4bit.trainer.plan import _is_router

    return [name for name, m in model.named_modules() if _is_router(name, m) and fuse_router(m)]
