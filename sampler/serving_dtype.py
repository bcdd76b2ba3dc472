"""Serving copies in the compute dtype: weights the forward only reads through a cast to the autocast dtype.

The policy holds FP32 master weights and runs under BF16 autocast
(`rl4bit.trainer.models.autocast_dtype`), and the embedded sampler runs the same
forward so that both compute the same bits. Most weights are only ever read
through a cast to BF16: an `nn.Linear` under autocast (`F.linear` casts its
weight and bias), and the `bf16` recipe's experts (`w.to(compute dtype)`).
A sampler that keeps those weights in FP32 re-casts them at every forward:
one cast kernel per linear and step, and for the bf16 recipe's experts all of
their FP32 bytes read once a decode step (inside a CUDA graph the autocast
cast cache is off). `precast(model, dtype)` stores them in `dtype` once; the
autocast cast of a BF16 tensor to BF16 is the identity, and `Tensor.to` rounds
FP32 to BF16 exactly as autocast does (round to nearest even), so the forward's
bits do not change (tests/rl/test_bf16_compute.py checks sampler and trainer
logprobs for exact equality; tests/sampler/test_serving_dtype.py the engine).

Kept in FP32: everything read in FP32 arithmetic (norm weights, embeddings,
routers: surgery runs them in FP32, replacing their forward on the object, and
a module with a replaced or hooked forward is never cast), and any parameter
shared with such a module (tied input/output embeddings). Weight updates carry
FP32 masters; the receiver casts them to the live dtype (`weight_sync`, or
`EmbeddedEngine.update_weights` for pre-cast names), the same rounding again.

Leaves out: quantized serving modules (they hold QTensors already), plain HF
experts modules (`invariant_experts`), models without autocast.
"""

from __future__ import annotations

import torch
from torch import nn


def _reads_through_cast(module: nn.Module, param: str) -> bool:
    """True when `module`'s forward reads `param` only through a cast to the autocast (compute) dtype."""
    from rl4bit.trainer.modules import QuantExperts

    if "forward" in vars(module) or module._forward_hooks or module._forward_pre_hooks:
        return False  # a forward replaced on the object (e.g. surgery's FP32 router) or hooked: unknown reads
    if type(module) is nn.Linear:  # not subclasses: QuantLinear and others have their own forward
        return param in ("weight", "bias")
    if isinstance(module, QuantExperts) and module.spec.fmt == "bf16" and module.served is None:
        return param in ("gate_up_proj", "down_proj")  # QuantExperts._gemm: .to(x.dtype), x in the compute dtype
    return False


def precast(model: nn.Module, dtype: torch.dtype | None) -> set[str]:
    """Store every parameter the forward reads only through a cast to `dtype` in `dtype`; their names.

    Changes `model` in place (new Parameter objects: do not share it with a
    trainer). A parameter qualifies only when every module that holds it reads
    it that way (a tied weight also used by an embedding stays). Qualifying
    parameters already in `dtype` (a model precast before) are named too, so
    every engine over the model accepts FP32 updates for them. The converted
    tensors are new Parameters (requires_grad False: serving only), shared again
    by every module that held the old one. None: no autocast, nothing to do.
    """
    if dtype is None:
        return set()
    holders: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((f"{mname}.{pname}" if mname else pname, module, pname))
    done: set[str] = set()
    for refs in holders.values():
        _, module, pname = refs[0]
        p = module._parameters[pname]
        if not p.is_floating_point() or not all(_reads_through_cast(m, n) for _, m, n in refs):
            continue
        if p.dtype != dtype:
            cast = nn.Parameter(p.detach().to(dtype), requires_grad=False)
            for _, m, n in refs:
                m._parameters[n] = cast
        done.update(name for name, _, _ in refs)
    return done
