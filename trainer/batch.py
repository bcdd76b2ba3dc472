"""One RL step's batch as the trainer takes it, and how it is cut into micro-batches.

    batch = TrainBatch(prompt_ids, completion_ids, sampler_logprobs, advantages)   # group after group
    for mb in microbatches(lengths, trainer.tokens_per_microbatch): ...            # consecutive rows, within budget
    values, mask = pad(rows, device)                                               # [rows, longest], zero-padded

Leaves out: packing sequences into one row (each sequence is its own row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl4bit.kernels.transfer import to_device


@dataclass
class TrainBatch:
    """One RL step's rollouts, group after group (samples_per_prompt consecutive rows share a prompt)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logprobs: list[list[float]]
    advantages: list[float]


def microbatches(lengths: list[int], tokens_per_microbatch: int) -> list[list[int]]:
    """Consecutive index groups whose summed lengths stay within the budget (a longer sequence goes alone)."""
    out, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > tokens_per_microbatch:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        out.append(cur)
    return out


def pad(seqs: list[list[float]], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, mask) [len(seqs), longest] fp32, zero-padded; built on the host, one copy to `dev`."""
    t = max(len(s) for s in seqs)
    vals = torch.zeros(len(seqs), t)
    mask = torch.zeros(len(seqs), t)
    for i, s in enumerate(seqs):
        vals[i, : len(s)] = torch.as_tensor(s, dtype=torch.float32)
        mask[i, : len(s)] = 1
    return to_device(vals, dev), to_device(mask, dev)


def stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """Variable-length rows stacked into [len(parts), longest], zero-padded."""
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)
