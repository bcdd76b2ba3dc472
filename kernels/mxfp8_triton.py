"""Triton MXFP8 quantize: rowwise, columnwise, and the fused NVFP4 -> MXFP8 requantize.

    data, scale, flag = quantize_rows(x)         # [..., K] -> codes [..., K], E8M0 [..., K/32], Inf flag
    data, scale, flag = quantize_cols(x)         # [..., M, K] -> [..., K, M]: 32x1 blocks, from x itself
    data, scale = requantize_nvfp4(data, scale, outer_rows, shape)   # saved NVFP4 -> transposed MXFP8 (SR)

Bitwise equal to the references (``mxfp8.py``, ``requant.py``) on every backend: RCEIL E8M0 scale per 32,
values clamped to 448, nearest-even or SR with 16 Philox bits an element keyed by the flat index in the OUTPUT
(``_mx_quant_blocks`` states it); a NaN block gets scale 0xFF. A program loads a [BLOCK_M, BLOCK_K] tile once,
reduces 32-blocks in registers and writes the (transposed) codes once; SR costs one Philox4x32-10 call (about
40-60 integer instructions) per eight elements. Codes are built on integers (``formats_triton``), stored uint8.

Leaves out: the FLOOR scale mode (the Triton path is RCEIL only; the dispatch falls back to the reference) and
Inf inputs (rejected before the kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.formats_triton import (
    e4m3_code_rn,
    e4m3_code_sr,
    e4m3_value,
    e8m0_rceil_of_quotient,
    nonfinite_flag,
    pow2,
    raise_flag,
    tile_2d,
)
from rl4bit.kernels.philox_triton import philox_sr16, split_seed

MX_BLOCK = 32


@triton.jit
def _mx_quant_blocks(ax3, sign3, bits3, AXIS: tl.constexpr, STOCHASTIC: tl.constexpr, CHECK_NAN: tl.constexpr):
    """Quantize magnitudes ax3 (fp32 |x|) in blocks of 32 along AXIS -> (uint8 codes like ax3, uint8 E8M0).

    sign3: int32 0 or 0x80 per element (x's sign bit, in the code's place);
    bits3: the SR random bits shaped like ax3, 16 an element (ignored for round-to-nearest).
    The scale is rceil_biased(f32(amax / 448)) computed without the division
    (formats_triton.e8m0_rceil_of_quotient). CHECK_NAN=False skips the NaN-block
    pass for sources that cannot hold NaN (decoded NVFP4).
    Values are clamped to 448 before rounding, to nearest even or stochastically: element o, its flat index in
    the OUTPUT tensor, takes half o % 2 of word (o // 2) % 4 of the Philox call for counter o // 8 (one call per
    eight consecutive output elements). A block holding NaN gets scale 0xFF.
    """
    amax = tl.max(ax3, axis=AXIS)
    sc = e8m0_rceil_of_quotient(amax, 0x600000, 8, 0x04600001)
    y = tl.minimum(ax3 * tl.expand_dims(pow2(127 - sc), AXIS), 448.0)
    if STOCHASTIC:
        code = e4m3_code_sr(y, bits3)
    else:
        code = e4m3_code_rn(y)
    code = code | sign3
    if CHECK_NAN:  # a NaN block: scale 0xFF and every element byte 0x7F (mxfp8.py)
        has_nan = tl.max((ax3 != ax3).to(tl.int32), axis=AXIS) > 0
        code = tl.where(tl.expand_dims(has_nan, AXIS), 0x7F, code)
        sc = tl.where(has_nan, 255, sc)
    return code.to(tl.uint8), sc.to(tl.uint8)


@triton.jit
def _sign_byte(x):
    """x's fp32 sign bit moved to bit 7 (int32 0 or 0x80), -0.0 included."""
    return (x.to(tl.int32, bitcast=True) >> 24) & 0x80


@triton.jit
def _flag_inf(x, flag_ptr):
    """Set *flag_ptr to 1 if the tile holds an Inf (MXFP8 keeps NaN as a 0xFF scale; Inf is an error)."""
    raise_flag((tl.abs(x) == float("inf")).to(tl.int32), flag_ptr)


@triton.jit(do_not_specialize=['M', 'seed_lo', 'seed_hi'])  # see formats_triton.NO_SPECIALIZE
def _mxfp8_rows_kernel(x_ptr, data_ptr, scale_ptr, flag_ptr, M, K, seed_lo, seed_hi,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, STOCHASTIC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 32
    rows, cols, mask, offs = tile_2d(pid_m, pid_k, M, K, BLOCK_M, BLOCK_K)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _flag_inf(x, flag_ptr)
    x3 = tl.reshape(x, [BLOCK_M, G, 32])
    bits3 = x3
    if STOCHASTIC:  # one Philox call per 8 consecutive elements: counter = flat offset // 8 (K % 32 == 0)
        ctr = rows.to(tl.int64)[:, None] * (K // 8) + (pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8))[None, :]
        bits3 = tl.reshape(philox_sr16(seed_lo, seed_hi, ctr), [BLOCK_M, G, 32])
    code, sc = _mx_quant_blocks(tl.abs(x3), _sign_byte(x3), bits3, 2, STOCHASTIC, True)
    tl.store(data_ptr + offs, tl.reshape(code, [BLOCK_M, BLOCK_K]), mask=mask)
    scols = pid_k * G + tl.arange(0, G)
    smask = (rows < M)[:, None] & (scols < K // 32)[None, :]
    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (K // 32) + scols[None, :], sc, mask=smask)


@triton.jit
def _nvfp4_tile(src_ptr, src_scale_ptr, src_outer_ptr, rows64, pid_k, K, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """Decode an NVFP4 tile -> (|x| fp32 [BLOCK_M, BLOCK_K], sign bits 0/0x80 int32), as nvfp4.dequantize_nvfp4.

    |x| = (e2m1(|q|) * s_b) * |S_dec|: q * s is exact, so the magnitude and the
    sign (q's, xor S_dec's; -0.0 kept) can be taken apart. E2M1 index i decodes
    from its bits: i * 2**22 + bits(0.5) for i >= 2, i * bits(0.5) for i < 2.
    """
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    scols = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    p_ptr = src_ptr + rows64[:, None] * (K // 2) + pcols[None, :]
    s_ptr = src_scale_ptr + rows64[:, None] * (K // 16) + scols[None, :]
    if EVEN:
        byte = tl.load(p_ptr).to(tl.int32)
        sbyte = tl.load(s_ptr).to(tl.int32)
    else:
        byte = tl.load(p_ptr, mask=(pcols < K // 2)[None, :], other=0).to(tl.int32)
        sbyte = tl.load(s_ptr, mask=(scols < K // 16)[None, :], other=0).to(tl.int32)
    outer = tl.load(src_outer_ptr + rows64)
    idx = tl.reshape(tl.join(byte & 7, (byte >> 4) & 7), [BLOCK_M, BLOCK_K // 16, 16])  # element 2i: low nibble
    neg = tl.reshape(tl.join((byte << 4) & 0x80, byte & 0x80), [BLOCK_M, BLOCK_K])
    q = tl.where(idx < 2, idx * 0x3F000000, idx * 4194304 + 0x3F000000).to(tl.float32, bitcast=True)
    mag = q * e4m3_value(sbyte & 0x7F)[:, :, None]
    ax = tl.reshape(mag, [BLOCK_M, BLOCK_K]) * tl.abs(outer)[:, None]
    return ax, neg ^ _sign_byte(outer)[:, None]


@triton.jit(do_not_specialize=['seed_lo', 'seed_hi'])  # see formats_triton.NO_SPECIALIZE (M: output pitch)
def _mxfp8_cols_kernel(src_ptr, src_scale_ptr, src_outer_ptr, data_ptr, scale_ptr, flag_ptr, M, K,
                       seed_lo, seed_hi, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       SRC_NVFP4: tl.constexpr, STOCHASTIC: tl.constexpr, EVEN: tl.constexpr):
    """Source [B, M, K] (float, or NVFP4 packed [B, M, K/2] + scales + per-row outer) -> [B, K, M].

    M is a multiple of BLOCK_M (the launcher picks BLOCK_M | M), so only K needs
    masks, and none when EVEN (K % BLOCK_K == 0).
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    G: tl.constexpr = BLOCK_M // 32
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = b * M + rows.to(tl.int64)
    if SRC_NVFP4:
        ax, sign = _nvfp4_tile(src_ptr, src_scale_ptr, src_outer_ptr, rows64, pid_k, K, BLOCK_M, BLOCK_K, EVEN)
    else:
        x_ptr = src_ptr + rows64[:, None] * K + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr).to(tl.float32)
        else:
            x = tl.load(x_ptr, mask=(cols < K)[None, :], other=0.0).to(tl.float32)
        _flag_inf(x, flag_ptr)
        ax = tl.abs(x)
        sign = _sign_byte(x)
    # blocks of 32 along M: reduce over axis 1 of [G, 32, BLOCK_K], then transpose only the uint8 codes
    bits3 = ax
    if STOCHASTIC:
        # output offset of (m, k) is (b*K + k)*M + m: one Philox call per 8 consecutive m (M % 32 == 0)
        ctr = ((b * K + cols.to(tl.int64))[None, :] * (M // 8)
               + (pid_m * (BLOCK_M // 8) + tl.arange(0, BLOCK_M // 8))[:, None])
        bits = tl.reshape(philox_sr16(seed_lo, seed_hi, ctr), [BLOCK_M // 8, BLOCK_K, 8])
        bits3 = tl.reshape(tl.permute(bits, (0, 2, 1)), [G, 32, BLOCK_K])
    code, sc = _mx_quant_blocks(tl.reshape(ax, [G, 32, BLOCK_K]), tl.reshape(sign, [G, 32, BLOCK_K]), bits3, 1,
                                STOCHASTIC, not SRC_NVFP4)
    code_t = tl.trans(tl.reshape(code, [BLOCK_M, BLOCK_K]))  # [BLOCK_K, BLOCK_M]
    t_ptr = data_ptr + (b * K + cols.to(tl.int64))[:, None] * M + rows[None, :]
    srows = pid_m * G + tl.arange(0, G)
    s_ptr = scale_ptr + (b * K + cols.to(tl.int64))[:, None] * (M // 32) + srows[None, :]
    sc = tl.trans(sc)  # [BLOCK_K, G]
    if EVEN:
        tl.store(t_ptr, code_t)
        tl.store(s_ptr, sc)
    else:
        tl.store(t_ptr, code_t, mask=(cols < K)[:, None])
        tl.store(s_ptr, sc, mask=(cols < K)[:, None])


def _check_last(n: int, what: str) -> None:
    if n % MX_BLOCK:
        raise ValueError(f"{what} {n} is not a multiple of 32 (MXFP8 block); pad it to {-(-n // 32) * 32}")


def _seed_args(stochastic: bool, seed):
    if not stochastic:
        return 0, 0
    if seed is None:
        raise ValueError("stochastic rounding needs a seed (an int in [0, 2**64))")
    return split_seed(seed)


def quantize_rows(x: torch.Tensor, *, stochastic: bool = False, seed=None,
                  block_m: int = 16, block_k: int = 256, num_warps: int = 4):
    """MXFP8 along the last dim of x [..., K] -> (uint8 codes [..., K], uint8 E8M0 [..., K/32], Inf flag int32 [1])."""
    K = x.shape[-1]
    _check_last(K, "last dimension")
    x2 = x.contiguous().reshape(-1, K)
    M = x2.shape[0]
    data = torch.empty((M, K), dtype=torch.uint8, device=x.device)
    scale = torch.empty((M, K // MX_BLOCK), dtype=torch.uint8, device=x.device)
    block_k = min(block_k, triton.next_power_of_2(K))
    flag = nonfinite_flag(x.device)
    lo, hi = _seed_args(stochastic, seed)
    grid = (triton.cdiv(M, block_m), triton.cdiv(K, block_k))
    _mxfp8_rows_kernel[grid](x2, data, scale, flag, M, K, lo, hi, BLOCK_M=block_m, BLOCK_K=block_k,
                             STOCHASTIC=stochastic, num_warps=num_warps, enable_fp_fusion=False)
    return data.reshape(x.shape), scale.reshape(*x.shape[:-1], K // MX_BLOCK), flag


def _launch_cols(src, src_scale, src_outer, B, M, K, device, stochastic, seed, block_m, block_k, nvfp4, num_warps):
    _check_last(M, "transposed dimension M =")
    data = torch.empty((B, K, M), dtype=torch.uint8, device=device)
    scale = torch.empty((B, K, M // MX_BLOCK), dtype=torch.uint8, device=device)
    flag = nonfinite_flag(device)
    lo, hi = _seed_args(stochastic, seed)
    while M % block_m:  # BLOCK_M must divide M (a multiple of 32), so rows need no mask
        block_m //= 2
    block_k = min(block_k, triton.next_power_of_2(K))
    grid = (M // block_m, triton.cdiv(K, block_k), B)
    _mxfp8_cols_kernel[grid](src, src_scale, src_outer, data, scale, flag, M, K, lo, hi,
                             BLOCK_M=block_m, BLOCK_K=block_k, SRC_NVFP4=nvfp4, STOCHASTIC=stochastic,
                             EVEN=K % block_k == 0, num_warps=num_warps, enable_fp_fusion=False)
    return data, scale, flag


def quantize_cols(x: torch.Tensor, *, stochastic: bool = False, seed=None,
                  block_m: int = 32, block_k: int = 256, num_warps: int = 4):
    """Columnwise MXFP8 of x [..., M, K]: quantize x.transpose(-2, -1) along M -> ([..., K, M], [..., K, M/32], Inf
    flag). The 32x1 blocks of TE's ``mxfp8.rst``, quantized from high precision in one pass over memory."""
    if x.dim() < 2:
        raise ValueError(f"columnwise MXFP8 needs a tensor of at least 2 dims, got shape {tuple(x.shape)}")
    *lead, M, K = x.shape
    x3 = x.contiguous().reshape(-1, M, K)
    data, scale, flag = _launch_cols(x3, x3, x3, x3.shape[0], M, K, x.device, stochastic, seed,
                               block_m, block_k, nvfp4=False, num_warps=num_warps)
    return data.reshape(*lead, K, M), scale.reshape(*lead, K, M // MX_BLOCK), flag


def requantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, outer_rows: torch.Tensor, shape, *,
                     stochastic: bool = True, seed=None, block_m: int = 32, block_k: int = 256,
                     num_warps: int = 4):
    """Fused NVFP4 [..., M, K] -> dequantize -> transpose -> MXFP8 along M (the backward's SR requantize).

    ``data`` uint8 [..., M, K/2], ``scale`` uint8 view of the E4M3 scales
    [..., M, K/16], ``outer_rows`` fp32 with one decode multiplier per row
    (B*M values: the caller expands a per-tensor or per-group outer).
    Returns (uint8 codes [..., K, M], uint8 E8M0 [..., K, M/32]).
    """
    *lead, M, K = shape
    B = 1
    for d in lead:
        B *= d
    d3 = data.contiguous().reshape(B, M, K // 2)
    s3 = scale.contiguous().reshape(B, M, K // 16)
    o = outer_rows.contiguous().reshape(B * M).to(torch.float32)
    out, sc, _ = _launch_cols(d3, s3, o, B, M, K, data.device, stochastic, seed, block_m, block_k, nvfp4=True,
                             num_warps=num_warps)
    return out.reshape(*lead, K, M), sc.reshape(*lead, K, M // MX_BLOCK)
