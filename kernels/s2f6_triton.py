"""Triton S2F6 quantize / dequantize, optionally fused with the 32-dim random Hadamard transform.

Bitwise equal to the plain-PyTorch reference: encode = ``s2f6.quantize_s2f6``
of ``hadamard.rht(x, seed)`` (or of x itself), decode =
``hadamard.inverse_rht(s2f6.dequantize_s2f6(q), seed)`` (or the plain
dequantize). The Hadamard is the reference's fixed butterfly order (h = 1, 2,
4, 8, 16; (a, b) -> (a + b, a - b)), never a ``tl.dot``, whose reduction order
would differ; signs are ``1 - 2 * (philox(seed, i) & 1)`` for i = 0..31. S2F6:
E8M0 per 32 with e = rceil(amax / (127/64)), y = x * 2**(127 - e), data =
clamp(round_half_even(y * 64), -128, 127) as int8.

Both directions are one read and one write: the RHT groups of 32 are the S2F6
blocks, so a program transforms and quantizes its tile in registers.

Leaves out: stochastic rounding (the combine rounds to nearest; the reference
has none) and Hadamard sizes other than 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.checks import layout_problem
from rl4bit.kernels.formats_triton import e8m0_rceil_of_quotient, nonfinite_flag, pow2, raise_flag, tile_2d
from rl4bit.kernels.philox_triton import philox_bits, split_seed

S2F6_BLOCK = 32
INV_SQRT32 = 0.1767766922712326  # f32(1/sqrt(32)), as hadamard.INV_SQRT_DIM rounds


@triton.jit
def _fwht32(t, N: tl.constexpr):
    """t @ H32 for t [N, 32], butterflies in hadamard.fwht's order."""
    for s in tl.static_range(5):  # h = 2**s
        v = tl.permute(tl.reshape(t, [N, 16 >> s, 2, 1 << s]), (0, 1, 3, 2))
        a, b = tl.split(v)
        t = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [N, 32])
    return t


@triton.jit
def _signs(seed_lo, seed_hi):
    """fp32 [32] of +-1: 1 - 2 * (philox(seed, i) & 1)."""
    bits = philox_bits(seed_lo, seed_hi, tl.arange(0, 32).to(tl.int64))
    return 1.0 - 2.0 * (bits & 1).to(tl.float32)


@triton.jit(do_not_specialize=['R', 'seed_lo', 'seed_hi'])  # see formats_triton.NO_SPECIALIZE
def _s2f6_quant_kernel(x_ptr, data_ptr, scale_ptr, flag_ptr, R, K, seed_lo, seed_hi,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RHT: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 32
    N: tl.constexpr = BLOCK_R * G
    rows, cols, mask, offs = tile_2d(pid_r, pid_k, R, K, BLOCK_R, BLOCK_K)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    raise_flag(((tl.abs(x) == float("inf")) | (x != x)).to(tl.int32), flag_ptr)
    t = tl.reshape(x, [N, 32])
    if HAS_RHT:
        t = t * _signs(seed_lo, seed_hi)[None, :]
        t = _fwht32(t, N) * 0.1767766922712326
    b = tl.max(tl.abs(t), axis=1)
    e = e8m0_rceil_of_quotient(b, 0x7E0000, 0, 0x7F0000)  # rceil_biased(f32(b / (127/64)))
    z = (t * pow2(127 - e)[:, None]) * 64.0
    a = tl.minimum(tl.abs(z), 256.0)
    n = a.to(tl.int32)
    f = a - n.to(tl.float32)
    m = n + ((f > 0.5) | ((f == 0.5) & ((n & 1) == 1))).to(tl.int32)
    q = tl.minimum(tl.maximum(tl.where(z < 0.0, -m, m), -128), 127)
    tl.store(data_ptr + offs, tl.reshape(q, [BLOCK_R, BLOCK_K]).to(tl.int8), mask=mask)
    scols = pid_k * G + tl.arange(0, G)
    smask = (rows < R)[:, None] & (scols < K // 32)[None, :]
    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (K // 32) + scols[None, :],
             tl.reshape(e, [BLOCK_R, G]).to(tl.uint8), mask=smask)


@triton.jit(do_not_specialize=['R', 'seed_lo', 'seed_hi'])  # see formats_triton.NO_SPECIALIZE
def _s2f6_dequant_kernel(data_ptr, scale_ptr, out_ptr, R, K, seed_lo, seed_hi,
                         BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RHT: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 32
    N: tl.constexpr = BLOCK_R * G
    rows, cols, mask, offs = tile_2d(pid_r, pid_k, R, K, BLOCK_R, BLOCK_K)
    q = tl.load(data_ptr + offs, mask=mask, other=0).to(tl.float32)
    scols = pid_k * G + tl.arange(0, G)
    smask = (rows < R)[:, None] & (scols < K // 32)[None, :]
    e = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * (K // 32) + scols[None, :], mask=smask, other=127)
    e = tl.reshape(e.to(tl.int32), [N])
    sval = tl.where(e == 255, float("nan"), pow2(tl.minimum(e, 254) - 127))
    t = (tl.reshape(q, [N, 32]) * 0.015625) * sval[:, None]
    if HAS_RHT:
        t = _fwht32(t, N) * _signs(seed_lo, seed_hi)[None, :]
        t = t * 0.1767766922712326
    tl.store(out_ptr + offs, tl.reshape(t, [BLOCK_R, BLOCK_K]), mask=mask)


def _tile(K: int, target: int = 4096) -> tuple[int, int]:
    block_k = min(triton.next_power_of_2(K), 1024)
    return max(1, target // block_k), block_k


def quantize_s2f6(x: torch.Tensor, *, rht_seed=None):
    """S2F6 of x [..., K] (of rht(x, rht_seed) if given) -> (int8 [..., K], uint8 E8M0 [..., K/32], flag int32 [1])."""
    K = x.shape[-1]
    problem = layout_problem(x, "s2f6", S2F6_BLOCK)
    if problem is not None:
        raise ValueError(problem)
    x2 = x.contiguous().reshape(-1, K)
    R = x2.shape[0]
    data = torch.empty((R, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((R, K // 32), dtype=torch.uint8, device=x.device)
    flag = nonfinite_flag(x.device)
    lo, hi = split_seed(rht_seed) if rht_seed is not None else (0, 0)
    block_r, block_k = _tile(K)
    grid = (triton.cdiv(R, block_r), triton.cdiv(K, block_k))
    _s2f6_quant_kernel[grid](x2, data, scale, flag, R, K, lo, hi, BLOCK_R=block_r, BLOCK_K=block_k,
                             HAS_RHT=rht_seed is not None, num_warps=4, enable_fp_fusion=False)
    return data.reshape(x.shape), scale.reshape(*x.shape[:-1], K // 32), flag


def dequantize_s2f6(data: torch.Tensor, scale_u8: torch.Tensor, shape, *, rht_seed=None) -> torch.Tensor:
    """fp32 values of S2F6 codes (inverse_rht of them if rht_seed is given), shaped `shape`."""
    K = shape[-1]
    d2 = data.contiguous().reshape(-1, K)
    s2 = scale_u8.contiguous().reshape(-1, K // 32)
    R = d2.shape[0]
    out = torch.empty((R, K), dtype=torch.float32, device=data.device)
    lo, hi = split_seed(rht_seed) if rht_seed is not None else (0, 0)
    block_r, block_k = _tile(K)
    grid = (triton.cdiv(R, block_r), triton.cdiv(K, block_k))
    _s2f6_dequant_kernel[grid](d2, s2, out, R, K, lo, hi, BLOCK_R=block_r, BLOCK_K=block_k,
                               HAS_RHT=rht_seed is not None, num_warps=4, enable_fp_fusion=False)
    return out.reshape(shape)
