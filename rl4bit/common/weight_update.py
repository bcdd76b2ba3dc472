"""The dense weight-update message: new policy tensors by state-dict name, for an engine to copy in.

The trainer builds it (`rl4bit.trainer.weight_sync`), every sampler backend applies it
(`update_weights`); the quantized weights travel beside it as QTensors. Leaves out: the bucketed wire form
(`rl4bit.trainer.weight_sync.Bucket`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WeightUpdate:
    """New policy weights for the sampler."""

    version: int
    """Policy version these weights are; becomes Rollout.policy_version of later completions."""
    tensors: dict[str, torch.Tensor]
    """Names as in model.state_dict(), same shapes and dtypes (FP32 also for weights an engine serves pre-cast
    in its compute dtype, `rl4bit.sampler.serving_dtype`); applied with copy_ into the existing storage
    (pointer-stable). A subset of the names is allowed."""
