"""Pieces of the FSDP2 tests: the tiny nvfp4 config, fixed synthetic batches, the one-process reference run.

The batches are synthetic (fixed seeds, no sampler): what matters here is that
the one-process Trainer and the sharded TrainerGroup see the same data.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rl4bit.config import load_config, trainer_args
from rl4bit.trainer.actor import TrainBatch, Trainer

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
    "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32", "recipe.name=nvfp4",
    "rl.ppo_epochs=2", "rl.kl_coef=0.0", "run.warmup_sft_steps=0", "run.cpu_threads=1", "run.progress=false",
    "trainer.device=cpu", "trainer.lr=1e-3",
    # 9 kept sequences of ~10 tokens: micro-batches of 4, 4, 1 (rank 1 runs a dummy)
    "trainer.tokens_per_microbatch=40",
]


def tiny_cfg(extra=()):
    return load_config(QUICKSTART, TINY + list(extra))


def batches(cfg, steps: int, n: int = 10, seed: int = 0) -> list[TrainBatch]:
    """`steps` fixed batches of `n` arithmetic prompts with random completions (one empty: a masked sample)."""
    from rl4bit.trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        prompts, comps, lps, adv = [], [], [], []
        for i in range(n):
            text = f"{rng.randrange(10, 99)}+{rng.randrange(10, 99)}="
            prompts.append(tok(text, add_special_tokens=False).input_ids)
            comps.append([] if i == 2 else [rng.randrange(3, len(tok)) for _ in range(rng.randrange(2, 5))])
            lps.append([-rng.uniform(0.5, 3.0) for _ in comps[-1]])
            adv.append(rng.uniform(-1.0, 1.0))
        out.append(TrainBatch(prompts, comps, lps, adv))
    return out


def run_single(cfg, data: list[TrainBatch]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The one-process reference: metrics per step and the final model state."""
    t = Trainer(**trainer_args(cfg))
    t.setup_rl()
    metrics = [t.train_step(b) for b in data]
    return metrics, {k: v.detach().clone() for k, v in t.model.state_dict().items()}

