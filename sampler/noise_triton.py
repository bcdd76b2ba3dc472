"""Triton kernel of `rl4bit.sampler.noise.uniform_reference`: per-row keyed Philox bits -> fp32 uniforms.

Bitwise equal to the reference (integer Philox, then an exact 23-bit int + 0.5 ->
fp32 conversion and a multiply by a power of two, `noise.bits_to_uniform`); tests/sampler/test_noise.py checks
it under TRITON_INTERPRET=1 and on the GPU.

Leaves out: the logs (torch does them on the result, on every device alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.philox_triton import philox_bits


@triton.jit
def _uniform_kernel(lo_ptr, hi_ptr, step_ptr, u_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = v < V
    seed_lo = tl.load(lo_ptr + row).to(tl.uint32)
    seed_hi = tl.load(hi_ptr + row).to(tl.uint32)
    offsets = tl.load(step_ptr + row) * V + v.to(tl.int64)
    bits = philox_bits(seed_lo, seed_hi, offsets)
    u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: noise.bits_to_uniform
    tl.store(u_ptr + row.to(tl.int64) * V + v, u, mask=mask)


def uniform_triton(keys: torch.Tensor, steps: torch.Tensor, vocab: int, block: int = 1024) -> torch.Tensor:
    """fp32 [B, vocab] (see the reference); keys, steps int64 [B] on the kernel's device."""
    keys = keys.to(torch.int64)
    out = torch.empty((keys.numel(), vocab), dtype=torch.float32, device=keys.device)
    if keys.numel() and vocab:
        lo, hi = (keys & 0xFFFFFFFF).contiguous(), (keys >> 32).contiguous()
        _uniform_kernel[(keys.numel(), triton.cdiv(vocab, block))](lo, hi, steps.to(torch.int64).contiguous(), out,
                                                                   vocab, BLOCK=block)
    return out
