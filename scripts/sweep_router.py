"""Which tile shape should the fused router's partial-sum kernel take (`router_triton.BLOCK_T`, CHUNK, warps)?

    python -P scripts/sweep_router.py [--hidden 2048 --experts 32 --top-k 4]

Prints µs a call (50 calls in one CUDA graph, median of 20 replays) of `router_triton._partial_kernel` for each
(BLOCK_T, BLOCK_K, CHUNK, warps) at 1, 16 and 128 tokens, FP32 (rl4bit's router) and BF16, then
`route_topk` as shipped and torch's ops (`fused_router.reference`) as the baseline. Tile shapes change the bits
(the sum order), not the results' meaning: pick one, then every pass uses it."""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import triton

from rl4bit.kernels import router_triton as rr
from rl4bit.trainer.fused_router import reference


def _time(fn, reps=20, calls=50):
    """µs a call of device time: `calls` calls captured in one CUDA graph (no host launch cost), median replay."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--hidden", type=int, default=2048)
    a.add_argument("--experts", type=int, default=32)
    a.add_argument("--top-k", type=int, default=4)
    args = a.parse_args()
    h, e = args.hidden, args.experts
    bd = max(16, triton.next_power_of_2(e))
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(e, h, device="cuda").to(dtype)
        for t in (1, 16, 128):
            x = torch.randn(t, h, device="cuda").to(dtype)
            rows = []
            for bt, bk, chunk, warps in itertools.product((1, 4), (64, 128), (128, 256, 512), (1, 4)):
                if bk > chunk:
                    continue
                n_chunks = triton.cdiv(h, chunk)
                part = torch.empty(n_chunks, t, e, device="cuda")

                def call():
                    rr._partial_kernel[(triton.cdiv(t, bt), n_chunks)](
                        x, w, part, t, h, e, x.stride(0), w.stride(0), C=rr._TL[dtype], X_IS_C=True, W_IS_C=True,
                        BLOCK_T=bt, BLOCK_E=bd, BLOCK_K=bk, CHUNK=chunk, num_warps=warps, enable_fp_fusion=False)
                rows.append((_time(call), bt, bk, chunk, warps))
            rows.sort()
            shipped = _time(lambda: rr.route_topk(x, w, args.top_k, True, dtype))
            torch_us = _time(lambda: reference(x, w, args.top_k, True, dtype))
            print(f"{dtype} T={t}: route_topk as shipped {shipped:.1f} µs, torch ops {torch_us:.1f} µs; "
                  f"partial kernel fastest (µs, BLOCK_T, BLOCK_K, CHUNK, warps): {rows[:6]}; slowest {rows[-1]}")


if __name__ == "__main__":
    main()
