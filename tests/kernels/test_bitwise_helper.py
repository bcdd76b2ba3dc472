"""The bitwise helper reports how many bytes differ (and passes on equal tensors)."""

import pytest
import torch
from bitwise import assert_bitwise_equal, count_differing_bytes


def test_equal_tensors_pass():
    a = torch.arange(10, dtype=torch.float32)
    assert_bitwise_equal(a, a.clone(), "arange")


def test_difference_is_counted():
    a = torch.zeros(8, dtype=torch.float32)
    b = a.clone()
    b[3] = 1.0  # 0x3F800000: two of its four bytes are non-zero
    assert count_differing_bytes(a, b) == 2
    with pytest.raises(AssertionError, match=r"2 of 32 bytes differ \(1 of 8 elements\)"):
        assert_bitwise_equal(a, b, "x")


def test_nan_payloads_compare_by_bits():
    a = torch.full((4,), float("nan"))
    assert_bitwise_equal(a, a.clone(), "nan")
    b = torch.zeros(4, dtype=torch.uint8).view(torch.float8_e4m3fn)
    c = b.clone()
    c.view(torch.uint8)[1] = 0x7F
    with pytest.raises(AssertionError, match="1 of 4 bytes differ"):
        assert_bitwise_equal(b, c, "fp8")
