"""Serving copies in the autocast dtype (sampler/serving_dtype.py): which weights, and the same bits.

An engine under BF16 autocast over FP32 masters holds its linears (and the bf16
recipe's experts) in BF16; its rollouts are bitwise those of an engine that
keeps FP32 and lets autocast cast at every forward, before and after an FP32
weight update. Norms, embeddings, routers and tied weights stay FP32.
"""

from __future__ import annotations

import pytest
import torch

from rl4bit.sampler import engine as engine_mod
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.serving_dtype import precast
from rl4bit.sampler.types import Request, SamplingParams, WeightUpdate

from .conftest import make_model, prompts


def _fp32_masters(recipe: str | None, seed: int):
    """FP32 weights off the BF16 grid (so a wrong rounding shows), converted like the job's policy."""
    model = make_model(torch.float32, seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    if recipe is not None:
        from rl4bit.trainer.recipe import RecipeConfig
        from rl4bit.trainer.surgery import convert_model

        convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0))
    return model


def _rollouts(engine):
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=6))
            for i, p in enumerate(prompts(6, seed=31))]
    return [(r.completion_ids, r.logprobs) for r in engine.generate(reqs)]


@pytest.mark.parametrize("recipe", [None, "bf16"])
def test_precast_serving_gives_the_same_bits(tokenizer, monkeypatch, recipe):
    cast = EmbeddedEngine(_fp32_masters(recipe, 3), tokenizer, max_batch_size=8, autocast=torch.bfloat16)
    monkeypatch.setattr(engine_mod, "precast", lambda model, dtype: set())
    plain = EmbeddedEngine(_fp32_masters(recipe, 3), tokenizer, max_batch_size=8, autocast=torch.bfloat16)
    assert cast.precast and not plain.precast
    assert _rollouts(cast) == _rollouts(plain)
    # an FP32 update (the trainer's masters) is cast on the way in: still the same bits
    new = {k: v for k, v in _fp32_masters(recipe, 4).state_dict().items()}
    for e in (cast, plain):
        e.update_weights(WeightUpdate(version=1, tensors=new))
    assert _rollouts(cast) == _rollouts(plain)
    assert _rollouts(cast) != _rollouts(EmbeddedEngine(_fp32_masters(recipe, 3), tokenizer, max_batch_size=8,
                                                       autocast=torch.bfloat16))  # the update took effect


def test_which_weights_are_cast(tokenizer):
    model = _fp32_masters("bf16", 5)
    names = precast(model, torch.bfloat16)
    params = dict(model.named_parameters())
    for name, p in params.items():
        kind = "linear/expert" if name in names else "kept"
        assert p.dtype == (torch.bfloat16 if name in names else torch.float32), (name, kind)
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names  # the bf16 recipe's experts
    assert not any("norm" in n or "embed_tokens" in n or ".gate." in n or n.endswith("mlp.gate.weight")
                   for n in names)
    assert precast(make_model(torch.float32), None) == set()  # no autocast: nothing


def test_tied_weights_stay_in_fp32(tokenizer):
    model = make_model(torch.float32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: the embedding reads it in FP32
    names = precast(model, torch.bfloat16)
    assert "lm_head.weight" not in names and model.lm_head.weight.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _qwen2_moe():
    """A tiny Qwen2-MoE: its `shared_expert_gate` is an nn.Linear that surgery runs in FP32 (forward replaced)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = Qwen2MoeConfig(vocab_size=48, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(8)
    model = Qwen2MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    convert_model(model, RecipeConfig(name="bf16", high_precision_tail=0.0))
    return model


def test_a_linear_with_a_replaced_forward_is_not_cast(tokenizer, monkeypatch):
    """Surgery's FP32 routers (Qwen2-MoE's shared_expert_gate is an nn.Linear) read their weight in FP32."""
    model = _qwen2_moe()
    names = precast(model, torch.bfloat16)
    assert "model.layers.0.mlp.shared_expert_gate.weight" not in names
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in names
    cast = EmbeddedEngine(_qwen2_moe(), tokenizer, max_batch_size=8, autocast=torch.bfloat16)
    monkeypatch.setattr(engine_mod, "precast", lambda model, dtype: set())
    plain = EmbeddedEngine(_qwen2_moe(), tokenizer, max_batch_size=8, autocast=torch.bfloat16)
    assert _rollouts(cast) == _rollouts(plain)


def test_every_engine_over_a_precast_model_takes_fp32_updates(tokenizer):
    model = _fp32_masters("bf16", 6)
    first = EmbeddedEngine(model, tokenizer, max_batch_size=4, autocast=torch.bfloat16)
    second = EmbeddedEngine(model, tokenizer, max_batch_size=4, autocast=torch.bfloat16)
    assert first.precast and second.precast == first.precast
    new = _fp32_masters("bf16", 7).state_dict()
    second.update_weights(WeightUpdate(version=1, tensors=new))
    with pytest.raises(ValueError, match="dtype torch.float16"):  # only the masters' FP32 is cast on the way in
        second.update_weights(WeightUpdate(version=2, tensors={"lm_head.weight": new["lm_head.weight"].half()}))
