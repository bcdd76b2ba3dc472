"""The n samples of a request prefill their prompt once (`share_prefix`): the same bits as n prefills.

The other samples copy the first one's prompt K/V and draw their first token
from its logits row. Checked bitwise against share_prefix=False, for a plain
and a quantized serving model, with sampling parameters that differ between
requests, and with a batch cap so small that some followers find no room and
prefill on their own.
"""

from __future__ import annotations

import pytest
import torch

from rl4bit.sampler import engine as engine_mod
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams

from .conftest import make_model, prompts


def _requests():
    return [Request(str(i), p, SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_p=0.9 if i % 2 else 1.0,
                                              seed=70 + i, max_new_tokens=3 + i % 4, n=[4, 1, 3][i % 3]))
            for i, p in enumerate(prompts(7, seed=41))]


def _model(recipe):
    model = make_model(torch.float32, seed=6)
    if recipe != "plain":
        from rl4bit.trainer.recipe import RecipeConfig
        from rl4bit.trainer.surgery import convert_model, load_quantized, quantized_weights

        convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0))
        load_quantized(model, quantized_weights(model))
    return model


@pytest.mark.parametrize("recipe", ["plain", "nvfp4"])
@pytest.mark.parametrize("cap", [32, 5, 2])
def test_shared_prefill_equals_one_prefill_per_sample(tokenizer, recipe, cap):
    model, reqs = _model(recipe), _requests()
    own = EmbeddedEngine(model, tokenizer, max_batch_size=cap, share_prefix=False)
    shared = EmbeddedEngine(model, tokenizer, max_batch_size=cap)
    a, b = own.generate(reqs), shared.generate(reqs)
    assert [(r.request_id, r.sample_index) for r in a] == [(r.request_id, r.sample_index) for r in b]
    for x, y in zip(a, b):
        assert (x.completion_ids, x.logprobs, x.finish_reason) == (y.completion_ids, y.logprobs, y.finish_reason), \
            f"request {x.request_id} sample {x.sample_index}"
    assert own.shared_prompt_tokens == 0 and shared.shared_prompt_tokens > 0
    assert shared.prompt_tokens == own.prompt_tokens  # every sample's prompt is served, fewer are computed
    every = sum(len(r.prompt_ids) * (r.params.n - 1) for r in reqs)
    if cap == 32:  # room for everyone: every follower forked
        assert shared.shared_prompt_tokens == every
    if cap == 2:  # a leader and one fork fit; the other followers prefill on their own
        assert 0 < shared.shared_prompt_tokens < every
    assert len({tuple(r.completion_ids) for r in b if r.request_id == "0"}) > 1  # the samples still differ


def test_sharing_with_small_prefill_budget_graph_decode_stops_and_processed_logprobs(tokenizer):
    """Followers that find no room fork from the first of them later; a stop on the first token; processed
    logprobs; the static decode path; a prefill budget that admits one prompt a step."""
    model = _model("plain")
    eos = 2
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, top_k=5, seed=90 + i, max_new_tokens=4, n=5,
                                              stop_token_ids=[eos, 7, 11, 13, 17], processed_logprobs=True))
            for i, p in enumerate(prompts(4, seed=43))]
    kw = dict(max_batch_size=3, max_prefill_tokens=8, decode_graphs="static")
    a = EmbeddedEngine(model, tokenizer, share_prefix=False, **kw).generate(reqs)
    engine = EmbeddedEngine(model, tokenizer, **kw)
    b = engine.generate(reqs)
    for x, y in zip(a, b, strict=True):
        assert (x.completion_ids, x.logprobs, x.processed_logprobs, x.finish_reason) == \
               (y.completion_ids, y.logprobs, y.processed_logprobs, y.finish_reason)
    assert engine.shared_prompt_tokens > 0
    assert any(len(r.completion_ids) == 1 and r.finish_reason == "stop" for r in b)
    assert sorted(engine.cache.free) == sorted(set(range(4)) - {engine.graphs.scratch_slot})  # no slot leaked


def test_an_error_mid_generate_returns_every_slot(tokenizer, monkeypatch):
    engine = EmbeddedEngine(_model("plain"), tokenizer, max_batch_size=8)
    free = sorted(engine.cache.free)
    calls = []

    def failing_sample(*args, **kwargs):
        calls.append(1)
        raise FloatingPointError("injected")

    monkeypatch.setattr(engine_mod, "sample_rows", failing_sample)
    with pytest.raises(FloatingPointError):
        engine.generate(_requests())
    assert calls and sorted(engine.cache.free) == free
