"""Public API: argument checks with actionable errors, QTensor properties, CPU dispatch, no Triton import."""

import subprocess
import sys

import pytest
import torch
from bitwise import assert_bitwise_equal

import rl4bit.kernels as K


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: K.quantize(torch.randn(4, 30), "nvfp4"),
         r"last dimension 30 .* not a multiple of 16 .* pad it with zeros to 32"),
        (lambda: K.quantize(torch.randn(4, 48), "mxfp8"), r"last dimension 48 .* multiple of 32 .* to 64"),
        (lambda: K.quantize(torch.randn(4, 40), "s2f6"), r"last dimension 40 .*s2f6 block"),
        (lambda: K.quantize(torch.ones(4, 32, dtype=torch.int32), "nvfp4"),
         r"dtype torch.int32 is not a high-precision float"),
        (lambda: K.quantize(torch.ones(4, 32).to(torch.float8_e4m3fn), "mxfp8"), r"dequantize it first"),
        (lambda: K.quantize(torch.randn(4, 32), "nvfp4", rounding="stochastic"), r"needs a seed"),
        (lambda: K.quantize(torch.randn(4, 32), "mxfp8", rounding="stochastic", seed=-1), r"seed must be an int"),
        (lambda: K.quantize(torch.tensor([[float("nan")] * 16]), "nvfp4"),
         r"16 NaN value\(s\), first at index \(0, 0\).*cannot encode NaN"),
        (lambda: K.quantize(torch.randn(4, 32), "fp4"), r"fmt='fp4' is not one of"),
        (lambda: K.quantize(torch.randn(4, 32), "nvfp4", rounding="up"), r"rounding='up'"),
        (lambda: K.quantize(torch.randn(4, 32), "mxfp8", outer="row"), r"outer='row' applies to nvfp4 only"),
        (lambda: K.quantize(torch.randn(4, 32), "nvfp4", outer="expert"), r"outer='expert' is not one of"),
        (lambda: K.quantize(torch.randn(4, 32), "nvfp4", four_over_six=True, rounding="stochastic", seed=1),
         r"four_over_six supports rounding='nearest'"),
        (lambda: K.quantize(torch.randn(4, 32), "s2f6", rounding="stochastic", seed=1), r"s2f6 supports nearest only"),
        (lambda: K.quantize(torch.zeros(0, 32), "nvfp4"), r"shape \(0, 32\)"),
        (lambda: K.requantize(K.quantize(torch.randn(40, 32), "nvfp4"), seed=1), r"M=40 .* pad M \(tokens\) to 64"),
        (lambda: K.requantize(K.quantize(torch.randn(32, 32), "mxfp8"), seed=1), r"expects an NVFP4 QTensor"),
        (lambda: K.requantize(K.quantize(torch.randn(32, 32), "nvfp4")), r"needs a seed"),
    ],
)
def test_bad_input_names_the_problem_and_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_qtensor_layout_and_sizes():
    x = torch.randn(2, 64, 256)
    q4 = K.quantize(x, "nvfp4")
    assert q4.data.dtype == torch.uint8 and q4.data.shape == (2, 64, 128)
    assert q4.scale.dtype == torch.float8_e4m3fn and q4.scale.shape == (2, 64, 16)
    assert q4.outer.dtype == torch.float32 and q4.outer.shape == (1, 1, 1)
    assert q4.bits_per_value == 4.5 and q4.shape == x.shape
    assert q4.nbytes == 2 * 64 * 128 + 2 * 64 * 16 + 4
    assert q4.data.numel() * 8 + q4.scale.numel() * 8 == q4.bits_per_value * x.numel()
    for fmt, dtype in (("mxfp8", torch.float8_e4m3fn), ("s2f6", torch.int8)):
        q8 = K.quantize(x, fmt)
        assert q8.data.dtype == dtype and q8.data.shape == x.shape
        assert q8.scale.dtype == torch.float8_e8m0fnu and q8.scale.shape == (2, 64, 8)
        assert torch.all(q8.outer == 1) and q8.bits_per_value == 8.25
        assert q8.data.numel() * 8 + q8.scale.numel() * 8 == q8.bits_per_value * x.numel()
    assert K.dequantize(q4, torch.bfloat16).dtype == torch.bfloat16


def test_cpu_quantize_is_the_reference(monkeypatch):
    x = torch.randn(8, 64)
    for fmt in ("nvfp4", "mxfp8", "s2f6"):
        assert_bitwise_equal(K.quantize(x, fmt), K.quantize_reference(x, fmt), f"{fmt} dispatch on CPU")
    monkeypatch.setenv("RL4BIT_KERNELS", "reference")
    a = K.quantize(x, "nvfp4", rounding="stochastic", seed=3)
    assert_bitwise_equal(a, K.quantize_reference(x, "nvfp4", rounding="stochastic", seed=3), "env reference")


def test_import_does_not_pull_in_triton():
    code = "import sys, rl4bit.kernels; assert 'triton' not in sys.modules, 'rl4bit.kernels imported triton'"
    subprocess.run([sys.executable, "-P", "-c", code], check=True)
