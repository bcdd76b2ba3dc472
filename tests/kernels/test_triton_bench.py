"""Smoke tests of ``rl4bit.bench.kernels``: the CPU quick run, and every GPU case's call on tiny shapes.

The GPU cases are built with tiny shapes and each called once (under
TRITON_INTERPRET=1 without CUDA), so a broken call in the H200 benchmark shows
up in CI; the numbers themselves only mean something on the GPU.
"""

from __future__ import annotations

from triton_setup import DEVICE

# isort: split

import json

from rl4bit.bench import kernels as bench_kernels


def test_gpu_cases_run_on_tiny_shapes():
    cases = bench_kernels._triton_cases(DEVICE, tokens=(64,), hidden=64, inter=32, experts=2, square=64)
    assert len(cases) == 11 + 4 + 3
    for c in cases:
        written = bench_kernels._nbytes(c.fn())
        assert written > 0 and c.read_bytes > 0, c.name


def test_sweep_configs_give_their_defaults_bits():
    """Every swept tile of a group computes its default's bits (what `run` checks before timing a config); a
    sample of each group, on shapes several tiles wide."""
    cases = bench_kernels._sweep_cases(DEVICE, tokens=128, hidden=512)
    groups: dict[str, list] = {}
    for c in cases:
        groups.setdefault(c.group, []).append(c)
    assert set(groups) == {"nvfp4 4/6 row", "nvfp4 SR tensor", "requantize SR", "requantize RN", "mxfp8 rowwise"}
    for group, members in groups.items():
        assert members[0].name.endswith("[default]"), group
        want = members[0].fn()
        for c in members[1::5]:
            assert bench_kernels._same_bits(c.fn(), want), c.name


def test_same_bits_sees_one_flipped_bit():
    import torch

    a = (torch.zeros(4, dtype=torch.uint8), torch.ones(2, dtype=torch.float32))
    b = (a[0].clone(), a[1].clone())
    assert bench_kernels._same_bits(a, b)
    b[1].view(torch.int32)[1] ^= 1
    assert not bench_kernels._same_bits(a, b)


def test_quick_run_reference_path(tmp_path):
    results = bench_kernels.run(device="cpu", quick=True, out=str(tmp_path))
    assert {r["kernel"] for r in results} >= {"nvfp4 4/6, per-token outer", "requantize nvfp4->mxfp8^T SR"}
    assert all(r["us"] > 0 and r["copy_us"] > 0 for r in results)
    assert json.loads((tmp_path / "bench_kernels.json").read_text()) == results
