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
    ("same_version", "newer than the serving version 0"),
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
    elif breakage == "same_version":
        version = 0  # one version, one set of weights: a second set may not take the serving version's number
    else:
        version = -1
    with pytest.raises(ValueError, match=message):
        engine.update_weights(WeightUpdate(version, tensors))
    assert engine.version == 0
    assert all(torch.equal(saved[k], v) for k, v in a.state_dict().items())
    assert _greedy(engine, ps) == before


def _quantized_engine(tokenizer, serving: bool):
    """An nvfp4-recipe engine whose expert modules serve QTensors already (`serving`) or still hold masters."""
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, load_quantized, quantized_weights

    model = make_model(seed=3)
    convert_model(model, RecipeConfig(name="nvfp4", high_precision_tail=0.0))
    if serving:
        load_quantized(model, quantized_weights(model))
    return EmbeddedEngine(model, tokenizer, max_batch_size=4), model


@pytest.mark.parametrize("serving", [False, True])
@pytest.mark.parametrize("breakage, message", [
    ("scale_nan", "scale: holds NaN/Inf"), ("outer_inf", "outer: holds NaN/Inf"),
    ("data_shape", "data"), ("logical_shape", "shape"), ("scale_dtype", "scale"),
])
def test_rejected_quantized_update_changes_nothing(tokenizer, serving, breakage, message):
    """A bad QTensor (NaN E4M3 block scale: torch's isfinite cannot see it; wrong shapes; wrong dtype) is
    rejected before anything changes, whether its module serves QTensors already (in-place copies) or still
    holds master weights (it would be put into serving mode): the old weights keep serving, bit for bit."""
    import dataclasses

    from rl4bit.trainer.surgery import quant_modules, quantized_weights

    engine, model = _quantized_engine(tokenizer, serving)
    ps = prompts(3, seed=8)
    before = _greedy(engine, ps)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    served_before = {n: m.served is not None for n, m in quant_modules(model).items()}
    qw = quantized_weights(model)
    mname = next(iter(qw))
    q = qw[mname]["down_proj"]
    if breakage == "scale_nan":
        bits = q.scale.view(torch.uint8).clone()
        bits.view(-1)[5] = 0x7F  # E4M3 NaN
        q = dataclasses.replace(q, scale=bits.view(torch.float8_e4m3fn))
    elif breakage == "outer_inf":
        q = dataclasses.replace(q, outer=torch.full_like(q.outer, float("inf")))
    elif breakage == "data_shape":
        q = dataclasses.replace(q, data=q.data[..., :-1].clone())
    elif breakage == "logical_shape":
        q = dataclasses.replace(q, shape=(q.shape[0], q.shape[1] + 1, q.shape[2]))
    else:
        q = dataclasses.replace(q, scale=q.scale.float())
    qw[mname] = {**qw[mname], "down_proj": dataclasses.replace(q)}
    with pytest.raises(ValueError, match=message):
        engine.update_weights(WeightUpdate(1, {}), qw)
    assert engine.version == 0
    assert {n: m.served is not None for n, m in quant_modules(model).items()} == served_before
    after = model.state_dict()
    assert set(after) == set(saved) and all(torch.equal(saved[k], after[k]) for k in saved)
    assert _greedy(engine, ps) == before


def test_a_failed_move_to_the_device_changes_nothing(tokenizer, monkeypatch):
    """The new QTensors of modules not yet serving are moved to the engine's device before any weight is
    overwritten: a failure there (the device out of memory) leaves the old weights and version serving, bit for
    bit. Before, the dense tensors were already copied in by then."""
    from rl4bit.sampler import engine as engine_mod
    from rl4bit.trainer.surgery import quantized_weights

    engine, model = _quantized_engine(tokenizer, serving=False)
    ps = prompts(3, seed=9)
    before = _greedy(engine, ps)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    other, _ = _quantized_engine(tokenizer, serving=False)
    dense = {k: v.detach() + 1 for k, v in other.model.state_dict().items() if k.endswith("norm.weight")}

    def out_of_memory(q, device):
        raise torch.OutOfMemoryError("injected: the device is out of memory")

    monkeypatch.setattr(engine_mod, "_to_device", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.update_weights(WeightUpdate(1, dense), quantized_weights(other.model))
    assert engine.version == 0
    after = model.state_dict()
    assert all(torch.equal(saved[k], after[k]) for k in saved)
    monkeypatch.undo()
    assert _greedy(engine, ps) == before
