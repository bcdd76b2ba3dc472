"""Philox4x32-10 random bits inside Triton kernels, equal to ``rl4bit.kernels.philox``.

    lo, hi = split_seed(seed)                      # host: a Python int seed -> the two kernel arguments
    w0, w1, w2, w3 = philox4x32(lo, hi, counters)  # in a kernel; philox_bits(lo, hi, offsets) is w0 (RHT signs)
    r = philox_sr8(lo, hi, c)                      # SR bits of offsets 16c..16c+15 (philox_sr16: 16 bits, 8c..8c+7)

Bit for bit ``philox.philox4x32(seed, counters)`` with ``seed = hi << 32 | lo``, and ``philox_sr8`` /
``philox_sr16`` are ``philox.sr_bits`` (their docstrings give the layout). It is written out here rather than
calling ``tl.randint`` so the bits do not depend on the installed Triton's random module (the GPU image runs
triton 3.6, CI 3.9).

Leaves out: the 64-bit variant (nothing uses it).
"""

from __future__ import annotations

import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF


def split_seed(seed: int) -> tuple[int, int]:
    """(low 32 bits, high 32 bits) of a seed in [0, 2**64), the kernel arguments."""
    seed = int(seed)
    if not 0 <= seed < 2**64:
        raise ValueError(f"philox seed must be in [0, 2**64), got {seed}")
    return seed & _MASK32, (seed >> 32) & _MASK32


@triton.jit
def _mul_wide(a, C: tl.constexpr):
    """(high, low) 32-bit words of uint32 a * C: one 32x32->64 multiply (``mul.wide.u32``), not mul.hi + mul.lo."""
    p = a.to(tl.uint64) * C
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def philox4x32(seed_lo, seed_hi, counters):
    """The four uint32 Philox4x32-10 outputs for each int64 counter (``philox.philox4x32``).

    key = (seed_lo, seed_hi), counter = (offset low 32, offset high 32, 0, 0), ten rounds, the constants of
    Salmon et al. (SC'11); not ``tl.randint``, so the bits do not depend on the installed Triton.

    About 40 instructions a call on sm_90 (a wide multiply and a 3-input XOR
    per word per round); the keys live in uniform registers.
    """
    counters = counters.to(tl.int64)
    # Keys as tensors shaped like the counters: works whether Triton passed the
    # seed halves as runtime scalars or specialised them to constexpr (value 1),
    # and needs no tl.to_tensor (absent from triton 3.6's language namespace).
    k0 = (counters * 0 + seed_lo).to(tl.uint32)
    k1 = (counters * 0 + seed_hi).to(tl.uint32)
    c0 = counters.to(tl.uint32)
    c1 = (counters >> 32).to(tl.uint32)
    # round 1 has c2 = c3 = 0, so its B product is 0
    hi_a, c3 = _mul_wide(c0, 0xD2511F53)
    c2 = hi_a ^ k1
    c0 = c1 ^ k0
    c1 = c0 * 0
    for _ in tl.static_range(9):
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
        hi_b, lo_b = _mul_wide(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul_wide(c0, 0xD2511F53)
        c0 = hi_b ^ c1 ^ k0
        c2 = hi_a ^ c3 ^ k1
        c1 = lo_b
        c3 = lo_a
    return c0, c1, c2, c3


@triton.jit
def philox_bits(seed_lo, seed_hi, offsets):
    """uint32 random bits for each int64 offset (first Philox4x32-10 stream, ``philox.random_bits``)."""
    c0, _, _, _ = philox4x32(seed_lo, seed_hi, offsets)
    return c0


@triton.jit
def _words(seed_lo, seed_hi, counters):
    """The four Philox words of each counter as [*counters.shape, 2, 2]: element [..., i, j] is W[2i + j], so a
    reshape of the last two dims to 4 lists W[0..3] in order."""
    c0, c1, c2, c3 = philox4x32(seed_lo, seed_hi, counters)
    return tl.join(tl.join(c0, c2), tl.join(c1, c3))


@triton.jit
def philox_sr8(seed_lo, seed_hi, counters):
    """E2M1 SR bits (8 an element) of the 16 offsets 16c .. 16c+15 of each counter c: int32 0..255,
    shape [*counters.shape, 2, 2, 2, 2].

    Element [..., i, j, k, l] is byte 2k + l of word W[2i + j], the bits of offset 16c + 8i + 4j + 2k + l
    (``philox.sr_bits(seed, o, 8)``): reshaping the last four dims to 16 lays the bits out along consecutive
    offsets. One Philox call per 16 elements, then a shift and a mask per element.
    """
    w = _words(seed_lo, seed_hi, counters)
    b = tl.join(tl.join(w & 0xFF, (w >> 16) & 0xFF), tl.join((w >> 8) & 0xFF, w >> 24))
    return b.to(tl.int32)


@triton.jit
def philox_sr16(seed_lo, seed_hi, counters):
    """E4M3 SR bits (16 an element) of the 8 offsets 8c .. 8c+7 of each counter c: int32 0..65535,
    shape [*counters.shape, 2, 2, 2].

    Element [..., i, j, h] is half h (h = 0: bits 0..15) of word W[2i + j], the bits of offset 8c + 4i + 2j + h
    (``philox.sr_bits(seed, o, 16)``): reshaping the last three dims to 8 lays the bits out along consecutive
    offsets. One Philox call per 8 elements, then a shift or a mask per element.
    """
    w = _words(seed_lo, seed_hi, counters)
    return tl.join(w & 0xFFFF, w >> 16).to(tl.int32)
