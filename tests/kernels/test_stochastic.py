"""Stochastic rounding: unbiasedness within a deterministic variance bound, the bias of
round-to-nearest on the same data, seeds, the random-bit layout, and requantize.

Bound: with n independent draws of a value whose two neighbours are `step` apart,
sigma <= step/2, so the sample mean lies within 6 * (step/2) / sqrt(n) of E[SR(x)]
(the seeds are fixed, so the check is deterministic; a correct SR fails it with
probability < 1e-8 per element). E[SR(x)] itself sits below x by less than
step * 2**-n_bits (SR_BIAS below), so |mean - x| <= 6 * (step/2) / sqrt(n) + step * SR_BIAS.
The draws are n stacked copies of x in one call: each copy has its own offsets.
"""

import pytest
import torch
from bitwise import assert_bitwise_equal, count_differing_bytes

from rl4bit.kernels import dequantize, e2m1, e4m3, quantize_reference, requantize
from rl4bit.kernels.philox import philox4x32, sr_bits, sr_bits_range
from rl4bit.kernels.stochastic import E2M1_SR_BITS, E4M3_SR_BITS

# SR with n random bits rounds up with probability floor(2**n * frac) / 2**n (frac truncated to n bits,
# shared/docs/numerics.md "Random bits for stochastic rounding"), so
# E[SR(y)] - y = -step * (frac - floor(2**n frac) / 2**n) lies in (-step * 2**-n, 0]: the bias bound in units of
# the grid step, at most 1/256 for E2M1 (8 bits) and 2**-16 for E4M3 (16 bits).
# test_sr_expectation_over_every_draw checks this figure exactly.
E2M1_SR_BIAS = 2.0**-E2M1_SR_BITS
E4M3_SR_BIAS = 2.0**-E4M3_SR_BITS
N = 1024


def _e2m1_step(y):
    """Grid spacing around E2M1 magnitudes y (in units of the block scale)."""
    a = y.abs()
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def _e4m3_step(y):
    """E4M3 grid spacing at magnitude y (|y| <= 448)."""
    e = torch.floor(torch.log2(y.abs().clamp(min=2.0**-6)))
    return torch.exp2(e - 3)


def _data(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-3, 3, shape, generator=g).float())


def test_nvfp4_sr_is_unbiased_and_nearest_is_not():
    x = _data(0, (2, 64))
    reps = x.expand(N, 2, 64).contiguous()  # tensor amax unchanged -> same S_enc for every copy
    qt = quantize_reference(reps, "nvfp4", rounding="stochastic", seed=1234)
    unit = qt.scale[0].float().repeat_interleave(16, -1) * qt.outer.reshape(())  # value of E2M1 1.0
    mean = dequantize(qt).double().mean(0)
    step = _e2m1_step(x / unit) * unit
    bound = 6 * (step / 2) / N**0.5 + step * E2M1_SR_BIAS + 1e-6 * x.abs()
    assert torch.all((mean - x).abs() <= bound), f"max excess {((mean - x).abs() - bound).max()}"
    # round-to-nearest on the same data sits far outside that bound for most elements
    rn = dequantize(quantize_reference(x, "nvfp4"))
    assert ((rn - x).abs() > bound).float().mean() > 0.5
    assert (rn - x).abs().mean() > 3 * (mean - x).abs().mean()
    # the 16/17 shrink: no element was clamped, so every draw is a neighbour of x
    assert torch.all((dequantize(qt) - x).abs() <= _e2m1_step(x / unit) * unit * (1 + 1e-6))


def test_mxfp8_sr_is_unbiased_and_nearest_is_not():
    x = _data(1, (2, 64))
    qt = quantize_reference(x.expand(N, 2, 64).contiguous(), "mxfp8", rounding="stochastic", seed=99)
    s = qt.scale[0].float().repeat_interleave(32, -1)
    mean = dequantize(qt).double().mean(0)
    step = _e4m3_step(x / s) * s
    bound = 6 * (step / 2) / N**0.5 + step * E4M3_SR_BIAS + 1e-7 * x.abs()
    assert torch.all((mean - x).abs() <= bound)
    rn = dequantize(quantize_reference(x, "mxfp8"))
    assert ((rn - x).abs() > bound).float().mean() > 0.5
    assert (rn - x).abs().mean() > 3 * (mean - x).abs().mean()


def test_requantize_keeps_the_expectation_transposed():
    x = _data(2, (32, 32))
    fwd = quantize_reference(x.expand(N // 2, 32, 32).contiguous(), "nvfp4")  # identical copies
    target = dequantize(fwd)[0].T  # [32, 64]
    r = requantize(fwd, seed=5)
    assert r.fmt == "mxfp8" and r.shape == (N // 2, 32, 32)
    s = r.scale[0].float().repeat_interleave(32, -1)
    mean = dequantize(r).double().mean(0)
    step = _e4m3_step(target / s) * s
    bound = 6 * (step / 2) / (N // 2) ** 0.5 + step * E4M3_SR_BIAS + 1e-7 * target.abs()
    assert torch.all((mean - target).abs() <= bound)
    near = dequantize(requantize(fwd, seed=5, rounding="nearest"))[0]
    off_grid = near != target  # dequantized NVFP4 values that E4M3 cannot hold
    assert off_grid.sum() > 50, "expected NVFP4 values that are not E4M3-representable"
    assert ((near - target).abs()[off_grid] > bound[off_grid]).float().mean() > 0.5


def test_same_seed_same_bits_different_seed_different_bits():
    x = _data(3, (8, 128))
    for fmt in ("nvfp4", "mxfp8"):
        a = quantize_reference(x, fmt, rounding="stochastic", seed=42)
        b = quantize_reference(x, fmt, rounding="stochastic", seed=42)
        c = quantize_reference(x, fmt, rounding="stochastic", seed=43)
        assert_bitwise_equal(a, b, f"{fmt} same seed")
        assert_bitwise_equal(a.scale, c.scale, f"{fmt} scales do not depend on the seed")
        assert count_differing_bytes(a.data, c.data) > a.data.numel() // 8


def test_sr_expectation_over_every_draw():
    """Averaged over all 2**n values of r, SR(y) is exactly lo + step * floor(2**n frac) / 2**n: the bias is the
    truncation of frac to n bits, in (-step * SR_BIAS, 0], and zero for y on the grid."""
    g = torch.Generator().manual_seed(7)
    cases = (
        (e2m1.round_stochastic, lambda c: e2m1.codes_to_float(c), E2M1_SR_BITS, E2M1_SR_BIAS,
         torch.cat([torch.rand(200, generator=g) * 6.5, torch.tensor(e2m1.E2M1_VALUES), torch.tensor([0.5 + 2**-20])])),
        (e4m3.round_stochastic, lambda c: c.float(), E4M3_SR_BITS, E4M3_SR_BIAS,
         torch.cat([torch.rand(40, generator=g) * 448, torch.tensor([1.0, 1.0 + 2**-20, 2.0**-8 + 2**-30, 448.0])])),
    )
    for rounding, value, n_bits, bias_bound, y in cases:
        r = torch.arange(2**n_bits).unsqueeze(-1)
        v = value(rounding(y.expand(2**n_bits, -1), r)).double()
        mean = v.mean(0)
        lo, hi = v.min(0).values, v.max(0).values
        step = torch.where(hi > lo, hi - lo, 1.0)
        a = y.double().clamp(max=float(hi.max()))
        frac = (a - lo) / step
        assert_bitwise_equal(mean, lo + step * torch.floor(frac * 2**n_bits) / 2**n_bits, f"E[SR] ({n_bits} bits)")
        bias = (mean - a) / step
        assert torch.all((bias <= 0) & (bias > -bias_bound)), f"bias {bias.min()} beyond -{bias_bound} of a step"
        assert (bias < -bias_bound / 2).any(), "no value shows the truncation bias"


def test_offsets_are_flat_output_indices():
    """Element at flat index o rounds up iff floor(2**n * frac) + sr_bits(seed, o, n) >= 2**n; frac = 1/2 here."""
    seed = 2024
    # MXFP8: block amax 448 -> scale 1; 1 + 1/16 sits halfway between E4M3 1 and 1.125: up iff r16 >= 2**15
    x = torch.full((3, 64), 1.0625)
    x[:, 0] = x[:, 32] = 448.0
    got = quantize_reference(x, "mxfp8", rounding="stochastic", seed=seed).data.float()
    r = sr_bits(seed, torch.arange(x.numel()), 16).reshape(x.shape)
    want = torch.where(r >= 2**15, 1.125, 1.0)
    want[:, 0] = want[:, 32] = 448.0
    assert_bitwise_equal(got, want, "mxfp8 SR decisions vs Philox offsets")
    # NVFP4: block 0 holds A = 2688 (S_enc = 1, s_0 = 448, every code saturates to 6); blocks 1-2 have
    # amax 6 -> v = 1.0625 (the SR shrink) -> s_b = e4m3 tie -> 1.0, so 0.75 is exactly halfway 0.5..1:
    # up iff r8 >= 2**7
    x = torch.full((2, 48), 0.75)
    x[:, :16] = 2688.0
    x[:, 16] = x[:, 32] = 6.0
    qt = quantize_reference(x, "nvfp4", rounding="stochastic", seed=seed)
    assert qt.outer.item() == 1.0 and qt.scale.float()[:, 1:].eq(1.0).all()
    r = sr_bits(seed, torch.arange(x.numel()), 8).reshape(x.shape)
    want = torch.where(r >= 2**7, 1.0, 0.5)
    exact = x != 0.75
    want[exact] = x[exact]
    assert_bitwise_equal(dequantize(qt), want, "nvfp4 SR decisions vs Philox offsets")
    # requantize: offsets index the transposed output
    fwd = quantize_reference(torch.randn(64, 32), "nvfp4")
    r1 = requantize(fwd, seed=seed)
    r2 = quantize_reference(dequantize(fwd).T.contiguous(), "mxfp8", rounding="stochastic", seed=seed)
    assert_bitwise_equal(r1, r2, "requantize == quantize(dequantize(q).T) with the same seed")


_M32 = 0xFFFFFFFF


def _philox_textbook(counter, key):
    """Philox4x32-10 from Salmon et al. (SC'11), all four counter words, Python integers: independent of
    rl4bit.kernels.philox (which fixes counter words 2 and 3 at 0)."""
    c, k = list(counter), list(key)
    for rnd in range(10):
        if rnd:
            k = [(k[0] + 0x9E3779B9) & _M32, (k[1] + 0xBB67AE85) & _M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & _M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & _M32]
    return c


def _spec_bits(seed, o, n_bits):
    """numerics.md's table, literally: n = 8: (W[(o // 4) % 4] >> (8 * (o % 4))) & 0xFF of counter o // 16;
    n = 16: (W[(o // 2) % 4] >> (16 * (o % 2))) & 0xFFFF of counter o // 8. Counter (o lo, o hi, 0, 0), key
    (seed lo, seed hi)."""
    per_word = 32 // n_bits
    ctr = o // (4 * per_word)
    w = _philox_textbook([ctr & _M32, ctr >> 32, 0, 0], [seed & _M32, seed >> 32])
    return (w[(o // per_word) % 4] >> (n_bits * (o % per_word))) & ((1 << n_bits) - 1)


# Random123's known-answer vectors for Philox4x32-10 (kat_vectors: counter, key -> output)
_KAT = (
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([_M32] * 4, [_M32, _M32], [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
)
# Seed 0, counter 0 is the first vector: W = 6627e8d5 e169c58d bc57ac4c 9b00dbd8. Split by hand, low end first:
R8_SEED0 = [0xD5, 0xE8, 0x27, 0x66, 0x8D, 0xC5, 0x69, 0xE1, 0x4C, 0xAC, 0x57, 0xBC, 0xD8, 0xDB, 0x00, 0x9B]  # o 0..15
R16_SEED0 = [0xE8D5, 0x6627, 0xC58D, 0xE169, 0xAC4C, 0xBC57, 0xDBD8, 0x9B00]  # o 0..7


def test_sr_bit_layout_pinned_by_hand():
    """The spec's layout on a worked example: seed 0, counter 0 (Random123's first known-answer vector), bytes
    and halves split by hand, then the quantizers' decisions at the threshold floor(2**n frac) + r = 2**n."""
    for counter, key, want in _KAT:
        assert _philox_textbook(counter, key) == want
    assert [int(w) for w in philox4x32(0, torch.tensor([0]))] == _KAT[0][2]
    assert sr_bits(0, torch.arange(16), 8).tolist() == R8_SEED0
    assert sr_bits(0, torch.arange(8), 16).tolist() == R16_SEED0
    assert [_spec_bits(0, o, 8) for o in range(16)] == R8_SEED0
    assert [_spec_bits(0, o, 16) for o in range(8)] == R16_SEED0

    # NVFP4, seed 0, x [1, 32]: block 1 = 2688 (A = 2688: S_enc = 1; its codes saturate at 6); block 0 has amax
    # 6 at o = 14 (r = 0) -> s_b = 1, y = x. Elsewhere y = 0.5 + 0.5 * k / 256 (frac = k / 256, E2M1 0.5 .. 1):
    # even o: k = 256 - r (up, exactly at the threshold); odd o: k = 255.5 - r (floor 255 - r: down, half a unit
    # below it); o = 3 (mod 4) negative (SR acts on |y|, the sign is reapplied).
    sign = [-1.0 if o % 4 == 3 else 1.0 for o in range(16)]
    x = [sign[o] * (0.5 + 0.5 * ((256 - r) if o % 2 == 0 else (255.5 - r)) / 256) for o, r in enumerate(R8_SEED0)]
    x[14] = 6.0
    want = [sign[o] * (1.0 if o % 2 == 0 else 0.5) for o in range(16)]
    want[14] = 6.0
    q = quantize_reference(torch.tensor([x + [2688.0] * 16]), "nvfp4", rounding="stochastic", seed=0)
    assert q.outer.item() == 1.0 and q.scale.float().tolist() == [[1.0, 448.0]]
    assert_bitwise_equal(dequantize(q)[0, :16], torch.tensor(want), "nvfp4 SR, seed 0, offsets 0..15")

    # MXFP8, seed 0, x [1, 32]: amax 448 at o = 31 -> scale 1. o = 0..7: y = 1 + 0.125 * k / 65536 (E4M3 1 ..
    # 1.125), k as above with 2**16; o = 8..30 (counters 1..3): frac = 1/2, up iff r >= 2**15 by the table.
    x = [(1 + 0.125 * ((65536 - r) if o % 2 == 0 else (65535.5 - r)) / 65536) for o, r in enumerate(R16_SEED0)]
    want = [1.125 if o % 2 == 0 else 1.0 for o in range(8)]
    for o in range(8, 31):
        x.append(1.0625)
        want.append(1.125 if _spec_bits(0, o, 16) >= 2**15 else 1.0)
    x.append(-448.0)
    want.append(-448.0)
    q = quantize_reference(torch.tensor([x]), "mxfp8", rounding="stochastic", seed=0)
    assert q.scale.float().tolist() == [[1.0]]
    assert_bitwise_equal(q.data.float()[0], torch.tensor(want), "mxfp8 SR, seed 0, offsets 0..31")


@pytest.mark.parametrize("n_bits", [8, 16])
def test_sr_bits_follow_the_spec_table(n_bits):
    """sr_bits / sr_bits_range equal numerics.md's formula on small, large and random offsets and seeds."""
    g = torch.Generator().manual_seed(n_bits)
    offs = torch.cat([torch.arange(41), torch.tensor([2**33 + 2, 2**36 - 1, 2**62 + 1]),
                      torch.randint(0, 2**40, (40,), generator=g)])
    for seed in (2**63 + 11, 5):
        want = torch.tensor([_spec_bits(seed, int(o), n_bits) for o in offs])
        assert_bitwise_equal(sr_bits(seed, offs, n_bits), want, f"sr_bits {n_bits} seed={seed}")
        assert_bitwise_equal(sr_bits_range(seed, 41, n_bits), want[:41], f"sr_bits_range {n_bits} seed={seed}")
        assert len(set(want[:41].tolist())) > 41 * 3 // 4  # the fields of a call are not copies of each other
    with pytest.raises(ValueError, match="bits an element"):
        sr_bits(1, torch.arange(4), 24)


def test_scalar_philox_is_the_tensor_philox():
    """`philox4x32_int` (host-side key derivation) gives the tensor reference's four words for any seed/counter,
    and `derive_seed` (built on it) folds keys exactly as the tensor version did."""
    from rl4bit.kernels.philox import derive_seed, philox4x32_int

    g = torch.Generator().manual_seed(5)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**64 - 1] + torch.randint(0, 2**62, (40,), generator=g).tolist()
    counters = [0, 1, 2**32 - 1, 2**32, 2**63 - 1] + torch.randint(0, 2**62, (40,), generator=g).tolist()
    for seed, ctr in zip(seeds, counters):
        want = tuple(int(w) for w in philox4x32(seed, torch.tensor([ctr])))
        assert philox4x32_int(seed, ctr) == want, (seed, ctr)

    def derive_with_tensors(*keys):
        state = 0x243F6A8885A308D3
        for k in keys:
            c0, c1, _, _ = philox4x32(state, torch.tensor([int(k) & (2**63 - 1)]))
            state = (int(c0) << 32) | int(c1)
        return state

    for keys in [(0,), (7, 3), (2**63 - 1, 5, 0, 9), (123456789, 2, 17, 3, 1)]:
        assert derive_seed(*keys) == derive_with_tensors(*keys)
