"""Bitwise comparisons with independent peers (torchao, compressed-tensors), and the exact differences.

Where conventions agree the outputs must be byte-identical. Where they differ
(numerics.md, "NVFP4 scale chain"), the test shows the differing blocks are
exactly the predicted ones:
- torchao NVFP4 clamps the block scale at the smallest E4M3 normal (2**-6) and
  rounds the block scale as (b/6)/per_tensor_scale (twice) instead of TE's
  b*(S_enc*(1/6)). With a power-of-two S_enc every other op agrees exactly.
- torchao MXFP8 RCEIL takes ceil(log2(.)) in fp32 and uses scale 1 for exponent 0,
  which differs from the bit-exact RCEIL only for blocks with amax/448 below 2**-126.
- compressed-tensors replaces a zero block scale by 0.125, rounds (b/6)*global_scale
  twice, and stores the ENCODE global scale 2688/A (we store its reciprocal).
"""

import pytest
import torch
from bitwise import assert_bitwise_equal

from rl4bit.kernels import e2m1, quantize_reference
from rl4bit.kernels.e4m3 import cast_rn

pytest.importorskip("torchao")
from torchao.prototype.mx_formats.constants import F8E4M3_MAX  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor  # noqa: E402

E4M3_MIN_NORMAL = 2.0**-6


def _blocky(shape, block, gen, lo=-12, hi=4):
    """Random data whose blocks span magnitudes 2**lo .. 2**hi (so some block scales fall under floors)."""
    x = torch.randn(shape, generator=gen)
    nb = shape[-1] // block
    exps = torch.randint(lo, hi, (*shape[:-1], nb), generator=gen).float()
    return (x.unflatten(-1, (nb, block)) * torch.exp2(exps).unsqueeze(-1)).flatten(-2)


def _set_amax(x, amax):
    """Force the tensor amax to exactly `amax` (one element), so S_enc = 2688/amax is a power of two."""
    x = x.clone()
    x.view(-1)[0] = -amax
    return x


def _block_mask(codes_a, codes_b, block):
    """Per-block True where any code differs (codes unpacked, [..., K])."""
    return (codes_a != codes_b).unflatten(-1, (-1, block)).any(-1)


@pytest.mark.parametrize("k", [0, 3, -4])
def test_nvfp4_vs_torchao_per_tensor(k):
    gen = torch.Generator().manual_seed(100 + k)
    amax = 2688.0 * 2.0**-k
    x = _set_amax(_blocky((64, 256), 16, gen, lo=-9 - k, hi=6 - k), amax)
    ours = quantize_reference(x, "nvfp4")
    pts = torch.tensor(amax / 2688.0)  # torchao's decode per-tensor scale, exact here
    ta = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
    assert ours.outer.item() == pts.item()

    b = x.abs().unflatten(-1, (-1, 16)).amax(-1)
    under_floor = ours.scale.float() < E4M3_MIN_NORMAL
    double_round = cast_rn((b / 6.0) / pts).view(torch.uint8) != ours.scale.view(torch.uint8)
    predicted = under_floor | double_round
    differs = (ours.scale.view(torch.uint8) != ta.scale.view(torch.uint8)) | _block_mask(
        e2m1.unpack(ours.data), e2m1.unpack(ta.qdata), 16
    )
    assert under_floor.sum() > 20 and (~predicted).sum() > 500, "test data should exercise both cases"
    assert torch.equal(differs, predicted), (
        f"{int((differs != predicted).sum())} blocks differ from torchao other than by the documented "
        "floor/double rounding"
    )
    keep = ~predicted
    assert_bitwise_equal(ours.scale[keep], ta.scale[keep], "nvfp4 block scale vs torchao")
    codes_keep = keep.repeat_interleave(16, dim=-1)
    assert_bitwise_equal(e2m1.unpack(ours.data)[codes_keep], e2m1.unpack(ta.qdata)[codes_keep],
                         "nvfp4 codes vs torchao")
    from rl4bit.kernels import dequantize

    assert_bitwise_equal(dequantize(ours)[codes_keep], ta.dequantize(torch.float32)[codes_keep],
                         "nvfp4 dequantize vs torchao")


def test_nvfp4_group_vs_torchao_per_expert():
    gen = torch.Generator().manual_seed(7)
    e_amax = [2688.0, 2688.0 * 2.0**-5, 2688.0 * 2.0**3]
    x = torch.stack([_set_amax(_blocky((32, 64), 16, gen, lo=-8 + i, hi=2 + i), a) for i, a in enumerate(e_amax)])
    ours = quantize_reference(x, "nvfp4", outer="group")
    pts = torch.tensor(e_amax).reshape(3, 1, 1) / 2688.0
    ta = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
    assert_bitwise_equal(ours.outer, pts, "per-expert outer vs torchao per_tensor_scale")
    b = x.abs().unflatten(-1, (-1, 16)).amax(-1)
    predicted = (ours.scale.float() < E4M3_MIN_NORMAL) | (
        cast_rn((b / 6.0) / pts).view(torch.uint8) != ours.scale.view(torch.uint8)
    )
    differs = (ours.scale.view(torch.uint8) != ta.scale.view(torch.uint8)) | _block_mask(
        e2m1.unpack(ours.data), e2m1.unpack(ta.qdata), 16
    )
    assert torch.equal(differs, predicted)
    assert (~predicted).sum() > 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_rceil_vs_torchao(dtype):
    gen = torch.Generator().manual_seed(3)
    x = _blocky((32, 512), 32, gen, lo=-30, hi=30)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 32:64] = 448.0 * 2.0**5  # amax/448 exactly a power of two
    x = x.to(dtype)
    ours = quantize_reference(x, "mxfp8")
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert_bitwise_equal(ours.scale, scale, "mxfp8 RCEIL scale vs torchao")
    assert_bitwise_equal(ours.data, data, "mxfp8 RCEIL data vs torchao")


def test_mxfp8_floor_vs_torchao():
    gen = torch.Generator().manual_seed(4)
    x = _blocky((16, 256), 32, gen, lo=-20, hi=20)
    from rl4bit.kernels.mxfp8 import quantize_mxfp8

    ours = quantize_mxfp8(x, scale_mode="floor")
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    assert_bitwise_equal(ours.scale, scale, "mxfp8 FLOOR scale vs torchao")
    assert_bitwise_equal(ours.data, data, "mxfp8 FLOOR data vs torchao")


def test_mxfp8_rceil_differs_from_torchao_only_below_fp32_normal():
    """Where amax/448 <= 2**-127 both pick scale byte 0 (2**-127, E8M0's smallest), but torchao's eager RCEIL
    encodes that block's values as if the scale were 1 (flushing them to 0); rl4bit divides by 2**-127 exactly."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=gen)
    tiny = torch.zeros(8, 8, dtype=torch.bool)
    tiny[::2, ::3] = True  # these blocks get amax/448 ~ 2**-129
    x = (x.unflatten(-1, (8, 32)) * torch.where(tiny, 2.0**-121, 1.0).unsqueeze(-1)).flatten(-2)
    ours = quantize_reference(x, "mxfp8")
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert_bitwise_equal(ours.scale, scale, "mxfp8 RCEIL scale vs torchao")
    assert int(ours.scale.view(torch.uint8)[tiny].max()) == 0
    keep = (~tiny).repeat_interleave(32, dim=-1)
    assert_bitwise_equal(ours.data[keep], data[keep], "mxfp8 data on normal blocks")
    exact = (x * 2.0**127).clamp(-448, 448).to(torch.float8_e4m3fn)  # x / 2**-127, exact in fp32, one rounding
    assert_bitwise_equal(ours.data[~keep], exact[~keep], "mxfp8 data of the 2**-127 blocks")
    assert bool((data[~keep].float() == 0).all()) and bool((ours.data[~keep].float() != 0).any())
    assert F8E4M3_MAX == 448.0


# ---- compressed-tensors ----------------------------------------------------------------------

ct_helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")


def test_pack_unpack_vs_compressed_tensors():
    gen = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 16, (24, 64), generator=gen, dtype=torch.uint8)
    values = e2m1.codes_to_float(codes)  # code 8 -> -0.0, which compressed-tensors packs as 8 too
    ours = e2m1.pack(codes)
    assert_bitwise_equal(ours, ct_helpers.pack_fp4_to_uint8(values), "pack vs compressed-tensors")
    theirs = ct_helpers.unpack_fp4_from_uint8(ours, 24, 64, dtype=torch.float32)
    assert_bitwise_equal(values, theirs, "unpack vs compressed-tensors")
    assert_bitwise_equal(e2m1.unpack_to_float(ours), theirs, "packed decode vs compressed-tensors")
    assert_bitwise_equal(e2m1.unpack(ours), codes, "pack/unpack round trip")


def test_nvfp4_scale_convention_vs_compressed_tensors():
    from compressed_tensors.quantization.quant_scheme import NVFP4
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = NVFP4["weights"]
    gen = torch.Generator().manual_seed(12)
    x = _blocky((32, 256), 16, gen, lo=-16, hi=4)
    x[3, 16:32] = 0.0
    ours = quantize_reference(x, "nvfp4")
    blocks = x.unflatten(-1, (-1, 16))
    gscale = generate_gparam(x.min(), x.max())  # ENCODE scale 448*6/A
    scales, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gscale)
    # Same S_enc, stored the other way round: ours is the decode multiplier 1/S_enc.
    s_enc = 2688.0 / x.abs().max()
    assert gscale.item() == s_enc.item()
    assert ours.outer.item() == (1.0 / s_enc).item()
    b = blocks.abs().amax(-1)
    zero = ours.scale.float() == 0
    double_round = cast_rn((b / 6.0) * gscale).view(torch.uint8) != ours.scale.view(torch.uint8)
    differs = ours.scale.view(torch.uint8) != scales.to(torch.float8_e4m3fn).view(torch.uint8)
    assert zero.sum() > 5 and (~(zero | double_round)).sum() > 200
    assert torch.equal(differs, zero | double_round)
    assert torch.all(scales[zero].float() == 0.125)
