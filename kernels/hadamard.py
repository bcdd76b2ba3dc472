"""32-dim random Hadamard transform (RHT) over the last dim, and its inverse, in plain PyTorch: the reference.

    y = rht(x, seed);   x_back = inverse_rht(y, seed)        # fp32, groups of 32 along the last dim

R = D * H32 / sqrt(32), D = diag(signs(seed)), H32 the Sylvester Hadamard matrix (H[i, j] = (-1)**popcount(i & j));
forward y = x @ R, inverse x = y @ R^T. The MoE combine runs it before S2F6 (docs/numerics.md, "Random Hadamard
transform"). The fp32 op order is fixed so a Triton kernel matches it bit for bit (a matmul's reduction order
is not): ``rht``, ``inverse_rht`` and ``fwht`` state it. Both return float32 (the transform of bf16 data is not
bf16-representable).

Leaves out: other sizes, randomized row permutations, and fusing with S2F6 (the Triton kernel fuses; the
reference composes ``quantize(rht(x, seed), "s2f6")``).
"""

from __future__ import annotations

import math

import torch

from rl4bit.kernels.checks import FLOAT_DTYPES
from rl4bit.kernels.philox import random_bits

DIM = 32
INV_SQRT_DIM = 1.0 / math.sqrt(DIM)  # rounded once to fp32 where used


def signs(seed: int, device=None) -> torch.Tensor:
    """fp32 [32] of +-1: 1 - 2 * (random_bits(seed, i) & 1) for i = 0..31 (philox.py): one R per seed everywhere."""
    bits = random_bits(int(seed), torch.arange(DIM, dtype=torch.int64, device=device))
    return (1 - 2 * (bits & 1)).to(torch.float32)


def fwht(t: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform over groups of 32 of the last dim (t @ H32), fixed butterfly order.

    for h in 1, 2, 4, 8, 16: within each group of 2h, (a, b) = (t[i], t[i+h]) -> (a + b, a - b)
    (the butterfly of the natural-order Sylvester H)."""
    shape = t.shape
    t = t.reshape(-1, DIM)
    h = 1
    while h < DIM:
        v = t.reshape(-1, DIM // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        t = torch.stack((a + b, a - b), dim=2).reshape(-1, DIM)
        h *= 2
    return t.reshape(shape)


def _check(x, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what}: expected a float tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] % DIM:
        raise ValueError(
            f"{what}: last dimension of shape {tuple(x.shape)} is not a multiple of {DIM} (Hadamard size); "
            f"pad it with zeros to a multiple of {DIM}"
        )


def rht(x: torch.Tensor, seed: int) -> torch.Tensor:
    """y = x @ (D H32 / sqrt(32)) over groups of 32 of the last dim; fp32 result.

    In fp32: t = x * sign;  t = fwht(t);  y = t * f32(1/sqrt(32))."""
    _check(x, "rht")
    x32 = x.to(torch.float32)
    d = signs(seed, x32.device)
    t = (x32.unflatten(-1, (-1, DIM)) * d).flatten(-2)
    return fwht(t) * torch.tensor(INV_SQRT_DIM, dtype=torch.float32, device=x32.device)


def inverse_rht(y: torch.Tensor, seed: int) -> torch.Tensor:
    """x = y @ (D H32 / sqrt(32))^T over groups of 32 of the last dim; fp32 result.

    In fp32: t = fwht(y);  t = t * sign;  x = t * f32(1/sqrt(32))."""
    _check(y, "inverse_rht")
    y32 = y.to(torch.float32)
    d = signs(seed, y32.device)
    t = (fwht(y32).unflatten(-1, (-1, DIM)) * d).flatten(-2)
    return t * torch.tensor(INV_SQRT_DIM, dtype=torch.float32, device=y32.device)
