"""Which rows of a forward are padding: set by the embedded engine, read by the fused MoE router.

    with padding.live_rows(live):      # live: int [rows] on the model's device, 0 where a row is padding
        model(...)

The engine pads every forward to at least `kv_cache.MIN_ROWS` rows and each decode graph to its bucket's row
count. Padding rows run on a dummy token, and in an MoE layer the router would send them to experts of their
own (at batch 1 the step's expert GEMMs would read twice the weights the real token needs). Under `live_rows`
the fused router gives every padding row row 0's logits, weights and experts. A real row's outputs do not
change (its routing is its own, every expert kernel is batch-invariant); padding outputs stay finite and unread.
The mask is a device tensor, so a CUDA graph captured under it reads each replay's mask. Outside the context
every row is live; the router's torch path does the same (`fused_router.padding_on_row_0`). The gain:
`bench rollout --compare-unmarked`.

Leaves out: routers rl4bit does not fuse, which route padding rows as any row (same outputs, only slower).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_LIVE: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("rl4bit_live_rows", default=None)
_IGNORED: contextvars.ContextVar[bool] = contextvars.ContextVar("rl4bit_padding_ignored", default=False)


@contextlib.contextmanager
def live_rows(live: torch.Tensor | None):
    """Mark the rows of the forwards run inside: `live` int32 or int64 [rows], non-zero for a real row (row 0 must
    be one), or None (every row live)."""
    if live is not None and (live.dim() != 1 or live.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"live_rows: need an int32 or int64 [rows] mask, got {live.dtype} {tuple(live.shape)}")
    token = _LIVE.set(live)
    try:
        yield
    finally:
        _LIVE.reset(token)


@contextlib.contextmanager
def ignored():
    """Forwards inside route padding rows as any row, marked or not (what the router did before the mark): the
    A/B of `python -m rl4bit.bench.rollout --compare-unmarked`."""
    token = _IGNORED.set(True)
    try:
        yield
    finally:
        _IGNORED.reset(token)


def current(rows: int, device: torch.device) -> torch.Tensor | None:
    """The live mask of a forward over `rows` rows on `device`, or None: outside `live_rows`, inside `ignored`, or
    a call of another row count or device (a module run on other rows than the forward's, which has no mask)."""
    live = _LIVE.get()
    if live is None or _IGNORED.get() or live.numel() != rows or live.device != device:
        return None
    return live
