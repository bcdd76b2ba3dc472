"""Per-head RMSNorm then rotary embedding of queries and keys, in one Triton launch (Qwen3's qk-norm + RoPE).

    q_out, k_out = qk_norm_rope(q, k, wq, wk, eps_q, eps_k, cos, sin)      # cache=(v, kc, vc, slot, pos) too

For every head row x of q [B, T, Hq, D] and k [B, T, Hkv, D] (a token's heads contiguous, tokens at any stride,
so the q/k views of a stacked q/k/v GEMM's output are read in place) and cos/sin [B, T, D]: h = rmsnorm_triton's
norm of x, out = h * cos + rotate_half(h) * sin (HF's `apply_rotary_pos_emb`), with HF's roundings
(`_norm_rope_row` states them). One program per head row with a fixed sum order: batch-invariant. Every pass of
trainer and samplers runs this kernel (`trainer/fused_attention.py`; training through an autograd Function),
which is what makes them agree. With `cache=` the key and value rows also go into the engine's KV cache,
rounded as `attention_triton.cache_write` rounds them (the decode step's cache write is no launch of its own).

Leaves out: odd head dims, partial rotary (rotary dim < head dim), interleaved (GPT-J) rotation, a row of
more than 1024 elements (one chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.formats_triton import negate
from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.qgemm_triton import interpret
from rl4bit.kernels.rmsnorm_triton import FLOAT_TL, round_to, rsqrt_f32, square_rn


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, r, heads, s_t, D, eps, H_DTYPE: tl.constexpr,
                   ASM: tl.constexpr, BLOCK: tl.constexpr):
    """Head row r: h = rmsnorm_triton's norm of x with its weight (the same formula and loop), then
    out = h * cos + rotate_half(h) * sin (HF's `apply_rotary_pos_emb`).

    HF's roundings: h in promote(weight, x) (the norm's output dtype), each product and the sum rounded to
    promote(h, cos) (torch's elementwise ops, one rounding each, no FMA: `enable_fp_fusion=False`).
    rotate_half(h)[i] is -h[i + D/2] for i < D/2 and h[i - D/2] above: the program recomputes the partner
    element's norm value from its input (elementwise, so exactly the value the norm gave it). On the H200 this
    equals the fused norm followed by HF's rotary ops bitwise for D = 64 and 128 (tested); by construction it
    need not (`tl.sum`'s tree is the compiler's layout choice for each kernel)."""
    offs = tl.arange(0, BLOCK)
    live = offs < D
    bt = r // heads
    x_row = x_ptr + bt * s_t + (r - bt * heads) * D  # token bt's head: tokens s_t apart, heads D apart
    x = tl.load(x_row + offs, mask=live, other=0.0).to(tl.float32)
    rstd = rsqrt_f32(tl.div_rn(tl.sum(square_rn(x, ASM), axis=0), D.to(tl.float32)) + eps, ASM)
    w = tl.load(w_ptr + offs, mask=live, other=0.0).to(tl.float32)
    h = round_to(w * round_to(x * rstd, x_ptr.dtype.element_ty), H_DTYPE)
    half = D // 2
    low = offs < half
    p = tl.where(low, offs + half, offs - half)  # the rotation partner
    xp = tl.load(x_row + p, mask=live, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + p, mask=live, other=0.0).to(tl.float32)
    hp = round_to(wp * round_to(xp * rstd, x_ptr.dtype.element_ty), H_DTYPE)
    rot = tl.where(low, negate(hp), hp)  # HF's cat(-x2, x1): -(+0) = -0
    c = tl.load(cos_ptr + bt * D + offs, mask=live, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + bt * D + offs, mask=live, other=0.0).to(tl.float32)
    out_ty = y_ptr.dtype.element_ty
    y = round_to(round_to(h * c, out_ty) + round_to(rot * s, out_ty), out_ty)
    tl.store(y_ptr + r * D + offs, y.to(out_ty), mask=live)
    return y, offs, live


@triton.jit
def _cache_row(y, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, r, heads, s_vt, s_cs, s_ch, s_cp, n_cache, D, offs, live):
    """Key row r's value y (FP32 holding the key output's values) and the same token's value row, rounded to the
    cache's dtype (`attention_triton._cache_write_kernel`'s rounding), into cache slot slot[t] at position
    pos[t] (t = r // heads, for t < n_cache)."""
    t = r // heads
    if t < n_cache:
        head = r - t * heads
        slot = tl.load(slot_ptr + t)
        pos = tl.load(pos_ptr + t)
        dst = slot * s_cs + head * s_ch + pos * s_cp + offs
        ty = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, round_to(y, ty).to(ty), mask=live)
        v = tl.load(v_ptr + t * s_vt + head * D + offs, mask=live, other=0.0).to(tl.float32)
        tl.store(vc_ptr + dst, round_to(v, ty).to(ty), mask=live)


@triton.jit(do_not_specialize=["rows_q", "rows_k", "n_cache", "s_cs", "s_ch", "s_cp"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, rows_q, rows_k, hq, hk,
                         s_qt, s_kt, D, eps_q, eps_k, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, s_vt, s_cs, s_ch, s_cp,
                         n_cache, HQ_DTYPE: tl.constexpr, HK_DTYPE: tl.constexpr, ASM: tl.constexpr,
                         BLOCK: tl.constexpr):
    """Key rows of the first n_cache tokens (and their value rows) also go to the KV cache (`qk_norm_rope(cache=)`).
    A run-time count, not a constexpr: with and without the cache it is one compiled kernel where the pointer
    types agree, so the norm's sum tree (the compiler's layout choice) cannot differ between the engine's
    calls and the trainer's."""
    r = tl.program_id(0).to(tl.int64)
    if r < rows_q:
        _norm_rope_row(q_ptr, wq_ptr, qo_ptr, cos_ptr, sin_ptr, r, hq, s_qt, D, eps_q, HQ_DTYPE, ASM, BLOCK)
    else:
        y, offs, live = _norm_rope_row(k_ptr, wk_ptr, ko_ptr, cos_ptr, sin_ptr, r - rows_q, hk, s_kt, D, eps_k,
                                       HK_DTYPE, ASM, BLOCK)
        _cache_row(y, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, r - rows_q, hk, s_vt, s_cs, s_ch, s_cp, n_cache, D,
                   offs, live)


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] as the kernel reads it: heads of a token contiguous, tokens x.stride(1) apart (the q/k views
    of one stacked q/k/v GEMM's output: no copy); any other layout is copied contiguous."""
    b, t, h, d = x.shape
    if x.stride(3) == 1 and x.stride(2) == d and (b == 1 or x.stride(0) == t * x.stride(1)):
        return x
    return x.contiguous()


def qk_norm_rope(q, k, wq, wk, eps_q: float, eps_k: float, cos, sin, cache: tuple | None = None):
    """q [B, T, Hq, D], k [B, T, Hkv, D], weights [D], cos/sin [B, T, D] (or broadcastable) ->
    (q_out [B, T, Hq, D], k_out [B, T, Hkv, D]) in HF's dtypes (see module doc). ValueError on other shapes.

    cache = (v, kc, vc, slot, pos): also `attention_triton.cache_write(k_out[0, :n], v[0, :n], kc, vc, slot,
    pos)` with n = len(slot), in the same launch (B = 1; v [1, T, Hkv, D] with a token's heads contiguous,
    kc / vc [slots, Hkv, L, D], slot / pos int64 [n]): the same values in the cache, one launch fewer a layer.
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if (d % 2 or d > 1024 or k.shape[:2] != q.shape[:2] or k.shape[3] != d or wq.shape != (d,) or wk.shape != (d,)
            or cos.shape[-1] != d or sin.shape != cos.shape
            or any(x.dtype not in floats for x in (q, k, wq, wk, cos, sin))):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)}, k {tuple(k.shape)}, weights {tuple(wq.shape)} / "
                         f"{tuple(wk.shape)}, cos/sin {tuple(cos.shape)} / {tuple(sin.shape)}; need [B, T, H, D] q/k "
                         "with one even D <= 1024, [D] weights, cos/sin [B, T, D], FP32/BF16/FP16")
    q, k = _token_rows(q), _token_rows(k)
    cos, sin = cos.expand(b, t, d).contiguous(), sin.expand(b, t, d).contiguous()
    hq_dt, hk_dt = torch.promote_types(wq.dtype, q.dtype), torch.promote_types(wk.dtype, k.dtype)
    qo = torch.empty(q.shape, dtype=torch.promote_types(hq_dt, cos.dtype), device=q.device)
    ko = torch.empty(k.shape, dtype=torch.promote_types(hk_dt, cos.dtype), device=k.device)
    rows_q, rows_k = b * t * hq, b * t * hk
    if cache is None:  # nothing written (n_cache 0); the same pointer types as the engine's calls, whose cache
        # holds k's dtype (the GEMM output's): one compiled kernel for both (see the kernel)
        idx = torch.empty(1, dtype=torch.int64, device=k.device)  # never read: no fill launch
        v, kc, vc, slot, pos = k, k, k, idx, idx
    else:
        v, kc, vc, slot, pos = cache
        if (b != 1 or v.shape != k.shape or v.stride(3) != 1 or v.stride(2) != d or kc.shape != vc.shape
                or kc.stride() != vc.stride() or kc.dim() != 4 or kc.shape[1] != hk or kc.shape[3] != d
                or kc.stride(3) != 1 or slot.shape != pos.shape or slot.dim() != 1 or slot.numel() > t
                or slot.dtype != torch.int64 or pos.dtype != torch.int64):
            raise ValueError(f"qk_norm_rope cache: v {tuple(v.shape)}, caches {tuple(kc.shape)} / {tuple(vc.shape)}, "
                             f"slot {tuple(slot.shape)}, pos {tuple(pos.shape)}: need B = 1, v like k with a token's "
                             f"heads contiguous, [slots, Hkv, L, D] caches of one layout, int64 [n <= T] slot/pos")
    if rows_q + rows_k:
        with _on_device(q):
            _qk_norm_rope_kernel[(rows_q + rows_k,)](
                q, k, wq.contiguous(), wk.contiguous(), qo, ko, cos, sin, rows_q, rows_k, hq, hk, q.stride(1),
                k.stride(1), d, float(eps_q), float(eps_k), v, kc, vc, slot, pos, v.stride(1),
                *(kc.stride()[:3] if cache is not None else (0, 0, 0)), slot.numel() if cache is not None else 0,
                HQ_DTYPE=FLOAT_TL[hq_dt], HK_DTYPE=FLOAT_TL[hk_dt], ASM=not interpret(),
                BLOCK=triton.next_power_of_2(d), num_warps=4, enable_fp_fusion=False)
    return qo, ko
