"""The engine's rotary cos/sin as two gathers from tables built once, instead of HF's computation every forward.

    rope_tables(model, max_len)     # by EmbeddedEngine, on its own model; True when installed

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


def rope_tables(model: nn.Module, max_len: int) -> bool:
    """Serve `model.model.rotary_emb` from tables of positions [0, max_len) if it qualifies (module doc)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None or getattr(rotary, "_rl4bit_rope_table", False):
        return rotary is not None
    rope_type = getattr(rotary, "rope_type", None)
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope" or max_len < 2:
        return False
    emb = model.get_input_embeddings().weight
    x = torch.zeros(1, 1, 1, dtype=emb.dtype, device=emb.device)
    try:
        with torch.no_grad():
            cos, sin = rotary(x, torch.arange(max_len, device=emb.device)[None])
    except Exception:  # noqa: BLE001 - a rotary module of another signature keeps its forward
        return False
    if not isinstance(cos, torch.Tensor) or cos.dim() != 3 or cos.shape[:2] != (1, max_len) \
            or 2 * cos.numel() * cos.element_size() > MAX_BYTES:
        return False
    tables = {(x.device, x.dtype): (cos[0].contiguous(), sin[0].contiguous())}
    g = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, max_len, (3, 5), generator=g), torch.tensor([[max_len - 1]])]
    with torch.no_grad():
        for pos in probes:
            pos = pos.to(emb.device)
            want, got = rotary(x, pos), _forward(rotary, None, tables, x, pos)
            if not all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got)):
                return False
    rotary.forward = functools.partial(_forward, rotary, rotary.forward, tables)
    rotary._rl4bit_rope_table = True
    return True
