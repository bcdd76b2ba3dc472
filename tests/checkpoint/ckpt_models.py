"""Tiny models for the checkpoint / weight-sync tests (imported by conftest.py and the tests)."""

from __future__ import annotations

import torch

RECIPE = dict(name="nvfp4", high_precision_tail=1 / 3)


def make_config():
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen3_moe", vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_hidden_layers=3, head_dim=16, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def make_trainer_model(seed: int = 0):
    """(converted model, plan): FP32 masters holding BF16-representable values."""
    from transformers import AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config())
    model.config.use_cache = False
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    plan = convert_model(model, RecipeConfig(**RECIPE))
    return model.eval(), plan




def make_sampler_model():
    """A sampler-side model: same architecture and recipe, different (seed 1) weights, not yet serving."""
    return make_trainer_model(seed=1)[0]


def bump_weights(model, factor: float = 1.5) -> None:
    """A new policy: scale every parameter (stays BF16-representable), so every stored tensor changes."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
