"""RecipeConfig validation and the quantization plan (rl4bit.trainer.recipe / plan)."""

from __future__ import annotations

import pytest

from rl4bit.trainer.plan import quant_plan, quantized_modules
from rl4bit.trainer.recipe import RecipeConfig


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("name", "fp4", "bf16, mxfp8, nvfp4"),
        ("scope", "attention", "experts, all_linear"),
        ("grad_rounding", "floor", "nearest, stochastic"),
        ("high_precision_tail", 1.5, "[0, 1]"),
        ("seed", -1, "non-negative"),
        ("four_over_six", "yes", "true or false"),
    ],
)
def test_validate_names_field_value_and_choices(field, value, fragment):
    with pytest.raises(ValueError) as err:
        RecipeConfig(**{field: value}).validate()
    assert f"recipe.{field}" in str(err.value) and repr(value) in str(err.value) and fragment in str(err.value)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown recipe key.*'foo'.*valid keys: name"):
        RecipeConfig.from_dict({"name": "nvfp4", "foo": 1})
    assert RecipeConfig.from_dict({"name": "mxfp8"}).name == "mxfp8"


def test_plan_qwen3_moe_experts_scope_with_tail(tiny_config):
    cfg = tiny_config("qwen3_moe", num_hidden_layers=6)
    plan = quant_plan(cfg, RecipeConfig(name="nvfp4"))  # from a config: built on the meta device
    experts = {n: f for n, f in plan.items() if n.endswith("mlp.experts")}
    assert [experts[f"model.layers.{i}.mlp.experts"] for i in range(6)] == ["nvfp4"] * 5 + ["mxfp8"]  # 1/6 tail
    assert plan["lm_head"] == "bf16" and plan["model.layers.0.mlp.gate"] == "bf16"
    assert plan["model.layers.0.self_attn.q_proj"] == "bf16"  # scope experts leaves attention alone
    assert set(quantized_modules(plan)) == set(experts)
    no_tail = quant_plan(cfg, RecipeConfig(name="nvfp4", high_precision_tail=0.0))
    assert set(f for n, f in no_tail.items() if n.endswith("experts")) == {"nvfp4"}
    assert set(quant_plan(cfg, RecipeConfig(name="mxfp8")).values()) == {"mxfp8", "bf16"}
    assert set(quant_plan(cfg, RecipeConfig(name="bf16")).values()) == {"bf16"}


def test_plan_all_linear_scope_dense(tiny_model):
    plan = quant_plan(tiny_model("llama"), RecipeConfig(name="nvfp4", scope="all_linear", high_precision_tail=0.5))
    assert plan["model.layers.0.self_attn.q_proj"] == "nvfp4" and plan["model.layers.0.mlp.down_proj"] == "nvfp4"
    assert plan["model.layers.1.mlp.up_proj"] == "mxfp8"  # the tail is the last half here
    assert plan["lm_head"] == "bf16"


def test_plan_rejects_bad_shapes_naming_layer_and_fix(tiny_config):
    cfg = tiny_config("qwen3_moe", hidden_size=72)  # expert K = 72
    with pytest.raises(ValueError,
                       match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: K = 72 .* multiple of 16 .*pad K to 80"):
        quant_plan(cfg, RecipeConfig(name="nvfp4"))
    cfg = tiny_config("qwen3_moe", moe_intermediate_size=40)  # gate_up N = 80
    with pytest.raises(ValueError, match=r"gate_up_proj: N = 80 .*multiple of 32.*pad N to 96"):
        quant_plan(cfg, RecipeConfig(name="mxfp8"))
    quant_plan(cfg, RecipeConfig(name="bf16"))  # bf16 has no shape constraint
