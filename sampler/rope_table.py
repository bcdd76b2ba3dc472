"""The engine's rotary cos/sin as two gathers from tables built once, instead of HF's computation every forward.

    rope_tables(model, max_len)     # by EmbeddedEngine, on its own model; True when installed
                                    # (again by a later engine: a longer table, or another device/dtype)

HF's rotary module (`model.model.rotary_emb`) computes cos and sin of position
x inverse frequency at every forward: the product (a K = 1 batched matmul in
transformers 5.17), a cat, cos, sin, two scalings and two casts, ~9 launches
a decode step. Each entry depends on its position alone, so a table of
positions 0..max_len-1 computed by the module's own forward, on the engine's
device, holds the values every later call would compute; the replacement
gathers its rows (`index_select`, one launch each for cos and sin).

Installed only when (a) the module's frequencies do not change with the
length (HF rescales "dynamic" and "longrope" types as sequences grow), (b)
the tables fit in `MAX_BYTES`, and (c) a probe on the engine's device gives
the module's own bits: positions in another shape than the table's, and a
one-position call. At run time inputs of another dtype or device than the
table's (the model's embedding output) take the module's forward.

Leaves out: the trainer (it computes them once a micro-batch: the same bits),
rotary modules of other shapes (no `rope_type`, other call signature).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

MAX_BYTES = 64 << 20
"""Largest pair of tables built (max_len x head_dim x 2 x the dtype's size); longer contexts keep HF's forward."""


def _forward(module: nn.Module, orig_forward, tables: dict, x: torch.Tensor, position_ids: torch.Tensor):
    table = tables.get((x.device, x.dtype))
    if table is None:
        return orig_forward(x, position_ids)
    cos, sin = table
    flat, shape = position_ids.reshape(-1), (*position_ids.shape, cos.shape[-1])
    return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)


def _build(orig_forward, max_len: int, x: torch.Tensor):
    """(cos, sin) tables of positions [0, max_len) from the module's own forward, or None when they would not
    qualify (module doc: shape, size, probe)."""
    try:
        with torch.no_grad():
            cos, sin = orig_forward(x, torch.arange(max_len, device=x.device)[None])
    except Exception:  # noqa: BLE001 - a rotary module of another signature keeps its forward
        return None
    if not isinstance(cos, torch.Tensor) or cos.dim() != 3 or cos.shape[:2] != (1, max_len) \
            or 2 * cos.numel() * cos.element_size() > MAX_BYTES:
        return None
    table = (cos[0].contiguous(), sin[0].contiguous())
    g = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, max_len, (3, 5), generator=g), torch.tensor([[max_len - 1]])]
    with torch.no_grad():
        for pos in probes:
            pos = pos.to(x.device)
            want, got = orig_forward(x, pos), _forward(None, None, {(x.device, x.dtype): table}, x, pos)
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got)):
                return None
    return table


def rope_tables(model: nn.Module, max_len: int) -> bool:
    """Serve `model.model.rotary_emb` from tables of positions [0, max_len) if it qualifies (module doc).

    A later engine on the same model with a longer context or another device or dtype gets its own table
    (built and probed the same way); where that one does not qualify, its (device, dtype) goes back to the
    module's forward. Replaced tables stay alive as long as the model (at most `MAX_BYTES` each, one per engine
    that needed a longer one): an earlier engine's CUDA graphs read them.
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return False
    state = getattr(rotary, "_rl4bit_rope_state", None)
    if state is None and getattr(rotary, "_rl4bit_rope_table", False):
        return True  # marked by the caller: keep the module's forward
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope" or max_len < 2:
        return False
    emb = model.get_input_embeddings().weight
    x = torch.zeros(1, 1, 1, dtype=emb.dtype, device=emb.device)
    key = (x.device, x.dtype)
    if state is not None:
        have = state["tables"].get(key)
        if have is not None and have[0].shape[0] >= max_len:
            return True
    table = _build(state["orig"] if state else rotary.forward, max_len, x)
    if state is None:
        if table is None:
            return False
        state = {"orig": rotary.forward, "tables": {}, "kept": []}
        rotary.forward = functools.partial(_forward, rotary, state["orig"], state["tables"])
        rotary._rl4bit_rope_state = state
        rotary._rl4bit_rope_table = True
    old = state["tables"].pop(key, None)
    if old is not None:
        state["kept"].append(old)
    if table is not None:
        state["tables"][key] = table
    return table is not None
