"""The sampler's random draw: Gumbel noise for a batch of rows from per-sequence counter-based keys, one kernel.

    g = gumbel_noise(keys, steps, vocab, device)   # [B, V] fp32; argmax(logp + g) is a draw from softmax(logp)

Row i's noise depends only on (keys[i], steps[i]): uint32 bits from Philox4x32-10
(`rl4bit.kernels.philox`, first stream) keyed by the sequence's 64-bit key at
offsets steps[i] * V + v, so token t of a sequence always sees the same noise,
whatever else is in the batch and whatever order requests arrive in; a fixed
request seed reproduces its samples. u = ((bits >> 9) + 0.5) * 2**-23: 23
random bits plus a half fit fp32's 24-bit significand, so every u is exact and
lies strictly inside (0, 1) (from 2**-24 to 1 - 2**-24; with 24 bits, + 0.5
would round the top value to 1.0 and give infinite noise). g = -log(-log(u))
is standard Gumbel (the exponential race argmax(p / E), E = -log u, in log form).

Why not one torch.Generator per sequence: a generator draws for one row per
kernel, so a decode step at batch 256 would cost hundreds of launches in sampling
alone (`scripts/profile_decode.py` shows them); here it is one kernel for
the bits (Triton on CUDA, the PyTorch reference on CPU: the same bits, tested
under TRITON_INTERPRET) and two elementwise torch ops for the logs.

Leaves out: other distributions; the processed-logprob truncation (sampling.py).
"""

from __future__ import annotations

import torch

from rl4bit.kernels.philox import philox4x32_keyed
from rl4bit.kernels.transfer import to_device

_MASK32 = 0xFFFFFFFF


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """fp32 u strictly inside (0, 1) from uint32 bits (held in int64): ((bits >> 9) + 0.5) * 2**-23, exact."""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def uniform_reference(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, V] u in (0, 1) from int64 keys [B] (non-negative) and steps [B], in plain PyTorch."""
    offsets = steps.to(torch.int64)[:, None] * vocab + torch.arange(vocab, device=steps.device)
    k = keys.to(torch.int64)[:, None]
    return bits_to_uniform(philox4x32_keyed(k & _MASK32, (k >> 32) & _MASK32, offsets)[0])


def uniform(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """`uniform_reference`; on CUDA by the Triton kernel (`noise_triton.uniform_triton`, same bits)."""
    if keys.is_cuda:
        from rl4bit.sampler.noise_triton import uniform_triton

        return uniform_triton(keys, steps, vocab)
    return uniform_reference(keys, steps, vocab)


def gumbel_noise(keys: list[int], steps: list[int], vocab: int, device) -> torch.Tensor:
    """fp32 [len(keys), vocab] standard Gumbel noise; keys in [0, 2**63), steps >= 0 (the token index)."""
    if any(not 0 <= int(k) < 2**63 for k in keys) or any(int(t) < 0 for t in steps):
        raise ValueError("gumbel_noise: keys must lie in [0, 2**63) and steps be >= 0")
    k = to_device(torch.tensor([int(x) for x in keys], dtype=torch.int64), device)
    t = to_device(torch.tensor([int(x) for x in steps], dtype=torch.int64), device)
    return uniform(k, t, vocab).log_().neg_().log_().neg_()
