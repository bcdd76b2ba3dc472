"""Why does an expert GEMM take longer in the engine's decode step than alone? A probe on the GPU.

    source scripts/device_env.sh && python3 -P scripts/probe_gemm_context.py

The eighteenth and nineteenth sessions' batch-1 profiles (H100) put the NVFP4 grouped GEMM at 13.0 µs a call
inside the engine's step, while `probe_split_k.py` times the same shapes at 9.0 (gate_up) and 7.8 (down) µs a
call, tile-map launch included. This times the bench model's one-token gate_up (4 rows, one an expert of 32,
K 2048, N 1536, DECODE) three ways, each as a CUDA graph of 64 calls, by CUDA events (µs a call) and by the
profiler (the kernel's own mean duration inside the replays, as `profile_decode.py` reads it):

- rotating: what the microbenchmarks do: 16 weight tensors (100 MB touched, twice the L2), the same 4 experts
  of each every call, one tile map;
- footprint: 16 layers x 32 experts of weights (the engine's 0.8 GB of gate_up weights), each call the next
  layer and 4 other experts (routings drawn beforehand, on the device), like the engine's step;
- footprint + quantize: the same with the activation quantize kernel before each GEMM (the engine's pair).

A gap between rotating and footprint is the memory system (TLB reach, DRAM pages); one between the events and
the profiler is the measurement; one that only the quantize opens is the pair's hand-over.

`--padding` (twentieth session) times the engine's batch-1 call instead: 16 rows (one real, 15 padding) x top-4
= 64 grouped rows, gate_up and down over the 16-layer footprint, four ways: the real row's 4 entries alone (the
grid of a 4-row call), the padding on row 0's experts (16 rows on each of 4 experts: the nineteenth session's
mark), the padding uncounted (64-row call whose counts cover the 4 real entries: what routing padding rows to
the expert-parallel sentinel would give), and the padding unmarked (its own 4 experts, 15 rows each).

`--dead-tile` (twenty-third session) times the row-tile bound's `- 1`: each call with its tile map as
`n_row_tiles` now sizes it, and with one dead (-1) tile appended (the bound before), side by side, as CUDA graphs
of 64 calls: the issue's dense shape (K 4096, N 14336, one group: 1 row tile against 2) at 1 / 4 / 16 rows,
rotating over 8 weight tensors (twice the L2), and the bench model's batch-1 gate_up (4 rows over 32 experts).
"""

from __future__ import annotations

import statistics

import torch

from rl4bit.bench_gemm import _weights, capture, replay_us
from rl4bit.kernels import qgemm_triton as qg
from rl4bit.kernels import quantize

LAYERS, EXPERTS, K, N, TOP_K, CALLS = 16, 32, 2048, 1536, 4, 64


def _graph(fns):
    for f in fns:
        f()
    return capture(fns)


def _profiled_us(g, name: str) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    from torch.autograd import DeviceType

    durations = [e.time_range.elapsed_us() for e in prof.events()
                 if getattr(e, "device_type", None) == DeviceType.CUDA and name in e.name]
    return statistics.mean(durations) if durations else float("nan")


def main() -> int:
    dev = "cuda"
    layers = [quantize(_weights((EXPERTS, N, K), dev, 100 + i), "nvfp4", outer="group") for i in range(LAYERS)]
    x = _weights((1, K), dev, 2) * 50
    g = torch.Generator().manual_seed(0)
    routes = []
    for _ in range(CALLS):
        experts = torch.randperm(EXPERTS, generator=g)[:TOP_K]
        counts = torch.bincount(experts, minlength=EXPERTS).to(torch.int32).to(dev)
        routes.append((counts, torch.zeros(TOP_K, dtype=torch.int64, device=dev)))
    cfg = qg.pick_config(TOP_K, EXPERTS, N)

    def gemm(qw, counts, maps, rows):
        return qg.quantize_and_multiply(x, qw, counts, torch.bfloat16, config=cfg, maps=maps, rows=rows,
                                        cast=torch.bfloat16)[1]

    qx = qg.quantize_and_multiply(x, layers[0], routes[0][0], config=cfg, rows=routes[0][1])[0]
    xh = qg.predecode(qx, qg.GPU_DECODE)
    maps = [{} for _ in range(CALLS)]
    for m, (counts, _) in zip(maps, routes):  # tile maps built outside the graphs
        qg.shared_tile_map(m, counts, EXPERTS, TOP_K, cfg.block_m, dev)
    rotating = [lambda i=i: qg.grouped_nvfp4(qx, layers[i % LAYERS], routes[0][0], torch.bfloat16, config=cfg,
                                             xh=xh, maps=maps[0]) for i in range(CALLS)]
    footprint = [lambda i=i: qg.grouped_nvfp4(qx, layers[i % LAYERS], routes[i][0], torch.bfloat16, config=cfg,
                                              xh=xh, maps=maps[i]) for i in range(CALLS)]
    paired = [lambda i=i: gemm(layers[i % LAYERS], routes[i][0], maps[i], routes[i][1]) for i in range(CALLS)]
    print(f"gate_up one token (4 rows over {EXPERTS} experts, K {K}, N {N}), {cfg}; µs a call")
    print(f"{'case':<22} {'events':>8} {'profiler: GEMM':>15} {'quantize':>9}")
    for name, fns in (("rotating (16 layers)", rotating), ("footprint (16 layers)", footprint),
                      ("footprint + quantize", paired)):
        gr = _graph(fns)
        print(f"{name:<22} {replay_us(gr, 20) / CALLS:8.2f} {_profiled_us(gr, '_nvfp4_grouped_kernel'):15.2f} "
              f"{_profiled_us(gr, '_nvfp4_kernel'):9.2f}")
    return 0


def padding_cases() -> int:
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    for what, n, k in (("gate_up", N, K), ("down", K, N // 2)):  # down: hidden-size outputs from the SwiGLU's
        layers = [quantize(_weights((EXPERTS, n, k), dev, 200 + i), "nvfp4", outer="group") for i in range(LAYERS)]
        cases = {"real rows only (4-row call)": (TOP_K, []), "padding on row 0's experts": (16 * TOP_K, []),
                 "padding uncounted": (16 * TOP_K, []), "padding unmarked": (16 * TOP_K, [])}  # name: (rows, counts)
        for _ in range(CALLS):
            perm = torch.randperm(EXPERTS, generator=g)
            picks = (perm[:TOP_K], perm[TOP_K:2 * TOP_K])  # the real row's experts, the unmarked padding's
            one, own = (torch.bincount(e, minlength=EXPERTS).to(torch.int32) for e in picks)
            for (_, counts), c in zip(cases.values(), (one, one * 16, one, one + 15 * own)):
                counts.append(c.to(dev))
        print(f"{what} (K {k}, N {n}, {EXPERTS} experts, 16-layer footprint); µs a call")
        print(f"{'case':<30} {'config':>6} {'events':>8} {'profiler: GEMM':>15}")
        for name, (rows, counts) in cases.items():
            cfg = qg.pick_config(rows, EXPERTS, n)
            qx = quantize(_weights((rows, k), dev, 3) * 50, "nvfp4", outer="row")
            xh = qg.predecode(qx, qg.GPU_DECODE) if cfg.predecode_x else None
            maps = [{} for _ in counts]
            for m, c in zip(maps, counts):  # tile maps built outside the graphs
                qg.shared_tile_map(m, c, EXPERTS, rows, cfg.block_m, dev)
            fns = [lambda i=i: qg.grouped_nvfp4(qx, layers[i % LAYERS], counts[i], torch.bfloat16, config=cfg,
                                                xh=xh, maps=maps[i]) for i in range(CALLS)]
            gr = _graph(fns)
            label = "DECODE" if cfg == qg.DECODE else ("WIDE" if cfg == qg.DECODE_WIDE else "other")
            print(f"{name:<30} {label:>6} {replay_us(gr, 20) / CALLS:8.2f} "
                  f"{_profiled_us(gr, '_nvfp4_grouped_kernel'):15.2f}")
    return 0

def dead_tile_cases() -> int:
    dev = "cuda"
    g = torch.Generator().manual_seed(0)
    print("tile map as n_row_tiles sizes it against the same map + one dead tile (the bound before); µs a call")
    print(f"{'case':<34} {'tiles':>5} {'tight':>8} {'+1 dead':>8} {'ratio':>6}")
    dense = [quantize(_weights((1, 14336, 4096), dev, 300 + i), "nvfp4", outer="group") for i in range(8)]
    experts = [quantize(_weights((EXPERTS, N, K), dev, 400 + i), "nvfp4", outer="group") for i in range(LAYERS)]
    cases = [(f"dense K 4096 N 14336, {m} rows", dense, m, [torch.tensor([m], dtype=torch.int32, device=dev)])
             for m in (1, 4, 16)]
    cases.append((f"gate_up {TOP_K} rows over {EXPERTS} experts", experts, TOP_K,
                  [torch.bincount(torch.randperm(EXPERTS, generator=g)[:TOP_K], minlength=EXPERTS)
                   .to(torch.int32).to(dev) for _ in range(CALLS)]))
    for name, weights, rows, counts in cases:
        groups, n, k = weights[0].shape
        cfg = qg.pick_config(rows, groups, n)
        qx = quantize(_weights((rows, k), dev, 3) * 50, "nvfp4", outer="row")
        xh = qg.predecode(qx, qg.GPU_DECODE) if cfg.predecode_x else None
        us = []
        for extra in (0, 1):
            maps = []
            for c in counts:  # tile maps built outside the graphs; the dead tile appended by hand
                cmap = qg.tile_map(c, rows, cfg.block_m, dev)
                dead = torch.tensor([[-1] * extra, [0] * extra, [0] * extra], dtype=torch.int32, device=dev)
                maps.append({"counts": c, (rows, cfg.block_m): torch.cat([cmap, dead], 1).contiguous()})
            fns = [lambda i=i: qg.grouped_nvfp4(qx, weights[i % len(weights)], counts[i % len(counts)],
                                                torch.bfloat16, config=cfg, xh=xh, maps=maps[i % len(maps)])
                   for i in range(CALLS)]
            us.append(replay_us(_graph(fns), 20) / CALLS)
        tiles = maps[0][(rows, cfg.block_m)].shape[1] - 1
        print(f"{name:<34} {tiles:>5} {us[0]:8.2f} {us[1]:8.2f} {us[1] / us[0]:5.2f}x")
    return 0


if __name__ == "__main__":
    import sys

    if "--padding" in sys.argv[1:]:
        raise SystemExit(padding_cases())
    raise SystemExit(dead_tile_cases() if "--dead-tile" in sys.argv[1:] else main())
