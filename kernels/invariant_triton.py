"""Batch-invariant dense products and means (Triton): a result's bits depend on its own row, never on the row count.

Why: on CUDA, `torch.mm` / `bmm` / `addmm` (cuBLAS) and `mean` (ATen) pick kernels, tiles and the split of the
reduction by shape, so the sampler's decode step (P rows) and the trainer's forward (a micro-batch) round the
same row differently, and quantization amplifies that (a 4/6 scale choice flips). Here every output element
is one FP32 accumulation over K in BLOCK_K steps from K = 0 (no split-K), tiles chosen from K, N and the dtype
only; a mean is one program per output in fixed chunks, then one tree sum. BF16/FP16 use the tensor cores,
FP32 multiplies in full FP32 (`input_precision="ieee"`). Not bitwise equal to cuBLAS: the point is that
trainer and sampler run the same kernels (`rl4bit.kernels.invariant`). Under TRITON_INTERPRET=1 tiles are
up-cast to FP32 and multiplied by `interpreter_dot` (the interpreter's BF16 dot is wrong).

Leaves out: FP8 operands, complex and integer dtypes (callers fall back), speed at tiny K.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rl4bit.kernels.tile_map_triton import as_counts, map_entry, tile_map

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
MAX_GRID_Z = 65535


def _on_device(t: torch.Tensor):
    """Launch on t's device: Triton launches on the current one, and torch.library impls get no device guard."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


@triton.jit
def interpreter_dot(a, b):
    """a [M, K] @ b [K, N] as FP32 products summed per output element (`tl.sum` over K): under the interpreter,
    where `tl.dot` is numpy's matmul and a row's bits can depend on the other rows of its tile (OpenBLAS's
    kernels are chosen by CPU). A row's bits here depend on that row alone, on any CPU."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _k_sum(a_base, s_ak, b_base, s_bk, m_ok, n_ok, K, IEEE: tl.constexpr, UPCAST: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The one reduction order of this file: FP32 [BLOCK_M, BLOCK_N] = sum over K in BLOCK_K steps from 0 of
    a[:, k-tile] @ b[k-tile, :] (`tl.dot` into the accumulator). a_base [BLOCK_M, 1] and b_base [1, BLOCK_N]
    point at k = 0; m_ok / n_ok mask rows and columns; masked K reads 0 (an exact zero product)."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(a_base + kk[None, :].to(tl.int64) * s_ak, mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        b = tl.load(b_base + kk[:, None].to(tl.int64) * s_bk, mask=(kk < K)[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            acc = acc + interpreter_dot(a, b)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    return acc


# Every integer argument is specialized (Triton compiles a variant per value == 1, value % 16 == 0, other): the
# strides and M, N, K follow the shapes, so a model's calls compile a few variants once. A stride known to be 1 or
# a multiple of 16 is what lets the compiler prove an operand's alignment and copy it 16 bytes at a time.
@triton.jit
def _bmm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_bias_m, s_bias_n, alpha, beta,
                HAS_BIAS: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                BATCHED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[b] = a[b] @ b[b] (alpha * that + beta * bias when SCALED), FP32 accumulator, rounded once on store.

    BATCHED: the launch covers more than one b, and the batch strides move the pointers. A one-matrix launch
    (every `mm` / `addmm`, hence every `F.linear`) never reads them, so its batch stride (M x K for a contiguous
    a: not a multiple of 16 for an odd row count and K) cannot hide the operands' alignment. Where alignment is
    unknown the compiler loads an operand element by element (`ld.global.b16` in the sm_90 PTX instead of
    16-byte `cp.async` copies into shared memory): `tests/kernels/test_triton_compile.py` checks the mode's
    layouts; `scripts/sweep_invariant_gemm.py` times the mode against cuBLAS."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if BATCHED:
        pid_b = tl.program_id(2).to(tl.int64)
        a_ptr += pid_b * s_ab
        b_ptr += pid_b * s_bb
        c_ptr += pid_b * s_cb
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_base = a_ptr + rm.to(tl.int64)[:, None] * s_am
    b_base = b_ptr + rn.to(tl.int64)[None, :] * s_bn
    acc = _k_sum(a_base, s_ak, b_base, s_bk, rm < M, rn < N, K, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
    if SCALED:
        acc = acc * alpha
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rm.to(tl.int64)[:, None] * s_bias_m + rn.to(tl.int64)[None, :] * s_bias_n,
                       mask=(rm < M)[:, None] & (rn < N)[None, :], other=0.0).to(tl.float32)
        if SCALED:
            bias = bias * beta
        acc = acc + bias
    c = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn.to(tl.int64)[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


class Tiles(NamedTuple):
    """One launch configuration of this file's products. A row's bits follow from block_k's K steps and the
    tensor-core instruction the compiler derives from all five; on the H100 twelve 16-bit candidates gave the same
    bits on every shape tried (`scripts/sweep_invariant_gemm.py`), but only `tiles()`'s choice is tested."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


def tiles(k: int, n: int, dtype: torch.dtype) -> Tiles:
    """The configuration for a product of reduction length k into n columns, from k, n and the dtype only (never
    the row count): 16-bit operands on tensor cores, FP32 in smaller tiles (the IEEE product runs on the FMA
    units). The 16-bit tile was the fastest of four on a kernel of known alignment over the GPU job's projections
    at 16 and 8,192 rows (not the grouped product's few-row tiles), in `scripts/sweep_invariant_gemm.py`."""
    if dtype == torch.float32:
        return Tiles(32, 32, 32, 4, 3)
    return Tiles(128, 128, 64, 8, 3)


def bmm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, alpha: float = 1.0,
        beta: float = 1.0, *, config: Tiles | None = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N] in a's dtype (a, b: same floating dtype; any strides).

    With `bias` (broadcastable to [M, N], the batch dimension absent): alpha * (a @ b) + beta * bias,
    in FP32 before the one rounding (`addmm`'s contract; beta = 0 ignores the bias, NaN included).
    `config` replaces `tiles(K, N, dtype)` (the tile sweep's candidates); the mode never passes one.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"invariant bmm: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not multiply")
    if a.dtype != b.dtype or a.dtype not in FLOATS:
        raise ValueError(f"invariant bmm: dtypes {a.dtype} @ {b.dtype}; need one of {FLOATS} on both sides")
    nb, m, k = a.shape
    n = b.shape[2]
    out = torch.empty((nb, m, n), dtype=torch.float32 if _interpret() else a.dtype, device=a.device)
    if out.numel() == 0:
        return out.to(a.dtype)
    bm, bn, bk, warps, stages = config or tiles(k, n, a.dtype)
    if bias is not None and beta == 0:
        bias = None
    bias2 = bias.expand(m, n) if bias is not None else out
    scaled = alpha != 1.0 or (bias is not None and beta != 1.0)
    with _on_device(a):
        for b0 in range(0, nb, MAX_GRID_Z):  # the grid's z extent is limited to 65535
            nz = min(MAX_GRID_Z, nb - b0)
            _bmm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), nz)](
                a[b0:], b[b0:], out[b0:], bias2, m, n, k, *a.stride(), *b.stride(), *out.stride(), *bias2.stride()[-2:],
                float(alpha), float(beta), HAS_BIAS=bias is not None, SCALED=scaled, IEEE=a.dtype == torch.float32,
                UPCAST=_interpret(), BATCHED=nz > 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                num_stages=stages,
                enable_fp_fusion=False)
    return out.to(a.dtype) if out.dtype != a.dtype else out


@triton.jit(do_not_specialize=["C"])  # C == 1 would become a constexpr int (and `C.to` fail)
def _row_mean_kernel(x_ptr, out_ptr, C, s_r, BLOCK: tl.constexpr):
    """out[r] = (sum of row r) / C: FP32 partial sums per lane over BLOCK-wide chunks in order, one tree sum."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, C, BLOCK):
        acc += tl.load(x_ptr + r * s_r + c0 + offs, mask=c0 + offs < C, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + r, tl.div_rn(total, C.to(tl.float32)))


def row_mean(x2: torch.Tensor) -> torch.Tensor:
    """Mean of each row of a 2D tensor whose rows are contiguous -> FP32 [R]. BLOCK depends on the row length only."""
    r, c = x2.shape
    out = torch.empty((r,), dtype=torch.float32, device=x2.device)
    if r == 0:
        return out
    if c == 0:
        return out.fill_(float("nan"))  # torch's mean of nothing
    block = min(1024, triton.next_power_of_2(c))
    with _on_device(x2):
        _row_mean_kernel[(r,)](x2, out, c, x2.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


def mean(x: torch.Tensor, dims, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.mean(x, dims, keepdim, dtype=dtype)` with `row_mean`'s fixed order: the reduced dims are moved
    last and flattened (a copy unless they already are), each output one program."""
    if dtype is not None:
        x = x.to(dtype)
    if x.dtype not in FLOATS:
        raise ValueError(f"invariant mean: dtype {x.dtype}; need one of {FLOATS}")
    nd = x.dim()
    given = list(dims) if dims else list(range(nd))
    for d in given:
        if not -max(nd, 1) <= d < max(nd, 1):
            raise IndexError(f"mean: dim {d} out of range for a {nd}-D tensor")
    dims = sorted({d % nd for d in given}) if nd else []
    if len(dims) != len(given) and nd:
        raise RuntimeError(f"mean: dim {list(given)} names a dimension twice")
    keep = [d for d in range(nd) if d not in dims]
    moved = x.permute(*keep, *dims) if nd else x.reshape(1)
    c = 1
    for d in dims:
        c *= x.shape[d]
    rows = 1
    for d in keep:
        rows *= x.shape[d]
    flat = moved.reshape(rows, c)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    out = row_mean(flat).to(x.dtype).reshape([x.shape[d] for d in keep])
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


@triton.jit(do_not_specialize=["n_tiles"])  # follows the row count
def _grouped_kernel(x_ptr, w_ptr, y_ptr, map_ptr, n_tiles, N, K, s_xm, s_we, s_wn, s_ym,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[rows of e] = x[rows of e] @ w[e]ᵀ: the tile map (tile_map_triton.tile_map) gives each row tile its expert and
    row range; each output is one FP32 accumulation over K from 0, as in _bmm_kernel."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, row0, row1 = map_entry(map_ptr, n_tiles, pid_t)
    if e >= 0:
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_base = x_ptr + rm.to(tl.int64)[:, None] * s_xm
        w_base = w_ptr + e.to(tl.int64) * s_we + rn.to(tl.int64)[None, :] * s_wn
        acc = _k_sum(x_base, 1, w_base, 1, rm < row1, rn < N, K, IEEE, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
        y = y_ptr + rm.to(tl.int64)[:, None] * s_ym + rn.to(tl.int64)[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rm < row1)[:, None] & (rn < N)[None, :])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts) -> torch.Tensor:
    """x [R, K] (rows grouped by expert, counts[e] each) @ w[e]ᵀ for w [E, N, K] -> [R, N] in x's dtype.

    The `bf16` recipe's grouped product in the invariant mode (`trainer.qgemm.bf16_grouped`): counts a list or a
    device int tensor (then nothing reads the host: CUDA-graph capturable). A row's bits are those of `bmm` on
    its expert's rows alone (same tiles, each expert's first row at a tile's first row), whatever the counts.
    """
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(f"invariant grouped_mm: x {tuple(x.shape)} and w {tuple(w.shape)}: need [R, K] and [E, N, K]")
    if x.dtype != w.dtype or x.dtype not in FLOATS:
        raise ValueError(f"invariant grouped_mm: dtypes {x.dtype} and {w.dtype}; need one of {FLOATS} on both")
    rows, k = x.shape
    groups, n, _ = w.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(2) == 1 else w.contiguous()
    bm, bn, bk, warps, stages = tiles(k, n, x.dtype)
    cmap = tile_map(as_counts(counts, groups, x.device), rows, bm, x.device)
    n_tiles = cmap.shape[1]
    y = torch.empty((rows, n), dtype=torch.float32 if _interpret() else x.dtype, device=x.device)
    if rows and n:
        with _on_device(x):
            _grouped_kernel[(n_tiles, triton.cdiv(n, bn))](
                x, w, y, cmap, n_tiles, n, k, x.stride(0), w.stride(0), w.stride(1), y.stride(0),
                IEEE=x.dtype == torch.float32, UPCAST=_interpret(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return y.to(x.dtype) if y.dtype != x.dtype else y
