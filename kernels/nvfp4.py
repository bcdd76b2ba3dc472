"""NVFP4 quantize / dequantize in plain PyTorch, following TransformerEngine's scale chain exactly: the reference.

    q = quantize_nvfp4(x, outer="row")       # outer "tensor" | "row" | "group"; rounding="stochastic", seed=...
    x_hat = dequantize_nvfp4(q)

Peers: TE ``common/cast/nvfp4/core_nvfp4.cuh`` (``compute_global_encode_scaling_factor_FP4``,
``compute_decoding_scaling_factor``) and ``custom_recipes/reference_nvfp4.py``. ``quantize_nvfp4`` states the
fp32 op order, the outer-amax modes, 16x16 tiles and the stochastic-rounding shrink (docs/numerics.md, "NVFP4",
gives the same chain); the helpers below are its steps, shared with four_over_six.py.

Leaves out: 4/6 scale selection (four_over_six.py), swizzled scale layouts, and NaN/Inf input (E2M1 cannot
hold them: ValueError via checks.py; inside `checks.host_deferred()` recorded instead, and the output is then
garbage).
"""

from __future__ import annotations

import torch

from rl4bit.kernels import e2m1
from rl4bit.kernels.checks import check_choice, check_input
from rl4bit.kernels.e4m3 import E4M3_MAX, cast_rn
from rl4bit.kernels.qtensor import QTensor
from rl4bit.kernels.stochastic import E2M1_SR_BITS, check_seed, element_bits

BLOCK = 16
FLT_MAX = torch.finfo(torch.float32).max
INV6 = 1.0 / 6.0  # rounded to fp32 wherever used: f32(1/6)
SR_SHRINK = 1.0625  # 17/16, exact in fp32
OUTERS = ("tensor", "row", "group")


def f32(value: float, device) -> torch.Tensor:
    """A 0-d fp32 constant, so every op below is an fp32 op (no double-precision scalars)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def outer_amax(x32: torch.Tensor, outer: str) -> torch.Tensor:
    """Outer amax A, shaped to broadcast against x32 ([1]*ndim, [..., 1] or [E, 1, 1])."""
    check_choice("outer", outer, OUTERS)
    a = x32.abs()
    if outer == "tensor":
        return a.amax().reshape((1,) * x32.dim())
    if outer == "row":
        return a.amax(dim=-1, keepdim=True)
    if x32.dim() != 3:
        raise ValueError(
            f"nvfp4: outer='group' needs a 3D [E, N, K] tensor (one scale per expert), got shape "
            f"{tuple(x32.shape)}; reshape to [E, N, K] or use outer='tensor'/'row'"
        )
    return a.amax(dim=(1, 2), keepdim=True)


def encode_scale(amax: torch.Tensor, bound: float = E4M3_MAX) -> torch.Tensor:
    """S_enc = min(bound*6 / A, FLT_MAX); 1 where A == 0 or S_enc == 0 (TE core_nvfp4.cuh)."""
    dev = amax.device
    s = f32(bound * 6.0, dev) / amax
    s = torch.minimum(s, f32(FLT_MAX, dev))
    return torch.where((amax == 0) | (s == 0), f32(1.0, dev), s)


def block_amax(x32: torch.Tensor, tiles_16x16: bool) -> torch.Tensor:
    """b per block of 16 along the last dim ([..., K/16]); or per 16x16 tile, repeated per row."""
    k = x32.shape[-1]
    a = x32.abs().unflatten(-1, (k // BLOCK, BLOCK))
    if not tiles_16x16:
        return a.amax(dim=-1)
    if x32.dim() < 2 or x32.shape[-2] % BLOCK:
        raise ValueError(
            f"nvfp4: tiles_16x16 needs the second-to-last dimension to be a multiple of 16, got shape "
            f"{tuple(x32.shape)}; pad that dimension to a multiple of 16 or use 1x16 blocks"
        )
    m = x32.shape[-2]
    tiles = a.unflatten(-3, (m // BLOCK, BLOCK)).amax(dim=(-3, -1))  # [..., M/16, K/16]
    return tiles.repeat_interleave(BLOCK, dim=-2)


def block_scale(b: torch.Tensor, s_enc: torch.Tensor, *, shrink: bool = False, factor: float = 1.0) -> torch.Tensor:
    """s_b = e4m3_RN(min(v, 448)), v = b * (S_enc * f32(1/6)) [* factor] [* 17/16 for SR].

    `s_enc` broadcasts against b ([..., 1]). `factor` is 1.5 for the 4/6 "scale to 4" choice.
    """
    dev = b.device
    v = b * (s_enc * f32(INV6, dev))
    if factor != 1.0:
        v = v * f32(factor, dev)
    if shrink:
        v = v * f32(SR_SHRINK, dev)
    return cast_rn(torch.minimum(v, f32(E4M3_MAX, dev)))


def block_encode_multiplier(s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """enc_b = 0 where s_b == 0, else min(1 / (f32(s_b) * S_dec), FLT_MAX)."""
    dev = s_b.device
    s32 = s_b.to(torch.float32)
    enc = torch.minimum(f32(1.0, dev) / (s32 * s_dec), f32(FLT_MAX, dev))
    return torch.where(s32 == 0, f32(0.0, dev), enc)


def encode_codes(xb: torch.Tensor, s_b: torch.Tensor, enc_b: torch.Tensor, r=None) -> torch.Tensor:
    """E2M1 codes [..., K/16, 16] of blocked fp32 xb; r (same shape: 8 random bits an element) selects SR."""
    y = xb * enc_b.unsqueeze(-1)  # where s_b == 0, enc_b = 0 and y = +-0: code 0, or 8 (-0) for a negative x (TE)
    return e2m1.round_nearest(y) if r is None else e2m1.round_stochastic(y, r)


def decode_blocks(codes: torch.Tensor, s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """fp32 x_hat = (q * f32(s_b)) * S_dec for blocked codes [..., K/16, 16]; s_dec broadcasts to [..., 1]."""
    return scale_blocks(e2m1.codes_to_float(codes), s_b, s_dec)


def scale_blocks(q: torch.Tensor, s_b: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """fp32 (q * f32(s_b)) * S_dec for blocked code values q [..., K/16, 16] (`decode_blocks` after the lookup)."""
    return (q * s_b.to(torch.float32).unsqueeze(-1)) * s_dec.unsqueeze(-1)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    rounding: str = "nearest",
    outer: str = "tensor",
    seed=None,
    tiles_16x16: bool = False,
) -> QTensor:
    """NVFP4 QTensor of x (blocks of 16 along the last dim), TE's chain.

    With outer amax A and block amax b (16 values), every op in fp32, in this order:

        S_enc = 2688 / A;  S_enc = min(S_enc, FLT_MAX);  S_enc = 1 if A == 0 or S_enc == 0
        S_dec = 1 / S_enc                                 # stored as QTensor.outer
        v     = b * (S_enc * f32(1/6))                    # ONE rounding chain; not (b/6)*S_enc
        s_b   = e4m3_RN(min(v, 448))                      # no lower clamp: may round to 0
        enc_b = 0 if s_b == 0 else min(1 / (f32(s_b) * S_dec), FLT_MAX)
        q     = e2m1_RN_satfinite(x * enc_b)              # where s_b == 0: +-0 (code 8 for a negative x, as TE)
        x_hat = (q * f32(s_b)) * S_dec                    # dequantize (q * s_b is exact)

    Outer amax A: "tensor" (one), "row" (one per row of the flattened [M, K] view: per token), "group" (one per
    leading index of a 3D [E, N, K] tensor: per expert). ``tiles_16x16``: b is the amax of a 16x16 tile of the
    last two dims (TE ``_quantize_blockwise_reference`` 2D mode; an ablation), stored repeated per row so the
    scale layout stays [..., K/16].

    ``rounding="stochastic"``: rounding s_b to nearest can lower it by up to a factor 16/17, so |x| * enc_b could
    reach 6 * 17/16 and clamp (biased). The shrink enters at exactly one place: v_sr = (b * (S_enc * f32(1/6)))
    * 1.0625, i.e. the block is scaled for a max of 6 * 16/17 (Quartet-II ``schemes/nvidia.py``, fouroversix
    ``stochastic_unbiased``). S_enc, S_dec and the rest of the chain are unchanged, and the E2M1 rounding is the
    SR rule of stochastic.py with 8 random bits an element: element o (its flat index) takes byte o % 4 of word
    (o // 4) % 4 of the Philox call for counter o // 16, one call per 16-element block.
    """
    check_input(x, "nvfp4", BLOCK, allow_nan=False)
    check_choice("rounding", rounding, ("nearest", "stochastic"))
    x32 = x.to(torch.float32)
    k = x32.shape[-1]
    s_enc = encode_scale(outer_amax(x32, outer))
    s_dec = f32(1.0, x32.device) / s_enc
    b = block_amax(x32, tiles_16x16)
    s_b = block_scale(b, s_enc, shrink=rounding == "stochastic")
    enc_b = block_encode_multiplier(s_b, s_dec)
    xb = x32.unflatten(-1, (k // BLOCK, BLOCK))
    r = None
    if rounding == "stochastic":
        r = element_bits(check_seed(seed, "nvfp4"), x32.shape, E2M1_SR_BITS, x32.device)
        r = r.unflatten(-1, (k // BLOCK, BLOCK))
    codes = encode_codes(xb, s_b, enc_b, r).flatten(-2)
    return QTensor(data=e2m1.pack(codes), scale=s_b, outer=s_dec, fmt="nvfp4", shape=x.shape)


def dequantize_nvfp4(q: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x_hat = (e2m1(code) * f32(scale)) * outer, in fp32, then cast to dtype."""
    values = e2m1.unpack_to_float(q.data)
    k = values.shape[-1]
    blocks = scale_blocks(values.unflatten(-1, (k // BLOCK, BLOCK)), q.scale, q.outer)
    return blocks.flatten(-2).reshape(q.shape).to(dtype)
