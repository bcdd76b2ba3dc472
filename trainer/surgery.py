"""Convert a Hugging Face transformers 5.x model in place to run a recipe.

    plan = convert_model(model, RecipeConfig(name="nvfp4"))   # {module: fmt}
    set_step(model, step)                                      # before each optimizer step

What it does, from `rl4bit.trainer.plan.quant_plan` (the single source of the
quantization scope):
- fused-experts modules (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE in 5.x: 3D
  `gate_up_proj` / `down_proj`) become `QuantExperts` under every recipe
  (bf16 too, so all recipes share one routing/grouping code path);
- under scope "all_linear", attention / dense-MLP linears become `QuantLinear`;
- routers compute their logits in FP32 (autocast off, FP32 input and weight), Qwen3-MoE-style ones
  (softmax, top-k, renormalize) in one fused kernel on CUDA (`rl4bit.trainer.fused_router`);
- parameters are made FP32 (master weights; AdamW state follows them). Run
  the forward under `torch.autocast(device, torch.bfloat16)`: BF16 compute,
  FP32 master weights. Everything else (attention math, norms, embeddings,
  lm_head) is left to transformers, except that
- HF RMSNorms run one fused kernel on CUDA (`rl4bit.kernels.rmsnorm`), and Qwen3-style attention its
  q/k norms and rotary embedding in one more (`rl4bit.trainer.fused_attention`): trainer and samplers
  alike, since both convert their model here; and pre-norm decoder layers add the attention's residual
  inside the post-attention norm's kernel and, over `QuantExperts`, the MoE block's inside the combine
  (`rl4bit.trainer.fused_layer`).
Parameter names do not change, so `model.state_dict()` loads into a plain
transformers model of the same config.

Leaves out: unfused (per-expert nn.Linear) MoE layouts of older
transformers, which would need a different grouping hook.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from rl4bit.common.checkpoint_format import expert_weight_shapes
from rl4bit.kernels.rmsnorm import fuse_norms
from rl4bit.trainer.fused_attention import fuse_attentions
from rl4bit.trainer.fused_layer import fuse_layers
from rl4bit.trainer.fused_router import fuse_router, kernel_forward
from rl4bit.trainer.modules import QuantExperts, QuantLinear
from rl4bit.trainer.plan import _is_router, quant_plan
from rl4bit.trainer.qgemm import GemmSpec
from rl4bit.trainer.recipe import RecipeConfig


def gemm_spec(recipe: RecipeConfig, fmt: str) -> GemmSpec:
    """The GemmSpec of a module planned as `fmt` under `recipe`."""
    return GemmSpec(
        fmt=fmt,
        four_over_six=recipe.four_over_six,
        tiles_16x16=recipe.weight_tiles_16x16,
        stochastic_requant=recipe.stochastic_requant,
        grad_rounding=recipe.grad_rounding,
    )


def _fp32_router_forward(module: nn.Module, orig_forward, hidden_states, *args, **kwargs):
    """The router in FP32, autocast off: the fused kernel rounds a BF16 stream's rows to FP32 itself (the cast's
    bits without its launch), else the module's forward on the cast input."""
    with torch.autocast(hidden_states.device.type, enabled=False):
        out = None if args or kwargs else kernel_forward(module, hidden_states, torch.float32)
        return orig_forward(hidden_states.float(), *args, **kwargs) if out is None else out


def _make_router_fp32(module: nn.Module) -> None:
    if getattr(module, "_rl4bit_fp32_router", False):
        return
    module.forward = functools.partial(_fp32_router_forward, module, module.forward)
    module._rl4bit_fp32_router = True


def convert_model(model: nn.Module, recipe: RecipeConfig, *, master_dtype=torch.float32) -> dict[str, str]:
    """Swap in quantized modules per the plan, in place; returns the plan. Raises ValueError on unsupported shapes."""
    plan = quant_plan(model, recipe)
    model.to(master_dtype)
    modules = dict(model.named_modules())
    for layer_id, (name, fmt) in enumerate(plan.items()):
        module = modules[name]
        if isinstance(module, (QuantExperts, QuantLinear)):
            raise ValueError(f"{name} is already converted; convert a fresh model")
        if expert_weight_shapes(module) is not None:
            new = QuantExperts(module, gemm_spec(recipe, fmt), recipe.seed, layer_id)
        elif isinstance(module, nn.Linear) and fmt != "bf16":
            new = QuantLinear.from_linear(module, gemm_spec(recipe, fmt), recipe.seed, layer_id)
        else:
            if _is_router(name, module):
                fuse_router(module)  # the kernel under the FP32 wrap: it sees FP32 input, autocast off
                _make_router_fp32(module)
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
    fuse_norms(model)
    fuse_attentions(model)  # after the norms: its probe and the layers' check for fused norms
    fuse_layers(model)
    return plan


def quant_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the converted (QuantExperts / QuantLinear) modules."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (QuantExperts, QuantLinear))}


def set_step(model: nn.Module, step: int) -> None:
    """Key every stochastic rounding of the next forward/backward on `step` (call once per optimizer step)."""
    for m in quant_modules(model).values():
        m.set_step(step)


def quantized_weights(model: nn.Module) -> dict[str, dict]:
    """{module name: {param name: QTensor}} exactly as the forward uses them (quantized modules only)."""
    return {n: m.quantized_weights() for n, m in quant_modules(model).items() if m.spec.fmt != "bf16"}


def load_quantized(model: nn.Module, qweights: dict[str, dict]) -> None:
    """Put every quantized module named in `qweights` into serving mode from its QTensors."""
    mods = quant_modules(model)
    missing = sorted(set(qweights) - set(mods))
    if missing:
        raise ValueError(f"no quantized module named {missing[:3]}; convert the model with the same recipe first")
    for name, q in qweights.items():
        mods[name].load_quantized(q)
