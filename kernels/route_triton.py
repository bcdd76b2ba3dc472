"""The MoE grouping of a small batch in one Triton kernel: stable order by expert, token of each entry, counts.

    order, tok, counts, inv, _, offs = expert_order(top_k_index.reshape(-1), num_experts, k)

is, for a flat index of at most MAX_ENTRIES entries (a decode step's routing), exactly torch's
``argsort(flat, stable=True)``, ``order // k``, ``bincount(flat, num_experts)``, ``inv[order] = arange(n)`` and
``cumsum(counts)`` (`expert_order` gives dtypes and the expert-parallel sentinel), optionally with the grouped
GEMMs' tile map. One program: a bitonic sort (`tl.sort`) of the unique keys `expert * BLOCK + entry` and a
histogram. Integers only, so the results are exactly torch's (tested against `argsort` / `bincount`); what it
saves is kernels: torch's version is about six launches, one of the decode step's costs (kernel count, not
bytes). Larger inputs (training) keep torch's ops.

Leaves out: torch's order among distinct out-of-range indices (the caller's routing never makes them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rl4bit.kernels.invariant_triton import _on_device
from rl4bit.kernels.tile_map_triton import map_tiles, n_row_tiles

MAX_ENTRIES = 4096
"""Largest flat index the one-program kernel takes (a 4096-key bitonic sort in registers)."""


def route_warps(block: int, e_pad: int) -> int:
    """Warps of the one program for a padded index of `block` entries over `e_pad` histogram bins (the experts
    and the EP sentinel, padded to a power of 2); integers, so any count gives the same results. One warp
    where both are at most 64 (a decode step of up to 16 tokens at top-4 over up to 63 experts): every
    reduction, scan and sort stays in one warp's shuffles (fewer instructions and barriers in the sm_90 SASS);
    more bins or entries spread over 4 warps, 8 above 256 entries. Counts from `scripts/sweep_route.py`; figures
    in docs/performance.md."""
    return 1 if block <= 64 and e_pad <= 64 else 4 if block <= 256 else 8


@triton.jit
def _route_kernel(idx_ptr, order_ptr, tok_ptr, inv_ptr, counts_ptr, offs_ptr, map_ptr, N, E, T, K: tl.constexpr,
                  BLOCK: tl.constexpr, E_PAD: tl.constexpr, MAP_BLOCK_M: tl.constexpr, T_BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    live = offs < N
    e = tl.load(idx_ptr + offs, mask=live, other=E)
    e = tl.where((e < 0) | (e > E), E, e).to(tl.int32)  # padding and anything outside [0, E): the sentinel E
    order = tl.sort(e * BLOCK + offs) % BLOCK  # keys are unique: ties cannot reorder, so the sort is stable
    tl.store(order_ptr + offs, order.to(tl.int64), mask=live)
    tl.store(tok_ptr + offs, (order // K).to(tl.int64), mask=live)
    tl.store(inv_ptr + order, offs.to(tl.int64), mask=live)  # order maps live places onto live entries
    counts = tl.histogram(e, E_PAD)
    bins = tl.arange(0, E_PAD)
    c = tl.where(bins < E, counts, 0).to(tl.int32)  # the experts' counts, the sentinel's bin zeroed
    tl.store(counts_ptr + bins, c, mask=bins < E)
    tl.store(offs_ptr + bins, tl.cumsum(c, 0), mask=bins < E)
    if MAP_BLOCK_M > 0:  # the grouped GEMMs' tile map of these counts (integers: `tile_map`'s values exactly)
        map_tiles(c, bins, T, map_ptr, 0, 1, MAP_BLOCK_M, T_BLOCK)


def expert_order(flat: torch.Tensor, num_experts: int, k: int, map_block_m: int = 0, num_warps: int | None = None):
    """(order int64, tok int64, counts int32 [E], inv int64, tile map or None, offs int32 [E]) of a flat int index
    of <= MAX_ENTRIES entries (see module doc); map_block_m > 0: also the grouped GEMMs' tile map of the counts for
    row tiles of that many rows (`tile_map_triton.tile_map(counts, N, map_block_m)`'s int32 [3, T]), in the same
    launch. num_warps: the program's warps (None: `route_warps`; the results never depend on it).

        order = argsort(flat, stable=True)      int64: entries grouped by expert, entry order kept within one
        tok = order // k                        int64: the token each grouped entry came from
        counts = bincount(flat, num_experts)    int32 [E]: entries per expert (an index >= E is not counted and,
                                                being the largest key, sorts last: the EP sentinel)
        inv[order] = arange(n)                  int64: each entry's place in the grouped order (the combine's)
        tile map (optional)                     int32 [3, T]: `tile_map_triton.tile_map(counts, n, block_m)`, for
                                                the grouped GEMMs that follow (one launch fewer a layer)
        offs = cumsum(counts)                   int32 [E]: each expert's end row, `torch._grouped_mm`'s offs
                                                (the BF16 experts' two cumsums, four launches, gone)

    Exactly torch's for indices in [0, E] (E: the expert-parallel sentinel). Any index outside [0, E) counts as
    that sentinel here: sorts last, in entry order, uncounted (torch would order distinct out-of-range values by
    value, and negative ones first); never an out-of-bounds write. Torch's version is about six launches (sort,
    index fill, zeros, ones, index_add, floor divide)."""
    n = flat.numel()
    if n > MAX_ENTRIES or flat.dim() != 1 or flat.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expert_order: a 1-D int index of <= {MAX_ENTRIES} entries, got {tuple(flat.shape)} "
                         f"{flat.dtype}; larger inputs take torch.argsort / bincount")
    order = torch.empty(n, dtype=torch.int64, device=flat.device)
    tok = torch.empty(n, dtype=torch.int64, device=flat.device)
    inv = torch.empty(n, dtype=torch.int64, device=flat.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    n_tiles = n_row_tiles(n, num_experts, map_block_m) if map_block_m > 0 else 0
    cmap = torch.empty((3, n_tiles), dtype=torch.int32, device=flat.device) if map_block_m > 0 else None
    block, e_pad = triton.next_power_of_2(max(n, 2)), triton.next_power_of_2(num_experts + 1)  # + the sentinel
    with _on_device(flat):
        _route_kernel[(1,)](flat.contiguous(), order, tok, inv, counts, offs, counts if cmap is None else cmap, n,
                            num_experts, n_tiles, K=k, BLOCK=block, E_PAD=e_pad,
                            MAP_BLOCK_M=map_block_m, T_BLOCK=min(64, triton.next_power_of_2(max(n_tiles, 2))),
                            num_warps=num_warps or route_warps(block, e_pad))
    return order, tok, counts, inv, cmap, offs
