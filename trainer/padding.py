"""Which rows of a forward are padding: set by the embedded engine, read by the fused MoE router.

    with padding.live_rows(live):      # live: int [rows] on the model's device, 0 where a row is padding
        model(...)

The engine pads every forward to at least `kv_cache.MIN_ROWS` rows (16) and each decode graph to its bucket's
row count. Padding rows are real computations on a dummy token (0 at position 0, in a scratch cache slot), and
in an MoE layer the router sends them to experts of their own: at batch 1 the padding picks about top-k experts
beside the real row's, so the step's expert GEMMs read twice the weights the one real token needs. Under
`live_rows` the fused router (`trainer/fused_router.py`, `kernels/router_triton.py`) gives every padding row
row 0's logits, weights and experts, so padding rows land on experts a real row already reads. A real row's outputs do not change: its
routing is its own, and every expert kernel computes a row from that row alone (their batch invariance).
Padding rows' outputs stay finite values that nothing reads. Measured (twentieth session, H100, `bench_rollout
--compare-unmarked`): the batch-1 decode step 1.17x faster in the BF16 engine, 1.04x in the NVFP4 engine (its
grouped GEMM 13.0 -> 10.9 µs a call; the rest of its gap to a 4-row call is the grid, `qgemm_triton.tile_first`).

The mask is a device tensor so that a CUDA graph captured under it reads each replay's mask (the decode graphs
keep it as row 3 of their static input buffer, which the host rewrites before each replay). Outside the context
(the trainer, the other backends) every row is live.

The fused router's torch path (kernels off, the CPU engine) does the same with three `torch.where`s on HF's
outputs (`fused_router.padding_on_row_0`). Leaves out: routers rl4bit does not fuse (other formulas keep HF's
forward), which route padding rows as any row: the same real outputs, only slower.
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
    A/B of `python -m rl4bit.bench_rollout --compare-unmarked`."""
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
