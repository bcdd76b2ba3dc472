"""Causal attention of packed sequences, reading each sequence's keys where they lie (a KV-cache slot or the packed
row): one Triton kernel for the embedded engine's prefill and decode and for the trainer's forward.

    out = attention(q, k, v, seqs, tiles, scaling, compute_dtype)

A sequence's queries are consecutive rows of q [T, Hq, D]; its keys and values are read at offsets from its
`kv_row` (a cache slot, or the packed row itself); query head h reads kv head h // G (grouped-query attention).
Online softmax over key blocks in a fixed order, so a row's bits depend on that row alone: the same in a decode
step of any batch, in a prefill and in the trainer's pass (numerics and the split decode in `attention`'s
docstring). The same roundings as the engine's torch path, not its bits: within a job every pass runs this
kernel or every pass runs the torch ops (`rl4bit.kernels.fused`). `cache_write` puts a step's new keys and
values into their cache slots in one launch.

Leaves out: sliding windows, softcapping, attention sinks, ALiBi, head dims above 256, dropout, the backward
(`kernels/attention.py` differentiates the torch formula).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device, interpreter_dot
from rl4bit.kernels.qgemm_triton import interpret
from rl4bit.kernels.rmsnorm_triton import FLOAT_TL, round_to, to_compute
from rl4bit.kernels.transfer import to_device

BLOCK_M = 16
"""Query rows a program takes: a constant (tensor-core tiles need 16), so no launch's tile depends on a count."""

MAX_HEAD_DIM = 256


KEY_CHUNK = 128
"""Key positions a chunk: every row's keys are taken in chunks from position 0, each chunk's online softmax
from scratch, the chunks folded in order (`_fold`). The bits depend on it (never on a count); a multiple of
every `block_n`. A decode step splits its rows' chunks over programs (`attention(key_chunks=)`)."""

SPLIT_MAX_BYTES = 64 << 20
"""Most bytes of chunk states (FP32 max, sum and accumulator of every (row tile, kv head, chunk)) a split call
allocates; past it the call runs unsplit (the same bits). 64 rows x 4 kv heads x 128-dim heads fit 4096 key
positions; one row fits ~256K."""


def block_n(head_dim: int) -> int:
    """Key positions per block: from the head dim alone (bits depend on it: never from a count)."""
    return 64 if head_dim <= 128 else 32


@triton.jit
def _tile_rows(seq_ptr, tile_ptr, n_seqs, n_tiles, tile, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """(q_start, kv_row, token t, head, live, limit, last) of row tile `tile` for kv head `kvh`: rows
    token-major (token t, query head of this kv head); limit = a row's last key position (-1 past the
    sequence); last = the tile's last key position."""
    s = tl.load(tile_ptr + tile)
    row0 = tl.load(tile_ptr + n_tiles + tile)
    q_start = tl.load(seq_ptr + s)
    n = tl.load(seq_ptr + n_seqs + s)
    pos0 = tl.load(seq_ptr + 2 * n_seqs + s)
    kv_row = tl.load(seq_ptr + 3 * n_seqs + s)
    r = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    live = r < n * G
    t = r // G
    head = kvh * G + r % G
    limit = tl.where(live, pos0 + t, -1)
    last = pos0 + tl.minimum(n - 1, (row0 + BLOCK_M - 1) // G)
    return q_start, kv_row, t, head, live, limit, last


@triton.jit
def _fold(m_all, l_all, a_all, m, l_sum, acc):
    """The softmax state of the keys so far (m_all, l_all, a_all) folded with one chunk's (m, l_sum, acc): a row
    with no key in the chunk (m = -inf) keeps its state bit for bit, a row with nothing before it takes the
    chunk's bit for bit, the others rescale both to the larger max (elementwise FP32: the same bits in any
    kernel that runs these ops)."""
    empty = m == float("-inf")
    first = m_all == float("-inf")
    m_new = tl.maximum(m_all, m)
    a = tl.exp(tl.where(empty | first, 0.0, m_all - m_new))
    b = tl.exp(tl.where(empty | first, 0.0, m - m_new))
    l_new = tl.where(empty, l_all, tl.where(first, l_sum, l_all * a + l_sum * b))
    a_new = tl.where(empty[:, None], a_all,
                     tl.where(first[:, None], acc, a_all * a[:, None] + acc * b[:, None]))
    return tl.where(empty, m_all, m_new), l_new, a_new


@triton.jit
def _store_out(o_ptr, q_start, t, head, live, d, d_ok, l_all, a_all, s_ot, s_oh, C: tl.constexpr):
    """out = C(acc / l) rounded to the output's dtype, for the live rows."""
    l_all = tl.where(live, l_all, 1.0)  # a row past the sequence (not stored) divides 0 by 1, not by 0
    out = round_to(round_to(tl.div_rn(a_all, l_all[:, None]), C), o_ptr.dtype.element_ty)
    o = o_ptr + (q_start + t)[:, None] * s_ot + head[:, None] * s_oh + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])


@triton.jit
def _merge_states(o_ptr, st_m_ptr, st_l_ptr, st_a_ptr, first, q_start, t, head, live, last, d, d_ok, s_ot, s_oh,
                  C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """The chunk states of one (row tile, kv head), stored from `first` (its chunk 0) on, folded in chunk order,
    then the output: what the unsplit kernel computes in registers. Loads from L2 (`.cg`): other programs
    wrote them."""
    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_all = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c in range(0, last // CHUNK + 1):
        at = (first + c) * BLOCK_M + tl.arange(0, BLOCK_M)
        m = tl.load(st_m_ptr + at, cache_modifier=".cg")
        l_sum = tl.load(st_l_ptr + at, cache_modifier=".cg")
        acc = tl.load(st_a_ptr + at[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
        m_all, l_all, a_all = _fold(m_all, l_all, a_all, m, l_sum, acc)
    _store_out(o_ptr, q_start, t, head, live, d, d_ok, l_all, a_all, s_ot, s_oh, C)


@triton.jit(do_not_specialize=["n_seqs", "n_tiles", "split", "n_chunks"])  # strides specialize (vector loads)
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, st_m_ptr, st_l_ptr, st_a_ptr, cnt_ptr, seq_ptr, tile_ptr, n_seqs,
                      n_tiles, split, n_chunks, s_qt, s_qh, s_kh, s_kp, s_vh, s_vp, s_ot, s_oh, D, scaling,
                      G: tl.constexpr, C: tl.constexpr, KV_IS_C: tl.constexpr, IEEE: tl.constexpr,
                      UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      CHUNK: tl.constexpr):
    """split 0: all of a row's keys, chunk by chunk, folded here and stored as the output. split 1: program z
    takes chunk z only and stores its softmax state; the (row tile, kv head)'s last chunk program to finish
    folds them all in chunk order with the same `_fold` (`_merge_states`). One compiled kernel for both (split
    is a run-time argument), so a chunk's state is the same arithmetic either way."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2).to(tl.int64)
    q_start, kv_row, t, head, live, limit, last = _tile_rows(seq_ptr, tile_ptr, n_seqs, n_tiles, tile, kvh, G,
                                                             BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + (q_start + t)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=live[:, None] & d_ok[None, :], other=0.0)
    q = to_compute(q, C, False, UPCAST)
    lo = chunk * CHUNK * split
    hi = last + 1
    if split != 0:
        hi = tl.minimum(lo + CHUNK, last + 1)

    m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the chunks folded so far
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    a_all = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the current chunk
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_rows = k_ptr + kvh * s_kh
    v_rows = v_ptr + kvh * s_vh
    for j0 in range(lo, hi, BLOCK_N):
        if (j0 % CHUNK == 0) & (j0 != lo):  # a new chunk (split 0 only): fold the last one, start afresh
            m_all, l_all, a_all = _fold(m_all, l_all, a_all, m, l_sum, acc)
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        j = j0 + tl.arange(0, BLOCK_N).to(tl.int64)
        j_ok = j <= last
        kt = tl.load(k_rows + (kv_row + j)[None, :] * s_kp + d[:, None], mask=d_ok[:, None] & j_ok[None, :],
                     other=0.0)
        kt = to_compute(kt, C, KV_IS_C, UPCAST)
        if UPCAST:
            dots = interpreter_dot(q, kt)
        elif IEEE:
            dots = tl.dot(q, kt, input_precision="ieee")
        else:
            dots = tl.dot(q, kt)
        score = round_to(round_to(dots, C) * scaling, C)
        score = tl.where(j[None, :] <= limit[:, None], score, float("-inf"))
        active = j0 <= limit  # rows with a key in this block; the others keep their state bit for bit
        m_new = tl.where(active, tl.maximum(m, tl.max(score, axis=1)), 0.0)  # finite where active (key j0)
        alpha = tl.exp(tl.where(active, m - m_new, 0.0))  # exp(-inf) = 0 on a row's first block
        p = tl.where(active[:, None], tl.exp(score - m_new[:, None]), 0.0)
        vb = tl.load(v_rows + (kv_row + j)[:, None] * s_vp + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                     other=0.0)
        vb = to_compute(vb, C, KV_IS_C, UPCAST)
        pc = to_compute(p, C, False, UPCAST)
        if UPCAST:
            pv = interpreter_dot(pc, vb)
        elif IEEE:
            pv = tl.dot(pc, vb, input_precision="ieee")
        else:
            pv = tl.dot(pc, vb)
        l_sum = tl.where(active, l_sum * alpha + tl.sum(p, axis=1), l_sum)
        acc = tl.where(active[:, None], acc * alpha[:, None] + pv, acc)
        m = tl.where(active, m_new, m)
    if split != 0:
        if lo <= last:  # the chunk's state at [tile, kv head, chunk, row] (x head dim), FP32: exact
            pair = tile * tl.num_programs(1) + kvh
            at = (pair * n_chunks + chunk) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(st_m_ptr + at, m)
            tl.store(st_l_ptr + at, l_sum)
            tl.store(st_a_ptr + at[:, None] * BLOCK_D + d[None, :], acc)
            tl.debug_barrier()  # every thread's stores, then one thread's release (CUTLASS's semaphore arrive)
            done = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")  # chunks finished before this
            if done == last // CHUNK:  # the last of the tile's chunks with keys: fold them all
                tl.atomic_xchg(cnt_ptr + pair, 0, sem="relaxed", scope="gpu")  # 0 again for the next call
                _merge_states(o_ptr, st_m_ptr, st_l_ptr, st_a_ptr, pair * n_chunks, q_start, t, head, live, last,
                              d, d_ok, s_ot, s_oh, C, BLOCK_M, BLOCK_D, CHUNK)
    else:
        m_all, l_all, a_all = _fold(m_all, l_all, a_all, m, l_sum, acc)
        _store_out(o_ptr, q_start, t, head, live, d, d_ok, l_all, a_all, s_ot, s_oh, C)


@triton.jit(do_not_specialize=["s_kt", "s_kh", "s_vt", "s_vh", "s_cs", "s_ch", "s_cp"])
def _cache_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, pos_ptr, s_kt, s_kh, s_vt, s_vh, s_cs, s_ch, s_cp,
                        H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i)
    pos = tl.load(pos_ptr + i)
    h = tl.arange(0, BLOCK_H).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = (h < H)[:, None] & (d < D)[None, :]
    dst = slot * s_cs + pos * s_cp + h[:, None] * s_ch + d[None, :]
    ty = kc_ptr.dtype.element_ty
    k = tl.load(k_ptr + i * s_kt + h[:, None] * s_kh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(kc_ptr + dst, round_to(k, ty).to(ty), mask=ok)
    v = tl.load(v_ptr + i * s_vt + h[:, None] * s_vh + d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(vc_ptr + dst, round_to(v, ty).to(ty), mask=ok)


def cache_write(key: torch.Tensor, value: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
                pos: torch.Tensor) -> None:
    """kc[slot[i], :, pos[i]] = key[i] and the same for values, rounded to the cache's dtype (to nearest, ties
    to even: torch's `.to`), in one launch. key / value [N, Hkv, D], kc / vc [slots,
    Hkv, L, D] of one shape and strides, slot / pos int64 [N] on the cache's device. Rows that repeat a
    (slot, position) race, as torch's index write does (the engine's padding rows, which write its scratch slot)."""
    n, h, d = key.shape
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    if value.shape != key.shape or kc.shape != vc.shape or kc.stride() != vc.stride() or kc.shape[1:2] != (h,) \
            or kc.shape[-1] != d or kc.stride(-1) != 1:
        raise ValueError(f"cache_write: key {tuple(key.shape)}, value {tuple(value.shape)}, cache "
                         f"{tuple(kc.shape)} / {tuple(vc.shape)}: need [N, Hkv, D] rows into [slots, Hkv, L, D]")
    if n == 0:
        return
    with _on_device(kc):
        _cache_write_kernel[(n,)](key, value, kc, vc, slot, pos, key.stride(0), key.stride(1), value.stride(0),
                                  value.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), h, d,
                                  BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), num_warps=4)


def seq_table(q_start, n, pos0, kv_row, device) -> torch.Tensor:
    """int64 [4, S]: the per-sequence columns the kernel reads (lists or tensors of S values each)."""
    cols = [torch.as_tensor(c, dtype=torch.int64) for c in (q_start, n, pos0, kv_row)]
    return to_device(torch.stack(cols), device)  # host lists: queued from pinned memory, no wait for the GPU


def tile_table(n: list[int], group: int, device) -> torch.Tensor:
    """int64 [2, tiles]: (sequence, first row) of every BLOCK_M-row tile of n[s] * group rows per sequence."""
    seq, row0 = [], []
    for s, count in enumerate(n):
        for r in range(0, count * group, BLOCK_M):
            seq.append(s)
            row0.append(r)
    return to_device(torch.tensor([seq, row0], dtype=torch.int64), device)


def _block_d(d: int) -> int:
    """The kernels' head-dim block for head dim d."""
    return max(16, triton.next_power_of_2(d))


def split_fits(n_tiles: int, hkv: int, key_chunks: int, d: int) -> bool:
    """Whether a split over key_chunks keeps its chunk states within SPLIT_MAX_BYTES (else `attention` runs the
    call unsplit: the same bits)."""
    return n_tiles * hkv * key_chunks * BLOCK_M * (_block_d(d) + 2) * 4 <= SPLIT_MAX_BYTES


def split_counters(n_tiles: int, hkv: int, device) -> torch.Tensor:
    """Zeroed chunk counters for split calls of up to n_tiles row tiles over hkv kv heads (`attention(counters=)`):
    every call leaves them zero again, so the calls of one stream can share them."""
    return torch.zeros(n_tiles * hkv, dtype=torch.int32, device=device)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, tiles: torch.Tensor,
              scaling: float, compute_dtype: torch.dtype, out: torch.Tensor, key_chunks: int = 0,
              counters: torch.Tensor | None = None) -> torch.Tensor:
    """Write into `out` [T, Hq, D] (q's dtype) the attention of q [T, Hq, D].

    Rows: a sequence s has n_s query tokens at packed rows q_start_s .. q_start_s + n_s - 1 of q [T, Hq, D], the
    first one at causal position pos0_s; its keys / values for kv head h at position j are
    k[(kv_row_s + j) * s_p + h * s_h + 0..D-1] (element offsets into k's storage, the same for v): `kv_row` counts
    position strides, so a cache slot is `kv_row = slot * stride0 / s_p` and the packed row `kv_row = first row`
    (offsets stay multiples of the strides, which Triton's specialization sees: vectorized loads). Query token t
    attends to key positions 0 .. pos0 + t.

    Numerics, per query row (C = `compute_dtype`, what the matmuls run in: the autocast dtype, or the operands'):

        q, k, v rounded to C; score_j = C(C(sum_d q_d k_jd) * scaling)          (FP32 accumulation)
        keys in chunks of KEY_CHUNK positions from 0; in each chunk, an online softmax over key blocks of
        BLOCK_N, in order, from scratch: m = running max, p_j = exp(score_j - m),
        l = l * exp(m_old - m) + sum p, acc = acc * exp(m_old - m) + C(p) @ v
        the chunks' (m, l, acc) folded in order (`_fold`: both rescaled to the larger max, FP32)
        out = C(acc / l)                         (IEEE division), stored in the output's dtype (q's)

    A decode step of few rows takes its chunks in separate programs (`attention(key_chunks=)`): each stores its
    chunk's softmax state and counts itself done on its (row tile, kv head)'s counter, and the program that counts
    last folds the stored states in chunk order with the same `_fold` and stores the output (`_merge_states`; the
    counter goes back to 0 for the next call). One compiled kernel computes a chunk either way (whether it splits is
    a run-time argument), so split and unsplit give the same bits, and no second launch merges. The hand-off is
    CUTLASS's split-K semaphore: a CTA barrier, then one thread's acq_rel atomic at GPU scope (Triton performs a
    scalar atomic in one thread and broadcasts its result through shared memory behind a barrier), and the merging
    program reads the states from L2 (`.cg`).

    The same roundings as the engine's torch path (`kv_cache.engine_attention`: scores and products in C, softmax
    in FP32, probabilities in C), but another softmax algorithm and summation order, so not its bits: within a
    job every pass runs this kernel or every pass runs the torch ops (`rl4bit.kernels.fused`).

    Why a row's bits depend on that row alone: every launch has the same tile shapes (BLOCK_M query rows from the
    row count of no one: a constant; BLOCK_N and BLOCK_D from the head dim and C alone; KEY_CHUNK a constant), a
    row's key blocks are visited in the same order from 0, and a block past a row's last key leaves its m, l and acc
    untouched (a
    select, not a multiply by exp(0)). So a token's output is the same in a decode step of any batch, in a
    prefill next to other tokens, and in the trainer's pass over the whole sequence, as long as its q, keys and
    values are. (Masked keys add p = 0 products: exact zeros, which can change only the sign of an output that is
    exactly zero.) Under TRITON_INTERPRET=1 tiles are FP32 C values multiplied by `interpreter_dot` (not numpy's
    matmul, whose row bits can move with the row's place in its tile), so the interpreter tests check the same
    properties, not the GPU's bits.

    key_chunks > 0: split each row tile's keys over that many programs, KEY_CHUNK positions each (enough for
    every position of k: the engine's decode steps pass cdiv(cache length, KEY_CHUNK); fewer is a ValueError);
    each tile's last chunk to finish folds the chunks in order: the same bits as key_chunks = 0, more programs
    for few rows over long contexts. Unsplit where the chunk states would pass SPLIT_MAX_BYTES. `counters`:
    `split_counters` of at least this call's tiles and kv heads, zero, on q's device, which the call leaves
    zero (the engine's decode step shares one across its layers: no launch to clear them); None: a fresh one.
    Calls sharing counters must not run concurrently (one stream).

    k / v: any tensors whose last dim is the head dim (contiguous) and whose rows for (kv head h, position j)
    sit at (seqs' kv_row + j) * s_p + h * s_h, with (s_h, s_p) = k.stride()[-3:-1]: a cache [slots, Hkv, L, D]
    (kv_row = slot * Hkv * L) or a packed [Hkv, T, D] view (kv_row = the sequence's first row).
    `seqs` int64 [4, S] (`seq_table`), `tiles` int64 [2, n_tiles]
    (`tile_table`), both on q's device. Rows of `out` no sequence covers are left as they are.
    """
    t_rows, hq, d = q.shape
    hkv = k.shape[-3]
    if hq % hkv or d != k.shape[-1] or d != v.shape[-1] or v.shape[-3] != hkv:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need q [T, Hq, D] "
                         f"and k, v [..., Hkv, positions, D] with Hq a multiple of Hkv")
    if d > MAX_HEAD_DIM or compute_dtype not in FLOAT_TL:
        raise ValueError(f"attention: head dim {d} (at most {MAX_HEAD_DIM}) / compute dtype {compute_dtype}")
    if any(x.stride(-1) != 1 for x in (q, k, v, out)) or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError("attention: q, k, v and out need a contiguous last dim; out q's shape and dtype")
    if k.stride() != v.stride():
        raise ValueError(f"attention: k and v need the same strides (one kv_row and one stride serve both), "
                         f"got {k.stride()} and {v.stride()}")
    if key_chunks < 0 or 0 < key_chunks * KEY_CHUNK < k.shape[-2]:
        raise ValueError(f"attention: key_chunks {key_chunks} must be 0 or cover the {k.shape[-2]} key positions a "
                         f"sequence can reach (at least cdiv({k.shape[-2]}, KEY_CHUNK={KEY_CHUNK}))")
    n_tiles = tiles.shape[1]
    if n_tiles == 0:
        return out
    bd = _block_d(d)
    if not split_fits(n_tiles, hkv, key_chunks, d):
        key_chunks = 0  # the states would not fit the budget: unsplit, the same bits
    chunks = max(key_chunks, 1)
    if key_chunks:  # the chunks' softmax states (max, sum, accumulator) for the merge
        st_m = torch.empty((n_tiles, hkv, chunks, BLOCK_M), dtype=torch.float32, device=q.device)
        st_l = torch.empty_like(st_m)
        st_a = torch.empty((n_tiles, hkv, chunks, BLOCK_M, bd), dtype=torch.float32, device=q.device)
        if counters is None:
            counters = split_counters(n_tiles, hkv, q.device)
        elif (counters.dtype != torch.int32 or counters.numel() < n_tiles * hkv or counters.device != q.device
              or not counters.is_contiguous()):
            raise ValueError(f"attention: counters {counters.dtype} [{counters.numel()}] on {counters.device}: need "
                             f"contiguous int32 zeros, at least {n_tiles} tiles x {hkv} kv heads, on {q.device} "
                             f"(`split_counters`)")
    else:  # unused; FP32 like the split's states, so both modes run one compiled kernel (pointer types are
        st_m = st_l = st_a = torch.empty(1, dtype=torch.float32, device=q.device)  # part of its signature)
        counters = torch.empty(1, dtype=torch.int32, device=q.device)
    common = dict(G=hq // hkv, C=FLOAT_TL[compute_dtype], BLOCK_M=BLOCK_M, BLOCK_D=bd, CHUNK=KEY_CHUNK)
    with _on_device(q):
        _attention_kernel[(n_tiles, hkv, chunks)](
            q, k, v, out, st_m, st_l, st_a, counters, seqs, tiles, seqs.shape[1], n_tiles, int(key_chunks > 0),
            chunks, q.stride(0), q.stride(1), k.stride(-3), k.stride(-2), v.stride(-3), v.stride(-2), out.stride(0),
            out.stride(1), d, float(scaling), KV_IS_C=k.dtype == v.dtype == compute_dtype,
            IEEE=compute_dtype == torch.float32, UPCAST=interpret(), BLOCK_N=block_n(d), num_warps=4,
            enable_fp_fusion=False, **common)
    return out
