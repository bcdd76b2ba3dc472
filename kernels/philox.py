"""Philox4x32-10 counter-based random bits in plain PyTorch.

Matches Triton's ``tl.randint(seed, offset)`` / ``tl.randint4x`` (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC'11; triton
``python/triton/language/random.py``) bit for bit: key = (seed low 32 bits,
seed high 32 bits), counter = (offset low 32, offset high 32, 0, 0), ten
rounds. The Triton kernels in this package call the same generator
(``philox_triton.py``), so a stochastically rounded tensor is identical
whether the reference or a kernel produced it.

``random_bits4(seed, offsets)`` is the draw stochastic rounding uses: all
four streams of one call serve four consecutive offsets, bits(o) =
philox4x32(seed, counter=o // 4)[o % 4], so a kernel makes one Philox call per
4 elements (``philox_triton.philox_bits4``).

Every value is carried in int64 holding a uint32 (0 .. 2**32-1): PyTorch's
uint32 arithmetic is incomplete on CPU. The 32x32-bit products split the
constant into 16-bit halves so no needed intermediate leaves int64's range
(the low word uses the wrapped int64 product, whose low 64 bits are exact).

Leaves out: other round counts, and the 64-bit Philox variant.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
N_ROUNDS = 10


def _mul_hi_lo(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high 32 bits, low 32 bits) of a * const for uint32 a (int64 tensor) and a uint32 constant.

    With const = c_hi * 2**16 + c_lo: floor(a * const / 2**32) =
    (a * c_hi + (a * c_lo >> 16)) >> 16 (nested floors of exact integer
    divisions, every term < 2**49); the low word is the int64 product, which
    wraps modulo 2**64 and so keeps its low 32 bits exact.
    """
    high = torch.mul(a, const & 0xFFFF).bitwise_right_shift_(16).add_(a * (const >> 16)).bitwise_right_shift_(16)
    return high, torch.mul(a, const).bitwise_and_(_MASK32)


def philox4x32(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Four uint32 streams (as int64 tensors) for each offset, like ``tl.randint4x``.

    ``seed`` is a Python int in [0, 2**64); ``offsets`` an integer tensor of
    non-negative element offsets (< 2**63).
    """
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"philox seed must be in [0, 2**64), got {seed}")
    offsets = offsets.to(torch.int64)
    if offsets.numel() and int(offsets.min()) < 0:
        raise ValueError("philox offsets must be non-negative")
    seed = int(seed)
    return philox4x32_keyed(seed & _MASK32, (seed >> 32) & _MASK32, offsets)


def philox4x32_keyed(k0, k1, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``philox4x32`` with the key as two uint32 words (Python ints, or int64 tensors broadcastable to
    ``offsets``: one key per row, e.g. one per sequence in the sampler). No argument checks."""
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    # round 1 with c2 = c3 = 0 (its B product is 0), then the nine others
    hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
    c0, c1, c2, c3 = c1.bitwise_xor_(k0), torch.zeros_like(c0), hi_a.bitwise_xor_(k1), lo_a
    for _ in range(N_ROUNDS - 1):
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0), lo_b, hi_a.bitwise_xor_(c3).bitwise_xor_(k1), lo_a
    return c0, c1, c2, c3


def random_bits(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """The first Philox stream: one uint32 (in int64) per offset, like ``tl.randint(seed, offsets)``."""
    return philox4x32(seed, offsets)[0]


def random_bits4(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding's bits: one uint32 (in int64) per offset o, stream o % 4 of the call for counter o // 4.

    One Philox call serves four consecutive offsets. For offsets 0..n-1 (every
    quantize), ``random_bits4_range`` does a quarter of ``random_bits``' work.
    """
    offsets = offsets.to(torch.int64)
    streams = torch.stack(philox4x32(seed, offsets >> 2), dim=-1)
    return streams.gather(-1, (offsets & 3).unsqueeze(-1)).squeeze(-1)


def random_bits4_range(seed: int, n: int, device=None) -> torch.Tensor:
    """``random_bits4(seed, arange(n))``: ceil(n/4) Philox calls, their four streams interleaved."""
    counters = torch.arange((int(n) + 3) // 4, dtype=torch.int64, device=device)
    return torch.stack(philox4x32(seed, counters), dim=-1).reshape(-1)[: int(n)]


def philox4x32_int(seed: int, counter: int) -> tuple[int, int, int, int]:
    """``philox4x32(seed, tensor([counter]))`` for one counter in Python integers (same bits; no tensors).

    For host-side key derivation, where one value is needed and the tensor
    version's ~100 small tensor ops (about half a millisecond) would be paid
    per key: it ran several times per quantized GEMM backward and per sample.
    """
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2, c3 = counter & _MASK32, (counter >> 32) & _MASK32, 0, 0
    for r in range(N_ROUNDS):
        if r:
            k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
        pa, pb = c0 * _ROUND_A, c2 * _ROUND_B
        c0, c1, c2, c3 = (pb >> 32) ^ c1 ^ k0, pb & _MASK32, (pa >> 32) ^ c3 ^ k1, pa & _MASK32
    return c0, c1, c2, c3


def derive_seed(*keys: int) -> int:
    """Fold integer keys (seed, step, layer, tensor id, ...) into one 64-bit seed.

    Uses Philox itself as the mixing function, so distinct key tuples give
    independent streams and the derivation is reproducible everywhere.
    """
    state = 0x243F6A8885A308D3
    for k in keys:
        k = int(k)
        if k < 0:
            raise ValueError(f"seed keys must be non-negative, got {k}")
        c0, c1, _, _ = philox4x32_int(state, k & (2**63 - 1))
        state = (c0 << 32) | c1
    return state
