"""Logits divided by the sampling temperature, one way for every site, so sampler and trainer agree bitwise.

Used by the sampler's draw and logprobs (`rl4bit.sampler.sampling`) and the trainer's recomputed logprobs
(`rl4bit.trainer.logprobs`).
"""

from __future__ import annotations

import torch


def temperature_scaled(logits: torch.Tensor, temperature) -> torch.Tensor:
    """logits in fp32 divided by T (a float, or a tensor that broadcasts), always as a true division by a tensor
    on the logits' device: every site that scales logits (the sampler's draw, `policy_logprobs`, the trainer's
    `TargetLogprobs` and its backward) goes through here, so they agree bitwise at every T.

    Why not `logits / t` with t a Python float: on CUDA, PyTorch divides by a CPU scalar as a multiply by its
    reciprocal (aten's div_true_kernel_cuda, "may lose one bit"), while a device tensor divisor (the sampler's
    per-row temperatures) gets true division: at T = 0.7 the two differ in the last bit of about a tenth of the
    scaled logits, and the trainer's recomputed logprobs then miss the sampler's. On the CPU both are true
    division. vLLM divides by a device tensor too.
    """
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        return logits / temperature.to(device=logits.device, dtype=torch.float32)
    # filled on the device: a copy from the host would wait for the stream (the trainer calls this per chunk)
    return logits / torch.full((), float(temperature), dtype=torch.float32, device=logits.device)
