"""The quantization plan: {module name: "nvfp4" | "mxfp8" | "bf16"} for a model.

This is the ONE place that decides which GEMMs are quantized (and so which are
on the ignore list): model surgery (`rl4bit.trainer.surgery`) applies it, the
checkpoint exporter and weight sync reuse it. Every GEMM-bearing module is
listed: fused MoE experts (3D `gate_up_proj` [E, 2I, H] + `down_proj`
[E, H, I]), every `nn.Linear`, and routers; modules a recipe leaves alone map
to "bf16" (i.e. the model's compute dtype).

Rules (numerics.md recipe table):
- routers (`*.gate`, `*_gate`, `*Router` classes) and `lm_head`: always bf16;
  embeddings and norms are not GEMMs and are not listed.
- scope "experts": the expert GEMMs follow the recipe, every nn.Linear is bf16.
  scope "all_linear": attention / dense-MLP / shared-expert linears too.
- recipe nvfp4: quantized modules in the last floor(n_layers * high_precision_tail + 1/2)
  decoder layers run mxfp8 (half rounds up: 3 layers -> 1, 15 -> 3; 1 or 2 layers -> none).
- shapes are checked here, at build time: NVFP4 needs K % 16 == 0, MXFP8 K % 32
  == 0, and both need N % 32 == 0 (the MXFP8 dgrad blocks run along N). The
  token dimension is padded to 32 at run time, so it has no constraint.

Leaves out: per-module overrides from YAML (add an `ignore` list here if needed).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rl4bit.common.checkpoint_format import expert_weight_shapes
from rl4bit.trainer.recipe import RecipeConfig

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _is_router(name: str, module: nn.Module) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last == "gate" or last.endswith("_gate") or type(module).__name__.endswith("Router")


def _num_layers(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_hidden_layers", None)
    if n is None:
        found = [int(m.group(1)) for name, _ in model.named_modules() if (m := _LAYER_RE.search(name + "."))]
        n = max(found) + 1 if found else 0
    return int(n)


def _check_gemm(name: str, param: str, n: int, k: int, fmt: str) -> None:
    """Raise ValueError naming the layer and the fix if [N, K] cannot run in fmt."""
    k_block = 16 if fmt == "nvfp4" else 32
    if k % k_block:
        fix = -(-k // k_block) * k_block
        raise ValueError(
            f"{name}.{param}: K = {k} (in features) is not a multiple of {k_block} ({fmt} block along K); "
            f"pad K to {fix} or keep this layer in bf16 (recipe.scope / recipe.name)"
        )
    if n % 32:
        fix = -(-n // 32) * 32
        raise ValueError(
            f"{name}.{param}: N = {n} (out features) is not a multiple of 32 (the MXFP8 dgrad blocks run along N); "
            f"pad N to {fix} or keep this layer in bf16 (recipe.scope / recipe.name)"
        )


def _as_model(model_or_config) -> nn.Module:
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    from transformers import AutoModelForCausalLM  # only when given a config: build on meta, no memory

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_or_config)


def quant_plan(model_or_config, recipe: RecipeConfig) -> dict[str, str]:
    """{module name: "nvfp4" | "mxfp8" | "bf16"} for every GEMM-bearing module, shapes checked.

    `model_or_config`: an nn.Module (HF or already converted) or a transformers
    PretrainedConfig (then the model is built on the meta device).
    """
    recipe.validate()
    model = _as_model(model_or_config)
    n_layers = _num_layers(model)
    n_tail = int(n_layers * recipe.high_precision_tail + 0.5) if recipe.name == "nvfp4" else 0
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        experts = expert_weight_shapes(module)
        if experts is not None:
            gemms = {p: (s[1], s[2]) for p, s in experts.items()}
            in_scope = True
        elif isinstance(module, nn.Linear):
            gemms = {"weight": (module.out_features, module.in_features)}
            in_scope = recipe.scope == "all_linear" and not _is_router(name, module) and not name.endswith("lm_head")
        elif _is_router(name, module) and isinstance(getattr(module, "weight", None), torch.Tensor):
            plan[name] = "bf16"
            continue
        else:
            continue
        fmt = recipe.name if in_scope else "bf16"
        m = _LAYER_RE.search(name + ".")
        if fmt == "nvfp4" and m is not None and int(m.group(1)) >= n_layers - n_tail:
            fmt = "mxfp8"
        if fmt != "bf16":
            for param, (n, k) in gemms.items():
                _check_gemm(name, param, n, k, fmt)
        plan[name] = fmt
    return plan


def quantized_modules(plan: dict[str, str]) -> list[str]:
    """Names of the modules whose weights are quantized (the complement is the exporter's ignore list)."""
    return [name for name, fmt in plan.items() if fmt != "bf16"]
