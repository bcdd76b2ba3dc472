"""Triton MXFP8 GEMMs of the backward (and of the mxfp8 recipe's forward): two paths, one contract.

    out = grouped_mxfp8(qa, qb, counts)        # out[rows of e] = A[rows] @ B[e]ᵀ   (dgrad; mxfp8 forward)
    dw  = wgrad_mxfp8(qa, qb, padded_counts)   # dw[e] = A[:, seg e] @ B[:, seg e]ᵀ  (wgrad, per expert)

Both operands are MXFP8 QTensors with blocks along the reduction dimension, exactly what
``rl4bit.trainer.qgemm._mxfp8_backward`` feeds its FP32 matmuls (the CPU reference; each function names its
operands). ``fp8`` picks the path (``FP8_CORES`` is the default): BF16 dequantize (exact products) or FP8
tensor cores (not exact per block); ``_mx_step`` states both. Against the reference they differ only in the
order (fp8: and the precision) of the FP32 sum over K, bounded in tests/kernels/test_qgemm_triton.py. A
dgrad/forward program owns rows of one expert and walks K in one fixed order (batch-invariant, as qgemm_triton).

Leaves out: split-K for small-M wgrad, persistent scheduling, NaN blocks beyond propagation (the backward
checks dY is finite first).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from rl4bit.kernels.formats_triton import pow2
from rl4bit.kernels.qgemm_triton import Config, alloc_out, grouped_shapes, interpret
from rl4bit.kernels.tile_map_triton import as_counts, check_tile_offsets, map_entry, store_tile, tile_first, tile_map
from rl4bit.kernels.transfer import to_device

FP8_CORES = False
"""Default path: False = BF16 dequantize (exact products, FP32 sums); True = FP8 tensor cores. Pick by bench_gemm."""
BF16_BLOCK_K = 64
MX_DECODE = Config(block_m=16, block_n=64, num_warps=4, num_stages=3)
MX_TRAIN = {False: Config(block_m=128, block_n=128, num_warps=4, num_stages=3),
            True: Config(block_m=128, block_n=64, num_warps=4, num_stages=3)}
"""Per path (fp8): the FP8 path keeps a second FP32 tile (the fresh partial sum) live, so a smaller N tile.
BF16 path: 4 warps, the fastest bitwise-equal tile of ``scripts/sweep_mxfp8_gemm.py`` on the bench model's gate_up
dgrad (4 warps also won every shape of the NVFP4 forward's sweep)."""
MX_DECODE_MAX_ROWS = 64
TWO_CONFIGS = True
"""False: MX_TRAIN for every M (if the two configs ever differ in bits on a GPU)."""
WGRAD = {False: Config(block_m=128, block_n=128, num_warps=4, num_stages=3), True: MX_TRAIN[True]}
"""The wgrad kernel's tiles. BF16 path: 4 warps, two CTAs an SM (the 8-warp tile's registers allowed one); the
fastest bitwise-equal tile of ``scripts/sweep_mxfp8_gemm.py`` on all four wgrad shapes (docs/performance.md)."""


@triton.jit
def _scale_value(code):
    """fp32 value of an E8M0 code: 2**(code - 127), NaN for 255."""
    return tl.where(code == 255, float("nan"), pow2(code - 127))


@triton.jit
def _mx_scale_codes(sa_ptr, a_off, amask, sb_ptr, b_off, bmask, k0, kend, BK: tl.constexpr):
    """The E8M0 scale codes (int32 [BM, BK/32], [BN, BK/32]) of the K step at k0; sa_ptr, sb_ptr point at the
    tiles' first rows and a_off, b_off are the rows' int32 offsets from them (row * scales a row; see
    `check_tile_offsets`). Masked past kend (code 127, no read), so the loops below can load the step after
    their last one."""
    kb = k0 // 32 + tl.arange(0, BK // 32)
    kbmask = kb < (kend + 31) // 32
    ca = tl.load(sa_ptr + (a_off + kb[None, :]), mask=amask & kbmask[None, :], other=127)
    cb = tl.load(sb_ptr + (b_off + kb[None, :]), mask=bmask & kbmask[None, :], other=127)
    return ca.to(tl.int32), cb.to(tl.int32)


@triton.jit
def _mx_step(a_ptr, ca, a_off, amask, b_ptr, cb, b_off, bmask, k0, kend, acc,
             BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr,
             EVEN_K: tl.constexpr = False):
    """acc += A[rows, k0:k0+BK] @ B[rows, k0:k0+BK]ᵀ with the step's MXFP8 scale codes ca, cb
    (`_mx_scale_codes`); a_ptr, b_ptr point at the tiles' first rows, a_off, b_off are the rows' int32 offsets
    (row * row length). EVEN_K: the caller knows every K step is whole (no K masks).

    The callers load a step's scale codes one step early, into registers: a K step of 64 reads 2 scale bytes
    a row, under `cp.async`'s 4-byte minimum, so the software pipeline cannot stage them like the codes, and a
    load at the top of the step left every step waiting one memory latency (sm_90 TTGIR). The values, hence
    the bits, are the same.

    FP8 (BK = 32): one ``tl.dot`` of the raw E4M3 operands into a fresh FP32 tile, then
    ``acc += (d * sa[m]) * sb[n]`` with the E8M0 scales as FP32 powers of two (scales applied to the partial
    sums along K). Hopper's FP8 MMA adds the 32 products with a narrower accumulator than FP32 (DeepSeek-V3
    report), so this path is NOT exact per block; the error is bounded by the test tolerance (looser than BF16's).
    BF16 (BK = 64): each E4M3 value times its scale is exact in BF16 (3-bit mantissa, FP32 exponent range; only
    values below 2**-133 flush), then a BF16 ``tl.dot`` with FP32 accumulation. The tests check
    |out - ref| <= TOL_K * K * 2**-24 * (|A| @ |B|ᵀ) against the FP32 reference."""
    kk = k0 + tl.arange(0, BK)
    kmask = (kk < kend) | EVEN_K
    a = tl.load(a_ptr + (a_off + kk[None, :]), mask=amask & kmask[None, :], other=0)
    b = tl.load(b_ptr + (b_off + kk[None, :]), mask=bmask & kmask[None, :], other=0)
    sa = _scale_value(ca)
    sb = _scale_value(cb)
    if FP8:  # BK == 32: one block, scales applied to the FP8 partial sum
        d = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(b.to(tl.float8e4nv, bitcast=True)))
        acc += (d * tl.reshape(sa, [BM])[:, None]) * tl.reshape(sb, [BN])[None, :]
    else:
        av = tl.reshape(a.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BM, BK // 32, 32]) * sa[:, :, None]
        bv = tl.reshape(b.to(tl.float8e4nv, bitcast=True).to(tl.float32), [BN, BK // 32, 32]) * sb[:, :, None]
        av = tl.reshape(av, [BM, BK])
        bv = tl.reshape(bv, [BN, BK])
        if not INTERPRET:  # the CPU interpreter's BF16 dot is wrong; its FP32 dot of the same exact values is not
            av = av.to(tl.bfloat16)
            bv = bv.to(tl.bfloat16)
        acc = tl.dot(av, tl.trans(bv), acc)
    return acc


@triton.jit(do_not_specialize=['n_tiles'])  # see formats_triton.NO_SPECIALIZE
def _mx_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, map_ptr, n_tiles, NC, KR, KS,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, BK: tl.constexpr,
                    INTERPRET: tl.constexpr, EVEN_N: tl.constexpr = False, EVEN_K: tl.constexpr = False):
    """out[rows of e, :NC] = A[rows, :KR] @ B[e, :NC, :KR]ᵀ; the row tiles come from tile_map_triton.tile_map, the
    programs in `tile_first`'s order (a one-dimensional grid, live tiles first).
    KS = KR // 32 scales a row (an argument: Triton then knows its divisibility for the addresses).
    EVEN_N / EVEN_K: NC, KR are multiples of the tile (no column / K masks; same bits).

    Addresses: one 64-bit pointer per operand at the tile's first row plus int32 offsets within the tile (the
    launcher's `check_tile_offsets` bounds them), not a 64-bit pointer per element, which holds two registers
    per vector across the K loop. The epilogue's offsets and masks are built after the loop (`store_tile`):
    built before it, the output layout's 32 rows a thread stay live across it, and ptxas spills them on sm_90
    (docs/performance.md, Training GEMMs)."""
    pid_t, pid_n = tile_first(NC, BLOCK_N)
    e, row0, row1 = map_entry(map_ptr, n_tiles, pid_t)
    if e >= 0:
        r = tl.arange(0, BLOCK_M)
        rmask = (r < row1 - row0)[:, None]
        c = tl.arange(0, BLOCK_N)
        nmask = ((c < NC - pid_n * BLOCK_N) | EVEN_N)[:, None]
        a_off, sa_off = (r * KR)[:, None], (r * KS)[:, None]
        b_off, sb_off = (c * KR)[:, None], (c * KS)[:, None]
        a_tile = a_ptr + row0.to(tl.int64) * KR
        sa_tile = sa_ptr + row0.to(tl.int64) * KS
        b_row0 = e.to(tl.int64) * NC + pid_n * BLOCK_N
        b_tile = b_ptr + b_row0 * KR
        sb_tile = sb_ptr + b_row0 * KS
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        ca, cb = _mx_scale_codes(sa_tile, sa_off, rmask, sb_tile, sb_off, nmask, 0, KR, BK)
        for k0 in range(0, KR, BK):  # each step's scales loaded during the step before (see _mx_step)
            na, nb = _mx_scale_codes(sa_tile, sa_off, rmask, sb_tile, sb_off, nmask, k0 + BK, KR, BK)
            acc = _mx_step(a_tile, ca, a_off, rmask, b_tile, cb, b_off, nmask, k0, KR, acc, BLOCK_M, BLOCK_N, FP8,
                           BK, INTERPRET, EVEN_K)
            ca, cb = na, nb
        store_tile(out_ptr + row0.to(tl.int64) * NC, acc, row1 - row0, NC, pid_n * BLOCK_N, NC, BLOCK_M, BLOCK_N,
                    EVEN_N)


@triton.jit
def _mx_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, seg_ptr, P, Q, RP, RS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, BK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """out[e] [P, Q] = A[:, seg e] @ B[:, seg e]ᵀ, A [P, RP], B [Q, RP]; seg e = [seg[e], seg[e+1]); RS = RP // 32.
    Addresses as `_mx_rows_kernel`'s: a 64-bit pointer at each tile's first row, int32 offsets within it."""
    e = tl.program_id(0)
    pm = tl.program_id(1)
    pn = tl.program_id(2)
    s0 = tl.multiple_of(tl.load(seg_ptr + e), 32)  # segments are padded to 32: lets the loads vectorize
    s1 = tl.multiple_of(tl.load(seg_ptr + e + 1), 32)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    rmask = (r < P - pm * BLOCK_M)[:, None]
    nmask = (c < Q - pn * BLOCK_N)[:, None]
    a_off, sa_off = (r * RP)[:, None], (r * RS)[:, None]
    b_off, sb_off = (c * RP)[:, None], (c * RS)[:, None]
    a_row0 = (pm * BLOCK_M).to(tl.int64)
    b_row0 = (pn * BLOCK_N).to(tl.int64)
    a_tile, sa_tile = a_ptr + a_row0 * RP, sa_ptr + a_row0 * RS
    b_tile, sb_tile = b_ptr + b_row0 * RP, sb_ptr + b_row0 * RS
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ca, cb = _mx_scale_codes(sa_tile, sa_off, rmask, sb_tile, sb_off, nmask, s0, s1, BK)
    for k0 in range(s0, s1, BK):  # each step's scales loaded during the step before (see _mx_step)
        na, nb = _mx_scale_codes(sa_tile, sa_off, rmask, sb_tile, sb_off, nmask, k0 + BK, s1, BK)
        acc = _mx_step(a_tile, ca, a_off, rmask, b_tile, cb, b_off, nmask, k0, s1, acc, BLOCK_M, BLOCK_N, FP8, BK,
                       INTERPRET)
        ca, cb = na, nb
    store_tile(out_ptr + (e.to(tl.int64) * P + pm * BLOCK_M) * Q, acc, P - pm * BLOCK_M, Q, pn * BLOCK_N, Q,
                BLOCK_M, BLOCK_N)


def _operands(q, what: str):
    if q.fmt != "mxfp8":
        raise ValueError(f"{what} must be an MXFP8 QTensor, got {q.fmt!r}")
    return q.data.contiguous().view(torch.uint8), q.scale.contiguous().view(torch.uint8)


def pick_config(rows: int, fp8: bool) -> Config:
    return MX_DECODE if TWO_CONFIGS and rows <= MX_DECODE_MAX_ROWS else MX_TRAIN[fp8]


def grouped_mxfp8(qa, qb, counts, out_dtype: torch.dtype = torch.float32, *, fp8: bool | None = None,
                  config: Config | None = None) -> torch.Tensor:
    """out [R, NC] = grouped A [R, KR] @ B[e] [NC, KR]ᵀ (MXFP8, blocks along KR), rows of e contiguous.

    dgrad: A = Q(dY) [R, N], B = requantize(W) [E, K, N]; the mxfp8 recipe's forward likewise."""
    rows, kr, groups, nc = grouped_shapes(qa, qb, "mxfp8", "grouped_mxfp8")
    fp8 = FP8_CORES if fp8 is None else fp8
    cfg = config or pick_config(rows, fp8)
    bk = 32 if fp8 else BF16_BLOCK_K
    check_tile_offsets("grouped_mxfp8: the reduction dimension", max(cfg.block_m, cfg.block_n), kr, bk)
    check_tile_offsets("grouped_mxfp8: the output columns", cfg.block_m, nc, cfg.block_n)
    a, sa = _operands(qa, "A")
    b, sb = _operands(qb, "B")
    cmap = tile_map(as_counts(counts, groups, a.device), rows, cfg.block_m, a.device)
    out = alloc_out(rows, nc, out_dtype, a.device)
    if rows:
        _mx_rows_kernel[(cmap.shape[1] * triton.cdiv(nc, cfg.block_n),)](
            a, sa, b, sb, out, cmap, cmap.shape[1], nc, kr, kr // 32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            FP8=fp8, BK=bk, INTERPRET=interpret(), EVEN_N=nc % cfg.block_n == 0, EVEN_K=kr % bk == 0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(out_dtype)


def wgrad_mxfp8(qa, qb, padded_counts, out_dtype: torch.dtype = torch.float32, *, fp8: bool | None = None,
                config: Config | None = None) -> torch.Tensor:
    """dw [E, P, Q]: dw[e] = A[:, seg e] @ B[:, seg e]ᵀ, A [P, R_pad], B [Q, R_pad] MXFP8 (blocks along R_pad).

    padded_counts: columns of each expert (multiples of 32, list or int tensor [E]); empty experts give zeros.
    Expert e owns seg e = [sum(padded[:e]), sum(padded[:e+1])). wgrad: A = Q(dYᵀ) [N, R_pad],
    B = requantize(x) [K, R_pad].
    """
    if len(qa.shape) != 2 or len(qb.shape) != 2 or qa.shape[1] != qb.shape[1]:
        raise ValueError(f"wgrad_mxfp8: A [P, R] and B [Q, R] must share R; got {tuple(qa.shape)}, {tuple(qb.shape)}")
    fp8 = FP8_CORES if fp8 is None else fp8
    config = config or WGRAD[fp8]
    (p, rp), q = qa.shape, qb.shape[0]
    bk = 32 if fp8 else BF16_BLOCK_K
    check_tile_offsets("wgrad_mxfp8: the padded rows (R_pad)", max(config.block_m, config.block_n), rp, bk)
    check_tile_offsets("wgrad_mxfp8: Q", config.block_m, q, config.block_n)
    a, sa = _operands(qa, "A")
    b, sb = _operands(qb, "B")
    groups = len(padded_counts)
    if isinstance(padded_counts, torch.Tensor):
        pc = to_device(padded_counts, a.device).to(torch.int64)
        seg = torch.cat([pc.new_zeros(1), torch.cumsum(pc, 0)]).to(torch.int32)
    else:  # built on the host and queued from pinned memory: a pageable copy would make the host wait for the GPU
        seg = to_device(torch.tensor([0, *itertools.accumulate(int(m) for m in padded_counts)], dtype=torch.int32),
                        a.device)
    out = torch.empty((groups, p, q), dtype=out_dtype, device=a.device)
    grid = (groups, triton.cdiv(p, config.block_m), triton.cdiv(q, config.block_n))
    _mx_wgrad_kernel[grid](a, sa, b, sb, out, seg, p, q, rp, rp // 32, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                           FP8=fp8, BK=bk, INTERPRET=interpret(), num_warps=config.num_warps,
                           num_stages=config.num_stages)
    return out
