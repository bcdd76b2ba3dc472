"""EmbeddedEngine.update_weights: outputs follow new weights; rejected updates keep the old version serving."""

from __future__ import annotations

import pytest
import torch

from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams, WeightUpdate

from .conftest import make_model, prompts


def _greedy(engine, ps):
    return [r.completion_ids for r in engine.generate(
        [Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=10)) for i, p in enumerate(ps)])]


@pytest.fixture
def setup(tokenizer):
    a, b = make_model(seed=0), make_model(seed=1)
    engine = EmbeddedEngine(a, tokenizer, max_batch_size=4)
    ps = prompts(4, seed=21)
    ref_b = _greedy(EmbeddedEngine(make_model(seed=1), tokenizer, max_batch_size=4), ps)
    return engine, a, b, ps, ref_b


def test_update_follows_new_weights_in_place(setup):
    engine, a, b, ps, ref_b = setup
    before = _greedy(engine, ps)
    assert before != ref_b
    ptrs = {k: v.data_ptr() for k, v in a.state_dict().items()}
    engine.update_weights(WeightUpdate(1, {k: v.clone() for k, v in b.state_dict().items()}))
    assert engine.version == 1
    assert {k: v.data_ptr() for k, v in a.state_dict().items()} == ptrs
    assert _greedy(engine, ps) == ref_b
    out = engine.generate([Request("v", ps[0], SamplingParams(max_new_tokens=2))])[0]
    assert out.policy_version == 1


@pytest.mark.parametrize("breakage, message", [
    ("shape", "shape"), ("nan", "NaN"), ("unknown", "unknown tensor"), ("dtype", "dtype"), ("old_version", "version"),
])
def test_rejected_update_keeps_old_version_serving(setup, breakage, message):
    engine, a, b, ps, ref_b = setup
    before = _greedy(engine, ps)
    saved = {k: v.clone() for k, v in a.state_dict().items()}
    tensors = {k: v.clone() for k, v in b.state_dict().items()}  # valid tensors first: all-or-nothing
    name = "model.layers.0.self_attn.q_proj.weight"
    version = 1
    if breakage == "shape":
        tensors[name] = tensors[name][:, :-1].clone()
    elif breakage == "nan":
        tensors[name][3, 5] = float("nan")
    elif breakage == "unknown":
        tensors["model.layers.0.self_attn.qq_proj.weight"] = tensors.pop(name)
    elif breakage == "dtype":
        tensors[name] = tensors[name].to(torch.bfloat16)
    else:
        version = -1
    with pytest.raises(ValueError, match=message):
        engine.update_weights(WeightUpdate(version, tensors))
    assert engine.version == 0
    assert all(torch.equal(saved[k], v) for k, v in a.state_dict().items())
    assert _greedy(engine, ps) == before
