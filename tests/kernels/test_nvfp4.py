"""NVFP4 reference: TE scale chain, outer scales (tensor/row/group), 16x16 tiles, properties.

Properties (hypothesis): NVFP4-representable tensors round-trip exactly (E4M3
subnormal block scales included), rounding is monotonic within a block, block
amax never overshoots the E2M1 range by more than the scale rounding allows,
all-zero and underflowing blocks give zero scale and zero codes.
"""

import pytest
import torch
from bitwise import assert_bitwise_equal
from hypothesis import given
from hypothesis import strategies as st

from rl4bit.kernels import dequantize, e2m1, quantize_reference
from rl4bit.kernels.e4m3 import cast_rn

E4M3_VALUES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 2**-9 .. 448


def q(x, **kw):
    return quantize_reference(x, "nvfp4", **kw)


def test_block_scale_uses_te_single_rounding_order():
    """s_b = e4m3(b * (S_enc * f32(1/6))), not e4m3((b/6) * S_enc): find blocks where they differ."""
    amax = torch.tensor(3.1)
    s_enc = torch.tensor(2688.0) / amax
    found = []
    for tie in (1.0625, 1.1875, 100.0):  # near E4M3 rounding ties
        b0 = torch.tensor(tie * 6.0) / s_enc
        b = (b0.view(torch.int32) + torch.arange(-40, 41, dtype=torch.int32)).view(torch.float32)
        te = cast_rn(b * (s_enc * torch.tensor(1 / 6)))
        twice = cast_rn((b / 6.0) * s_enc)
        found += [(bi, ti) for bi, ti, wi in zip(b, te, twice) if ti.view(torch.uint8) != wi.view(torch.uint8)]
    assert found, "expected some blocks where the two rounding orders disagree"
    x = torch.zeros(len(found), 16)
    x[:, 0] = torch.stack([bi for bi, _ in found])
    x[0, 1] = -amax
    got = q(x)
    want = torch.stack([ti for _, ti in found])
    assert_bitwise_equal(got.scale[1:, 0], want[1:], "block scales (TE order)")


@st.composite
def representable(draw):
    """An NVFP4-representable [rows, 32] tensor with S_enc = 2**k, and its block scales."""
    rows = draw(st.integers(1, 4))
    k = draw(st.integers(-6, 6))
    codes = torch.tensor(draw(st.lists(st.integers(0, 15), min_size=rows * 32, max_size=rows * 32)), dtype=torch.uint8)
    codes = codes.reshape(rows, 2, 16)
    codes[..., 0] = codes[..., 0] | 7  # each block holds +-6, so its amax is 6 * s
    sidx = torch.tensor(draw(st.lists(st.integers(0, 125), min_size=rows * 2, max_size=rows * 2))).reshape(rows, 2)
    sidx[0, 0] = 125  # one block with s = 448: tensor amax = 2688 * 2**-k
    s = E4M3_VALUES[sidx]
    x = e2m1.codes_to_float(codes) * s.unsqueeze(-1) * 2.0**-k
    return x.reshape(rows, 32), s, k


@given(representable())
def test_representable_round_trip_including_subnormal_scales(case):
    x, s, k = case
    qt = q(x)
    assert qt.outer.item() == 2.0**-k
    assert_bitwise_equal(qt.scale.float(), s, "block scales")
    assert_bitwise_equal(dequantize(qt), x, "dequantize(quantize(x))")


def test_subnormal_block_scales_are_exercised():
    x = torch.zeros(1, 64)
    x[0, 0] = 2688.0  # S_enc = 1
    x[0, 16] = 6 * 2.0**-9  # s_b = 2**-9, smallest E4M3 subnormal
    x[0, 32] = 6 * 3 * 2.0**-9
    x[0, 48] = 6 * 2.0**-11  # v = 2**-11 < 2**-10: no lower clamp, rounds to 0
    qt = q(x)
    assert qt.scale.view(torch.uint8)[0].tolist() == [0x7E, 0x01, 0x03, 0x00]
    assert_bitwise_equal(dequantize(qt)[0, :48], x[0, :48], "subnormal-scale blocks decode exactly")
    assert torch.all(e2m1.unpack(qt.data)[0, 48:] == 0), "zero scale -> zero codes"


@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16), st.integers(0, 3))
def test_monotonic_within_a_block(vals, where):
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(len(vals)))
    x[1, where * 16 : where * 16 + 16] = torch.tensor(sorted(vals))
    v = dequantize(q(x))[1, where * 16 : where * 16 + 16]
    assert torch.all(v[1:] >= v[:-1])


@given(st.integers(0, 2**31 - 1), st.sampled_from(["tensor", "row"]))
def test_error_bound_and_saturation(seed, outer):
    """|x - x_hat| <= half a grid step, except values above the block's 6*s, which saturate to 6*s."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (4, 1), generator=g).float())
    qt = q(x, outer=outer)
    xh = dequantize(qt)
    s = qt.scale.float().repeat_interleave(16, -1)
    unit = s * qt.outer  # value of E2M1 "1.0" per element
    top = (6 * s) * qt.outer  # the largest magnitude, computed as dequantize does
    step = torch.where(xh.abs() < 2 * unit, 0.5 * unit, torch.where(xh.abs() < 4 * unit, unit, 2 * unit))
    over = x.abs() > top * (1 + 1e-6)
    assert torch.all(xh.abs()[over] == top[over]), "values above 6*s must saturate to 6*s"
    err = (x - xh).abs()[~over]
    assert torch.all(err <= (step[~over] * 0.5) * (1 + 1e-5) + 1e-30)
    normal = s >= 2.0**-6  # E4M3 normal: nearest rounding lowers the scale by at most 16/17
    assert torch.all(x.abs()[normal] <= top[normal] * (17 / 16) * (1 + 1e-5)), "scale lowered by more than rounding"


def test_all_zero_blocks_and_negative_zero():
    """A zero block scale gives enc_b = 0 and q = e2m1(x * 0) = +-0: code 0, and code 8 (-0) where x is negative
    or -0 (TE's chain, numerics.md), also for a block whose values underflow to a zero scale."""
    x = torch.randn(3, 64)
    x[0, 16:32] = 0.0
    x[1, :16] = -0.0
    x[2, 0] = 1000.0
    x[2, 16:32] = torch.tensor([-1e-6, 1e-6] * 8)  # block amax far under the outer's: s_b rounds to 0
    qt = q(x)
    codes = e2m1.unpack(qt.data)
    assert qt.scale[0, 1].float() == 0 and qt.scale[1, 0].float() == 0 and qt.scale[2, 1].float() == 0
    assert torch.all(codes[0, 16:32] == 0) and torch.all(codes[1, :16] == 8)
    assert codes[2, 16:32].tolist() == [8, 0] * 8
    assert torch.equal(torch.signbit(dequantize(qt)[2, 16:32]), torch.signbit(x[2, 16:32]))
    z = q(torch.zeros(3, 32))
    assert z.outer.item() == 1.0 and torch.all(z.data == 0) and torch.all(z.scale.float() == 0)


def test_outer_row_and_group_match_slices():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 64, generator=g) * torch.exp2(torch.randint(-8, 8, (3, 8, 1), generator=g).float())
    rows = q(x, outer="row")
    assert rows.outer.shape == (3, 8, 1)
    for e in range(3):
        for m in range(8):
            one = q(x[e, m : m + 1])
            assert_bitwise_equal(rows.data[e, m : m + 1], one.data, "row data")
            assert_bitwise_equal(rows.scale[e, m : m + 1], one.scale, "row scale")
            assert_bitwise_equal(rows.outer[e, m].reshape(1, 1), one.outer, "row outer")
    grp = q(x, outer="group")
    assert grp.outer.shape == (3, 1, 1)
    for e in range(3):
        one = q(x[e])
        assert_bitwise_equal(grp.data[e], one.data, "group data")
        assert_bitwise_equal(grp.scale[e], one.scale, "group scale")
    assert_bitwise_equal(dequantize(rows).reshape(24, 64), dequantize(q(x.reshape(24, 64), outer="row")),
                         "row on 3D == 2D")
    with pytest.raises(ValueError, match=r"3D \[E, N, K\]"):
        q(x[0], outer="group")


def test_tiles_16x16_scales_transpose_consistently():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 48, generator=g) * torch.exp2(torch.randint(-6, 6, (32, 48), generator=g).float())
    a, b = q(x, tiles_16x16=True), q(x.T.contiguous(), tiles_16x16=True)
    sa = a.scale.view(torch.uint8)[::16]  # [M/16, K/16], one per tile
    sb = b.scale.view(torch.uint8)[::16]  # [K/16, M/16]
    assert torch.equal(a.scale.view(torch.uint8), sa.repeat_interleave(16, 0))
    assert_bitwise_equal(sa, sb.T.contiguous(), "tile scales of W vs W^T")
    tile_amax = x.abs().reshape(2, 16, 3, 16).amax(dim=(1, 3))
    s_enc = torch.tensor(2688.0) / x.abs().max()
    assert_bitwise_equal(sa.view(torch.float8_e4m3fn), cast_rn(tile_amax * (s_enc * torch.tensor(1 / 6))), "tile scale")
    with pytest.raises(ValueError, match="multiple of 16"):
        q(torch.randn(24, 32), tiles_16x16=True)


def test_bf16_input_equals_its_fp32_value():
    x = torch.randn(4, 64).to(torch.bfloat16)
    assert_bitwise_equal(q(x).data, q(x.float()).data, "bf16 vs fp32 data")
    assert_bitwise_equal(q(x).scale, q(x.float()).scale, "bf16 vs fp32 scale")
