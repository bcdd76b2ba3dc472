"""Bit-exact element and scale codecs for the Triton kernels (E2M1, E4M3, E8M0).

Every cast is done on integers and exact fp32 arithmetic, never with hardware fp8/fp4 conversions: sm_90 has
no ``cvt.e2m1`` and no ``cvt.rs``, the CPU interpreter handles fp8 dtypes poorly, and integer codes make the
result the same on every backend. Kernels store the uint8 codes; the host views them as ``float8_e4m3fn`` /
``float8_e8m0fnu``. Division is always ``div_rn`` (Triton's ``/`` is the approximate ``div.full.f32`` on
NVIDIA), and kernels launch with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA.

Matches docs/numerics.md and the references ``e2m1.py``, ``mxfp8.py``, ``stochastic.py``: E2M1 nearest-even
saturating at 6, E4M3 nearest-even (callers clamp to 448 first), and SR with n random bits r an element
(8 for E2M1, 16 for E4M3): round up iff ``floor(2**n * frac) + r >= 2**n``.

Leaves out: E5M2, FP6, and anything with Inf/NaN semantics (callers handle NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_SPECIALIZE = "row counts, tile counts and Philox seeds"
"""Kernel arguments marked ``do_not_specialize``: Triton compiles a variant per (value % 16 == 0, value == 1) of
every integer argument, and these change every RL step (sequence lengths, routing, SR seeds), so a step could
hit a fresh variant and stall on a compile (seconds) at random. The ones marked only bound masks or seed the
generator, so the divisibility facts buy no vectorization. Arguments that are row pitches stay specialized
even where they follow the token count (the requantize kernel's M, the wgrad kernel's RP: always multiples of
32, so one variant, and the 16-byte alignment keeps vector loads and stores), as do K and N. Triton still
types an integer argument i32 or i64 by its value, so a seeded kernel has up to four variants by seed range,
all likely compiled in the first steps. Bits are unchanged: specialization never changes arithmetic."""

_FLAGS: dict = {}


def nonfinite_flag(device) -> torch.Tensor:
    """A persistent int32 [1] zero per device that kernels set to 1 on a non-finite input.

    Kept between calls so a quantize launches no extra memset; whoever reads a
    set flag (``triton_dispatch``) resets it to 0 before raising.
    """
    device = torch.device(device)
    flag = _FLAGS.get(device)
    if flag is None:
        flag = _FLAGS[device] = torch.zeros((1,), dtype=torch.int32, device=device)
    return flag


@triton.jit
def negate(x):
    """-x for FP32 x by flipping its sign bit: torch's and IEEE's negation (-(+0) = -0) on every Triton version.
    Triton 3.6 (the H200 image's) lowers unary minus on floats to 0 - x, which gives +0 for +0; 3.9 emits fneg."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """2**e as fp32 for an int32 tensor e in [-149, 127], subnormals included (exact, from the bits)."""
    sub = 1 << tl.minimum(tl.maximum(e + 149, 0), 22)
    return tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, sub).to(tl.float32, bitcast=True)


@triton.jit
def rint_small(t):
    """(int32 round-half-even(t), as float) for 0 <= t < 2**22: t + 2**23 rounds t to an integer (fp32 ulp 1)."""
    m = t + 8388608.0
    return m.to(tl.int32, bitcast=True) - 0x4B000000, m - 8388608.0


@triton.jit
def e4m3_code_rn(y):
    """E4M3 code (0..126) of 0 <= y <= 448, round to nearest, ties to even code.

    e = max(floor(log2 y), -6) and t = y * 2**(3 - e) (exact, in [0, 16]); the
    code is (e + 6) * 8 + rint(t): a carry to 16 is the next binade's code.
    Integer and add-only, no float<->int conversion instructions.
    """
    e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    t = y * ((130 - e) << 23).to(tl.float32, bitcast=True)
    n, _ = rint_small(t)
    return (e + 6) * 8 + n


@triton.jit
def e4m3_code_sr(y, r):
    """E4M3 code of 0 <= y <= 448 rounded stochastically with 16 random bits r (int32 0..65535).

    e = max(floor(log2 y), -6) picks the binade (-6: the subnormal range) and the
    step there is 2**(e-3). T = floor(y * 2**(19-e)) = floor(2**16 * y / step):
    the product is exact (a power-of-two scaling, below 2**20), so the float->int
    truncation is its floor, T >> 16 = trunc(y / step) is the index of the lower
    neighbour in the binade (normal and subnormal alike: code (e + 6) * 8 + that),
    and T & 0xFFFF = floor(2**16 * frac). So (T + r) >> 16 is that index plus
    one iff floor(2**16 * frac) + r >= 2**16: the rule of stochastic.py, one add.
    """
    e = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    t = (y * ((146 - e) << 23).to(tl.float32, bitcast=True)).to(tl.int32)
    return (e + 6) * 8 + ((t + r) >> 16)


@triton.jit
def e4m3_value(code):
    """fp32 value of a non-negative E4M3 code (0..126)."""
    ex = code >> 3
    m = code & 7
    normal = ((ex + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(ex == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def e2m1_value(idx):
    """fp32 magnitude of an E2M1 index 0..7 (0, .5, 1, 1.5, 2, 3, 4, 6), built from the bits."""
    bits = tl.where(idx < 2, idx * 0x3F000000, ((126 + (idx >> 1)) << 23) | ((idx & 1) << 22))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_round(y):
    """(|e2m1_RN(y)| as fp32, the rounding sum m): nearest, ties to the even code, saturating at 6.

    The grid step is 0.5 below 2, 1 below 4 and 2 up to 6, i.e. 2**(e-1) with
    e = max(floor(log2 a), 0) for a = min(|y|, 6). Adding C = step * 2**23 =
    2**(22+e) (the exponent bits of max(a, 1), times 2**22) rounds a to a
    multiple n of the step, ties to even n (the ulp at C is the step), and
    within each range the code index n + 2e has the parity of n, so this is
    round-to-nearest-even on codes. m - C is the value; ``e2m1_index(m)`` reads
    the code index from m's bits, so a kernel choosing between candidates
    (4/6) decodes only the chosen one.
    """
    a = tl.minimum(tl.abs(y), 6.0)
    c = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 4194304.0
    m = a + c
    return m - c, m


@triton.jit
def e2m1_index(m):
    """E2M1 magnitude index 0..7 of an ``e2m1_round`` sum m = 2**(22+e) + n * 2**(e-1).

    m's biased exponent is 149 + e and its mantissa is n (at most 4), so
    bits >> 22 = 298 + 2e and the index n + 2e = (bits & 7) + (bits >> 22) - 298.
    """
    bits = m.to(tl.int32, bitcast=True)
    return (bits & 7) + (bits >> 22) - 298


@triton.jit
def e2m1_code_sr(y, r):
    """E2M1 magnitude index of 0 <= y rounded stochastically with 8 random bits r (int32 0..255; y >= 6 gives 6).

    a = min(y, 6); the step is 0.5 below 2, 1 below 4 and 2 up to 6, so
    T = floor(256 * a / step) = trunc(a * (512, 256 or 128)) (the product is
    exact, below 2**10), T >> 8 = trunc(a / step), and the index of the lower
    neighbour is that plus (0, 2 or 4); T & 0xFF = floor(256 * frac). So
    (T + r) >> 8 goes up by one iff floor(256 * frac) + r >= 256 (stochastic.py);
    never at a = 6 (T = 768, frac 0).
    """
    a = tl.minimum(y, 6.0)
    lt2 = a < 2.0
    lt4 = a < 4.0
    t = (a * tl.where(lt2, 512.0, tl.where(lt4, 256.0, 128.0))).to(tl.int32)
    return ((t + r) >> 8) + tl.where(lt2, 0, tl.where(lt4, 2, 4))


@triton.jit
def e8m0_rceil_of_quotient(amax, MAN: tl.constexpr, SHIFT: tl.constexpr, ZERO_MAX_BITS: tl.constexpr):
    """``e8m0.rceil_biased(f32(amax / D))`` for finite amax >= 0 without a division (D = 1.man * 2**SHIFT).

    For a normal quotient, RN(amax / D) <= 2**p iff amax <= D * 2**p: the only
    reals that round down onto 2**p lie within half an ulp above it, and no fp32
    sits between D * 2**p and D * 2**p * (1 + 2**-24) when D has few mantissa
    bits (448 = 1.75 * 2**8, 127/64 = 1.984375). So with amax = 1.m * 2**E the
    answer is E_biased - SHIFT, plus 1 if m > man. A quotient at most 2**-127
    gives 0 (E8M0's smallest scale covers it): amax <= ZERO_MAX, the largest amax
    whose quotient rounds to at most 2**-127 (bits 0x04600001, one ulp above
    448 * 2**-127, for D = 448: the quotient is subnormal and that ulp rounds
    away; 127/64 * 2**-127, bits 0x7F0000, for D = 127/64); a larger subnormal
    quotient gives 1. Tested
    against the reference on every binade, on the mantissa boundary and around
    ZERO_MAX (test_triton_formats).
    """
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - SHIFT + ((bits & 0x7FFFFF) > MAN).to(tl.int32)
    return tl.where(bits <= ZERO_MAX_BITS, 0, tl.minimum(tl.maximum(e, 1), 254))


@triton.jit
def tile_2d(pid_r, pid_c, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows, cols, in-bounds mask and int64 element offsets of one [BLOCK_R, BLOCK_C] tile of a row-major [R, C]
    tensor."""
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    return rows, cols, mask, offs


@triton.jit
def raise_flag(bad, flag_ptr):
    """Set *flag_ptr when the 2D int tile `bad` holds a nonzero (a value the format cannot hold).

    The host wrapper reads the flag and raises the reference's exact error (triton_dispatch).
    """
    b = tl.max(tl.max(bad, axis=1), axis=0)
    if b > 0:
        tl.atomic_max(flag_ptr, b)


@triton.jit
def _nonfinite_kernel(x_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    """Set *flag_ptr to 1 if x[:n] (contiguous) holds NaN or Inf: one read of x, one launch."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    bad = ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
    raise_flag(tl.reshape(bad, [BLOCK // 128, 128]), flag_ptr)


def flag_nonfinite(x: torch.Tensor, flag: torch.Tensor) -> bool:
    """OR "x holds NaN/Inf" into the int32 [1] `flag` on x's device without a host read, in one pass over x;
    False (nothing launched) where x is not a contiguous float tensor of up to 2**40 elements (the caller's
    torch fallback)."""
    if not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.numel() >= 2**40:
        return False
    block = 4096
    if x.numel():
        _nonfinite_kernel[(triton.cdiv(x.numel(), block),)](x, flag, x.numel(), BLOCK=block, num_warps=8)
    return True
