"""Stochastic rounding: unbiasedness within a deterministic variance bound, the bias of
round-to-nearest on the same data, seeds, the Philox offset contract, and requantize.

Bound: with n independent draws of a value whose two neighbours are `step` apart,
sigma <= step/2, so |mean - x| <= 6 * (step/2) / sqrt(n) (the seeds are fixed, so
the check is deterministic; a correct SR fails it with probability < 1e-8 per element).
The draws are n stacked copies of x in one call: each copy has its own offsets.
"""

import torch
from bitwise import assert_bitwise_equal, count_differing_bytes

from rl4bit.kernels import dequantize, quantize_reference, requantize
from rl4bit.kernels.philox import philox4x32, random_bits4, random_bits4_range

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
    bound = 6 * (_e2m1_step(x / unit) * unit / 2) / N**0.5 + 1e-6 * x.abs()
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
    bound = 6 * (_e4m3_step(x / s) * s / 2) / N**0.5 + 1e-7 * x.abs()
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
    bound = 6 * (_e4m3_step(target / s) * s / 2) / (N // 2) ** 0.5 + 1e-7 * target.abs()
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


def test_offsets_are_flat_output_indices():
    """Element at flat index o rounds up iff (random_bits4(seed, o) >> 8) < frac * 2**24."""
    seed = 2024
    # MXFP8: block amax 448 -> scale 1; 1 + 1/16 sits halfway between E4M3 1 and 1.125
    x = torch.full((3, 64), 1.0625)
    x[:, 0] = x[:, 32] = 448.0
    got = quantize_reference(x, "mxfp8", rounding="stochastic", seed=seed).data.float()
    r = random_bits4(seed, torch.arange(x.numel())).reshape(x.shape)
    want = torch.where((r >> 8) < 2**23, 1.125, 1.0)
    want[:, 0] = want[:, 32] = 448.0
    assert_bitwise_equal(got, want, "mxfp8 SR decisions vs Philox offsets")
    # NVFP4: block 0 holds A = 2688 (S_enc = 1, s_0 = 448, every code saturates to 6); blocks 1-2 have
    # amax 6 -> v = 1.0625 (the SR shrink) -> s_b = e4m3 tie -> 1.0, so 0.75 is exactly halfway 0.5..1
    x = torch.full((2, 48), 0.75)
    x[:, :16] = 2688.0
    x[:, 16] = x[:, 32] = 6.0
    qt = quantize_reference(x, "nvfp4", rounding="stochastic", seed=seed)
    assert qt.outer.item() == 1.0 and qt.scale.float()[:, 1:].eq(1.0).all()
    r = random_bits4(seed, torch.arange(x.numel())).reshape(x.shape)
    want = torch.where((r >> 8) < 2**23, 1.0, 0.5)
    exact = x != 0.75
    want[exact] = x[exact]
    assert_bitwise_equal(dequantize(qt), want, "nvfp4 SR decisions vs Philox offsets")
    # requantize: offsets index the transposed output
    fwd = quantize_reference(torch.randn(64, 32), "nvfp4")
    r1 = requantize(fwd, seed=seed)
    r2 = quantize_reference(dequantize(fwd).T.contiguous(), "mxfp8", rounding="stochastic", seed=seed)
    assert_bitwise_equal(r1, r2, "requantize == quantize(dequantize(q).T) with the same seed")


def test_random_bits4_takes_stream_o_mod_4_of_counter_o_div_4():
    seed = 2**63 + 11
    offs = torch.cat([torch.arange(37), torch.tensor([2**33 + 2, 2**62 + 1]), torch.randint(0, 2**40, (50,))])
    streams = torch.stack(philox4x32(seed, offs // 4), dim=-1)
    want = torch.tensor([int(streams[i, int(o) % 4]) for i, o in enumerate(offs)])
    assert_bitwise_equal(random_bits4(seed, offs), want, "random_bits4 vs philox4x32 streams")
    assert_bitwise_equal(random_bits4_range(seed, 37), want[:37], "random_bits4_range vs random_bits4")
    assert len(set(want[:37].tolist())) == 37  # the four streams of a call differ


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
