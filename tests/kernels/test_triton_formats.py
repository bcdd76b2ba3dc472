"""Triton codecs and Philox vs the plain-PyTorch reference, element by element, bitwise.

Runs the ``@triton.jit`` helpers of ``philox_triton.py`` / ``formats_triton.py``
through a tiny kernel on dense sets of corner values (every E4M3 grid point,
midpoint and fp32 neighbour; every E2M1 tie) and compares with ``philox.py``,
``e4m3.py``, ``e2m1.py`` and ``e8m0.py``. CPU: TRITON_INTERPRET=1 (triton_setup).
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch
import triton
import triton.language as tl
from bitwise import assert_bitwise_equal

from rl4bit.kernels import e2m1, e4m3, e8m0
from rl4bit.kernels.formats_triton import (
    e2m1_code_sr,
    e2m1_index,
    e2m1_round,
    e2m1_value,
    e4m3_code_rn,
    e4m3_code_sr,
    e8m0_rceil_of_quotient,
    pow2,
)
from rl4bit.kernels.philox import random_bits, sr_bits
from rl4bit.kernels.philox_triton import philox_bits, philox_sr8, philox_sr16, split_seed
from rl4bit.kernels.stochastic import E2M1_SR_BITS, E4M3_SR_BITS, element_bits


@triton.jit
def _philox_kernel(offs_ptr, out_ptr, n, seed_lo, seed_hi, B: tl.constexpr):
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    r = philox_bits(seed_lo, seed_hi, tl.load(offs_ptr + i, mask=m, other=0))
    tl.store(out_ptr + i, r.to(tl.int64), mask=m)


@triton.jit
def _philox_sr_kernel(ctr_ptr, out_ptr, n, seed_lo, seed_hi, N_BITS: tl.constexpr, B: tl.constexpr):
    """out[F*j .. F*j + F-1] = SR bits of offsets F*c .. F*c + F-1 for the counter c = ctr[j] (F = 128 / N_BITS)."""
    F: tl.constexpr = 128 // N_BITS
    j = tl.program_id(0) * B + tl.arange(0, B)
    ctr = tl.load(ctr_ptr + j, mask=j < n, other=0)
    if N_BITS == 8:
        r = tl.reshape(philox_sr8(seed_lo, seed_hi, ctr), [F * B])
    else:
        r = tl.reshape(philox_sr16(seed_lo, seed_hi, ctr), [F * B])
    o = tl.program_id(0) * F * B + tl.arange(0, F * B)
    tl.store(out_ptr + o, r.to(tl.int64), mask=o < F * n)


@triton.jit
def _codec_kernel(y_ptr, out_ptr, n, seed_lo, seed_hi, OP: tl.constexpr, B: tl.constexpr):
    """OP 1 and 3 round element i with the SR bits of offset i: one Philox call per 8 (E4M3) or 16 (E2M1)."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    y = tl.load(y_ptr + i, mask=m, other=0.0)
    if OP == 0:
        c = e4m3_code_rn(tl.minimum(tl.abs(y), 448.0))
    elif OP == 1:
        ctr = (tl.program_id(0) * (B // 8) + tl.arange(0, B // 8)).to(tl.int64)
        c = e4m3_code_sr(tl.minimum(tl.abs(y), 448.0), tl.reshape(philox_sr16(seed_lo, seed_hi, ctr), [B]))
    elif OP == 2:
        v, rsum = e2m1_round(y)
        c = e2m1_index(rsum)
        c = tl.where(e2m1_value(c) == v, c, -1)  # the value is the grid value of its index
    elif OP == 3:
        ctr = (tl.program_id(0) * (B // 16) + tl.arange(0, B // 16)).to(tl.int64)
        c = e2m1_code_sr(tl.abs(y), tl.reshape(philox_sr8(seed_lo, seed_hi, ctr), [B]))
    elif OP == 5:
        c = pow2(y.to(tl.int32)).to(tl.int32, bitcast=True)
    elif OP == 6:
        c = e8m0_rceil_of_quotient(tl.abs(y), 0x600000, 8, 0x04600001)
    else:
        c = e8m0_rceil_of_quotient(tl.abs(y), 0x7E0000, 0, 0x7F0000)
    tl.store(out_ptr + i, c, mask=m)


@triton.jit
def _sr_given_bits_kernel(y_ptr, r_ptr, out_ptr, n, E4M3: tl.constexpr, B: tl.constexpr):
    """The SR codecs on given random bits r (int32), not Philox's: thresholds can be hit on purpose."""
    i = tl.program_id(0) * B + tl.arange(0, B)
    m = i < n
    y = tl.abs(tl.load(y_ptr + i, mask=m, other=0.0))
    r = tl.load(r_ptr + i, mask=m, other=0)
    if E4M3:
        c = e4m3_code_sr(tl.minimum(y, 448.0), r)
    else:
        c = e2m1_code_sr(y, r)
    tl.store(out_ptr + i, c, mask=m)


def _run(op: int, y: torch.Tensor, seed: int = 0) -> torch.Tensor:
    y = y.to(DEVICE).contiguous()
    out = torch.empty(y.shape, dtype=torch.int32, device=DEVICE)
    lo, hi = split_seed(seed)
    _codec_kernel[(triton.cdiv(y.numel(), 1024),)](y, out, y.numel(), lo, hi, OP=op, B=1024,
                                                   enable_fp_fusion=False)
    return out.cpu()


def _e4m3_corner_values() -> torch.Tensor:
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (grid[:-1] + grid[1:]) / 2
    pts = torch.cat([grid, mids, torch.tensor([448.0, 1e-40, 2.0**-10, 3 * 2.0**-11])])
    up = torch.nextafter(pts, torch.full_like(pts, float("inf")))
    down = torch.nextafter(pts, torch.zeros_like(pts))
    return torch.cat([pts, up, down, torch.rand(4096) * 448]).abs()


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5, 2**40 + 77, 2**64 - 1])
def test_philox_bits_equal_reference(seed):
    offs = torch.cat([torch.arange(300), torch.tensor([2**31, 2**32 + 3, 2**40 + 1, 2**62])])
    out = torch.empty_like(offs, device=DEVICE)
    lo, hi = split_seed(seed)
    _philox_kernel[(triton.cdiv(offs.numel(), 256),)](offs.to(DEVICE), out, offs.numel(), lo, hi, B=256)
    assert_bitwise_equal(out.cpu(), random_bits(seed, offs), f"philox seed={seed}")


@pytest.mark.parametrize("n_bits", [8, 16])
@pytest.mark.parametrize("seed", [3, 2**64 - 1])
def test_philox_sr_bits_equal_reference(seed, n_bits):
    """The SR draws: offset o gets the n-bit field of philox.sr_bits (numerics.md's table), in kernel and reference."""
    per_call = 128 // n_bits
    ctr = torch.cat([torch.arange(70), torch.tensor([2**29 + 1, 2**30 + 7, 2**38 + 3, 2**58 + 5])])
    out = torch.empty(per_call * ctr.numel(), dtype=torch.int64, device=DEVICE)
    lo, hi = split_seed(seed)
    _philox_sr_kernel[(triton.cdiv(ctr.numel(), 64),)](ctr.to(DEVICE), out, ctr.numel(), lo, hi, N_BITS=n_bits,
                                                      B=64)
    offs = (per_call * ctr[:, None] + torch.arange(per_call)).reshape(-1)
    assert_bitwise_equal(out.cpu(), sr_bits(seed, offs, n_bits), f"philox_sr{n_bits} seed={seed}")


def test_e4m3_nearest_equals_cast():
    y = _e4m3_corner_values()
    ref = e4m3.cast_rn(y).view(torch.uint8).to(torch.int32)
    assert_bitwise_equal(_run(0, y), ref, "e4m3 RN codes")


def test_e4m3_stochastic_equals_reference():
    y = _e4m3_corner_values()
    r = element_bits(123, y.shape, E4M3_SR_BITS, "cpu")
    ref = e4m3.round_stochastic(y, r).view(torch.uint8).to(torch.int32)
    assert_bitwise_equal(_run(1, y, seed=123), ref, "e4m3 SR codes")


def test_e2m1_nearest_and_stochastic_equal_reference():
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30])
    y = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1).abs(), torch.rand(4096) * 8])
    assert_bitwise_equal(_run(2, y), e2m1.round_nearest(y).to(torch.int32), "e2m1 RN codes")
    r = element_bits(9, y.shape, E2M1_SR_BITS, "cpu")
    assert_bitwise_equal(_run(3, y, seed=9), e2m1.round_stochastic(y, r).to(torch.int32), "e2m1 SR codes")


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_sr_codecs_at_the_threshold(fmt):
    """Each value with r = 2**n - floor(2**n frac) (the smallest r that rounds up), one below it, and r = 0 and
    2**n - 1, against the reference: a random draw hits the threshold once in 2**n (2**16 for E4M3)."""
    n_bits = E4M3_SR_BITS if fmt == "e4m3" else E2M1_SR_BITS
    if fmt == "e4m3":
        y = _e4m3_corner_values()
        ref_round = e4m3.round_stochastic
        lo = e4m3.round_stochastic(y, torch.zeros(y.shape, dtype=torch.int64)).float().abs()
        step = e4m3.pow2(torch.clamp(e4m3.fp32_exponent(y.clamp(max=448.0)), min=-6) - 3)
    else:
        pts = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0])
        y = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1).abs(), torch.rand(4096) * 8])
        ref_round = e2m1.round_stochastic
        lo = e2m1.codes_to_float(e2m1.round_stochastic(y, torch.zeros(y.shape, dtype=torch.int64)))
        a = y.clamp(max=6.0)
        step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    kept = torch.floor((y.clamp(max=float(lo.max())) - lo) / step * 2**n_bits).to(torch.int64)
    threshold = (2**n_bits - kept).clamp(max=2**n_bits - 1)
    for r in (threshold, threshold - 1, torch.zeros_like(kept), torch.full_like(kept, 2**n_bits - 1)):
        out = torch.empty(y.shape, dtype=torch.int32, device=DEVICE)
        rr = r.to(torch.int32).to(DEVICE).contiguous()
        _sr_given_bits_kernel[(triton.cdiv(y.numel(), 1024),)](y.to(DEVICE), rr, out, y.numel(),
                                                               E4M3=fmt == "e4m3", B=1024, enable_fp_fusion=False)
        ref = ref_round(y, r)
        ref = ref.view(torch.uint8).to(torch.int32) if fmt == "e4m3" else ref.to(torch.int32)
        assert_bitwise_equal(out.cpu(), ref, f"{fmt} SR codes at r = threshold and neighbours")
    assert (kept > 0).sum() > 1000  # most values are off the grid, so their threshold lies inside 1 .. 2**n - 1


def test_pow2_including_subnormals():
    e = torch.arange(-149, 128).float()
    assert_bitwise_equal(_run(5, e), torch.exp2(e).view(torch.int32), "pow2")


def test_e8m0_rceil_of_quotient_equals_division():
    """The division-free MXFP8 (D = 448) and S2F6 (D = 127/64) scale exponents on every binade and boundary."""
    mans = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7DFFFF, 0x7E0000, 0x7E0001, 0x7FFFFF, 0x400000])
    exps = torch.arange(0, 255)
    bits = (exps[:, None] << 23 | mans[None, :]).reshape(-1).to(torch.int32)
    tiny = torch.arange(0, 400, dtype=torch.int32)  # the smallest subnormals
    # around each D's ZERO_MAX, the largest amax whose quotient rounds to at most 2**-127 (scale byte 0)
    edges = torch.cat([z + torch.arange(-300, 300, dtype=torch.int32) for z in (0x04600001, 0x7F0000, 0x400000)])
    a = torch.cat([bits, tiny, edges]).view(torch.float32)
    a = torch.cat([a, torch.rand(2000) * torch.exp2(torch.randint(-140, 120, (2000,)).float())])
    ref448 = e8m0.rceil_biased(a / torch.tensor(448.0))
    ref_s2f6 = e8m0.rceil_biased(a / torch.tensor(127.0 / 64.0))
    assert_bitwise_equal(_run(6, a), ref448, "rceil(amax / 448) without division")
    assert_bitwise_equal(_run(7, a), ref_s2f6, "rceil(amax / (127/64)) without division")
