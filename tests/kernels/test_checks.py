"""checks.py's value and layout checks on QTensors: NaN/Inf in every float format, each part's layout."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from rl4bit.kernels import quantize
from rl4bit.kernels.checks import all_finite, qtensor_problems

NAN_BITS = {  # every NaN/Inf byte pattern of each 1-byte float, from the formats' definitions
    torch.float8_e4m3fn: [0x7F, 0xFF],
    torch.float8_e5m2: [0x7C, 0xFC, 0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF],
    torch.float8_e8m0fnu: [0xFF],
}


@pytest.mark.parametrize("dtype", list(NAN_BITS))
def test_all_finite_sees_every_nan_pattern_of_the_1_byte_floats(dtype):
    """Each byte's verdict against its decoded value (torch's isfinite is missing for E4M3 and calls the
    E8M0 NaN finite, so this is the check that sees a NaN block scale)."""
    for b in range(256):
        t = torch.tensor([0, b, 0], dtype=torch.uint8).view(dtype)
        assert all_finite(t) == (b not in NAN_BITS[dtype]) == bool(torch.isfinite(t.float()).all()), hex(b)


def test_all_finite_on_wide_floats_and_integers():
    assert all_finite(torch.ones(3)) and all_finite(torch.full((2,), 255, dtype=torch.uint8))
    assert not all_finite(torch.tensor([1.0, float("nan")], dtype=torch.bfloat16))
    assert not all_finite(torch.tensor([float("-inf")]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_qtensor_problems_name_each_broken_part(fmt):
    w = torch.randn(4, 8, 64)
    q = quantize(w, fmt, **({"outer": "row"} if fmt == "nvfp4" else {}))
    assert qtensor_problems("w", q, fmt, (4, 8, 64)) == []
    other = "mxfp8" if fmt == "nvfp4" else "nvfp4"
    cases = {
        "format": (q, other, "format"),
        "shape": (q, fmt, "!= the weight's"),
        "data": (dataclasses.replace(q, data=q.data[..., 1:]), fmt, "w.data"),
        "scale dtype": (dataclasses.replace(q, scale=q.scale.float()), fmt, "w.scale"),
        "outer": (dataclasses.replace(q, outer=torch.ones(3, 1, 1)), fmt, "w.outer"),
        "outer nan": (dataclasses.replace(q, outer=torch.full_like(q.outer, float("nan"))), fmt, "w.outer: holds NaN"),
        "not a qtensor": (w, fmt, "Tensor is not a QTensor"),
    }
    for case, (bad, want_fmt, needle) in cases.items():
        shape = (4, 8, 65) if case == "shape" else (4, 8, 64)
        problems = qtensor_problems("w", bad, want_fmt, shape)
        assert problems and needle in problems[0], (case, problems)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "s2f6"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_host_deferred_records_nan_and_inf_and_raises_once_at_the_exit(fmt, value):
    """Inside `host_deferred()` a quantize on the CPU with NaN/Inf input returns (garbage) instead of raising, and
    only the outermost block's exit raises one NonFiniteInputError (mxfp8 encodes NaN: nothing is recorded); a
    layout problem still raises at once; a block left by an exception clears the record, so the next block does
    not inherit it; outside any block the check raises at once, with the details."""
    from rl4bit.kernels.checks import NonFiniteInputError, defer_host, host_deferred

    bad = torch.ones(2, 64)
    bad[1, 3] = value
    recorded = not (fmt == "mxfp8" and value != value)
    inner_left = False
    with pytest.raises(NonFiniteInputError, match="inside a deferred block got NaN/Inf") if recorded else \
            contextlib.nullcontext():
        with host_deferred():
            with host_deferred():  # nested: only the outermost exit raises
                quantize(bad, fmt)
            inner_left = True
            quantize(torch.ones(2, 64), fmt)
    assert inner_left
    with pytest.raises(ValueError, match="not a multiple"), host_deferred():
        quantize(torch.ones(2, 63), fmt)
    with pytest.raises(KeyError), host_deferred():
        quantize(bad, fmt)
        raise KeyError("the block failed anyway")
    defer_host(True)  # outside a block: not recorded for the next one
    with host_deferred():  # the record was cleared: a finite block leaves quietly
        quantize(torch.ones(2, 64), fmt)
    if recorded:
        with pytest.raises(NonFiniteInputError, match="Inf value|NaN value"):
            quantize(bad, fmt)


def test_deferred_checks_with_host_clears_the_host_record_when_the_device_check_raises(monkeypatch):
    """`deferred_checks(host=True)`: the device flags' check runs at the inner exit; when it raises, the host
    record from the same block is cleared, not left to fail the next block."""
    pytest.importorskip("triton")
    from rl4bit.kernels import deferred_checks, triton_dispatch
    from rl4bit.kernels.checks import NonFiniteInputError

    def device_flag_set():
        raise NonFiniteInputError("a device flag was set (test)")
    monkeypatch.setattr(triton_dispatch, "check_deferred", device_flag_set)
    bad = torch.ones(2, 64)
    bad[0, 0] = float("inf")
    with pytest.raises(NonFiniteInputError, match="a device flag was set"), deferred_checks(host=True):
        quantize(bad, "nvfp4")
    monkeypatch.setattr(triton_dispatch, "check_deferred", lambda: None)
    with deferred_checks(host=True):
        quantize(torch.ones(2, 64), "nvfp4")
