"""The sampler's noise kernel (sampler/noise_triton.py) against its PyTorch reference, bitwise (interpreter on CPU)."""

from __future__ import annotations

from triton_setup import DEVICE  # first: sets TRITON_INTERPRET on CPU

# isort: split

import torch

from rl4bit.sampler.noise import uniform_reference
from rl4bit.sampler.noise_triton import uniform_triton


def test_uniform_kernel_matches_reference_bitwise():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 2**62, (6,), generator=g, dtype=torch.int64)
    keys[0], keys[1] = 2**63 - 1, 0  # all-ones and all-zero key words
    steps = torch.randint(0, 5000, (6,), generator=g, dtype=torch.int64)
    v = 2500  # not a multiple of the kernel's block
    ref = uniform_reference(keys, steps, v)
    got = uniform_triton(keys.to(DEVICE), steps.to(DEVICE), v).cpu()
    diff = int((got.view(torch.int32) != ref.view(torch.int32)).sum())
    assert diff == 0, f"{diff} of {ref.numel()} uniforms differ from the reference"
