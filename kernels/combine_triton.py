"""The MoE combine in one Triton kernel, in a fixed order: each token's expert outputs weighted and summed.

    out = combine(o, top_k_weights, top_k_index, inv, out_dtype, num_experts)

is, bitwise, what `QuantExperts` computes with torch ops on the CPU:

    o = o * top_k_weights.reshape(-1)[order, None].to(o.dtype)      # one rounding to o's dtype
    out = zeros(T, H, out_dtype).index_add_(0, tok, o.to(out_dtype)) # adds in grouped (expert) order

On CUDA torch's index_add_ adds with atomics (documented as nondeterministic); here a token's sum is a function
of its own row (batch-invariant; `combine` gives the layouts and the order), and one launch replaces six. With
`residual` it also takes the decoder layer's residual add (`trainer.fused_layer`).

Leaves out: the backward (`trainer/combine.py` differentiates the torch expression).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.rmsnorm_triton import round_to


@triton.jit(do_not_specialize=["E", "HAS_R"])
def _combine_kernel(o_ptr, w_ptr, idx_ptr, inv_ptr, r_ptr, out_ptr, H, E, HAS_R, K: tl.constexpr, K_PAD: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """HAS_R 1: out = r + the combine (rounded to out's dtype, then added and rounded again, as torch's add of the
    two); 0: the combine alone (r_ptr unused). A run-time argument: both modes are one compiled kernel."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cm = cols < H
    js = tl.arange(0, K_PAD)
    e = tl.load(idx_ptr + t * K + js, mask=js < K, other=E)
    live = (js < K) & (e < E)
    rows = tl.load(inv_ptr + t * K + js, mask=live, other=0)
    big = tl.full([K_PAD], 2**62, tl.int64)
    keys = tl.sort(tl.where(live, rows.to(tl.int64) * K_PAD + js, big))  # ascending row; dead slots last
    o_ty = o_ptr.dtype.element_ty
    out_ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for jj in tl.static_range(K):
        key = tl.sum(tl.where(js == jj, keys, 0), axis=0)
        if key != 2**62:
            slot = key % K_PAD
            row = key // K_PAD
            w = round_to(tl.load(w_ptr + t * K + slot).to(tl.float32), o_ty)
            v = tl.load(o_ptr + row * H + cols, mask=cm, other=0.0).to(tl.float32)
            acc += round_to(round_to(v * w, o_ty), out_ty)
    acc = round_to(acc, out_ty)
    if HAS_R != 0:
        acc = round_to(acc + tl.load(r_ptr + t * H + cols, mask=cm, other=0.0).to(tl.float32), out_ty)
    tl.store(out_ptr + t * H + cols, acc.to(out_ty), mask=cm)


def combine(o: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor, inv: torch.Tensor,
            out_dtype: torch.dtype, num_experts: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H] in out_dtype (see module doc); o [n, H], top_k_weights / top_k_index [T, k], inv [T*k].

    o holds the expert outputs in grouped order (`order`, stable by expert), inv each (token, slot) entry's row in
    o (inv[order[i]] = i), top_k_index the experts (an index >= E = num_experts, the expert-parallel sentinel, has
    no row and adds nothing). One program per (token, column block): the token's entries are added in ascending
    row of o (= ascending expert, as the CPU's sequential index_add_) in FP32 and rounded to out_dtype once at the
    end (the CPU's index_add_ accumulates BF16 in FP32 too: measured). A token's sum of three or more terms thus
    never changes order run to run, unlike torch's atomics on CUDA. One launch replaces six (gather, two casts,
    product, zero fill, index_add).
    residual [T, H] in out_dtype: out is residual + the combine, as torch adds the two (the decoder layer's
    residual add in the same launch)."""
    t, k = top_k_index.shape
    h = o.shape[1]
    if residual is not None and (residual.shape != (t, h) or residual.dtype != out_dtype):
        raise ValueError(f"combine: residual {tuple(residual.shape)} {residual.dtype}; it must be [{t}, {h}] in "
                         f"{out_dtype} (the tokens' rows in the output's dtype)")
    out = torch.empty((t, h), dtype=out_dtype, device=o.device)
    if t and h:
        block_h = min(1024, triton.next_power_of_2(h))
        r = out if residual is None else residual.contiguous()
        with _on_device(o):
            _combine_kernel[(t, triton.cdiv(h, block_h))](
                o.contiguous(), top_k_weights.contiguous(), top_k_index.contiguous(), inv.contiguous(), r, out, h,
                num_experts, int(residual is not None), K=k, K_PAD=triton.next_power_of_2(max(k, 2)),
                BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False)
    return out
