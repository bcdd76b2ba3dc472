"""`trainer.padding`: the engine's mark of its padding rows, as the fused router reads it."""

from __future__ import annotations

import pytest
import torch

from rl4bit.trainer import padding


def test_the_mask_is_seen_only_inside_for_its_row_count_and_device():
    live = torch.tensor([1, 0, 0], dtype=torch.int32)
    assert padding.current(3, live.device) is None
    with padding.live_rows(live):
        assert padding.current(3, live.device) is live
        with padding.ignored():  # the benchmark's A/B: as if unmarked
            assert padding.current(3, live.device) is None
        assert padding.current(4, live.device) is None  # a call over other rows than the forward's
        with padding.live_rows(None):  # nested: cleared inside, restored after
            assert padding.current(3, live.device) is None
        assert padding.current(3, live.device) is live
        if torch.cuda.is_available():
            assert padding.current(3, torch.device("cuda")) is None
    assert padding.current(3, live.device) is None


def test_a_bad_mask_is_refused():
    with pytest.raises(ValueError, match="int32 or int64"):
        with padding.live_rows(torch.ones(3, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match="int32 or int64"):
        with padding.live_rows(torch.ones(2, 3, dtype=torch.int32)):
            pass


def _converted_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = Qwen3MoeConfig(vocab_size=48, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    convert_model(model, RecipeConfig(name="bf16"))
    return model.eval()


def test_the_torch_router_puts_the_engines_padding_on_row_0s_experts():
    """Kernels off (the CPU engine): the fused router's torch path gives padding rows row 0's routing, real rows
    keep theirs, and the engine's completions and logprobs equal those with the padding unmarked."""
    from rl4bit.bench_rollout import _NullTokenizer
    from rl4bit.kernels import fused
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams

    assert not fused.enabled("cpu")
    model = _converted_model()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    seen: list[torch.Tensor] = []
    for m in experts:
        m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[1].clone()), with_kwargs=True)
    req = Request("a", [5, 9, 13, 2], SamplingParams(temperature=1.0, seed=3, max_new_tokens=4))
    engine = EmbeddedEngine(model, _NullTokenizer(), max_batch_size=2, autocast=torch.bfloat16, max_seq_len=32)
    marked = engine.generate([req])[0]
    assert seen and all(idx.shape[0] == engine.min_rows for idx in seen)
    for i, idx in enumerate(seen):  # each layer's first call is the prefill (4 real rows), then one real row
        real = 4 if i < len(experts) else 1
        assert (idx[real:] == idx[0]).all(), (i, idx)
    seen.clear()
    with padding.ignored():
        unmarked = engine.generate([req])[0]
    assert any((idx[1:] != idx[0]).any() for idx in seen[len(experts):])  # else this test could not fail
    assert (marked.completion_ids, marked.logprobs) == (unmarked.completion_ids, unmarked.logprobs)
