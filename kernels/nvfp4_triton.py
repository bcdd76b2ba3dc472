"""Triton NVFP4 quantize: TE scale chain, per-tensor / per-row / per-group outer scales, 4/6, SR.

    data, scale, s_dec_rows, flag = quantize_nvfp4(x, outer="row", four_over_six=True)

Bitwise equal to the references (``nvfp4.py``, ``four_over_six.py``): the same fp32 op order (``_nvfp4_kernel``
restates it), every division ``div_rn``, launches with ``enable_fp_fusion=False`` (no FMA contraction). With
``outer="row"`` a program holds whole rows and computes the row amax in registers, so activations take one
read of x and one write of codes + scales; per-tensor and per-group amaxes are one ``torch.amax`` first.
Options fold neighbouring launches in (``quantize_nvfp4`` documents them): ``rows=`` / ``cast=`` (the MoE
gather and cast), ``swiglu=True`` (the SwiGLU of a gate-up product, never stored), ``decoded=`` (the grouped
GEMM's pre-decoded operand). A non-finite input sets a flag the caller turns into the reference's ValueError.

Leaves out: 16x16 tiles (the dispatch falls back to the reference), SR with 4/6 (the reference does not
define it), and swizzled scale layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.checks import layout_problem
from rl4bit.kernels.formats_triton import (
    e2m1_code_sr,
    e2m1_index,
    e2m1_round,
    e4m3_code_rn,
    e4m3_value,
    nonfinite_flag,
    raise_flag,
    tile_2d,
)
from rl4bit.kernels.philox_triton import philox_sr8, split_seed
from rl4bit.kernels.qgemm_triton import DECODES, _decode_mode, _decode_tile
from rl4bit.kernels.rmsnorm_triton import FLOAT_TL, to_compute
from rl4bit.kernels.swiglu_triton import swiglu_values

NV_BLOCK = 16
MAX_ROW_K = 16384  # widest row held in one program; wider rows get their amax from torch first
SWIGLU_PER_THREAD = 4
"""Elements a thread of a ``swiglu=True`` launch, which holds one row a program (the SwiGLU's exp and two loads a
value make it heavier than a plain quantize's 16 a thread): one row and 8 warps a program was the fastest at
decode sizes in `scripts/sweep_quantize.py`. The tile cannot change a bit (a row's amax is a max, the 4/6 errors
pairwise sums within a block): the sweep checks every output."""


@triton.jit
def _block_scale(v):
    """(E4M3 code, fp32 value) of e4m3_RN(min(v, 448))."""
    code = e4m3_code_rn(tl.minimum(v, 448.0))
    return code, e4m3_value(code)


@triton.jit
def _scaled(x3, s_val, s_dec):
    """y = x * enc_b for blocked x3 [R, G, 16]; enc_b = 0 if s_b == 0 else min(1 / (s_b * S_dec), FLT_MAX)."""
    enc = tl.minimum(tl.div_rn(tl.full(s_val.shape, 1.0, tl.float32), s_val * s_dec[:, None]), 3.4028234663852886e38)
    enc = tl.where(s_val == 0.0, 0.0, enc)
    return x3 * enc[:, :, None]


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN, so a block max shows a NaN anywhere in the block."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pair_sum(t, N: tl.constexpr, R: tl.constexpr, G: tl.constexpr):
    """t [R, G, N] -> [R, G, N/2]: t[..., 0::2] + t[..., 1::2]."""
    a, b = tl.split(tl.reshape(t, [R, G, N // 2, 2]))
    return a + b


@triton.jit
def _sq_err(ax3, r, s_val, s_dec, R: tl.constexpr, G: tl.constexpr):
    """pairwise_sum16((x - x_hat)^2) per block, x_hat = (q * s) * S_dec (four_over_six.py order).

    Taken on magnitudes: q has x's sign (y = x * enc_b, enc_b >= 0) or is 0, and
    fp32 rounding is sign-symmetric, so x - x_hat = +-(|x| - (|q| * s) * S_dec) exactly.
    """
    d = ax3 - (r * s_val[:, :, None]) * s_dec[:, None, None]
    t = d * d
    t = _pair_sum(t, 16, R, G)
    t = _pair_sum(t, 8, R, G)
    t = _pair_sum(t, 4, R, G)
    t = _pair_sum(t, 2, R, G)
    return tl.reshape(t, [R, G])


@triton.jit(do_not_specialize=['R', 'rows_per_amax', 'seed_lo', 'seed_hi'])  # see formats_triton.NO_SPECIALIZE
def _nvfp4_kernel(x_ptr, src_ptr, amax_ptr, data_ptr, scale_ptr, outer_ptr, flag_ptr, xh_ptr, R, K, rows_per_amax,
                  seed_lo, seed_hi, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ROW_AMAX: tl.constexpr,
                  FOUR_SIX: tl.constexpr, STOCHASTIC: tl.constexpr, EVEN: tl.constexpr, DECODED: tl.constexpr,
                  SWIGLU: tl.constexpr, GATHER: tl.constexpr, CAST: tl.constexpr):
    """One program: BLOCK_R rows x BLOCK_K columns, the references' fp32 op order (nvfp4.py, four_over_six.py):

        S_enc = min(div(bound*6, A), FLT_MAX), 1 if A == 0 or S_enc == 0;  S_dec = 1 / S_enc
        v = b * (S_enc * f32(1/6))  [* 1.5 for the 4/6 "scale to 4" candidate]  [* 17/16 for SR]
        s_b = e4m3_RN(min(v, 448));  enc_b = 0 if s_b == 0 else min(1 / (s_b * S_dec), FLT_MAX)
        q = e2m1(x * enc_b)  (nearest-even, or SR with 8 random bits an element: element o, its flat index,
            takes byte o % 4 of word (o // 4) % 4 of the Philox call for counter o // 16: one call a block),
            where s_b == 0: y = x * 0 = +-0, code 0 or 8 (x's sign, as TE)
        4/6: err_k = pairwise tree sum of (x - (q_k * s_k) * S_dec)^2; pick 4 iff err4 < err6

    ROW_AMAX: the program holds whole rows and computes their amax in registers (outer="row")."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 16
    rows, cols, mask, offs = tile_2d(pid_r, pid_k, R, K, BLOCK_R, BLOCK_K)
    rmask = rows < R
    if SWIGLU:  # x = SwiGLU of h [R, 2K] = [gate | up], computed as swiglu_triton writes it (x's dtype values)
        h_offs = rows.to(tl.int64)[:, None] * (2 * K) + cols[None, :]
        g = tl.load(x_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + h_offs + K, mask=mask, other=0.0).to(tl.float32)
        x = swiglu_values(g, u, x_ptr.dtype.element_ty)
    else:
        x_offs = offs
        if GATHER:  # row r of the quantized x is row src[r] of the input (the outputs stay at row r)
            src = tl.load(src_ptr + rows, mask=rmask, other=0)
            x_offs = src.to(tl.int64)[:, None] * K + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr + x_offs)
        else:
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        x = to_compute(x, CAST, CAST == x_ptr.dtype.element_ty, True)  # x's own dtype, or rounded to CAST first
    ax3 = tl.abs(tl.reshape(x, [BLOCK_R, G, 16]))
    # NaN-keeping block amax: one compare per block finds any NaN or Inf in the tile
    b = tl.reduce(ax3, 2, _max_nan)
    raise_flag(tl.where(b <= 3.4028234663852886e38, 0, 1), flag_ptr)
    if ROW_AMAX:
        amax = tl.max(b, axis=1)
    else:
        amax = tl.load(amax_ptr + rows // rows_per_amax, mask=rmask, other=0.0)
    if FOUR_SIX:
        s_enc = tl.div_rn(tl.full(amax.shape, 1536.0, tl.float32), amax)
    else:
        s_enc = tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), amax)
    s_enc = tl.minimum(s_enc, 3.4028234663852886e38)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    if pid_k == 0:
        tl.store(outer_ptr + rows, s_dec, mask=rmask)

    v = b * (s_enc * 0.1666666716337204)[:, None]  # f32(1/6)
    if STOCHASTIC:
        v = v * 1.0625
    s_code, s_val = _block_scale(v)
    ay = _scaled(ax3, s_val, s_dec)  # |y| = |x| * enc_b; y has x's sign
    if STOCHASTIC:
        # one Philox call per 16-element block: counter = flat offset // 16 = row * K/16 + block (K % 16 == 0)
        ctr = rows.to(tl.int64)[:, None] * (K // 16) + (pid_k * G + tl.arange(0, G))[None, :]
        bits = tl.reshape(philox_sr8(seed_lo, seed_hi, ctr), [BLOCK_R, G, 16])
        idx = e2m1_code_sr(ay, bits)
    else:
        r, m = e2m1_round(ay)
        if FOUR_SIX:
            s4_code, s4_val = _block_scale(v * 1.5)
            r4, m4 = e2m1_round(_scaled(ax3, s4_val, s_dec))
            pick4 = _sq_err(ax3, r4, s4_val, s_dec, BLOCK_R, G) < _sq_err(ax3, r, s_val, s_dec, BLOCK_R, G)
            m = tl.where(pick4[:, :, None], m4, m)
            s_val = tl.where(pick4, s4_val, s_val)
            s_code = tl.where(pick4, s4_code, s_code)
        idx = e2m1_index(m)
    # sign bit of y = x * enc_b = sign bit of x, also where s_b == 0 (enc_b = 0, y = +-0: index 0, code 0 or 8)
    code = idx | ((tl.reshape(x, [BLOCK_R, G, 16]).to(tl.int32, bitcast=True) >> 28) & 8)

    lo, hi = tl.split(tl.reshape(code, [BLOCK_R, BLOCK_K // 2, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pmask = rmask[:, None] & (pcols < K // 2)[None, :]
    if EVEN:
        tl.store(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :], packed)
    else:
        tl.store(data_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :], packed, mask=pmask)
    scols = pid_k * G + tl.arange(0, G)
    smask = rmask[:, None] & (scols < K // 16)[None, :]
    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (K // 16) + scols[None, :], s_code.to(tl.uint8), mask=smask)
    if DECODED != 0:  # the codes decoded by the GEMM's own `_decode_tile` (its values, its K order), from the
        # words and scales just computed: `_predecode_kernel`'s output by construction
        c = tl.reshape(code, [BLOCK_R, BLOCK_K // 8, 2, 2, 2])  # code 4a + 2b + c of each 8 at (a, b, c)
        c0, c1 = tl.split(c)
        c = c0 | (c1 << 4)
        c0, c1 = tl.split(c)
        c = c0 | (c1 << 8)
        c0, c1 = tl.split(c)
        words = c0 | (c1 << 16)  # int32 [BLOCK_R, BLOCK_K / 8]: code 8j + i in bits 4i..4i+3 (`_words`)
        val = _decode_tile(words, s_code, BLOCK_R, BLOCK_K, DECODED - 1)
        if EVEN:
            tl.store(xh_ptr + offs, val)
        else:
            tl.store(xh_ptr + offs, val, mask=mask)


def _tile(K: int, row_amax: bool, target: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_K): whole rows when the row amax is computed in the kernel, ~target elements a program."""
    if row_amax:
        block_k = max(16, triton.next_power_of_2(K))
    else:
        block_k = min(max(16, triton.next_power_of_2(K)), 2048)
    return max(1, target // block_k), block_k


def _abs_max(x2: torch.Tensor) -> torch.Tensor:
    """fp32 max |x| per row of a 2D view in one read (aminmax; no |x| temporary). Exact."""
    lo, hi = torch.aminmax(x2, dim=1)
    return torch.maximum(-lo, hi).float().contiguous()


def quantize_nvfp4(x: torch.Tensor, *, outer: str = "tensor", four_over_six: bool = False,
                   stochastic: bool = False, seed=None, block_elems: int | None = None, num_warps: int | None = None,
                   decoded: torch.Tensor | None = None, decode: str | None = None, swiglu: bool = False,
                   rows: torch.Tensor | None = None, cast: torch.dtype | None = None):
    """NVFP4 codes of x [..., K] -> (packed uint8 [..., K/2], E4M3 codes uint8 [..., K/16],
    per-row S_dec fp32 [rows], non-finite flag int32 [1]).

    The caller shapes the per-row S_dec into the QTensor's outer ([1]*ndim,
    [..., 1] or [E, 1, 1]) and checks the flag.
    decoded: an FP16 [rows, K] tensor to also receive the codes decoded as the grouped GEMM's pre-decoded x
    operand, in the same launch: `qgemm_triton._predecode_kernel`'s output for that `decode` ("asm", "bits"
    or "f32"; None: the GEMM's default), bitwise (the same `_decode_tile` on the same words and scales).
    swiglu: x is h [R, 2K] = [gate | up] and the values quantized are its SwiGLU (`swiglu_triton.swiglu(h)`,
    bitwise, never stored); outer="row" only.
    rows: an int index [R]: the codes of x[rows] (x [S, K]), read in place (no gathered copy); outer="row"
    only. cast: a float dtype x is rounded to first, in registers: the codes of x.to(cast) (round to nearest
    even, as `Tensor.to`); None: x's own dtype.
    """
    if rows is not None:
        if swiglu or outer != "row" or x.dim() != 2 or x.shape[-1] > MAX_ROW_K:
            raise ValueError(f"nvfp4 rows=: need x [S, K] with K <= {MAX_ROW_K}, outer='row' and no swiglu, got "
                             f"{tuple(x.shape)}, outer={outer!r}, swiglu={swiglu}")
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device:
            raise ValueError(f"nvfp4 rows=: need a 1-D int32/int64 index on {x.device}, got {rows.dtype} "
                             f"{tuple(rows.shape)} on {rows.device}")
    if cast is not None and cast not in FLOAT_TL:
        raise ValueError(f"nvfp4 cast={cast}: need one of {tuple(FLOAT_TL)}")
    if swiglu:
        if x.dim() != 2 or x.shape[-1] % 2 or outer != "row":
            raise ValueError(f"nvfp4 swiglu: need h [R, 2K] and outer='row', got {tuple(x.shape)}, outer={outer!r}")
        problem = layout_problem(x[:, : x.shape[-1] // 2], "nvfp4", NV_BLOCK)
        if problem is not None:
            raise ValueError(problem)
        K = x.shape[-1] // 2
        x2 = x.contiguous()
    else:
        K = x.shape[-1]
        problem = layout_problem(x, "nvfp4", NV_BLOCK)
        if problem is not None:
            raise ValueError(problem)
        x2 = x.contiguous().reshape(-1, K)
    R = x2.shape[0] if rows is None else rows.numel()
    dev = x.device
    row_amax = outer == "row" and K <= MAX_ROW_K
    if outer == "tensor":
        amax, rows_per_amax = _abs_max(x2.reshape(1, -1)), R
    elif outer == "group":
        if x.dim() != 3:
            raise ValueError(f"nvfp4: outer='group' needs a 3D [E, N, K] tensor, got shape {tuple(x.shape)}")
        amax, rows_per_amax = _abs_max(x2.reshape(x.shape[0], -1)), x.shape[1]
    elif outer == "row":
        if swiglu and not row_amax:
            raise ValueError(f"nvfp4 swiglu: rows wider than {MAX_ROW_K} are not covered")
        amax = x2 if row_amax else _abs_max(x2)
        rows_per_amax = 1
    else:
        raise ValueError(f"outer={outer!r} is not one of ('tensor', 'row', 'group')")
    data = torch.empty((R, K // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((R, K // NV_BLOCK), dtype=torch.uint8, device=dev)
    outer_rows = torch.empty((R,), dtype=torch.float32, device=dev)
    flag = nonfinite_flag(dev)
    lo, hi = split_seed(seed) if stochastic else (0, 0)
    # Elements a thread: 32 for round-to-nearest; 16 for 4/6 (two candidates live) and SR (Philox
    # state), where 32 needs ~255 registers. Fewer warps a row also means a cheaper row amax.
    per_thread = 16 if four_over_six or stochastic else 32
    target = 128 * per_thread  # 4 warps
    if swiglu:  # one row a program, SWIGLU_PER_THREAD elements a thread
        per_thread, target = SWIGLU_PER_THREAD, 1
    block_r, block_k = _tile(K, row_amax, block_elems or target)
    grid = (triton.cdiv(R, block_r), triton.cdiv(K, block_k))
    warps = num_warps or min(16, max(1, block_r * block_k // (32 * per_thread)))
    if decoded is not None:
        decode = _decode_mode(decode)  # a known decode, and no inline PTX under the interpreter
    if decoded is not None and (decoded.shape != (R, K) or decoded.dtype != torch.float16
                                or not decoded.is_contiguous() or decoded.device != dev):
        raise ValueError(f"decoded: need a contiguous float16 [{R}, {K}] tensor on {dev}, got "
                         f"{decoded.dtype} {tuple(decoded.shape)} on {decoded.device}")
    _nvfp4_kernel[grid](x2, x2 if rows is None else rows.contiguous(), amax, data, scale, outer_rows, flag,
                        data if decoded is None else decoded, R, K, max(rows_per_amax, 1), lo, hi,
                        BLOCK_R=block_r, BLOCK_K=block_k, ROW_AMAX=row_amax, FOUR_SIX=four_over_six,
                        STOCHASTIC=stochastic, EVEN=R % block_r == 0 and K % block_k == 0,
                        DECODED=0 if decoded is None else 1 + DECODES[decode], SWIGLU=swiglu,
                        GATHER=rows is not None, CAST=FLOAT_TL[cast or x.dtype], num_warps=warps,
                        enable_fp_fusion=False)
    lead = (R,) if rows is not None else x2.shape[:-1] if swiglu else x.shape[:-1]
    return data.reshape(*lead, K // 2), scale.reshape(*lead, K // NV_BLOCK), outer_rows, flag
