"""Sampler actor (plain class, local mode): builds from a builder or a model, generates, syncs, reports health."""

from __future__ import annotations

import pytest

from rl4bit.config import SamplerConfig
from rl4bit.sampler.actor import Sampler, default_params
from rl4bit.sampler.types import Request, WeightUpdate

from .conftest import make_model, prompts


def test_sampler_generates_updates_and_reports_health(tokenizer):
    import rl4bit.sampler.actor as actor_mod
    assert "import ray" not in open(actor_mod.__file__).read()

    s = Sampler(lambda: make_model(seed=0), tokenizer, SamplerConfig(max_batch_size=4, max_new_tokens=5))
    h0 = s.health()
    assert h0["ok"] and h0["version"] == 0 and h0["tokens_generated"] == 0
    params = default_params(s.config, n=2, seed=1)
    out = s.generate([Request(str(i), p, params) for i, p in enumerate(prompts(3, seed=30))])
    assert len(out) == 6 and all(len(r.completion_ids) <= 5 for r in out)
    h1 = s.health()
    assert h1["tokens_generated"] == sum(len(r.completion_ids) for r in out) and h1["tokens_per_s"] > 0
    assert s.score(out[0].prompt_ids, out[0].completion_ids, params.temperature) == out[0].logprobs
    assert s.update_weights(WeightUpdate(3, dict(make_model(seed=1).state_dict()))) == 3
    assert s.health()["version"] == 3
    with pytest.raises(ValueError):
        s.update_weights(WeightUpdate(4, {"nope": make_model().lm_head.weight}))
    assert s.health()["version"] == 3 and s.health()["ok"]


def test_vllm_backend_without_vllm_says_how_to_get_it(tokenizer):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: tests/vllm covers the backend")
    with pytest.raises(ImportError, match="setup_vllm.sh"):
        Sampler(make_model(), tokenizer, SamplerConfig(backend="vllm"))


def test_default_params_carry_every_job_field():
    """Each SamplingParams field the sampler section has comes from it (ignore_eos was dropped once)."""
    import dataclasses

    cfg = SamplerConfig(temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, max_new_tokens=7, stop=["\n"],
                        ignore_eos=True)
    p = default_params(cfg, n=3)
    shared = {f.name for f in dataclasses.fields(p)} & {f.name for f in dataclasses.fields(cfg)}
    assert shared == {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "ignore_eos"}
    assert all(getattr(p, k) == getattr(cfg, k) for k in shared) and p.n == 3


def test_health_after_a_failed_generate(tokenizer, monkeypatch):
    """A generate that raises mid-run: `ok` is False until a later generate succeeds, `last_error` names the
    phase and stays, the failed call's time is in busy_s beside the tokens it sampled (tokens/s not inflated)."""
    import time

    s = Sampler(lambda: make_model(seed=0), tokenizer, SamplerConfig(max_batch_size=4, max_new_tokens=8),
                device="cpu")
    reqs = [Request(str(i), p, default_params(s.config, n=2, seed=1, ignore_eos=True))
            for i, p in enumerate(prompts(3, seed=30))]
    s.generate(reqs)
    step, calls = s.engine._step, []

    def failing_step(active):
        calls.append(1)
        if len(calls) == 4:
            time.sleep(0.3)
            raise RuntimeError("a kernel met NaN/Inf")
        return step(active)

    monkeypatch.setattr(s.engine, "_step", failing_step)
    busy, tokens = s.engine.busy_s, s.engine.tokens_generated
    with pytest.raises(RuntimeError, match="NaN/Inf"):
        s.generate(reqs)
    h = s.health()
    assert not h["ok"] and h["last_error"] == "generate: RuntimeError: a kernel met NaN/Inf" and h["errors"] == 1
    assert s.engine.busy_s - busy >= 0.3 and s.engine.tokens_generated > tokens
    monkeypatch.setattr(s.engine, "_step", step)
    with pytest.raises(ValueError):
        s.update_weights(WeightUpdate(1, {"nope": make_model().lm_head.weight}))
    assert s.health()["last_error"].startswith("update_weights: ValueError") and s.health()["errors"] == 2
    s.generate(reqs)
    h = s.health()
    assert h["ok"] and h["errors"] == 2 and h["version"] == 0
