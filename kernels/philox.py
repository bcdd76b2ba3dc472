"""Philox4x32-10 counter-based random bits in plain PyTorch: the reference for ``philox_triton``.

    w0, w1, w2, w3 = philox4x32(seed, offsets)   # like tl.randint4x; random_bits(seed, offsets) is w0
    r = sr_bits(seed, offsets, 8)                # stochastic rounding's draw: 8 bits (E2M1) or 16 (E4M3)
    seed = derive_seed(run_seed, step, layer, tensor_id)

Matches Triton's ``tl.randint(seed, offset)`` / ``tl.randint4x`` (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", SC'11; triton ``python/triton/language/random.py``) bit for bit, and so do the kernels'
``philox_triton.py``: a stochastically rounded tensor is the same whether the reference or a kernel made it.
``sr_bits`` gives an element only the bits its format needs, so one call serves 16 (E2M1) or 8 (E4M3)
consecutive offsets (its docstring; docs/numerics.md, "Random bits"). Values are carried in int64 holding a
uint32 (PyTorch's uint32 arithmetic is incomplete on CPU); ``_mul_hi_lo`` keeps the products exact.

Leaves out: other round counts, and the 64-bit Philox variant.
"""

from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF
_KEY_A = 0x9E3779B9
_KEY_B = 0xBB67AE85
_ROUND_A = 0xD2511F53
_ROUND_B = 0xCD9E8D57
N_ROUNDS = 10


def _mul_hi_lo(a: torch.Tensor, const: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high 32 bits, low 32 bits) of a * const for uint32 a (int64 tensor) and a uint32 constant.

    Every value is an int64 holding a uint32 (0 .. 2**32-1): PyTorch's uint32 arithmetic is incomplete on CPU.

    With const = c_hi * 2**16 + c_lo: floor(a * const / 2**32) =
    (a * c_hi + (a * c_lo >> 16)) >> 16 (nested floors of exact integer
    divisions, every term < 2**49); the low word is the int64 product, which
    wraps modulo 2**64 and so keeps its low 32 bits exact.
    """
    high = torch.mul(a, const & 0xFFFF).bitwise_right_shift_(16).add_(a * (const >> 16)).bitwise_right_shift_(16)
    return high, torch.mul(a, const).bitwise_and_(_MASK32)


def philox4x32(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Four uint32 streams (as int64 tensors) for each offset, like ``tl.randint4x``.

    key = (seed low 32 bits, seed high 32 bits), counter = (offset low 32, offset high 32, 0, 0), ten rounds.

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


SR_WORDS = 4  # 32-bit words a Philox4x32 call gives
SR_BIT_WIDTHS = (8, 16)  # bits an element: E2M1 (NVFP4 SR), E4M3 (MXFP8 SR)


def _sr_geometry(n_bits: int) -> tuple[int, int]:
    """(elements a 32-bit word, elements a Philox call) for n-bit SR draws."""
    if n_bits not in SR_BIT_WIDTHS:
        raise ValueError(f"stochastic-rounding draws are {SR_BIT_WIDTHS} bits an element, got {n_bits}")
    per_word = 32 // n_bits
    return per_word, SR_WORDS * per_word


def sr_bits(seed: int, offsets: torch.Tensor, n_bits: int) -> torch.Tensor:
    """Stochastic rounding's n-bit draw r (int64, 0 .. 2**n - 1) for each element offset o (module docstring).

    r(o) = (W[(o // per_word) % 4] >> (n * (o % per_word))) & (2**n - 1) of the call for counter
    o // (4 * per_word), per_word = 32 / n, with W[0..3] the four words of one call:

        n =  8: r(o) = (W[(o // 4) % 4] >> (8 * (o % 4))) & 0xFF     of counter o // 16
        n = 16: r(o) = (W[(o // 2) % 4] >> (16 * (o % 2))) & 0xFFFF  of counter o // 8

    Fields are taken from the low end of each word first; ``philox_triton.philox_sr8`` / ``philox_sr16`` give
    the same in kernels. For offsets 0..count-1 (every quantize) ``sr_bits_range`` makes each call once.
    """
    per_word, per_call = _sr_geometry(n_bits)
    offsets = offsets.to(torch.int64)
    words = torch.stack(philox4x32(seed, offsets // per_call), dim=-1)
    word = words.gather(-1, ((offsets // per_word) % SR_WORDS).unsqueeze(-1)).squeeze(-1)
    return (word >> (n_bits * (offsets % per_word))) & ((1 << n_bits) - 1)


def sr_bits_range(seed: int, count: int, n_bits: int, device=None) -> torch.Tensor:
    """``sr_bits(seed, arange(count), n_bits)``: ceil(count / (4 * per_word)) Philox calls, split into fields.

    Field b of word w of counter c is offset c * 4 * per_word + w * per_word + b, so the [calls, 4, per_word]
    fields read row-major are the offsets in order.
    """
    per_word, per_call = _sr_geometry(n_bits)
    counters = torch.arange((int(count) + per_call - 1) // per_call, dtype=torch.int64, device=device)
    words = torch.stack(philox4x32(seed, counters), dim=-1)  # [calls, 4]
    shifts = torch.arange(per_word, dtype=torch.int64, device=device) * n_bits
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << n_bits) - 1)  # [calls, 4, per_word]
    return fields.reshape(-1)[: int(count)]


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
        state = _fold(state, k & (2**63 - 1))
    return state


@functools.lru_cache(maxsize=1 << 12)
def _fold(state: int, key: int) -> int:
    """One step of `derive_seed`, memoized: the keys' prefixes (run seed, step, layer) repeat across a step's
    GEMMs, so a backward's four seeds cost four Philox calls in Python, not twenty (~15 µs each)."""
    c0, c1, _, _ = philox4x32_int(state, key)
    return (c0 << 32) | c1
