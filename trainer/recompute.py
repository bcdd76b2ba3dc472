"""Activation recomputation per decoder layer (`trainer.recompute`), bit for bit the plain backward.

    enable_recompute(model)   # after the recipe conversion (and after any deepcopy of the model)

Each decoder layer (every transformers ``GradientCheckpointingLayer``) runs under ``torch.utils.checkpoint``
(non-reentrant) when gradients are on, wrapped here rather than through ``gradient_checkpointing_enable``, which
needs training mode (the trainer keeps eval mode). Activation memory drops to one layer's saved tensors plus the
layer inputs, for a second forward's compute. The gradients keep their bits: the forward is deterministic, the
original autograd graph is kept (so each quantized GEMM's backward reads the stochastic-rounding keys its
original forward stored), and checkpoint's ``context_fn`` restores, for the re-run, the two pieces of state that
could differ: the attention/experts implementation choice (``model_implementations``) and the quantized modules'
call counters (a re-run would advance them, shifting later micro-batches' keys). tests/rl/test_recompute.py
checks parameters bitwise with and without it.

Leaves out: selective recomputation (attention only, experts only), CPU offload of the layer inputs."""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rl4bit.trainer.fused_layer import layer_forward


def _counters(model: nn.Module) -> list[nn.Module]:
    """The modules whose `calls` counter keys stochastic rounding (quantized linears, experts, EP experts)."""
    return [m for m in model.modules() if hasattr(m, "calls") and hasattr(m, "set_step")]


IMPL_ATTRS = ("_attn_implementation", "_experts_implementation")
"""Config attributes that pick the attention / experts functions (set by the caller's `model_implementations`
context, which has exited when the backward re-runs a layer)."""


class _Rewind:
    """The forward-time state a layer's re-run must see: entering sets the SR call counters and the model config's
    implementation choices to their values at the original forward; leaving puts the live values back."""

    def __init__(self, modules: list[nn.Module], config, snapshot: tuple[list[int], dict]):
        self.modules, self.config, self.snapshot, self.live = modules, config, snapshot, None

    @staticmethod
    def state(modules, config) -> tuple[list[int], dict]:
        return [m.calls for m in modules], {a: getattr(config, a) for a in IMPL_ATTRS if hasattr(config, a)}

    def _apply(self, state) -> None:
        calls, impls = state
        for m, c in zip(self.modules, calls):
            m.calls = c
        for a, v in impls.items():
            setattr(self.config, a, v)

    def __enter__(self):
        self.live = self.state(self.modules, self.config)
        self._apply(self.snapshot)
        return self

    def __exit__(self, *exc):
        self._apply(self.live)
        return False


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_recompute(model: nn.Module) -> int:
    """Checkpoint every decoder layer, rewinding the SR call counters on the re-run; returns the layer count."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.recompute: found no decoder layers (transformers GradientCheckpointingLayer) in "
                         f"{type(model).__name__}; set trainer.recompute=false")
    modules, config = _counters(model), model.config

    def context_fn():
        return contextlib.nullcontext(), _Rewind(modules, config, _Rewind.state(modules, config))

    def checkpointed(self, *args, **kwargs):
        forward = layer_forward(self)  # the class's (or the fused) forward of this layer: right after a deepcopy too
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    for layer in layers:
        if not getattr(layer, "_rl4bit_recompute", False):
            layer.forward = types.MethodType(checkpointed, layer)
            layer._rl4bit_recompute = True
    return len(layers)
