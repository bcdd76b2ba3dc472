"""The fused MoE grouping kernel gives exactly torch's integers: stable argsort, order // k, bincount.

CPU: TRITON_INTERPRET=1 (triton_setup); CUDA: the compiled kernel.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch

from rl4bit.kernels import fused
from rl4bit.kernels.route_triton import MAX_ENTRIES, expert_order
from rl4bit.trainer.qgemm import device_counts, expert_grouping


def _want(flat, e, k):
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, order // k, torch.bincount(flat, minlength=e + 1)[:e].to(torch.int32), inv


@pytest.mark.parametrize("tokens,e,k", [(0, 8, 2), (1, 8, 2), (5, 4, 1), (16, 32, 4), (256, 32, 4), (300, 128, 8),
                                        (MAX_ENTRIES // 8, 64, 8)])
def test_matches_argsort_and_bincount(tokens, e, k):
    g = torch.Generator().manual_seed(tokens + e)
    flat = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).reshape(-1) if tokens else \
        torch.zeros(0, dtype=torch.int64)
    flat = flat.to(DEVICE)
    out = expert_order(flat, e, k)
    for got, want, what in zip(out, _want(flat, e, k), ("order", "tok", "counts", "inv")):
        assert got.dtype == want.dtype and torch.equal(got, want), what
    offs = out[5]  # torch._grouped_mm's group ends, as `qgemm._group_offsets` computes them
    assert offs.dtype == torch.int32 and torch.equal(offs, out[2].cumsum(0, dtype=torch.int32))


def test_skewed_routing_and_the_ep_sentinel_sort_last():
    """Many ties (every token on experts 0 and 3) and the expert-parallel sentinel (== E): kept last, not counted."""
    flat = torch.tensor([3, 0] * 40 + [4, 0, 4, 3], device=DEVICE)
    got, want = expert_order(flat, 4, 2), _want(flat, 4, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    counts = got[2]
    assert counts.tolist() == [41, 0, 0, 41] and got[5].tolist() == [41, 41, 41, 82]  # the sentinel in no group


def test_grouping_takes_the_kernel_only_when_fused_and_small():
    flat = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        got = expert_grouping(flat, 16, 4)
        big = torch.randint(0, 16, (MAX_ENTRIES + 4,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        got_big = expert_grouping(big, 16, 4)  # past the kernel's size: torch's ops, same contract
    finally:
        fused.set_enabled(True, "cuda")
    for a, b in zip(got, _want(flat, 16, 4)):
        assert torch.equal(a, b)
    for a, b in zip(got_big[:3], _want(big, 16, 4)):
        assert torch.equal(a, b)
    assert got_big[3] is None and torch.equal(got_big[2], device_counts(big, 16))  # inv: built by combine if needed


def test_bad_input_names_the_limit():
    with pytest.raises(ValueError, match="<= 4096 entries"):
        expert_order(torch.zeros(MAX_ENTRIES + 1, dtype=torch.int64, device=DEVICE), 4, 1)


def test_out_of_range_indices_are_the_sentinel_never_a_stray_write():
    """Negative or > E indices count as the sentinel: sorted last in entry order, uncounted, inv still a permutation."""
    flat = torch.tensor([2, -1, 0, 1, 3, 2, 9], device=DEVICE)
    order, tok, counts, inv, cmap, offs = expert_order(flat, 4, 1)
    assert cmap is None and offs.tolist() == [1, 2, 4, 5]  # no map asked for
    assert order.tolist() == [2, 3, 0, 5, 4, 1, 6] and counts.tolist() == [1, 1, 2, 1]
    assert torch.equal(inv[order].cpu(), torch.arange(7)) and torch.equal(tok, order)


@pytest.mark.parametrize("tokens,e,k", [(1, 32, 4), (4, 32, 4), (16, 32, 4), (64, 16, 4), (300, 128, 8)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_map_in_the_same_launch_equals_tile_map(tokens, e, k, block_m):
    """map_block_m: the routing kernel's tile map = `tile_map_triton.tile_map` of its counts (the device kernel's and
    the host-built one), also with skewed routing and the EP sentinel in the index."""
    from rl4bit.kernels import tile_map_triton as tm

    g = torch.Generator().manual_seed(tokens * e + block_m)
    flat = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).reshape(-1)
    flat[: flat.numel() // 3] = 1  # one expert holds a third of the rows: several tiles
    flat[-1] = e  # the sentinel: not counted, still a row of the bound
    flat = flat.to(DEVICE)
    order, tok, counts, inv, cmap, _ = expert_order(flat, e, k, block_m)
    for a, b in zip((order, tok, counts, inv), _want(flat, e, k)):
        assert torch.equal(a, b)
    n = flat.numel()
    assert torch.equal(cmap, tm.tile_map(counts, n, block_m))
    assert torch.equal(cmap.cpu(), tm.tile_map(counts.tolist(), n, block_m, "cpu").cpu())


def test_grouping_fills_the_layers_shared_maps():
    """expert_grouping(maps=): the counts and DECODE's tile map land in the dict the layer's GEMMs share, so
    `shared_tile_map` launches nothing for them."""
    from rl4bit.kernels import qgemm_triton as qg
    from rl4bit.kernels import tile_map_triton as tm

    flat = torch.randint(0, 16, (64,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        maps = {"counts": "stale"}
        order, tok, counts, inv = expert_grouping(flat, 16, 4, maps)
    finally:
        fused.set_enabled(True, "cuda")
    assert maps["counts"] is counts and set(maps) == {"counts", "offs", (64, qg.DECODE.block_m)}
    assert torch.equal(maps["offs"], counts.cumsum(0, dtype=torch.int32))
    cmap = maps[(64, qg.DECODE.block_m)]
    assert qg.shared_tile_map(maps, counts, 16, 64, qg.DECODE.block_m, DEVICE) is cmap
    assert torch.equal(cmap, tm.tile_map(counts, 64, qg.DECODE.block_m))
    many = torch.randint(0, 4, (512,), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert not qg.decode_rows(512, 4)  # 128 rows an expert: MID / TRAIN tiles, so no 16-row map is made
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        maps = {"counts": "stale"}
        expert_grouping(many, 4, 2, maps)
        bf16 = {}
        expert_grouping(flat, 16, 4, bf16, tile_map=False)  # the BF16 experts: group offsets, no tile map
    finally:
        fused.set_enabled(True, "cuda")
    assert set(maps) == {"counts", "offs"}  # no 16-row map; a dict, so nothing stale stays
    assert set(bf16) == {"counts", "offs"}


def test_sweep_route_script_checks_every_warp_count():
    """`scripts/sweep_route.py --quick` (the timing `route_warps` is chosen from) finds every warp count's outputs,
    and the routing without the map followed by the map's own kernel, equal to torch's and the host-built map,
    and exits 0 (on the CPU the interpreter ignores warps: the GPU run is the one that checks them)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-P", str(root / "scripts" / "sweep_route.py"), "--device", DEVICE,
                          "--quick"], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "every variant's outputs equal torch's and the host map" in run.stdout
