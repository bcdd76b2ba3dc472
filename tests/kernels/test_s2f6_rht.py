"""S2F6 (int8/64 + E8M0 per 32) and the 32-dim random Hadamard transform."""

import pytest
import torch
from bitwise import assert_bitwise_equal
from hypothesis import given
from hypothesis import strategies as st

from rl4bit.kernels import dequantize, inverse_rht, quantize_reference, rht
from rl4bit.kernels.hadamard import fwht, signs


@st.composite
def representable(draw):
    ints = torch.tensor(draw(st.lists(st.integers(-128, 127), min_size=64, max_size=64)), dtype=torch.float32)
    ints = ints.reshape(2, 32)
    ints[:, 0] = torch.tensor(draw(st.lists(st.sampled_from([64, 100, 127, -64, -127]), min_size=2, max_size=2)))
    ints = ints.clamp(min=-127)  # -128 needs a larger scale; covered by the saturation test
    k = draw(st.integers(-100, 100))
    return ints / 64 * 2.0**k


@given(representable())
def test_s2f6_representable_round_trip(x):
    assert_bitwise_equal(dequantize(quantize_reference(x, "s2f6")), x, "s2f6 round trip")


@given(st.integers(0, 2**31 - 1))
def test_s2f6_no_positive_saturation_and_error_bound(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 128, generator=g) * torch.exp2(torch.randint(-30, 30, (4, 128), generator=g).float())
    qt = quantize_reference(x, "s2f6")
    s = qt.scale.float().repeat_interleave(32, -1)
    assert torch.all(qt.data >= -127) and torch.all(qt.data <= 127)
    b = x.abs().unflatten(-1, (-1, 32)).amax(-1)
    assert torch.all(b.double() * 64 / 127 <= qt.scale.float().double())
    assert torch.all(b.double() * 64 / 127 > qt.scale.float().double() / 2)
    assert torch.all((dequantize(qt) - x).abs() <= s / 128 * (1 + 1e-6))  # half of 1/64


def test_s2f6_rejects_non_finite():
    x = torch.randn(1, 32)
    x[0, 5] = float("nan")
    with pytest.raises(ValueError, match="s2f6 cannot encode NaN"):
        quantize_reference(x, "s2f6")


def _sylvester():
    i = torch.arange(32)
    pop = torch.tensor([bin(v).count("1") for v in range(32)])
    return (1 - 2 * (pop[(i.unsqueeze(1) & i.unsqueeze(0))] % 2)).float()


def test_fwht_is_sylvester_hadamard():
    assert_bitwise_equal(fwht(torch.eye(32)), _sylvester(), "fwht(I) == H32")


def test_rht_matches_matrix_and_inverts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g)
    r = torch.diag(signs(7)) @ _sylvester() / 32**0.5
    y = rht(x, 7)
    torch.testing.assert_close(y, (x.reshape(-1, 32) @ r).reshape(5, 96), rtol=0, atol=1e-5)
    torch.testing.assert_close(inverse_rht(y, 7), x, rtol=0, atol=1e-5)
    torch.testing.assert_close(y.norm(), x.norm(), rtol=1e-6, atol=0)
    assert_bitwise_equal(rht(x, 7), y, "same seed, same transform")
    assert not torch.equal(signs(7), signs(8))
    assert torch.all(signs(7).abs() == 1)


def test_rht_spreads_outliers_before_s2f6():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * 0.01
    x[:, ::32] = 5.0  # one outlier per block of 32
    plain = dequantize(quantize_reference(x, "s2f6"))
    rotated = inverse_rht(dequantize(quantize_reference(rht(x, 3), "s2f6")), 3)
    assert ((rotated - x) ** 2).mean() < ((plain - x) ** 2).mean()


def test_rht_bad_shape():
    with pytest.raises(ValueError, match="not a multiple of 32"):
        rht(torch.randn(2, 48), 0)
