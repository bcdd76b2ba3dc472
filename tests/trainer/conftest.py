"""Fixtures for the trainer tests: tiny Hugging Face model configs (built from a config, random init, CPU).

Sizes keep every dimension a multiple of 32 so all recipes apply, and the
whole trainer suite in a few tens of seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def make_config(family: str, **overrides):
    """A tiny transformers config: "qwen3_moe" | "olmoe" | "mixtral" | "qwen3" | "llama"."""
    from transformers import AutoConfig

    extra = {
        "qwen3_moe": dict(num_hidden_layers=3, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "olmoe": dict(num_hidden_layers=2, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      eos_token_id=0, pad_token_id=1, bos_token_id=None),
        "mixtral": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
        "qwen3": dict(num_hidden_layers=2, head_dim=16, intermediate_size=128),
        "llama": dict(num_hidden_layers=2, intermediate_size=128),
    }[family]
    cfg = AutoConfig.for_model(family, **{**COMMON, **extra, **overrides})
    return cfg


def make_model(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = make_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    return model


@pytest.fixture
def tiny_model():
    """Factory: tiny_model(family, seed=0, **config overrides) -> a fresh FP32 transformers model."""
    return make_model


@pytest.fixture
def tiny_config():
    return make_config
