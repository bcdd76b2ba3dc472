"""Row tiles of the grouped (per-expert) GEMMs: which rows each program owns, in which order programs start,
how a tile is addressed and stored. Shared by qgemm_triton (NVFP4), mxfp8_gemm_triton (MXFP8 backward),
invariant_triton (BF16) and route_triton (the routing kernel builds the same map in its own launch).

    cmap = tile_map(counts, rows, block_m, device)     # int32 [3, T]: (expert or -1, first row, end row) a tile
    e, row0, row1 = map_entry(cmap_ptr, T, t)          # in a kernel: row tile t
    t, n = tile_first(N, BLOCK_N)                      # this program's (row tile, column tile), live tiles first
    store_tile(out_tile, acc, n_rows, n_cols, col0, LD, BLOCK_M, BLOCK_N)   # the epilogue, after the K loop

A tile never spans two experts and its rows come from the counts alone, so which program computes a row (and
the grid's size) never changes its bits; with counts on the device nothing reads the host (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def as_counts(counts, groups: int, device):
    """counts checked against the expert count: a list of ints stays a list, a tensor becomes int32 on `device`."""
    if isinstance(counts, torch.Tensor):
        c = counts.to(device=device, dtype=torch.int32).reshape(-1)
        n = c.numel()
    else:
        c = [int(m) for m in counts]
        n = len(c)
    if n != groups:
        raise ValueError(f"counts has {n} entries but the weight has {groups} experts; pass one count per expert")
    return c


@triton.jit
def map_entry(map_ptr, n_tiles, t):
    """(expert or -1, first row, end row) of row tile t in a `tile_map` [3, n_tiles]: what each grouped kernel
    (qgemm_triton's, mxfp8_gemm_triton's, invariant_triton's) reads first; an expert of -1 is a tile to skip."""
    return tl.load(map_ptr + t), tl.load(map_ptr + n_tiles + t), tl.load(map_ptr + 2 * n_tiles + t)


@triton.jit
def map_tiles(c, ei, T, map_ptr, part, parts, BLOCK_M: tl.constexpr, T_BLOCK: tl.constexpr):
    """Store part `part` of `parts` of the `tile_map` [3, T] of the counts c (int32 [E_PAD], zero past the last
    expert) of experts ei, expert by expert: expert e's j-th tile is map[:, tiles before e + j] = (e, rows
    before e + j * BLOCK_M, rows up to e's last), then (-1, 0, 0) in the tiles past the last expert's. Integers:
    `tile_map`'s values exactly. Each tile index has one owner, found by two prefix sums over the experts rather
    than a [tiles x experts] search (the search took five [T_BLOCK, E_PAD] reductions a block of tiles); part p
    stores every parts-th tile of each expert from the p-th and every parts-th block of the tail (programs of
    one launch share the work; the routing kernel stores all: part 0 of 1). Stores past T are masked off (counts
    summing past the rows the bound was made for)."""
    tiles = (c + (BLOCK_M - 1)) // BLOCK_M
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(c, 0)
    t0 = tile_end - tiles
    r0 = row_end - c
    for j in range(part, tl.max(tiles, 0), parts):  # an expert's tiles, all experts at once (one pass at decode)
        t = t0 + j
        mine = (j < tiles) & (t < T)
        tl.store(map_ptr + t, ei, mask=mine)
        tl.store(map_ptr + T + t, r0 + j * BLOCK_M, mask=mine)
        tl.store(map_ptr + 2 * T + t, row_end, mask=mine)
    for s in range(tl.sum(tiles, 0) + part * T_BLOCK, T, parts * T_BLOCK):  # the tiles no expert owns
        t = s + tl.arange(0, T_BLOCK)
        rest = t < T
        tl.store(map_ptr + t, tl.full([T_BLOCK], -1, tl.int32), mask=rest)
        tl.store(map_ptr + T + t, tl.zeros([T_BLOCK], tl.int32), mask=rest)
        tl.store(map_ptr + 2 * T + t, tl.zeros([T_BLOCK], tl.int32), mask=rest)


@triton.jit(do_not_specialize=['T'])  # see formats_triton.NO_SPECIALIZE
def _tile_map_kernel(counts_ptr, map_ptr, E, T, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, T_BLOCK: tl.constexpr):
    """map[:, t] = (expert, first row, end row) of row tile t, or (-1, 0, 0) past the last tile; each program
    stores its part (`map_tiles`)."""
    ei = tl.arange(0, E_PAD)
    c = tl.load(counts_ptr + ei, mask=ei < E, other=0).to(tl.int32)
    map_tiles(c, ei, T, map_ptr, tl.program_id(0), tl.num_programs(0), BLOCK_M, T_BLOCK)


_MAP_CACHE: dict = {}
_MAP_CACHE_SIZE = 512


@triton.jit
def tile_first(N, BLOCK_N: tl.constexpr):
    """(row tile, column tile) of this program in a one-dimensional grid of row tiles x column tiles, the column
    tile varying fastest: the GPU starts programs in grid order, so every program of the tile map's live tiles
    (its first ones) starts before any of the dead tiles past them, which exit at once.

    Why: a decode call's grid is sized by the bound `n_row_tiles` (fixed for a CUDA graph) and is mostly dead
    below its bucket; with the row tile first, live programs of the last column tiles would wait behind the dead
    ones. Which program computes a tile does not change what it computes: the same bits either way."""
    pid = tl.program_id(0)
    n_cols = tl.cdiv(N, BLOCK_N)
    return pid // n_cols, pid % n_cols


def n_row_tiles(rows: int, groups: int, block_m: int) -> int:
    """Row tiles a grouped call can need: cdiv(rows, block_m) + min(groups, rows) - 1 (0 without rows).

    The k experts with rows (k <= min(groups, rows)) take sum_e cdiv(c_e, block_m) = k + sum_e floor((c_e - 1) /
    block_m) <= k + floor((rows - k) / block_m) <= k + cdiv(rows, block_m) - 1 tiles; the bound is reached (e.g.
    by groups = k <= block_m experts of block_m + 1 rows each, and by every dense call). It depends on the shape
    only (a CUDA graph's grid is fixed). With min(groups, rows) rather than groups, a decode step's 4 rows over
    32 experts launch 4 row tiles, not 32 of which 28 would exit at once; the - 1 keeps a dense call (one group)
    at one row tile.
    """
    return triton.cdiv(rows, block_m) + min(groups, rows) - 1 if rows > 0 else 0


def tile_map(counts, rows: int, block_m: int, device=None) -> torch.Tensor:
    """int32 [3, T] (expert or -1, first row, end row of the expert) for T = n_row_tiles(rows, E, block_m).

    Expert e gets cdiv(counts[e], block_m) consecutive tiles over its own rows;
    the tiles past the last one get -1. counts as a device tensor: one small
    kernel, no host sync (CUDA-graph safe). counts as a list: built on the host,
    copied without a host wait (pinned, non-blocking) and cached per (counts,
    block_m, device), so a dense layer's map is uploaded once.
    """
    if isinstance(counts, torch.Tensor):
        groups = counts.numel()
        n_tiles = n_row_tiles(rows, groups, block_m)
        cmap = torch.empty((3, n_tiles), dtype=torch.int32, device=counts.device)
        if not n_tiles:  # no rows: nothing to launch
            return cmap
        t_block = 64  # a program a block of 64 tiles (the work of a skewed map, all rows one expert's, spread)
        _tile_map_kernel[(triton.cdiv(n_tiles, t_block),)](counts.contiguous(), cmap, groups, n_tiles, BLOCK_M=block_m,
                                                           E_PAD=triton.next_power_of_2(max(groups, 2)),
                                                           T_BLOCK=t_block)
        return cmap
    key = (tuple(int(n) for n in counts), int(block_m), str(device))
    if sum(key[0]) > rows:  # the tile bound and the kernels' row reads assume the counts cover at most `rows`
        raise ValueError(f"counts sum to {sum(key[0])} rows but the operand has {rows}; pass one count per expert "
                         f"of the rows grouped in it")
    cmap = _MAP_CACHE.get(key)
    if cmap is None:
        groups = len(counts)
        n_tiles = n_row_tiles(rows, groups, block_m)
        host = [[-1] * n_tiles, [0] * n_tiles, [0] * n_tiles]
        t = start = 0
        for e, m in enumerate(key[0]):
            for r0 in range(start, start + m, block_m):
                host[0][t], host[1][t], host[2][t] = e, r0, start + m
                t += 1
            start += m
        cmap = torch.tensor(host, dtype=torch.int32)
        if device is not None and torch.device(device).type == "cuda":  # a pageable copy would wait for the GPU
            cmap = cmap.pin_memory().to(device, non_blocking=True)
        if len(_MAP_CACHE) >= _MAP_CACHE_SIZE:
            _MAP_CACHE.clear()
        _MAP_CACHE[key] = cmap
    return cmap


@triton.jit
def store_tile(out_tile, acc, n_rows, n_cols, col0, LD, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_N: tl.constexpr = False):
    """out_tile[m * LD + col0 + n] = acc[m, n] for m < n_rows, col0 + n < n_cols (EVEN_N: all columns are), in
    out_tile's dtype; out_tile points at the tile's first row (the grouped kernels of qgemm_triton and
    mxfp8_gemm_triton). The offsets (int32, `check_tile_offsets`) and masks are built here, after the K loop:
    built before it, they stay live across it (32 rows a thread in the output layout of a 128-row tile; ptxas
    spills them in the MXFP8 dgrad kernel on sm_90)."""
    m = tl.arange(0, BLOCK_M)
    n = col0 + tl.arange(0, BLOCK_N)
    tl.store(out_tile + (m[:, None] * LD + n[None, :]), acc.to(out_tile.dtype.element_ty),
             mask=(m < n_rows)[:, None] & ((n < n_cols) | EVEN_N)[None, :])


def check_tile_offsets(what: str, tile_rows: int, row_len: int, step: int) -> None:
    """ValueError unless int32 offsets address a tile of `tile_rows` rows of `row_len` elements from its first row.

    The grouped kernels (qgemm_triton's, mxfp8_gemm_triton's) hold one 64-bit pointer per operand at the tile's first
    row and int32 offsets (row in the tile * row_len + column) rather than a 64-bit pointer per element (fewer
    registers; the values loaded, hence the bits, are the same). The largest offset, a masked look-ahead of one
    K step (or the last column tile) included, is below tile_rows * (row_len + step). Training shapes are far
    from the bound (K = 2048, 32768 routed rows: under 2**23)."""
    if tile_rows * (row_len + step) >= 2**31:
        raise ValueError(f"{what}: rows of {row_len} elements are too long for the kernels' int32 offsets within a "
                         f"tile of {tile_rows} rows (tile_rows * (row_len + {step}) must stay below 2**31); split "
                         f"the call along that dimension")
