"""Fused causal attention for the engine and the trainer: when to take `attention_triton`, and its training form.

    if fused_attention_ok(query, key, value, C):                 # the fused kernels on for the device, sizes fit
        out = attend(q, k, v, seqs, tiles, scaling, C)                        # engine: keys in its cache
        out = attend(q, k, v, seqs, tiles, scaling, C, groups=layout.groups)  # trainer: differentiable

The engine (`sampler.kv_cache.engine_attention`) and the trainer (`trainer.logprobs.train_attention`) call the
same kernel with the same constants and decide with `fused_attention_ok` (the fused-kernels switch and shapes
alone), so a token's attention output has the same bits in a decode step, a prefill, the logprob recompute and
the training forward (`attention_triton`'s docstring says why). Training: see `_Attention`.

Leaves out: a backward kernel (the recompute materializes [heads, n, n] scores per sequence, as the torch path
did), attention over a KV cache with gradients.
"""

from __future__ import annotations

import torch

from rl4bit.kernels import fused


def compute_dtype(q: torch.Tensor, k: torch.Tensor) -> torch.dtype:
    """The dtype the attention's matmuls run in: autocast's for q's device when on, else torch's promotion."""
    dev = q.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(q.dtype, k.dtype)


def fused_attention_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this call, else the caller's torch path (which raises nothing new).

    query [1, Hq, T, D], key / value [1, Hkv, T, D] (HF's layout), `dtype` the matmuls' dtype: fused kernels on
    for the device, Hq a multiple of Hkv, one head dim <= 256, and q, k, v and the compute dtype each FP32,
    BF16 or FP16.
    """
    if not fused.enabled(query.device.type):
        return False  # before the import: off (or without triton) the kernel module is never loaded
    from rl4bit.kernels.attention_triton import MAX_HEAD_DIM

    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (query.shape[1] % key.shape[1] == 0
            and key.shape[1] == value.shape[1] and query.shape[-1] == key.shape[-1] == value.shape[-1] <= MAX_HEAD_DIM
            and all(t.dtype in floats for t in (query, key, value)) and dtype in floats)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[tuple[int, torch.Tensor]],
              scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """Causal attention of packed sequences in torch ops with the kernel's roundings (plain softmax).

    q [T, Hq, D], k / v [T, Hkv, D] (the packed row); `groups`: (n, tok [G, n]) per length, the packed rows of
    G sequences of n tokens each (`TrainLayout.groups`). Returns [T, Hq, D] in q's dtype, zero on rows no
    sequence covers. Autocast off inside: every cast is explicit.
    """
    t, hq, d = q.shape
    g = hq // k.shape[1]
    out = q.new_zeros(t, hq, d)
    with torch.autocast(q.device.type, enabled=False):
        for n, tok in groups:
            qg = q[tok].to(dtype).transpose(1, 2)  # [G, Hq, n, D]
            kg = k[tok].to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)
            vg = v[tok].to(dtype).transpose(1, 2).repeat_interleave(g, dim=1)
            scores = torch.matmul(qg, kg.transpose(-1, -2)) * scaling
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
            o = torch.matmul(probs, vg)  # [G, Hq, n, D]
            out = out.index_put((tok,), o.transpose(1, 2).to(q.dtype))
    return out


class _Attention(torch.autograd.Function):
    """The kernel forward; the backward differentiates `reference` on the saved inputs.

    `reference` is the torch formula with the kernel's roundings (plain softmax), recomputed under autograd from
    the saved q, k, v: right gradients, one forward's bits."""

    @staticmethod
    def forward(ctx, q, k, v, seqs, tiles, scaling, dtype, groups):
        from rl4bit.kernels.attention_triton import attention

        ctx.save_for_backward(q, k, v)
        ctx.args = (groups, scaling, dtype)
        return attention(q, k.transpose(0, 1), v.transpose(0, 1), seqs, tiles, scaling, dtype, q.new_zeros(q.shape))

    @staticmethod
    def backward(ctx, grad):
        groups, scaling, dtype = ctx.args
        need = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need))
            out = reference(q, k, v, groups, scaling, dtype)
        wanted = [t for t, n in zip((q, k, v), need) if n]
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (*(next(grads) if n else None for n in need), None, None, None, None, None)


def attend(q, k, v, seqs, tiles, scaling: float, dtype: torch.dtype, groups: list | None = None,
           covered: bool = False, key_chunks: int = 0, counters: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's attention of q [T, Hq, D]: a new [T, Hq, D] tensor in q's dtype (`attention_triton`).

    groups None: k / v are in the kernel's layout ([..., Hkv, positions, D], a cache) and nothing is
    differentiated. With `groups` (the packed row's sequences by length): k / v are the packed row [T, Hkv, D],
    and when gradients are on the call is differentiable (`_Attention`). Rows no sequence covers are zero;
    `covered` says there are none (the output is then not cleared first: one launch less). key_chunks (cache
    layout only): split the keys over that many programs a row tile (`attention_triton.attention`: same bits),
    with `counters` (`attention_triton.split_counters`) for the chunks' hand-off.
    """
    from rl4bit.kernels.attention_triton import attention

    q = q if q.stride(-1) == 1 else q.contiguous()
    if groups is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format) if covered else q.new_zeros(q.shape)
        return attention(q, k, v, seqs, tiles, scaling, dtype, out, key_chunks=key_chunks, counters=counters)
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, seqs, tiles, scaling, dtype, groups)
    return attention(q, k.transpose(0, 1), v.transpose(0, 1), seqs, tiles, scaling, dtype, q.new_zeros(q.shape))
