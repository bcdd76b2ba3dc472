"""How many warps should the MoE routing kernel take (`route_triton.route_warps`), and does the tile map belong in it?

    source scripts/device_env.sh && python3 -P scripts/sweep_route.py [--experts 32 --top-k 4]
    TRITON_INTERPRET=1 python3 -P scripts/sweep_route.py --device cpu --quick     # the equality checks only

For each decode batch (1, 16, 64, 256 tokens, top-k entries each), random routings: `route_triton.expert_order`
with the tile map inside (DECODE's 16-row tiles) at 1, 2, 4 and 8 warps, without the map, and without the map
followed by the map's own kernel (`tile_map_triton.tile_map` of device counts). µs a call in CUDA graphs, median,
over rotating routings. Every variant's outputs are first checked against torch's (`argsort`, `// k`,
`bincount`) and the host-built map; integers, so no warp count may change them. Exit status 1 if any differ."""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from rl4bit.bench.common import time_us
from rl4bit.kernels.qgemm_triton import DECODE
from rl4bit.kernels.route_triton import expert_order, route_warps
from rl4bit.kernels.tile_map_triton import tile_map


def routings(tokens: int, experts: int, top_k: int, device: str, copies: int) -> list[torch.Tensor]:
    """`copies` flat top-k indices of `tokens` tokens: distinct experts a token, as a router picks them."""
    g = torch.Generator().manual_seed(tokens)
    return [torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.reshape(-1).to(device)
            for _ in range(copies)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="batches 1 and 16, one routing each, no timing (CPU)")
    args = p.parse_args()
    e, k, bm = args.experts, args.top_k, DECODE.block_m
    batches, copies = ((1, 16), 1) if args.quick else ((1, 16, 64, 256), 64)
    print(f"routing {e} experts, top-{k}, tile map of {bm}-row tiles; µs a call (CUDA graphs, median)")
    print(f"{'tokens':>6} {'default warps':>13} " + " ".join(f"{f'{w} warps':>8}" for w in (1, 2, 4, 8))
          + f" {'no map':>8} {'+ map kernel':>12}")
    bad = 0
    for t in batches:
        flats = routings(t, e, k, args.device, copies)
        flat = flats[0]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e).to(torch.int32)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=flat.device)
        host_map = tile_map(counts.tolist(), flat.numel(), bm, "cpu").cpu()
        want = (order, order // k, counts, inv)
        for w in (1, 2, 4, 8):
            got = expert_order(flat, e, k, bm, num_warps=w)
            bad += not (all(torch.equal(a, b) for a, b in zip(got[:4], want))
                        and torch.equal(got[4].cpu(), host_map) and torch.equal(got[5], counts.cumsum(0).int()))
        plain = expert_order(flat, e, k)
        bad += not torch.equal(tile_map(plain[2], flat.numel(), bm).cpu(), host_map)
        if args.quick:
            continue
        us = [time_us([lambda f=f, w=w: expert_order(f, e, k, bm, num_warps=w) for f in flats], args.device,
                       args.reps) for w in (1, 2, 4, 8)]
        no_map = time_us([lambda f=f: expert_order(f, e, k) for f in flats], args.device, args.reps)
        split = time_us([lambda f=f: tile_map(expert_order(f, e, k)[2], f.numel(), bm) for f in flats],
                         args.device, args.reps)
        print(f"{t:>6} {route_warps(triton.next_power_of_2(max(t * k, 2)), triton.next_power_of_2(e + 1)):>13} "
              + " ".join(f"{u:>8.2f}" for u in us) + f" {no_map:>8.2f} {split:>12.2f}")
    if bad:
        print(f"{bad} variants' outputs differ from torch's / the host map", file=sys.stderr)
    else:
        print("every variant's outputs equal torch's and the host map")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
