"""Triton NVFP4 grouped GEMM: y[rows of e] = dequant(Qx) @ dequant(Qw[e])ᵀ, tiles decoded in registers.

    y = grouped_nvfp4(qx, qw, counts, torch.bfloat16)   # qx NVFP4 [R, K] per-row outer, qw NVFP4 [E, N, K]

Matches ``rl4bit.trainer.qgemm.grouped_forward`` (the exact CPU reference) up to the order of the FP32 sum over
K: operands are decoded to FP16 without their outer scales (E2M1 x E4M3 is exact there; `_decode_tile`),
multiplied on the tensor cores with FP32 accumulation, and the epilogue applies ``(acc * outer_x[m]) *
outer_w[e]`` in FP32. Batch-invariant: a program owns BLOCK_M rows of one expert, K is walked from 0 up (no
split-K), each output is one chain of k16 MMAs, so row m's bits depend on row m and the weights only; the
configs (DECODE, DECODE_WIDE, MID, TRAIN; `pick_config`) differ in tiles only and give the same bits (GPU
test). Row tiles come from `tile_map_triton`; with ``counts`` on the device the grid is fixed (`n_row_tiles`)
and nothing reads the host: a decode step can be captured in a CUDA graph. `quantize_and_multiply` serves a
layer: quantize (with SwiGLU or a row gather) and GEMMs sharing one tile map, the same bits as quantize + GEMM.

Leaves out: split-K, autotuning (tiles are fixed so the bits are), swizzled scale layouts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rl4bit.kernels.formats_triton import e2m1_value, e4m3_value, negate
from rl4bit.kernels.tile_map_triton import (
    as_counts,
    check_tile_offsets,
    map_entry,
    store_tile,
    tile_first,
    tile_map,
)

BLOCK_K = 64
"""Default K step of a loop iteration. The bits do not depend on it: each output element is one chain of k16
MMAs in K order whatever the step (a larger step loads more K per iteration, more bytes in flight); the GPU test
checks that configs with different steps give the same bits."""


@dataclass(frozen=True)
class Config:
    """Tiles of one launch. None of these fields changes the K order: each output is one k16 MMA chain from K = 0
    up, whatever the tile sizes and the K step (`block_k`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    predecode_x: bool = False
    """Decode x to FP16 once (a small kernel) instead of in every program: with few rows, every warp
    of an mma.sync program would otherwise re-decode the whole x tile."""
    block_k: int = BLOCK_K
    """K loaded per loop iteration (a multiple of 16); the k16 MMA chain, hence the bits, is the same for any.
    Compiled kernels take MIN_COMPILED_BLOCK_K and up (the interpreter any multiple of 16)."""
    w_first: bool = False
    """Multiply as (W x^T)^T: the decoded weights are the MMA's A operand, x its B, the accumulator transposed once
    in the epilogue. Each output is the same k16 MMA chain over the same products (the same bits, as DECODE and
    TRAIN are). For mma.sync tiles only (<= 2 warps or block_n <= 32; 64 x 4 warps compiles to wgmma, worse). Why:
    with x as A, every k16 step gathers x's A fragment from four 128-bit shared loads into a register quad (~90
    register moves a 256-wide K step, DECODE's sm_90 SASS); as B, x's fragment is a pair from one load. sm_90
    SASS has fewer thread instructions a weight element in the K loop, yet no W-first tile beat DECODE on the
    bench model's experts at 1-64 tokens (`scripts/sweep_decode_gemm.py`): not a default."""


MIN_COMPILED_BLOCK_K = 64
"""Smallest K step a compiled kernel takes. A compiled 16-wide step is wrong on sm_90 with Triton 3.6 (every
16-wide config off by order 1 against the exact product, while the interpreter is right): the bit-trick tile
is decoded right but reaches the k16 dot's operand layout wrong. 64 and up are what the tests and sweeps cover."""


DECODE = Config(block_m=16, block_n=64, num_warps=4, num_stages=3, predecode_x=True, block_k=256)
"""Few-row calls: the fastest bitwise-equal tile on the dense one-token shape and the bench model's gate_up in
``scripts/sweep_decode_gemm.py``; figures in docs/performance.md."""
DECODE_WIDE = Config(block_m=16, block_n=128, num_warps=4, num_stages=3, predecode_x=True, block_k=256)
"""DECODE's 128-wide sibling, for DECODE-row calls of more than `SMALL_GRID` programs, whatever K: within a few %
of each shape's best on Qwen3-30B-A3B and 235B-A22B expert shapes on both H100 and H200
(`scripts/sweep_decode_gemm.py --large-grid`), one rule for both GPUs rather than a table per GPU."""
TRAIN = Config(block_m=128, block_n=128, num_warps=4, num_stages=3, block_k=64)
"""Training-size calls: fastest or within 2% of it on Qwen3-30B-A3B's and the bench model's expert shapes at
thousands of tokens (``scripts/sweep_decode_gemm.py --train``)."""
DECODE_MAX_ROWS = 64
"""R at or below this runs DECODE (R = all rows of the call, so one call uses one config)."""
TWO_CONFIGS = True
"""False: TRAIN for every M (use if DECODE and TRAIN ever differ in bits on a GPU)."""


def interpret() -> bool:
    """True under TRITON_INTERPRET=1 (CPU), whose FP32 -> BF16 casts truncate instead of rounding to nearest."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def alloc_out(rows: int, cols: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The kernel's output buffer: FP32 under the interpreter (the caller rounds on the host), else `dtype`."""
    return torch.empty((rows, cols), dtype=torch.float32 if interpret() else dtype, device=device)


DECODES = {"asm": 0, "bits": 1, "f32": 2}
GPU_DECODE = "asm"
"""The decode compiled kernels use ("bits" if the PTX ever misbehaves: same values, ~10% more instructions)."""


DECODE_MAX_ROWS_PER_GROUP = 16
"""Grouped calls with at most this many rows per expert on average (MoE decode: a few tokens over many
experts) also run DECODE: TRAIN's 128-row tiles would be almost all masked rows."""

MID = Config(block_m=64, block_n=128, num_warps=4, num_stages=3, predecode_x=True, block_k=64)
"""Grouped calls with DECODE_MAX_ROWS_PER_GROUP < rows an expert <= MID_MAX_ROWS_PER_GROUP (batched MoE decode,
e.g. 256 tokens x top-4 over 16 experts): faster there than TRAIN and DECODE (``scripts/sweep_decode_gemm.py
--mid``)."""
MID_MAX_ROWS_PER_GROUP = 64


SMALL_GRID = 1024
"""Programs of DECODE's tiles (row tiles holding rows x 64-wide column tiles) up to which a DECODE-row call runs
DECODE; past it, DECODE_WIDE. With few programs a program's K loop is the call's latency and narrow tiles spread
the bytes over more SMs. Below the threshold neither tile wins everywhere, but DECODE's losses against the
sweep's best are small and DECODE_WIDE's large (``scripts/sweep_decode_gemm.py``), hence DECODE."""


def decode_programs(rows: int, groups: int, n: int) -> int:
    """Programs of a DECODE-tile call that hold rows: one row tile for each expert with rows (at most
    min(E, R); more only past 16 rows an expert), times the column tiles."""
    tiles = triton.cdiv(rows, DECODE.block_m) if groups == 1 else min(groups, rows)
    return tiles * triton.cdiv(n, DECODE.block_n)


def decode_rows(rows: int, groups: int) -> bool:
    """Whether `pick_config` gives a call of this many rows over `groups` experts a DECODE-family config (16-row
    tiles), whatever its K and N."""
    return TWO_CONFIGS and (rows <= DECODE_MAX_ROWS or rows <= DECODE_MAX_ROWS_PER_GROUP * groups)


def pick_config(rows: int, groups: int = 1, n: int | None = None) -> Config:
    """DECODE for few rows (R <= DECODE_MAX_ROWS, or at most DECODE_MAX_ROWS_PER_GROUP rows an expert;
    DECODE_WIDE, its 128-wide sibling, when the call has more than SMALL_GRID programs, `decode_programs`, with
    n the output columns; n None: DECODE), MID up to MID_MAX_ROWS_PER_GROUP rows an expert, else TRAIN.

    The choice depends on the call's shape only; all configs give the same bits per row (GPU-tested), so a
    row's result does not depend on which one ran.
    """
    if not TWO_CONFIGS:
        return TRAIN
    if decode_rows(rows, groups):
        if n is not None and decode_programs(rows, groups, n) > SMALL_GRID:
            return DECODE_WIDE
        return DECODE
    return MID if groups > 1 and rows <= MID_MAX_ROWS_PER_GROUP * groups else TRAIN


# ---------------------------------------------------------------- kernel


# One word (8 codes) + its FP16 block scale -> 8 FP16 values: pair k = codes k (low half) and k + 4 (high half),
# magnitude bits to 9..11 / 25..27, sign bits to 15 / 31, then one f16x2 multiply by the scale (f16 keeps subnormals).
_PAIR = "shl.b32 a, $8, {ma};\n shl.b32 b, $8, {sg};\n and.b32 a, a, 0x0E000E00;\n and.b32 b, b, 0x80008000;\n" \
        "or.b32 x, a, b;\n mul.rn.f16x2 x, x, s2;\n mov.b32 {{${lo}, ${hi}}}, x;\n"
_DECODE_ASM = tl.constexpr("{\n .reg .b32 a, b, x, s2;\n mov.b32 s2, {$9, $9};\n"
               + "".join(_PAIR.format(ma=9 - 4 * k, sg=12 - 4 * k, lo=2 * k, hi=2 * k + 1) for k in range(3))
               + "shr.u32 a, $8, 3;\n and.b32 b, $8, 0x80008000;\n and.b32 a, a, 0x0E000E00;\n"
               + "or.b32 x, a, b;\n mul.rn.f16x2 x, x, s2;\n mov.b32 {$6, $7}, x;\n}")


@triton.jit
def _low_half(p):
    """The FP16 held in the low 16 bits of int32 p."""
    return p.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _pairs_in_k_order(c0, c1, c2, c3, c4, c5, c6, c7, R: tl.constexpr, BK: tl.constexpr):
    """[R, BK] from the 8 codes' values of each word ([R, BK / 8] each, c_i = code i) in the K order
    (0, 4, 1, 5, 2, 6, 3, 7): the pairs (k, k + 4) the bit trick decodes in one 32-bit register stay adjacent,
    as the MMA operand registers hold them (`tl.join` adds a minor dim: the low halves, then the high ones)."""
    lo = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [.., 2, 2] flattened: c0 c1 c2 c3
    hi = tl.join(tl.join(c4, c6), tl.join(c5, c7))
    return tl.reshape(tl.join(lo, hi), [R, BK])


@triton.jit
def _decode_tile(words, scales, R: tl.constexpr, BK: tl.constexpr, DECODE: tl.constexpr):
    """FP16 [R, BK] of an NVFP4 tile: int32 words [R, BK/8] (8 codes each), E4M3 codes uint8 [R, BK/16].

    Within each word of 8 codes the K order is permuted to (0, 4, 1, 5, 2, 6, 3, 7)
    in every decode (`_pairs_in_k_order`): pair k of the bit trick holds codes k
    and k + 4 (nibbles 4k and 4k + 16) in one 32-bit register, which stays one
    register of the MMA operand. x and w use the same order and it stays inside
    one 16-block (one scale, one k16 MMA step, whose 16 products sum exactly),
    so the dot is unchanged.
    DECODE 0: the bit trick in PTX (GPU); 1: the same bit trick in Triton ops
    (interpreter); 2: plain FP32 decode (E2M1 value x E4M3 value, cast to FP16).
    0 and 1 give code x scale x 2**-14, 2 gives code x scale.

    The bit trick (no lookup table, no int->float conversion): an E2M1 code ``s e1 e0 m`` placed as FP16 bits
    ``s 00000 e1e0 m 000000000`` is the code value times 2**-14 for every code (exponent field 0 makes 0.5 the
    subnormal 2**-15, as in E2M1 itself); an E4M3 scale code shifted left by 7 is its value times 2**-8 in FP16.
    The product has at most 6 significant bits and is >= 2**-24 when non-zero, so it is an exact FP16 (PTX f16
    arithmetic keeps subnormals); the dot carries 2**-28, removed exactly in the epilogue. FP16 rather than
    BF16: both hold these values exactly, only FP16 has the subnormals the trick needs.
    """
    s = scales.to(tl.int32)
    if DECODE == 2:
        j = tl.arange(0, 8)
        shift = (j // 2) * 4 + (j % 2) * 16
        c = tl.reshape((words[:, :, None] >> shift[None, None, :]) & 15, [R, BK // 16, 16])
        mag = e2m1_value(c & 7) * e4m3_value(s)[:, :, None]
        v = tl.reshape(tl.where((c & 8) != 0, negate(mag), mag).to(tl.float16), [R, BK])  # code 8: -0
    else:
        sv = (s << 7).to(tl.int16).to(tl.float16, bitcast=True) * 256.0  # E4M3 code << 7 = value * 2**-8 in FP16
        if DECODE == 0:
            sw = tl.reshape(tl.broadcast_to(sv[:, :, None], [R, BK // 16, 2]), [R, BK // 8])
            e0, e4, e1, e5, e2, e6, e3, e7 = tl.inline_asm_elementwise(
                _DECODE_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, sw], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
            v = _pairs_in_k_order(e0, e1, e2, e3, e4, e5, e6, e7, R, BK)
        else:
            p0 = ((words << 9) & 0x0E000E00) | ((words << 12) & -2147450880)  # 0x80008000 as int32
            p1 = ((words << 5) & 0x0E000E00) | ((words << 8) & -2147450880)
            p2 = ((words << 1) & 0x0E000E00) | ((words << 4) & -2147450880)
            p3 = ((words >> 3) & 0x0E000E00) | (words & -2147450880)  # >> fills bits the mask drops
            h = _pairs_in_k_order(_low_half(p0), _low_half(p1), _low_half(p2), _low_half(p3),  # codes k = 0..3
                                  _low_half(p0 >> 16), _low_half(p1 >> 16), _low_half(p2 >> 16),  # codes k + 4
                                  _low_half(p3 >> 16), R, BK)
            v = tl.reshape(tl.reshape(h, [R, BK // 16, 16]) * sv[:, :, None], [R, BK])
    return v


@triton.jit(do_not_specialize=['R'])  # see formats_triton.NO_SPECIALIZE
def _predecode_kernel(xd_ptr, xs_ptr, xh_ptr, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                      DECODE: tl.constexpr):
    """xh [R, K] FP16 = _decode_tile of x, stored in the decode's own (permuted-within-8) K order."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    kk = k0 + tl.arange(0, BLOCK_K)
    r = rows.to(tl.int64)[:, None]
    rm = (rows < R)[:, None]
    xp = tl.load(xd_ptr + r * (K // 8) + kw[None, :], mask=rm & (kw < K // 8)[None, :], other=0)
    xs = tl.load(xs_ptr + r * (K // 16) + ks[None, :], mask=rm & (ks < K // 16)[None, :], other=0)
    tl.store(xh_ptr + r * K + kk[None, :], _decode_tile(xp, xs, BLOCK_R, BLOCK_K, DECODE), mask=rm & (kk < K)[None, :])


@triton.jit(do_not_specialize=['n_tiles'])  # see formats_triton.NO_SPECIALIZE
def _nvfp4_grouped_kernel(xd_ptr, xs_ptr, xh_ptr, xo_ptr, wd_ptr, ws_ptr, wo_ptr, y_ptr, map_ptr, n_tiles, N, K,
                          KW, KS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DECODE: tl.constexpr, X_F16: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                          W_FIRST: tl.constexpr):
    """One (row tile, BLOCK_N columns) program. KW, KS = K // 8 words and K // 16 scales a row, passed in so that
    Triton sees them as multiples of 16 when they are: the scale loads then vectorize and the software pipeline
    makes them asynchronous like the words (computed here from K, the scale loads stayed synchronous: one memory
    latency every K step). Addresses: a 64-bit pointer per operand at the tile's first row, int32 offsets
    within the tile (the launcher's `check_tile_offsets` bounds them); the epilogue's built after the K loop
    (`store_tile`)."""
    pid_t, pid_n = tile_first(N, BLOCK_N)
    e, row0, row1 = map_entry(map_ptr, n_tiles, pid_t)
    if e >= 0:
        r = tl.arange(0, BLOCK_M)
        rmask = r < row1 - row0
        c = tl.arange(0, BLOCK_N)
        wm = ((c < N - pid_n * BLOCK_N) | EVEN_N)[:, None]  # EVEN_N / EVEN_K: N, K are multiples of the tile
        kw = tl.arange(0, BLOCK_K // 8)
        ks = tl.arange(0, BLOCK_K // 16)
        x_row0 = row0.to(tl.int64)  # 64-bit pointers at the tiles' first rows, int32 offsets in them
        w_row0 = e.to(tl.int64) * N + pid_n * BLOCK_N
        xd_tile, xs_tile, xh_tile = xd_ptr + x_row0 * KW, xs_ptr + x_row0 * KS, xh_ptr + x_row0 * K
        wd_tile, ws_tile = wd_ptr + w_row0 * KW, ws_ptr + w_row0 * KS
        ox = tl.load(xo_ptr + row0 + r, mask=rmask, other=1.0)  # the epilogue's scales, loaded before the K loop:
        ow = tl.load(wo_ptr + e)  # their latency hides behind it instead of following it
        if W_FIRST:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kwm = ((k0 // 8 + kw) < K // 8) | EVEN_K
            ksm = ((k0 // 16 + ks) < K // 16) | EVEN_K
            wp = tl.load(wd_tile + ((c * KW)[:, None] + (k0 // 8 + kw)[None, :]), mask=wm & kwm[None, :], other=0)
            ws = tl.load(ws_tile + ((c * KS)[:, None] + (k0 // 16 + ks)[None, :]), mask=wm & ksm[None, :], other=0)
            if X_F16:  # x decoded once by _predecode_kernel (the small-M config: no per-warp re-decode of x)
                kk = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(xh_tile + ((r * K)[:, None] + kk[None, :]),
                             mask=rmask[:, None] & ((kk < K) | EVEN_K)[None, :], other=0.0)
            else:
                xp = tl.load(xd_tile + ((r * KW)[:, None] + (k0 // 8 + kw)[None, :]),
                             mask=rmask[:, None] & kwm[None, :], other=0)
                xs = tl.load(xs_tile + ((r * KS)[:, None] + (k0 // 16 + ks)[None, :]),
                             mask=rmask[:, None] & ksm[None, :], other=0)
                xv = _decode_tile(xp, xs, BLOCK_M, BLOCK_K, DECODE)
            wv = _decode_tile(wp, ws, BLOCK_N, BLOCK_K, DECODE)
            if W_FIRST:
                acc = tl.dot(wv, tl.trans(xv), acc)
            else:
                acc = tl.dot(xv, tl.trans(wv), acc)
        if W_FIRST:
            acc = tl.trans(acc)
        if DECODE != 2:
            acc = acc * 268435456.0  # 2**28: the two operands' 2**-14, exact
        y = (acc * ox[:, None]) * ow
        store_tile(y_ptr + x_row0 * N, y, row1 - row0, N, pid_n * BLOCK_N, N, BLOCK_M, BLOCK_N, EVEN_N)


# ---------------------------------------------------------------- wrapper


def grouped_shapes(qa, qb, fmt: str, what: str) -> tuple[int, int, int, int]:
    """(R, K, E, N) of a grouped GEMM's operands A [R, K] and B [E, N, K], both `fmt` QTensors (shared with
    mxfp8_gemm_triton); `what` names the call in the errors."""
    if qa.fmt != fmt or qb.fmt != fmt:
        raise ValueError(f"{what} needs {fmt} operands, got A {qa.fmt!r} and B {qb.fmt!r}")
    if len(qa.shape) != 2 or len(qb.shape) != 3:
        raise ValueError(f"{what}: A must be [R, K] and B [E, N, K]; got {tuple(qa.shape)} and {tuple(qb.shape)}")
    (rows, k), (groups, n, kb) = qa.shape, qb.shape
    if k != kb:
        raise ValueError(f"{what}: A has K={k} but B has K={kb}")
    return rows, k, groups, n


def _words(data: torch.Tensor) -> torch.Tensor:
    """Packed NVFP4 codes as int32 words of 8 codes (little-endian: code 8j + i in bits 4i..4i+3); K % 8 == 0."""
    return data.contiguous().view(torch.int32)


def row_outer(outer: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 [rows] from a per-row ([R, 1]) or per-tensor ([1, 1]) outer scale."""
    o = outer.reshape(-1).float()
    return (o if o.numel() == rows else o.expand(rows)).contiguous()


def group_outer(outer: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 [groups] from a per-expert ([E, 1, 1]) or per-tensor outer scale."""
    o = outer.reshape(-1).float()
    return (o if o.numel() == groups else o.expand(groups)).contiguous()


def _decode_mode(decode: str | None) -> str:
    """The decode a call runs: the given one checked, or the default ("bits" under the interpreter, else
    GPU_DECODE)."""
    decode = decode or ("bits" if interpret() else GPU_DECODE)
    if decode not in DECODES:
        raise ValueError(f"decode={decode!r} is not one of {tuple(DECODES)}")
    if decode == "asm" and interpret():
        raise ValueError("decode='asm' is inline PTX and cannot run under TRITON_INTERPRET=1; use 'bits' or 'f32'")
    return decode


def shared_tile_map(maps: dict | None, counts, groups: int, rows: int, block_m: int, device) -> torch.Tensor:
    """`tile_map(as_counts(counts, groups, device), ...)`, built once per (rows, block_m) for GEMMs that share
    `counts` (a layer's gate_up and down read the same routing): `maps` is a dict the caller keeps for them,
    one per routing (None: build it here). ValueError if the dict already holds the maps of other counts
    (another tensor object, or another list)."""
    if maps is None:
        return tile_map(as_counts(counts, groups, device), rows, block_m, device)
    mine = counts if isinstance(counts, torch.Tensor) else tuple(int(n) for n in counts)
    held = maps.setdefault("counts", mine)
    if held is not mine and (isinstance(mine, torch.Tensor) or isinstance(held, torch.Tensor) or held != mine):
        raise ValueError("maps holds the tile maps of other counts: keep one dict per routing (the GEMMs of one "
                         "layer call), not one across layers")
    key = (rows, block_m)
    if key not in maps:
        maps[key] = tile_map(as_counts(counts, groups, device), rows, block_m, device)
    return maps[key]


def predecode(qx, decode: str, block_k: int = BLOCK_K) -> torch.Tensor:
    """x's codes decoded to the FP16 operand of a config that pre-decodes x (`_predecode_kernel`, `decode` a key of
    DECODES), walking K in steps of block_k: the values do not depend on the step."""
    rows, k = qx.data.shape[0], qx.data.shape[1] * 2
    xh = torch.empty((rows, k), dtype=torch.float16, device=qx.data.device)
    _predecode_kernel[(triton.cdiv(rows, 16), triton.cdiv(k, block_k))](
        _words(qx.data), qx.scale.contiguous().view(torch.uint8), xh, rows, k, BLOCK_R=16, BLOCK_K=block_k,
        DECODE=DECODES[decode], num_warps=1)
    return xh


def grouped_nvfp4(qx, qw, counts, out_dtype: torch.dtype = torch.bfloat16, *, config: Config | None = None,
                  decode: str | None = None, xh: torch.Tensor | None = None, maps: dict | None = None) -> torch.Tensor:
    """y [R, N] in out_dtype = grouped dequant(qx) @ dequant(qw[e])ᵀ; rows of expert e contiguous (counts[e]).

    counts: list of ints or an int tensor [E] (a device tensor keeps the call free of host syncs).
    config: the tile config (default: ``pick_config(R, E, N)``). decode: "asm" (GPU default), "bits" (the same
    bit trick in Triton ops; interpreter default) or "f32" (plain decode): the same values either way.
    xh: qx already decoded to the FP16 operand by the same `decode` (`quantize_and_multiply`: the bit-trick
    decodes carry 2**-14, "f32" does not, and nothing here can tell), used when the config pre-decodes x.
    maps: a dict shared by GEMMs over the same `counts` (see `shared_tile_map`).
    """
    rows, k, groups, n = grouped_shapes(qx, qw, "nvfp4", "grouped_nvfp4")
    dev = qx.data.device
    decode = _decode_mode(decode)
    cfg = config or pick_config(rows, groups, n)
    if cfg.block_k % 16 or (cfg.block_k < MIN_COMPILED_BLOCK_K and not interpret()):
        raise ValueError(f"config block_k={cfg.block_k}: compiled kernels take multiples of 16 from "
                         f"{MIN_COMPILED_BLOCK_K} (see MIN_COMPILED_BLOCK_K; the interpreter takes 16 and up)")
    check_tile_offsets("grouped_nvfp4: K", max(cfg.block_m, cfg.block_n), k, max(cfg.block_k, cfg.block_n))
    check_tile_offsets("grouped_nvfp4: N", cfg.block_m, n, cfg.block_n)
    cmap = shared_tile_map(maps, counts, groups, rows, cfg.block_m, dev)
    n_tiles = cmap.shape[1]
    y = alloc_out(rows, n, out_dtype, dev)
    if not rows:
        return y.to(out_dtype)
    xd, xs = _words(qx.data), qx.scale.contiguous().view(torch.uint8)
    if not cfg.predecode_x:
        xh = xd  # unused
    elif xh is None:
        xh = predecode(qx, decode)
    elif xh.shape != (rows, k) or xh.dtype != torch.float16 or not xh.is_contiguous() or xh.device != dev:
        raise ValueError(f"xh: need x decoded as a contiguous float16 [{rows}, {k}] tensor on {dev}, got {xh.dtype} "
                         f"{tuple(xh.shape)} on {xh.device}")
    _nvfp4_grouped_kernel[(n_tiles * triton.cdiv(n, cfg.block_n),)](
        xd, xs, xh, row_outer(qx.outer, rows),
        _words(qw.data), qw.scale.contiguous().view(torch.uint8), group_outer(qw.outer, groups),
        y, cmap, n_tiles, n, k, k // 8, k // 16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DECODE=DECODES[decode], X_F16=cfg.predecode_x, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        W_FIRST=cfg.w_first,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.to(out_dtype)


def quantize_and_multiply(x: torch.Tensor, qw, counts, out_dtype: torch.dtype = torch.bfloat16, *,
                          four_over_six: bool = True, config: Config | None = None, decode: str | None = None,
                          maps: dict | None = None, swiglu: bool = False, rows: torch.Tensor | None = None,
                          cast: torch.dtype | None = None):
    """(qx, y): x [R, K] quantized as the recipe's activations (NVFP4, per-row outer, 4/6 optional) and
    y = `grouped_nvfp4(qx, qw, counts, out_dtype)`, bitwise; when the config pre-decodes x, the quantize kernel
    writes the decoded operand too (`nvfp4_triton.quantize_nvfp4(decoded=)`: one launch fewer). swiglu: x is
    h [R, 2K] = [gate | up] and the product's input is its SwiGLU (`swiglu_triton.swiglu(h)`'s values, never
    stored: two launches fewer). rows, cast: the product's input is x[rows].to(cast) (x [S, K], rows an int
    index [R]), read in place by the quantize (no gather, no cast launch).

    What the serving modules run (`trainer.qgemm.served_product`); the trainer's forward quantizes and
    multiplies separately (it keeps qx for the backward) and gets the same bits.
    """
    from rl4bit.kernels import quantize
    from rl4bit.kernels.triton_dispatch import quantize_nvfp4_rows

    decode = _decode_mode(decode)
    r = x.shape[0] if rows is None else rows.numel()
    cfg = config or pick_config(r, qw.shape[0], qw.shape[1])
    got = quantize_nvfp4_rows(x, four_over_six=four_over_six, decode=decode if cfg.predecode_x else None,
                              swiglu=swiglu, rows=rows, cast=cast)
    if got is None and swiglu:
        raise ValueError(f"quantize_and_multiply: h {x.dtype} {tuple(x.shape)} is not covered by the NVFP4 row "
                         f"quantize kernel (h [R, 2K] with K a multiple of 16 and at most nvfp4_triton.MAX_ROW_K); "
                         f"run swiglu_triton.swiglu(h) and pass its output with swiglu=False")
    if got is None:
        xr = (x if rows is None else x[rows]).to(cast or x.dtype)
        got = quantize(xr, "nvfp4", outer="row", four_over_six=four_over_six), None
    qx, xh = got
    return qx, grouped_nvfp4(qx, qw, counts, out_dtype, config=cfg, decode=decode, xh=xh, maps=maps)
