"""Batch invariance, bitwise: a request's tokens and logprobs do not depend on its batch neighbours.

Measured on CPU (torch 2.13) for fp32 and bf16 Qwen3-MoE models with mixed prompt
lengths: alone vs all together vs reversed arrival order vs a smaller batch cap
(so sequences join mid-decode and land in other cache slots). Also: the engine's
full-sequence scoring path gives the sampled logprobs bitwise. NOT covered: the
stock HF forward (SDPA, unpadded GEMMs) matches only to fp tolerance
(test_engine.py::test_logprobs_match_full_forward), and CUDA is unmeasured.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.trainer.batch_invariant import MIN_ROWS

from .conftest import make_model, prompts


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x.completion_ids != y.completion_ids or x.logprobs != y.logprobs:
            return f"request {x.request_id}: tokens {x.completion_ids} vs {y.completion_ids}"
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_do_not_depend_on_the_batch(tokenizer, dtype):
    model = make_model(dtype)
    ps = prompts(10, seed=11)
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0 if i % 3 else 0.0, top_p=0.9 if i % 2 else 1.0,
                                              seed=100 + i, max_new_tokens=6 + i % 5))
            for i, p in enumerate(ps)]
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=16)
    alone = [engine.generate([r])[0] for r in reqs]
    together = engine.generate(reqs)
    reversed_order = engine.generate(reqs[::-1])[::-1]
    small_cap = EmbeddedEngine(model, tokenizer, max_batch_size=3).generate(reqs)
    for name, other in (("together", together), ("reversed", reversed_order), ("max_batch_size=3", small_cap)):
        assert _first_diff(alone, other) is None, f"{dtype} {name}: {_first_diff(alone, other)}"
    for r in together:
        t = r.logprobs and (reqs[int(r.request_id)].params.temperature or 1.0)
        assert engine.score(r.prompt_ids, r.completion_ids, temperature=t) == r.logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_do_not_depend_on_row_count_above_min_rows(dtype):
    """The property the engine's padding rests on: with M >= MIN_ROWS a GEMM row's bits do not depend on M."""
    torch.manual_seed(0)
    w = torch.randn(96, 200).to(dtype)
    x = torch.randn(300, 200).to(dtype)
    ref = F.linear(x, w)
    bad = [m for m in range(MIN_ROWS, 300, 7) if not torch.equal(F.linear(x[:m], w), ref[:m])]
    assert bad == [], f"{dtype}: rows change with M for M in {bad}; raise MIN_ROWS or use a fixed-M GEMM"


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp8", "bf16"])
def test_quantized_serving_is_batch_invariant(tokenizer, recipe):
    """The trainer's recipe modules as the engine serves them (rl4bit.trainer.surgery): the quantized ones in
    serving mode, the bf16 recipe's converted model (its experts' grouped products) as it is."""
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, load_quantized, quantized_weights

    model = make_model(torch.float32, seed=4)
    plain = EmbeddedEngine(make_model(torch.float32, seed=4), tokenizer, max_batch_size=2)
    convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0, scope="all_linear"))
    if recipe != "bf16":
        load_quantized(model, quantized_weights(model))
    ps = prompts(5, seed=12)
    reqs = [Request(str(i), p, SamplingParams(seed=i, max_new_tokens=5)) for i, p in enumerate(ps)]
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=8)
    alone = [engine.generate([r])[0] for r in reqs]
    together = engine.generate(reqs[::-1])[::-1]
    assert _first_diff(alone, together) is None, f"{recipe}: {_first_diff(alone, together)}"
    for r in together:
        assert engine.score(r.prompt_ids, r.completion_ids) == r.logprobs
        if recipe != "bf16":
            assert plain.score(r.prompt_ids, r.completion_ids) != r.logprobs  # the quantized GEMMs are in effect
