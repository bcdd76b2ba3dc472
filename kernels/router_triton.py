"""An MoE router's gate in two Triton launches: logits, softmax, top-k and the renormalized top-k weights.

    logits, weights, index = route_topk(x, w, top_k, normalize, compute_dtype)      # live= marks padding rows

Qwen3-MoE's router (`Qwen3MoeTopKRouter`: `F.linear`, `softmax(dtype=float)`, `topk`, the in-place
renormalization, `.to(logits.dtype)`) to rounding: other sum orders and `tl.exp`, so not torch's bits
(`route_topk` states the formula and order). What it promises instead is rl4bit's rule for every fused kernel:
a row's bits depend on that row alone (every tile shape and the chunking come from E and C, never from T), and
the trainer (`trainer/fused_router.py`, through an autograd Function) and the samplers run these same kernels,
so they agree bitwise. On a decode step two launches replace about seven (input cast, cuBLAS's GEMM and
split-K reduce, softmax, top-k's two kernels, sum, division); the chunks spread a one-token GEMV over
H / CHUNK programs. No `tl.dot` (`_partial_kernel` says why).

Leaves out: more than 256 experts, grouped / biased routing (DeepSeek-V3), a softmax after the top-k (Mixtral).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.rmsnorm_triton import FLOAT_TL, round_to, to_compute

BLOCK_T = 1
"""Token rows a partial-sum program takes: a constant, never chosen from T (the products' tile shape). With
CHUNK, block_k and one warp: the fastest of `scripts/sweep_router.py` at 1 and 16 tokens (H 2048, 32 experts);
figures in docs/performance.md."""

CHUNK = 128
"""Hidden columns a partial sum covers: logits add the partials of chunks 0, 1, ... in order."""

ROWS = 16
"""Token rows a softmax / top-k program takes."""

MAX_EXPERTS = 256


def block_k(experts: int) -> int:
    """Hidden columns a step of a partial sum: from the expert count alone (a product tile of E x BLOCK_K
    stays 4K values; 128 for 32 experts), at most CHUNK (a step never crosses into the next chunk)."""
    return min(CHUNK, max(8, 4096 // max(16, triton.next_power_of_2(experts))))


@triton.jit(do_not_specialize=["T"])
def _partial_kernel(x_ptr, w_ptr, part_ptr, T, H, E, s_xt, s_we, C: tl.constexpr, X_IS_C: tl.constexpr,
                    W_IS_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                    CHUNK: tl.constexpr):
    """part[c, t, e] = sum over hidden columns of chunk c of C(x[t, k]) * C(w[e, k]) (FP32 products, each
    BLOCK_K step summed by `tl.sum`, the steps added in order).

    No `tl.dot`: an FP32 `tl.dot` (FMA) is many times slower at one token, and under TRITON_INTERPRET=1 it is
    numpy's matmul, whose row bits moved with the row's place in the tile (`invariant_triton.interpreter_dot`)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    chunk = tl.program_id(1).to(tl.int64)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    end = tl.minimum(chunk * CHUNK + CHUNK, H)
    for k0 in range(chunk * CHUNK, end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < end
        x = tl.load(x_ptr + t[:, None] * s_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + e[:, None] * s_we + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        x = to_compute(x, C, X_IS_C, True)  # FP32 holding C values: the products are FP32
        w = to_compute(w, C, W_IS_C, True)
        acc = acc + tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(part_ptr + (chunk * T + t[:, None]) * E + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _topk_kernel(part_ptr, live_ptr, logit_ptr, weight_ptr, index_ptr, T, E, n_chunks, TOP_K: tl.constexpr,
                 NORMALIZE: tl.constexpr, C: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                 K_PAD: tl.constexpr, LIVE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t_ok = t < T
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    ok = t_ok[:, None] & e_ok[None, :]
    acc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    src = t
    if LIVE:  # a padding row (live 0) takes row 0's partials, hence row 0's logits, weights and experts
        src = tl.where(tl.load(live_ptr + t, mask=t_ok, other=1) != 0, t, 0)
    rows = part_ptr + src[:, None] * E + e[None, :]  # chunk 0's partials; chunk c's lie c * T * E further
    for c in range(0, n_chunks):
        acc = acc + tl.load(rows, mask=ok, other=0.0)
        rows += T * E
    logits = round_to(acc, C)
    tl.store(logit_ptr + t[:, None] * E + e[None, :], logits.to(logit_ptr.dtype.element_ty), mask=ok)

    z = tl.where(e_ok[None, :], logits, float("-inf"))
    ex = tl.exp(z - tl.max(z, axis=1)[:, None])
    p = tl.div_rn(ex, tl.sum(ex, axis=1)[:, None])
    key = tl.where(e_ok[None, :], tl.where(p != p, float("inf"), p), -1.0)  # NaN largest; padding never chosen
    c = tl.arange(0, K_PAD)
    chosen = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    index = tl.zeros([ROWS, K_PAD], dtype=tl.int64)
    total = tl.zeros([ROWS], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        j = tl.min(tl.where(key == best[:, None], e[None, :], BLOCK_E), axis=1)  # the lowest expert of the best
        hit = e[None, :] == j[:, None]
        v = tl.sum(tl.where(hit, p, 0.0), axis=1)  # p at expert j (one term: exact)
        total = total + v  # 0 + v = v: the first term exactly
        chosen = tl.where(c[None, :] == i, v[:, None], chosen)
        index = tl.where(c[None, :] == i, j[:, None].to(tl.int64), index)
        key = tl.where(hit, -2.0, key)
    if NORMALIZE:
        chosen = tl.div_rn(chosen, total[:, None])
    out = round_to(chosen, C)
    keep = t_ok[:, None] & (c < TOP_K)[None, :]
    tl.store(weight_ptr + t[:, None] * TOP_K + c[None, :], out.to(weight_ptr.dtype.element_ty), mask=keep)
    tl.store(index_ptr + t[:, None] * TOP_K + c[None, :], index, mask=keep)


def route_topk(x: torch.Tensor, w: torch.Tensor, top_k: int, normalize: bool, compute_dtype: torch.dtype,
               live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E] in C, weights [T, top_k] in C, index [T, top_k] int64) of x [T, H] and w [E, H] (see the
    module docstring). live: an int32 / int64 [T] mask on x's device (`trainer.padding`); rows where it is 0 get
    row 0's outputs (padding rows routed onto a real row's experts, so the expert GEMMs read no weights for them
    that a real row does not need), the others their own, bitwise as without it.
    Raises ValueError for shapes or dtypes it does not cover.

    Per token row, C = `compute_dtype` (what HF's `F.linear` would run in, the autocast dtype or the operands'
    promotion; FP32 for rl4bit's FP32 routers):

        part_c = sum over the CHUNK hidden columns of chunk c of C(x_k) * C(w_ek)    FP32 products, no FMA;
                 BLOCK_K columns at a time summed by `tl.sum`, those steps added in order  (`_partial_kernel`)
        logits = C((part_0 + part_1) + ...)       the chunks in order                       (`_topk_kernel`)
        p = exp(logits - max) / sum(exp(...))     FP32 (IEEE division), over the E experts
        index = the top_k largest p, largest first; equal values: the lower expert first; NaN counts as largest
        weights = C(p_index / ((p_0 + p_1) + ...)) with `normalize` (left to right, in the order chosen),
                  else C(p_index)
    """
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"route_topk: x {tuple(x.shape)}, w {tuple(w.shape)}: need x [T, H] and w [E, H]")
    t, h = x.shape
    e = w.shape[0]
    if not 1 <= top_k <= e <= MAX_EXPERTS or not all(d in FLOAT_TL for d in (compute_dtype, x.dtype, w.dtype)):
        raise ValueError(f"route_topk: top_k {top_k} of {e} experts (1 <= top_k <= E <= {MAX_EXPERTS}), dtypes "
                         f"x {x.dtype}, w {w.dtype}, compute {compute_dtype} (FP32, BF16 or FP16)")
    if live is not None and (live.shape != (t,) or live.dtype not in (torch.int32, torch.int64)
                             or live.device != x.device or live.stride(0) != 1):
        raise ValueError(f"route_topk: live must be a contiguous int32 or int64 [{t}] mask on {x.device}, got "
                         f"{live.dtype} {tuple(live.shape)} on {live.device}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    logits = torch.empty(t, e, dtype=compute_dtype, device=x.device)
    weights = torch.empty(t, top_k, dtype=compute_dtype, device=x.device)
    index = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    if t == 0:
        return logits, weights, index
    n_chunks = triton.cdiv(h, CHUNK)
    bd = max(16, triton.next_power_of_2(e))
    part = torch.empty(n_chunks, t, e, dtype=torch.float32, device=x.device)
    with _on_device(x):
        _partial_kernel[(triton.cdiv(t, BLOCK_T), n_chunks)](
            x, w, part, t, h, e, x.stride(0), w.stride(0), C=FLOAT_TL[compute_dtype],
            X_IS_C=x.dtype == compute_dtype, W_IS_C=w.dtype == compute_dtype, BLOCK_T=BLOCK_T, BLOCK_E=bd,
            BLOCK_K=block_k(e), CHUNK=CHUNK, num_warps=1, enable_fp_fusion=False)
        _topk_kernel[(triton.cdiv(t, ROWS),)](
            part, part if live is None else live, logits, weights, index, t, e, n_chunks, TOP_K=top_k,
            NORMALIZE=bool(normalize), C=FLOAT_TL[compute_dtype], ROWS=ROWS, BLOCK_E=bd,
            K_PAD=triton.next_power_of_2(top_k), LIVE=live is not None, num_warps=4, enable_fp_fusion=False)
    return logits, weights, index
