"""Shared setup for the Triton kernel tests: interpreter on CPU, device choice, adversarial inputs.

Imported by ``test_triton_*.py`` before anything imports Triton: without CUDA
it sets ``TRITON_INTERPRET=1`` so the kernels run on CPU (small shapes); with
CUDA the same tests run the compiled kernels on the GPU. ``nasty`` builds
inputs that hit the rounding corner cases on purpose (grid points, ties,
zeros, -0.0, fp32 subnormals, outliers, wide dynamic range).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
_TRITON_WAS_LOADED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'rl4bit[triton]')")


def _interpret_triton_language() -> None:
    """Re-wrap triton.language's own @jit helpers (tl.max, tl.sum, ...) for the interpreter.

    Needed when triton was imported before TRITON_INTERPRET was set (torchao
    imports it in test_peers.py): those helpers were built as compiled
    JITFunctions, which the interpreter cannot call. Our own kernels are
    decorated after the variable is set, so they are interpreted anyway. (A
    conftest that sets TRITON_INTERPRET before collection makes this a no-op.)
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, object] = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith("triton.language") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(mod, attr, wrapped[id(value)])


if not HAS_CUDA and _TRITON_WAS_LOADED:
    _interpret_triton_language()

DEVICE = "cuda" if HAS_CUDA else "cpu"

# Magnitudes on and between the E2M1 grid, with its ties (0.25, 0.75, 1.25, ...).
_E2M1_POINTS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0)


def nasty(shape, seed: int, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    """Random tensor mixing normal values over ~2**+-20 with exact grid points, ties and special values."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    rows = shape[:-1] + (1,)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 21, rows, generator=g).float())
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    # E2M1 grid points and ties, scaled by a power of two per row
    grid = torch.tensor(_E2M1_POINTS)[torch.randint(0, len(_E2M1_POINTS), shape, generator=g)]
    grid = grid * torch.exp2(torch.randint(-8, 9, rows, generator=g).float())
    # values with 4-6 significant bits: E4M3 ties and near-ties; S2F6 half steps
    few_bits = torch.randint(16, 64, shape, generator=g).float() / 32 * torch.exp2(
        torch.randint(-12, 9, shape, generator=g).float())
    pick = torch.randint(0, 10, shape, generator=g)
    x = torch.where(pick == 0, grid * sign, x)
    x = torch.where(pick == 1, few_bits * sign, x)
    x = torch.where(pick == 2, torch.zeros_like(x), x)
    x = torch.where(pick == 3, -torch.zeros_like(x), x)
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randint(0, n, (max(1, n // 200),), generator=g)
    flat[idx] = 1e-40 * sign.view(-1)[idx]  # fp32 subnormals
    idx = torch.randint(0, n, (max(1, n // 500),), generator=g)
    flat[idx] = flat[idx] * 1e6  # outliers
    if shape[-1] >= 32 and n >= 64:
        x.view(-1, shape[-1])[0, :32] = 0.0  # an all-zero block
    return x.to(dtype).to(device)
