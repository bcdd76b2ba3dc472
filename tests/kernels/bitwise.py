"""Bitwise comparison helper shared by the kernel tests (reference and Triton).

`assert_bitwise_equal(a, b, what)` compares two tensors (or QTensors) byte for
byte, like torchao's mx_formats tests (rtol=0, atol=0), and on failure reports
how many bytes differ, where the first differences are, and their values: not
just "not equal". NaNs compare equal when their bit patterns are equal.

Import it in tests as ``from bitwise import assert_bitwise_equal``:
``tests/kernels/conftest.py`` puts this folder on ``sys.path`` (the suite runs
with ``--import-mode=importlib``, which adds nothing to ``sys.path`` itself).
"""

from __future__ import annotations

import torch


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 tensor (contiguous, on CPU)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def count_differing_bytes(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of bytes that differ between two tensors of equal dtype and shape."""
    return int((_as_bytes(a) != _as_bytes(b)).sum())


def _assert_tensor(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ab, bb = _as_bytes(a), _as_bytes(b)
    diff = ab != bb
    n = int(diff.sum())
    if n == 0:
        return
    per_elem = a.element_size()
    elem_idx = torch.nonzero(diff).reshape(-1) // per_elem
    elem_idx = torch.unique(elem_idx)
    first = elem_idx[:8].tolist()
    af = a.detach().contiguous().cpu().reshape(-1)
    bf = b.detach().contiguous().cpu().reshape(-1)
    shown = []
    for i in first:
        va, vb = af[i], bf[i]
        if va.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float8_e5m2):
            va, vb = va.view(torch.uint8), vb.view(torch.uint8)
        idx = tuple(torch.unravel_index(torch.tensor(i), a.shape)) if a.dim() else ()
        idx = tuple(int(j) for j in idx)
        shown.append(f"{idx}: {va.item()!r} vs {vb.item()!r}")
    raise AssertionError(
        f"{what}: {n} of {ab.numel()} bytes differ ({elem_idx.numel()} of {af.numel()} elements); "
        f"first at " + "; ".join(shown)
    )


def assert_bitwise_equal(a, b, what: str = "tensors") -> None:
    """Assert two tensors, or two QTensors (all fields), are bitwise identical.

    The failure message names `what`, the number of differing bytes, and the
    first differing elements (index: value vs value; float8 shown as raw bytes).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        _assert_tensor(a, b, what)
        return
    # QTensor-like: compare every field bitwise, and the metadata exactly.
    assert a.fmt == b.fmt, f"{what}: fmt {a.fmt!r} != {b.fmt!r}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    for field in ("data", "scale", "outer"):
        _assert_tensor(getattr(a, field), getattr(b, field), f"{what}.{field}")
