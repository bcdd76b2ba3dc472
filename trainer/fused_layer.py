"""Pre-norm decoder layers with the attention's residual add inside the post-attention RMSNorm's kernel.

    fuse_layer(layer)     # by `trainer.surgery.convert_model`, after the norms are fused; trainer and samplers alike

HF's pre-norm decoder layer (Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE, Llama...) computes h = x + attn(norm1(x)),
then h + mlp(norm2(h)), each `+` a launch of its own. The replacement forward computes the first sum and its norm
in one kernel (`rmsnorm.add_rms_norm`: the same bits as the add followed by the fused norm), and for a sparse MoE
block of `QuantExperts` the MoE combine adds the residual (`trainer.combine`, the same bits). Gradients run the
kernels too, so trainer, logprob recompute and samplers take one path; a layer in training mode runs HF's
forward. `fuse_layer` installs it only where it reproduces the layer's own forward bitwise on a probe
(`reproduces`); at run time it runs when the fused kernels are on and the call passes only the hidden states
positionally, else HF's forward.

Leaves out: the residual add of dense MLPs and other MoE blocks; fusing it with the next layer's input norm."""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch import nn

from rl4bit.kernels import fused
from rl4bit.kernels.rmsnorm import add_reference, add_rms_norm

_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def _defaults(layer: nn.Module) -> dict | None:
    """The named arguments of the layer's own forward with their defaults (HF passes each on to the attention,
    given or not), or None when the signature is not one this replaces."""
    return _class_defaults(type(layer))


@functools.lru_cache(maxsize=None)
def _class_defaults(cls) -> dict | None:
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return None
    named = [p for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.default is p.empty for p in named):
        return None
    return {p.name: p.default for p in named}


def _forward(module: nn.Module, orig_forward, hidden_states: torch.Tensor, *args, use_reference: bool = False,
             **kwargs):
    if args or not isinstance(hidden_states, torch.Tensor) or module.training \
            or not fused.enabled(hidden_states.device.type) and not use_reference:
        # training mode: dropout, router jitter and transformers' own checkpointing live in HF's forward (rl4bit's
        # trainer and samplers run the model in eval mode)
        return orig_forward(hidden_states, *args, **kwargs)
    post = module.post_attention_layernorm
    add_norm = add_reference if use_reference else add_rms_norm
    h = module.input_layernorm(hidden_states)
    h, _ = module.self_attn(hidden_states=h, **{**_defaults(module), **kwargs})
    x, h = add_norm(h, hidden_states, post.weight, post.variance_epsilon)
    if getattr(module.mlp, "_rl4bit_residual_block", False):
        return _moe_block(module.mlp, h, x)
    return x + module.mlp(h)


def _moe_block(block: nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + the sparse MoE block's forward on hidden_states, the add done by the experts' combine."""
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    _, weights, index = block.gate(flat)
    return block.experts(flat, index, weights, residual=residual.reshape(flat.shape)).reshape(residual.shape)


class _ProbeAttention(nn.Module):
    """Stand-in attention: records its arguments, returns a function of its input."""

    def forward(self, hidden_states, **kwargs):
        self.seen = kwargs
        return hidden_states * 1.5 + 0.25, None


class _ProbeMLP(nn.Module):
    def forward(self, hidden_states):
        return hidden_states * 0.75 - 0.5


def reproduces(layer: nn.Module) -> bool:
    """True when `_forward` equals the layer's own forward bitwise on a probe.

    The probe: a shallow copy of the layer whose attention and MLP are stand-ins (the norms copies of its own with
    distinct random weights), every kernel off, called with each named argument of the original forward set to a
    marker, and with none of them (HF's defaults); the replacement must give the same output and hand the
    attention the same arguments. A layer of another shape (parallel attention and MLP, norms after the
    sublayers, an extra output) keeps its forward. The post-attention norm must be a fused HF RMSNorm."""
    if not all(isinstance(getattr(layer, p, None), nn.Module) for p in _PARTS):
        return False
    post = layer.post_attention_layernorm
    if not getattr(post, "_rl4bit_fused_norm", False) or post.weight.device.type == "meta":
        return False
    defaults = _defaults(layer)
    if defaults is None:
        return False
    markers = {name: object() for name in defaults}
    if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(type(layer).forward).parameters.values()):
        markers["rl4bit_probe"] = object()  # passed through **kwargs
    g = torch.Generator().manual_seed(0)
    norms = {}
    for name in ("input_layernorm", "post_attention_layernorm"):  # distinct random weights: a layer that uses
        norms[name] = copy.deepcopy(getattr(layer, name))  # one norm where the other belongs must show
        with torch.no_grad():
            norms[name].weight.copy_(torch.randn(norms[name].weight.shape, generator=g) + 1)
    x = (torch.randn(2, 3, post.weight.shape[0], generator=g) * 2).to(post.weight.dtype).to(post.weight.device)
    for given in (markers, {}):  # every named argument given, and none (HF's defaults passed on)
        runs = []
        for attempt in ("layer", "replacement"):
            probe = copy.copy(layer)
            probe._modules = dict(layer._modules)  # the copy's own submodule table: the layer keeps its modules
            probe.self_attn, probe.mlp = _ProbeAttention(), _ProbeMLP()
            probe.input_layernorm, probe.post_attention_layernorm = norms["input_layernorm"], \
                norms["post_attention_layernorm"]
            probe.training = False  # the replacement runs in eval mode only (`_forward`); the copy's flag alone
            try:
                with torch.no_grad(), fused.disabled():
                    if attempt == "layer":
                        out = type(layer).forward(probe, x, **given)
                    else:
                        out = _forward(probe, None, x, use_reference=True, **given)
            except Exception:  # noqa: BLE001 - a forward of another signature is not the one this replaces
                return False
            runs.append((out, probe.self_attn.seen))
        (want, seen_want), (got, seen_got) = runs
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.dtype == got.dtype
                and torch.equal(want, got) and seen_want.keys() == seen_got.keys()
                and all(seen_want[k] is seen_got[k] for k in seen_want)):
            return False
    return True


class _ProbeGate(nn.Module):
    def forward(self, hidden_states):
        return None, torch.sigmoid(hidden_states[:, :2]), (hidden_states[:, 2:4] > 0).long()


class _ProbeExperts(nn.Module):
    def forward(self, hidden_states, top_k_index, top_k_weights, residual=None):
        out = hidden_states * 2 + top_k_weights.sum(-1, keepdim=True) + top_k_index.sum(-1, keepdim=True)
        return out if residual is None else residual + out


def residual_block(block: nn.Module) -> bool:
    """True when `block` is a sparse MoE block whose experts take `residual` (`QuantExperts`) and whose forward is
    `experts(x, *gate(x)[:0:-1])` over the tokens' rows: `_moe_block` reproduces it on a probe (stand-in gate and
    experts on a shallow copy, so a shared expert or any other term shows), and can hand the add to the combine."""
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if not isinstance(gate, nn.Module) or not isinstance(experts, nn.Module):
        return False
    try:
        if "residual" not in inspect.signature(experts.forward).parameters:
            return False
    except (TypeError, ValueError):
        return False
    probe = copy.copy(block)
    probe._modules = dict(block._modules)
    probe.gate, probe.experts = _ProbeGate(), _ProbeExperts()
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    try:
        with torch.no_grad():
            want = r + type(block).forward(probe, x)
            got = _moe_block(probe, x, r)
    except Exception:  # noqa: BLE001 - another block's forward (other arguments, other outputs)
        return False
    return isinstance(want, torch.Tensor) and want.shape == got.shape and torch.equal(want, got)


def fuse_layer(layer: nn.Module) -> bool:
    """Route `layer`'s forward through `_forward` if it reproduces it (see `reproduces`); idempotent."""
    if getattr(layer, "_rl4bit_fused_layer", False):
        return True
    if not fused.install(layer, "_rl4bit_fused_layer", "DecoderLayer", reproduces, _forward):
        return False
    if residual_block(layer.mlp):
        layer.mlp._rl4bit_residual_block = True
    return True


def layer_forward(layer: nn.Module):
    """`layer`'s forward as installed here (the fused one where `fuse_layer` took it, else the class's), bound
    to `layer`: for wrappers that replace the instance's forward and call it themselves (`trainer.recompute`)."""
    base = functools.partial(type(layer).forward, layer)
    if getattr(layer, "_rl4bit_fused_layer", False):
        return functools.partial(_forward, layer, base)
    return base


def fuse_layers(model: nn.Module) -> list[str]:
    """`fuse_layer` on every module of `model`; returns the names of the fused ones."""
    return [name for name, m in model.named_modules() if fuse_layer(m)]
