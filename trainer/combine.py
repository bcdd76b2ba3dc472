"""The MoE combine of `QuantExperts`: each token's expert outputs, weighted by the router, summed into its row.

    out = combine(o, top_k_weights, top_k_index, order, tok, inv, hidden_states)

`reference` is the torch expression (what the CPU runs, and CUDA with the fused
kernels off). With the fused kernels on for o's device (`kernels.fused`), one
fixed-order kernel (`kernels.combine_triton`) computes the same values in
`reference`'s CPU order, bitwise, in every pass: the samplers, the trainer's
logprob recompute and its training forward (there through `_Combine`, whose
backward differentiates `reference`: index_add_'s gradient is a gather, so
the gradients are deterministic already). The point besides the launch count:
on CUDA `index_add_` adds a token's terms with atomics (torch documents it as nondeterministic).

With `residual`, the decoder layer's residual add after the MoE block is done here too (`trainer.fused_layer`):
in the kernel, the combine rounded to its dtype and then added as torch adds, so the same bits as the add apart.

Leaves out: the expert-parallel combine (`trainer.expert_parallel`, its own
all-to-all and S2F6 path).
"""

from __future__ import annotations

import torch

from rl4bit.kernels import fused
from rl4bit.trainer.qgemm import inverse_order


def reference(o, top_k_weights, order, tok, hidden_states):
    """o [n, H] (grouped order) weighted by top_k_weights[order] (cast to o's dtype), added into zeros like
    hidden_states at rows tok."""
    o = o * top_k_weights.reshape(-1)[order, None].to(o.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, tok, o.to(hidden_states.dtype))


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, top_k_weights, top_k_index, order, tok, inv, hidden_states, num_experts, residual):
        from rl4bit.kernels.combine_triton import combine as kernel

        ctx.save_for_backward(o, top_k_weights, order, tok)
        ctx.like = (hidden_states.shape, hidden_states.dtype)
        return kernel(o, top_k_weights, top_k_index, inv, hidden_states.dtype, num_experts, residual)

    @staticmethod
    def backward(ctx, dout):
        o, w, order, tok = ctx.saved_tensors
        need_o, need_w = ctx.needs_input_grad[:2]
        shape, dtype = ctx.like
        with torch.enable_grad():
            od, wd = o.detach().requires_grad_(need_o), w.detach().requires_grad_(need_w)
            y = reference(od, wd, order, tok, torch.empty(shape, dtype=dtype, device=o.device))
        wanted = [t for t, need in ((od, need_o), (wd, need_w)) if need]
        grads = iter(torch.autograd.grad(y, wanted, dout) if wanted else ())
        d_residual = dout if ctx.needs_input_grad[8] else None  # d(residual + y) / d residual
        return (next(grads) if need_o else None), (next(grads) if need_w else None), None, None, None, None, None, \
            None, d_residual


def combine(o, top_k_weights, top_k_index, order, tok, inv, hidden_states, num_experts: int, residual=None):
    """[T, H] in hidden_states' dtype: the kernel when the fused kernels are on for o's device, else `reference`.
    inv [T*k]: each (token, slot)'s row in o (`qgemm.expert_grouping`; None: computed from order here);
    indices >= num_experts add nothing. residual [T, H]: `residual + ` that, as the decoder layer adds it (in
    the kernel when it has the output's dtype and shape, else one torch add: the same bits either way)."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if not fused.enabled(o.device.type) or any(t.dtype not in floats for t in (o, top_k_weights, hidden_states)):
        out = reference(o, top_k_weights, order, tok, hidden_states)
        return out if residual is None else residual + out
    if residual is not None and (residual.dtype != hidden_states.dtype or residual.shape != hidden_states.shape):
        return residual + combine(o, top_k_weights, top_k_index, order, tok, inv, hidden_states, num_experts)
    if inv is None:
        inv = inverse_order(order, top_k_index.numel())
    if torch.is_grad_enabled() and (o.requires_grad or top_k_weights.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return _Combine.apply(o, top_k_weights, top_k_index, order, tok, inv, hidden_states, num_experts, residual)
    from rl4bit.kernels.combine_triton import combine as kernel

    return kernel(o, top_k_weights, top_k_index, inv, hidden_states.dtype, num_experts, residual)
