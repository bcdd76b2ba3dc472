"""Triton NVFP4 / MXFP8 / S2F6+RHT / requantize kernels vs the plain-PyTorch reference, bitwise.

Every QTensor field (data, scale, outer) must match byte for byte, stochastic
rounding included (same Philox bits). Inputs come from ``triton_setup.nasty``
(grid points, ties, zeros, -0.0, subnormals, outliers). Shapes are small and
odd (rows not a multiple of the tile, K not a power of two, K split over
several programs) so masking is exercised. Without CUDA the kernels run under
TRITON_INTERPRET=1; the ``gpu`` tests at the end use real Qwen3-30B-A3B
expert shapes on CUDA and also go through the public ``rl4bit.kernels`` API.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA, nasty  # first: sets TRITON_INTERPRET on CPU

# isort: split

import pytest
import torch
from bitwise import assert_bitwise_equal

from rl4bit.kernels import inverse_rht, quantize, quantize_reference, requantize, rht
from rl4bit.kernels import triton_dispatch as td
from rl4bit.kernels.mxfp8 import quantize_mxfp8_columnwise
from rl4bit.kernels.requant import requantize_nvfp4_to_mxfp8
from rl4bit.kernels.s2f6 import dequantize_s2f6, quantize_s2f6

DTYPES = [torch.float32, torch.bfloat16]
SEED = 2**40 + 12345


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("outer", ["tensor", "row", "group"])
@pytest.mark.parametrize("mode", ["nearest", "four_over_six", "stochastic"])
def test_nvfp4_bitwise(dtype, outer, mode):
    x = nasty((3, 21, 80), seed=1, dtype=dtype)
    kw = dict(outer=outer, four_over_six=mode == "four_over_six",
              rounding="stochastic" if mode == "stochastic" else "nearest", seed=SEED)
    got = td.quantize(x, "nvfp4", **kw)
    assert got is not None, "the dispatch must have a kernel for this case"
    assert_bitwise_equal(got, quantize_reference(x, "nvfp4", **kw), f"nvfp4 {outer} {mode} {dtype}")


@pytest.mark.parametrize("shape,outer", [((2, 2064), "tensor"), ((2, 16400), "row")])
def test_nvfp4_wide_rows(shape, outer):
    """K split over programs (tensor) and the row amax taken before the kernel (rows wider than one program)."""
    x = nasty(shape, seed=2)
    for fs in (False, True):
        got = td.quantize(x, "nvfp4", outer=outer, four_over_six=fs)
        assert_bitwise_equal(got, quantize_reference(x, "nvfp4", outer=outer, four_over_six=fs), f"nvfp4 {shape}")


def test_nvfp4_tiny_amax_and_subnormal_block_scales():
    """Block scales that round to E4M3 subnormals or to 0 (no lower clamp) and an outer amax near fp32's floor."""
    x = nasty((4, 64), seed=3)
    x[0] = x[0] * 1e-30
    x[1, :16] = 1e-6
    x[1, 16:] = 1.0
    x[2] = 1e-38
    x[3, 5] = 1e30
    for outer in ("tensor", "row"):
        assert_bitwise_equal(td.quantize(x, "nvfp4", outer=outer), quantize_reference(x, "nvfp4", outer=outer),
                             f"nvfp4 tiny {outer}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp8_rows_bitwise(dtype, rounding):
    x = nasty((2, 19, 288), seed=4, dtype=dtype)
    got = td.quantize(x, "mxfp8", rounding=rounding, seed=SEED)
    assert_bitwise_equal(got, quantize_reference(x, "mxfp8", rounding=rounding, seed=SEED), f"mxfp8 {rounding}")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_mxfp8_columnwise_bitwise(rounding):
    x = nasty((2, 96, 80), seed=5, dtype=torch.bfloat16)
    got = td.quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED)
    ref = quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED)
    assert_bitwise_equal(got, ref, f"mxfp8 columnwise {rounding}")


def test_mxfp8_nan_block_matches_reference():
    x = nasty((3, 64), seed=6)
    x[1, 40] = float("nan")
    got = td.quantize(x, "mxfp8")
    assert got.scale.view(torch.uint8)[1, 1] == 0xFF
    assert_bitwise_equal(got, quantize_reference(x, "mxfp8"), "mxfp8 NaN block")


def _blocks_with_amax(bits: list[int], seed: int) -> torch.Tensor:
    """[2, 32 * len(bits)] fp32: block j's amax has fp32 bits bits[j] (at a varying place, either sign), its other
    values a random fraction of it (rounded to fp32: some underflow to subnormals or 0)."""
    gen = torch.Generator().manual_seed(seed)
    amax = torch.tensor(bits, dtype=torch.int32).view(torch.float32).repeat(2)
    x = torch.rand(len(amax), 32, generator=gen) * amax[:, None]
    pos = torch.randint(0, 32, (len(amax),), generator=gen)
    x[torch.arange(len(amax)), pos] = amax
    x = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -x, x)
    return x.reshape(2, -1).to(DEVICE)


def test_mx_scales_at_the_smallest_e8m0_scale():
    """Blocks whose amax / element max lies around 2**-127, E8M0's smallest scale (byte 0): the largest amax
    that takes it and the next fp32 up, for MXFP8 (448: bits 0x04600001) and S2F6 (127/64: bits 0x7F0000)."""
    near = lambda z: [z + d for d in range(-40, 41, 3)] + [z, z + 1, z + 2]  # noqa: E731
    x = _blocks_with_amax(near(0x04600001) + near(0x7F0000) + near(0x400000), seed=11)
    for rounding in ("nearest", "stochastic"):
        got = td.quantize(x, "mxfp8", rounding=rounding, seed=SEED)
        assert_bitwise_equal(got, quantize_reference(x, "mxfp8", rounding=rounding, seed=SEED), f"mxfp8 {rounding}")
        assert_bitwise_equal(td.quantize_mxfp8_columnwise(x.T.contiguous(), rounding=rounding, seed=SEED),
                             quantize_mxfp8_columnwise(x.T.contiguous(), rounding=rounding, seed=SEED),
                             f"mxfp8 columnwise {rounding}")
    assert_bitwise_equal(td.quantize(x, "s2f6"), quantize_reference(x, "s2f6"), "s2f6")
    scales = quantize_reference(x, "mxfp8").scale.view(torch.uint8)
    assert int((scales == 0).sum()) > 0 and int((scales == 1).sum()) > 0  # both sides of the boundary


@pytest.mark.parametrize("fmt,bad", [("nvfp4", float("inf")), ("nvfp4", float("nan")), ("mxfp8", float("-inf")),
                                     ("s2f6", float("nan"))])
def test_non_finite_raises_reference_error(fmt, bad):
    x = nasty((2, 64), seed=7)
    x[1, 33] = bad
    with pytest.raises(ValueError) as ref_err:
        quantize_reference(x, fmt)
    with pytest.raises(ValueError) as got_err:
        td.quantize(x, fmt)
    assert str(got_err.value) == str(ref_err.value)


def test_no_kernel_cases_fall_back():
    x = nasty((32, 48), seed=8)
    assert td.quantize(x, "nvfp4", tiles_16x16=True) is None
    assert td.quantize(x, "mxfp8") is None  # K=48 is not a multiple of 32: the reference raises
    assert td.quantize(x.to(torch.int32), "nvfp4") is None
    assert td.requantize(quantize_reference(x[:20], "nvfp4"), seed=1) is None  # M=20


@pytest.mark.parametrize("dtype", DTYPES)
def test_s2f6_and_rht_bitwise(dtype):
    x = nasty((5, 17, 96), seed=9, dtype=dtype)
    assert_bitwise_equal(td.quantize(x, "s2f6"), quantize_reference(x, "s2f6"), "s2f6")
    q_ref = quantize_s2f6(rht(x, SEED))
    assert_bitwise_equal(td.rht_quantize_s2f6(x, SEED), q_ref, "rht + s2f6 encode")
    assert_bitwise_equal(td.dequantize_s2f6_inverse_rht(q_ref, SEED), inverse_rht(dequantize_s2f6(q_ref), SEED),
                         "s2f6 decode + inverse rht")


@pytest.mark.parametrize("outer", ["tensor", "row", "group"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_requantize_bitwise(outer, rounding):
    x = nasty((2, 96, 80), seed=10, dtype=torch.bfloat16)
    q = quantize_reference(x, "nvfp4", outer=outer, four_over_six=outer == "row")
    got = td.requantize(q, seed=SEED, rounding=rounding)
    assert_bitwise_equal(got, requantize_nvfp4_to_mxfp8(q, seed=SEED, rounding=rounding), f"requantize {outer}")


def test_tile_multiples_take_the_unmasked_path():
    """Shapes that divide the tiles (EVEN: no load/store masks) on CPU too; the shapes above all need masks."""
    x = nasty((32, 256), seed=14, dtype=torch.bfloat16)  # nvfp4 tiles 16 x 256, mxfp8 columnwise 32 x 256
    for kw in (dict(outer="tensor"), dict(outer="row", four_over_six=True),
               dict(outer="tensor", rounding="stochastic", seed=SEED)):
        assert_bitwise_equal(td.quantize(x, "nvfp4", **kw), quantize_reference(x, "nvfp4", **kw), f"nvfp4 {kw}")
    for rounding in ("nearest", "stochastic"):
        assert_bitwise_equal(td.quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED),
                             quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED), f"cols {rounding}")
        q = quantize_reference(x, "nvfp4", outer="row")
        assert_bitwise_equal(td.requantize(q, seed=SEED, rounding=rounding),
                             requantize_nvfp4_to_mxfp8(q, seed=SEED, rounding=rounding), f"requantize {rounding}")
    for bad in (float("nan"), float("-inf")):
        y = x.clone()
        y[5, 77] = bad
        with pytest.raises(ValueError) as ref_err:
            quantize_reference(y, "nvfp4")
        with pytest.raises(ValueError) as got_err:
            td.quantize(y, "nvfp4")
        assert str(got_err.value) == str(ref_err.value)


# ---------------------------------------------------------------- GPU, real shapes
TOKENS, HIDDEN, INTER, EXPERTS = 8192, 2048, 768, 16  # Qwen3-30B-A3B expert dims, 16 of its 128 experts


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (H200)")
@pytest.mark.parametrize("shape", [(TOKENS, HIDDEN), (TOKENS, INTER), (8192, 8192)])
@pytest.mark.parametrize("mode", ["row46", "row", "tensor_sr"])
def test_gpu_nvfp4_activations(shape, mode):
    x = nasty(shape, seed=11, dtype=torch.bfloat16)
    kw = {"row46": dict(outer="row", four_over_six=True), "row": dict(outer="row"),
          "tensor_sr": dict(outer="tensor", rounding="stochastic", seed=SEED)}[mode]
    assert_bitwise_equal(quantize(x, "nvfp4", **kw), quantize_reference(x, "nvfp4", **kw), f"nvfp4 {shape} {mode}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (H200)")
@pytest.mark.parametrize("shape", [(EXPERTS, INTER, HIDDEN), (EXPERTS, HIDDEN, INTER)])
def test_gpu_nvfp4_weights_and_requantize(shape):
    w = nasty(shape, seed=12, dtype=torch.bfloat16)
    q = quantize(w, "nvfp4", outer="group")
    assert_bitwise_equal(q, quantize_reference(w, "nvfp4", outer="group"), f"nvfp4 group {shape}")
    assert_bitwise_equal(requantize(q, seed=SEED), requantize_nvfp4_to_mxfp8(q, seed=SEED), f"requantize {shape}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (H200)")
@pytest.mark.parametrize("shape", [(TOKENS, HIDDEN), (TOKENS, INTER)])
def test_gpu_mxfp8_s2f6_requantize(shape):
    x = nasty(shape, seed=13, dtype=torch.bfloat16)
    for rounding in ("nearest", "stochastic"):
        assert_bitwise_equal(quantize(x, "mxfp8", rounding=rounding, seed=SEED),
                             quantize_reference(x, "mxfp8", rounding=rounding, seed=SEED), f"mxfp8 {rounding}")
        assert_bitwise_equal(td.quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED),
                             quantize_mxfp8_columnwise(x, rounding=rounding, seed=SEED), f"mxfp8 cols {rounding}")
    q = quantize(x, "nvfp4", outer="row", four_over_six=True)
    assert_bitwise_equal(requantize(q, seed=SEED), requantize_nvfp4_to_mxfp8(q, seed=SEED), "requantize row 4/6")
    assert_bitwise_equal(quantize(x, "s2f6"), quantize_reference(x, "s2f6"), "s2f6")
    q_ref = quantize_s2f6(rht(x, SEED))
    assert_bitwise_equal(td.rht_quantize_s2f6(x, SEED), q_ref, "rht + s2f6")
    assert_bitwise_equal(td.dequantize_s2f6_inverse_rht(q_ref, SEED), inverse_rht(dequantize_s2f6(q_ref), SEED),
                         "s2f6 + inverse rht decode")


def test_sweep_quantize_script_checks_every_variant_here():
    """`scripts/sweep_quantize.py --quick` (the warp sweep of the experts' activation quantize at decode sizes)
    runs every launch variant of both served quantizes and finds their outputs equal to the default launch's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-P", str(root / "scripts" / "sweep_quantize.py"), "--device", "cpu",
                          "--quick"], capture_output=True, text=True, timeout=600, cwd=root,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("same") == 4 * 9 and "every variant's outputs equal" in run.stdout, run.stdout
