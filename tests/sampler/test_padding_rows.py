"""The engine's padding rows on row 0's experts through the fused router's torch path (kernels off: the CPU
engine); the kernel path is tests/kernels/test_fused_engine.py's."""

from __future__ import annotations

import torch

from rl4bit.kernels import fused
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.trainer import padding
from rl4bit.trainer.recipe import RecipeConfig
from rl4bit.trainer.surgery import convert_model

from .conftest import make_model


def test_the_torch_router_puts_the_engines_padding_on_row_0s_experts(tokenizer):
    """Padding rows get row 0's routing, real rows keep theirs, and the engine's completions and logprobs equal
    those with the padding unmarked (`padding.ignored`)."""
    assert not fused.enabled("cpu")
    model = make_model()
    convert_model(model, RecipeConfig(name="bf16"))  # installs the fused router (its torch path here)
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    seen: list[torch.Tensor] = []
    for m in experts:
        m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[1].clone()), with_kwargs=True)
    req = Request("a", [1, 5, 9, 13], SamplingParams(temperature=1.0, seed=3, max_new_tokens=4, ignore_eos=True))
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=2, autocast=torch.bfloat16, max_seq_len=32)
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
