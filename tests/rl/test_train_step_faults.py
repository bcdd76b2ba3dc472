"""A train step that meets NaN/Inf in its first epoch, and one where every rollout failed: the step is skipped
(counted in `train/skipped_steps`), the job goes on, the metrics stay numbers."""

from __future__ import annotations

import math

from rl4bit.config import load_config, trainer_args
from rl4bit.trainer.actor import TrainBatch, Trainer

from .conftest import QUICKSTART
from .test_trainer_checkpoint import _rollouts


def _three_epoch_trainer(small):
    """A bf16 Trainer of 3 PPO epochs over micro-batches of 12 tokens, its rollouts, and their TrainBatch."""
    cfg = load_config(QUICKSTART, small + ["recipe.name=bf16", "rl.ppo_epochs=3", "trainer.tokens_per_microbatch=12",
                                           "trainer.max_nonfinite_steps=5"])
    trainer = Trainer(**trainer_args(cfg))
    trainer.setup_rl()
    outs = _rollouts(cfg, trainer)
    batch = TrainBatch([o.prompt_ids for o in outs], [o.completion_ids for o in outs], [o.logprobs for o in outs],
                       [1.0, -1.0, 0.5] * 3)
    return trainer, outs, batch


def test_nonfinite_first_epoch_skips_the_step_and_empty_batches_train_nothing(small):
    trainer, outs, batch = _three_epoch_trainer(small)
    loss, calls = trainer._microbatch_loss, []

    def first_fails(*a, **k):  # what deferred_checks raises when a quantized GEMM met NaN/Inf
        calls.append(1)
        if len(calls) == 1:
            raise FloatingPointError("non-finite input to a quantized GEMM")
        return loss(*a, **k)

    trainer._microbatch_loss = first_fails
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    steps = trainer.opt_steps
    m = trainer.train_step(batch)
    assert m["train/skipped_steps"] == 1.0 and math.isnan(m["loss"]) and trainer.opt_steps == steps + 1
    assert all(v.equal(before[k]) for k, v in trainer.model.state_dict().items())  # no optimizer step taken
    trainer._microbatch_loss = loss
    assert trainer.train_step(batch)["train/skipped_steps"] == 0.0  # the next step trains

    empty = TrainBatch(batch.prompt_ids, [[] for _ in batch.prompt_ids], batch.sampler_logprobs, [0.0] * len(outs))
    m = trainer.train_step(empty)
    assert m["ratio/mean"] == m["ratio/min"] == m["ratio/max"] == 1.0 and m["loss"] == 0.0


def test_nan_old_logprobs_from_a_failed_last_micro_batch_stop_the_later_epochs(small):
    """The LAST micro-batch of epoch 0 fails after recording NaN old logprobs (on CUDA the deferred check raises
    after the forward recorded them): they are dropped, so the step stops after epoch 0, one skip, instead of
    running every later epoch against NaN and counting each as another skipped step."""
    import torch

    trainer, outs, batch = _three_epoch_trainer(small)
    loss, seen = trainer._microbatch_loss, []

    def last_of_epoch0_fails(batch, mb, epoch, old, *a, **k):
        out = loss(batch, mb, epoch, old, *a, **k)
        seen.append(epoch)
        if epoch == 0 and max(mb) == len(outs) - 1:  # the last micro-batch holds the last sequence
            for i in mb:
                old[i] = torch.full_like(old[i], float("nan"))
            raise FloatingPointError("non-finite input to a quantized GEMM")
        return out

    trainer._microbatch_loss = last_of_epoch0_fails
    steps = trainer.opt_steps
    m = trainer.train_step(batch)
    assert set(seen) == {0} and m["train/skipped_steps"] == 1.0 and trainer.opt_steps == steps + 1, (seen, m)
