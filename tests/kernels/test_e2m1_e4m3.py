"""Element-level rounding: E2M1 (nearest-even, saturation, SR, packing), E4M3 casts, E8M0 exponents.

Checks against brute force over the whole grid (nearest value, ties to the even
code), the ties listed in numerics.md, monotonicity and exact round trips.
"""

import math

import torch
from bitwise import assert_bitwise_equal
from hypothesis import given
from hypothesis import strategies as st

from rl4bit.kernels import e2m1
from rl4bit.kernels.e4m3 import cast_rn
from rl4bit.kernels.e4m3 import round_stochastic as e4m3_sr
from rl4bit.kernels.e8m0 import floor_biased, rceil_biased

f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
GRID = torch.tensor(e2m1.E2M1_VALUES)
E4M3_POS = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def test_e2m1_ties_from_spec():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 3.4e38, -0.25, -5.0])
    got = e2m1.codes_to_float(e2m1.round_nearest(y))
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0])
    assert_bitwise_equal(got, want, "E2M1 ties (numerics.md)")


@given(st.lists(f32s, min_size=1, max_size=64))
def test_e2m1_nearest_even_brute_force(vals):
    y = torch.tensor(vals, dtype=torch.float32)
    codes = e2m1.round_nearest(y)
    mag = y.abs().double().clamp(max=6.0)  # saturation: beyond 6 the nearest is 6
    dist = (mag.unsqueeze(-1) - GRID.double()).abs()
    best = dist.min(-1).values
    idx = (codes & 7).long()
    assert torch.all(dist.gather(-1, idx.unsqueeze(-1)).squeeze(-1) == best), "not a nearest grid value"
    ties = (dist == best.unsqueeze(-1)).sum(-1) > 1
    assert torch.all(idx[ties] % 2 == 0), "a tie did not go to the even code"
    assert torch.equal((codes >> 3).bool(), torch.signbit(y)), "sign bit not kept"


@given(st.lists(f32s, min_size=2, max_size=64))
def test_e2m1_monotonic(vals):
    y = torch.tensor(sorted(vals), dtype=torch.float32)
    v = e2m1.codes_to_float(e2m1.round_nearest(y))
    assert torch.all(v[1:] >= v[:-1])


def test_e2m1_representable_round_trip_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    assert_bitwise_equal(e2m1.round_nearest(e2m1.codes_to_float(codes)), codes, "E2M1 codes round trip")
    for r in (0, 255):  # grid values have frac 0: floor(256 * 0) + r < 256 for every 8-bit r
        got = e2m1.round_stochastic(e2m1.codes_to_float(codes), torch.full((16,), r))
        assert_bitwise_equal(got, codes, f"SR of grid values, r={r}")
    packed = e2m1.pack(codes)
    assert packed[0].item() == 0x10 and packed[7].item() == 0xFE  # element 2i in the low nibble
    assert_bitwise_equal(e2m1.unpack(packed), codes, "pack/unpack")


@given(st.lists(f32s, min_size=1, max_size=32), st.integers(0, 255))
def test_e2m1_sr_picks_a_neighbour(vals, r):
    """SR lands on a neighbour, and goes up iff floor(256 * frac) + r >= 256 (frac taken in float64 here)."""
    y = torch.tensor(vals, dtype=torch.float32)
    v = e2m1.codes_to_float(e2m1.round_stochastic(y, torch.full(y.shape, r))).abs()
    a = y.abs().clamp(max=6.0)
    lo = GRID[(GRID.unsqueeze(0) <= a.unsqueeze(-1)).sum(-1) - 1]
    hi = GRID[torch.clamp((GRID.unsqueeze(0) < a.unsqueeze(-1)).sum(-1), max=7)]
    assert torch.all((v == lo) | (v == hi))
    frac = (a.double() - lo.double()) / torch.where(hi > lo, hi - lo, torch.ones_like(lo)).double()
    assert torch.equal(v == hi, (torch.floor(frac * 256) + r >= 256) | (hi == lo))


@given(st.lists(st.floats(-600, 600, width=32), min_size=1, max_size=64))
def test_e4m3_cast_is_nearest_even_with_saturation(vals):
    v = torch.tensor(vals, dtype=torch.float32)
    q = cast_rn(v)
    got = q.float().abs().double()
    mag = v.abs().double().clamp(max=448.0)
    dist = (mag.unsqueeze(-1) - E4M3_POS.double()).abs()
    best = dist.min(-1).values
    assert torch.all((got - mag).abs() == best), "not a nearest E4M3 value"
    code = q.view(torch.uint8) & 0x7F
    ties = (dist == best.unsqueeze(-1)).sum(-1) > 1
    assert torch.all(code[ties] % 2 == 0), "a tie did not go to the even mantissa"


@given(st.lists(st.floats(-448, 448, width=32), min_size=1, max_size=64), st.integers(0, 2**16 - 1))
def test_e4m3_sr_picks_a_neighbour(vals, r):
    """SR lands on a neighbour, goes up iff floor(65536 * frac) + r >= 65536, keeps the sign."""
    y = torch.tensor(vals, dtype=torch.float32)
    q = e4m3_sr(y, torch.full(y.shape, r)).float()
    a = y.abs()
    lo = E4M3_POS[(E4M3_POS.unsqueeze(0) <= a.unsqueeze(-1)).sum(-1) - 1]
    hi = E4M3_POS[torch.clamp((E4M3_POS.unsqueeze(0) < a.unsqueeze(-1)).sum(-1), max=126)]
    assert torch.all((q.abs() == lo) | (q.abs() == hi))
    assert torch.equal(torch.signbit(q) | (q == 0), torch.signbit(y) | (q == 0))
    exact = lo == a
    assert torch.equal(q.abs()[exact], a[exact]), "representable values must not move"
    frac = (a.double() - lo.double()) / torch.where(hi > lo, hi - lo, torch.ones_like(lo)).double()
    assert torch.equal(q.abs()[~exact] == hi[~exact], (torch.floor(frac * 65536) + r >= 65536)[~exact])


@given(st.lists(st.floats(0, 2.0**127, width=32), min_size=1, max_size=64))
def test_e8m0_rceil_and_floor(vals):
    d = torch.tensor(vals, dtype=torch.float32)
    e = rceil_biased(d)
    for di, ei in zip(d.tolist(), e.tolist()):
        if di >= 2.0**-127:
            assert 2.0 ** (ei - 127) >= di > 2.0 ** (ei - 128), (di, ei)
    f = floor_biased(d, 8)
    for di, fi in zip(d.tolist(), f.tolist()):
        if di >= 2.0**-118:
            assert fi == math.floor(math.log2(di)) - 8 + 127 or di == 0, (di, fi)


def test_e2m1_decodes_every_code_and_every_packed_byte():
    """codes_to_float and unpack_to_float (the dequantize path's one-gather decode) against the spec's values:
    bit 3 the sign (code 8 is -0.0), bits 0-2 the magnitude; a byte's low nibble first."""
    def value(code: int) -> float:
        return math.copysign(e2m1.E2M1_VALUES[code & 7], -1.0 if code & 8 else 1.0)

    codes = torch.arange(16, dtype=torch.uint8)
    assert_bitwise_equal(e2m1.codes_to_float(codes), torch.tensor([value(c) for c in range(16)]), "codes")
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    want = torch.tensor([[value(b & 15), value(b >> 4)] for b in range(256)]).reshape(8, 64)
    assert_bitwise_equal(e2m1.unpack_to_float(packed), want, "packed bytes")
    assert_bitwise_equal(e2m1.unpack_to_float(packed[:, :0]), torch.zeros(8, 0), "empty")
