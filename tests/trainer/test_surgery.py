"""Model surgery on tiny transformers models (rl4bit.trainer.surgery): every recipe trains, names survive.

Qwen3-MoE (3 layers: the last runs the mxfp8 tail under nvfp4), OLMoE and
Mixtral (fused experts), dense Llama / Qwen3 under scope all_linear.
"""

from __future__ import annotations

import pytest
import torch

from rl4bit.trainer.modules import QuantExperts, QuantLinear
from rl4bit.trainer.qgemm import count_saved_bytes
from rl4bit.trainer.recipe import RecipeConfig
from rl4bit.trainer.surgery import convert_model, load_quantized, quant_modules, quantized_weights, set_step

FAMILIES = [("qwen3_moe", "experts"), ("olmoe", "experts"), ("mixtral", "experts"), ("llama", "all_linear"),
            ("qwen3", "all_linear")]
RECIPES = ["bf16", "mxfp8", "nvfp4"]
# |loss - loss of the unconverted BF16-autocast model| at init (vocab 128: loss ~ 4.85)
LOSS_TOLERANCE = {"bf16": 0.01, "mxfp8": 0.02, "nvfp4": 0.05}


def _batch(seed=0, batch=2, seq=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (batch, seq), generator=g)


def _loss(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("family, scope", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_backward_each_recipe(tiny_model, family, scope, recipe):
    ids = _batch()
    ref = _loss(tiny_model(family), ids).item()
    model = tiny_model(family)
    plan = convert_model(model, RecipeConfig(name=recipe, scope=scope))
    converted = quant_modules(model)
    quantized = {n for n, f in plan.items() if f != "bf16"}
    assert quantized <= set(converted)
    assert all(m.spec.fmt == plan[n] for n, m in converted.items())
    if recipe != "bf16":
        assert quantized, f"{family}: nothing quantized under {recipe}"
    loss = _loss(model, ids)
    assert abs(loss.item() - ref) < LOSS_TOLERANCE[recipe], (loss.item(), ref)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, f"{name}: master weight is {p.dtype}"
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    for name, m in converted.items():
        for pname in m._param_names:
            g = getattr(m, pname).grad
            assert g is not None and g.abs().sum() > 0, f"{name}.{pname} got no gradient"


def test_router_logits_are_fp32(tiny_model):
    model = tiny_model("qwen3_moe")
    convert_model(model, RecipeConfig(name="nvfp4"))
    seen = []
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[0].dtype))
    _loss(model, _batch())
    assert seen == [torch.float32]


@pytest.mark.parametrize("family, scope", [("qwen3_moe", "experts"), ("olmoe", "experts"), ("llama", "all_linear")])
def test_state_dict_round_trips_through_transformers(tiny_model, tmp_path, family, scope):
    from transformers import AutoModelForCausalLM

    model = tiny_model(family)
    names = [n for n, _ in model.named_parameters()]
    convert_model(model, RecipeConfig(name="nvfp4", scope=scope))
    assert [n for n, _ in model.named_parameters()] == names  # HF names kept
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model, _batch()).backward()
    opt.step()
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert not quant_modules(plain)
    theirs = plain.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(theirs[name], value), f"{name} changed in the round trip"
    fresh = tiny_model(family)
    fresh.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("scope", ["experts", "all_linear"])
def test_serving_mode_equals_training_forward_bitwise(tiny_model, scope):
    ids = _batch(1)
    model = tiny_model("qwen3_moe")
    convert_model(model, RecipeConfig(name="nvfp4", scope=scope))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train_logits = model(input_ids=ids).logits  # grad mode on, as in training
    qweights = quantized_weights(model)
    assert {q.fmt for d in qweights.values() for q in d.values()} == {"nvfp4", "mxfp8"}
    # a second model that never sees the expert master weights: all but the quantized ones loaded
    server = tiny_model("qwen3_moe", seed=1)
    convert_model(server, RecipeConfig(name="nvfp4", scope=scope))
    quantized_params = {f"{n}.{p}" for n, d in qweights.items() for p in d}
    rest = {k: v for k, v in model.state_dict().items() if k not in quantized_params}
    load_quantized(server, qweights)
    missing, unexpected = server.load_state_dict(rest, strict=False)
    assert not missing and not unexpected
    assert not any(f"{n}.{p}" in dict(server.named_parameters()) for n, d in qweights.items() for p in d)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        serve_logits = server(input_ids=ids).logits
    assert torch.equal(serve_logits, train_logits.detach())


def test_experts_module_is_batch_invariant(tiny_model):
    """A token's expert output is bitwise the same alone or inside a batch (routing given)."""
    model = tiny_model("qwen3_moe")
    convert_model(model, RecipeConfig(name="nvfp4"))
    experts = model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(48)])
    wts = torch.rand(48, 2, generator=g)
    with torch.no_grad():
        full = experts(x, idx, wts)
        for t in (0, 17, 47):
            assert torch.equal(experts(x[t : t + 1], idx[t : t + 1], wts[t : t + 1]), full[t : t + 1])
        assert torch.equal(experts(x[5:30], idx[5:30], wts[5:30]), full[5:30])


def test_saved_activation_bytes_nvfp4_at_most_035_of_bf16(tiny_model):
    ids = _batch(seq=64)
    saved = {}
    for recipe in ("bf16", "nvfp4"):
        model = tiny_model("qwen3_moe", hidden_size=128, moe_intermediate_size=64)
        convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0))
        with count_saved_bytes() as meter:
            _loss(model, ids)
        saved[recipe] = meter["bytes"]
    assert saved["nvfp4"] <= 0.35 * saved["bf16"], saved


def test_set_step_changes_random_bits_and_reproduces(tiny_model):
    grads = {}
    for step in (0, 1, 0):
        model = tiny_model("qwen3_moe")
        convert_model(model, RecipeConfig(name="nvfp4", grad_rounding="stochastic"))
        set_step(model, step)
        _loss(model, _batch()).backward()
        grads.setdefault(step, []).append(model.model.layers[0].mlp.experts.gate_up_proj.grad.clone())
    assert torch.equal(grads[0][0], grads[0][1])
    assert not torch.equal(grads[0][0], grads[1][0])


def test_converted_modules_have_expected_types(tiny_model):
    model = tiny_model("qwen3", num_hidden_layers=2)
    plan = convert_model(model, RecipeConfig(name="nvfp4", scope="all_linear"))
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    assert type(model.lm_head) is torch.nn.Linear and plan["lm_head"] == "bf16"
    moe = tiny_model("mixtral")
    convert_model(moe, RecipeConfig(name="mxfp8"))
    assert isinstance(moe.model.layers[0].mlp.experts, QuantExperts)
    with pytest.raises(ValueError, match="already converted"):
        convert_model(moe, RecipeConfig(name="mxfp8"))
