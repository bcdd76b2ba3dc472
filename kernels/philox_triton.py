"""Philox4x32-10 random bits inside Triton kernels, equal to ``rl4bit.kernels.philox``.

``philox_bits(seed_lo, seed_hi, offsets)`` returns the first Philox stream as
uint32 for int64 ``offsets``: the same value as
``rl4bit.kernels.philox.random_bits(seed, offsets)`` with
``seed = seed_hi << 32 | seed_lo`` (and as Triton's ``tl.randint(seed,
offsets)``). It is written out here rather than calling ``tl.randint`` so the
bits do not depend on the installed Triton's random module (the GPU image runs
triton 3.6, CI 3.9): key = (seed_lo, seed_hi), counter = (offset low 32,
offset high 32, 0, 0), ten rounds, constants of Salmon et al. (SC'11).

``split_seed(seed)`` turns a Python int seed into the two kernel arguments.

Leaves out: the other three streams and the 64-bit variant (nothing uses them).
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
def philox_bits(seed_lo, seed_hi, offsets):
    """uint32 random bits for each int64 offset (first Philox4x32-10 stream)."""
    offsets = offsets.to(tl.int64)
    # Keys as tensors shaped like the offsets: works whether Triton passed the
    # seed halves as runtime scalars or specialised them to constexpr (value 1),
    # and needs no tl.to_tensor (absent from triton 3.6's language namespace).
    k0 = (offsets * 0 + seed_lo).to(tl.uint32)
    k1 = (offsets * 0 + seed_hi).to(tl.uint32)
    c0 = offsets.to(tl.uint32)
    c1 = (offsets >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c0 * 0
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(0xCD9E8D57, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, _c0) ^ c3 ^ k1
        c1 = tl.mul(0xCD9E8D57, _c2, sanitize_overflow=False)
        c3 = tl.mul(0xD2511F53, _c0, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0
