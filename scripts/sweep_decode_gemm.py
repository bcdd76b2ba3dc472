"""Which tile configs of the NVFP4 grouped GEMM are fastest at decode (or training) shapes, among those bitwise equal?

    source scripts/device_env.sh && python3 -P scripts/sweep_decode_gemm.py [--out DIR]
    python3 -P scripts/sweep_decode_gemm.py --train     # the training-shape (TRAIN) tiles instead
    python3 -P scripts/sweep_decode_gemm.py --one-token | --rollout   # bench rollout's experts at batch 1 | 16, 64
    python3 -P scripts/sweep_decode_gemm.py --one-token --rollout --out DIR   # both; then scripts/ab_decode_config.py
    python3 -P scripts/sweep_decode_gemm.py --large-grid   # 128-expert models' decode shapes around SMALL_GRID programs

Why a sweep and not autotuning: the kernel's bits do not depend on the tile config (each output is one k16 MMA
chain in K order), but a config is only safe to pick if that holds on the GPU at hand, so every candidate is
checked bitwise against TRAIN on the same operands before it is timed. The winner is written into
``kernels/qgemm_triton.py`` by hand, and ``tests/kernels/test_qgemm_triton.py`` re-checks it. Shapes: a dense
K=4096 N=14336 layer at 1 / 4 / 16 rows, Qwen3-30B-A3B's and the bench model's experts; timing as ``rl4bit bench
gemm`` (CUDA graph of rotating weight copies beyond the L2, median).

Leaves out: the activation quantize (timed by bench gemm)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics

import torch

from rl4bit.bench.common import copy_gbps, time_us
from rl4bit.bench.gemm import _copies, _routing, _weights
from rl4bit.kernels import qgemm_triton as qg
from rl4bit.kernels import quantize
from rl4bit.trainer.qgemm import GemmSpec, quantize_activation

SHAPES = [("dense", 1, 4096, 14336, 1), ("dense", 1, 4096, 14336, 4), ("dense", 1, 4096, 14336, 16),
          ("a3b gate_up", 128, 2048, 1536, 1), ("a3b gate_up", 128, 2048, 1536, 16),
          ("a3b down", 128, 768, 2048, 16), ("bench gate_up", 16, 2048, 1536, 16)]
TOP_K = {128: 8, 16: 4, 32: 4}
TRAIN_SHAPES = [("a3b gate_up", 128, 2048, 1536, 4096), ("a3b down", 128, 768, 2048, 4096),
                ("bench gate_up", 16, 2048, 1536, 16384), ("bench down", 16, 768, 2048, 16384)]
"""(name, E, K, N, tokens): training micro-batch shapes (tokens x top-k routed rows)."""
ONE_TOKEN_SHAPES = [("1b gate_up", 32, 2048, 1536, 1), ("1b down", 32, 768, 2048, 1), ("1b down", 32, 768, 2048, 2),
                    ("1b down", 32, 768, 2048, 4), ("1b down", 32, 768, 2048, 8)]
"""(name, E, K, N, tokens): `bench rollout`'s 1B model at batch 1 (32 experts, top-4: four rows, one an expert),
and its down projection at 2 / 4 / 8 tokens: where the 256-wide K step stops winning (`qgemm_triton.SMALL_GRID`)."""
ROLLOUT_SHAPES = [("1b gate_up", 32, 2048, 1536, 16), ("1b down", 32, 768, 2048, 16),
                  ("1b gate_up", 32, 2048, 1536, 64), ("1b down", 32, 768, 2048, 64)]
"""(name, E, K, N, tokens): `bench rollout`'s 1B model at batch 16 and 64, where its NVFP4 / BF16 targets are
and the grouped GEMMs are issue-bound rather than latency-bound (`--rollout`)."""
MID_SHAPES = [("bench gate_up", 16, 2048, 1536, 256), ("bench down", 16, 768, 2048, 256)]
"""(name, E, K, N, tokens): the GPU job's batch-256 decode step (configs/gpu-h200.yaml: 16 experts, top-4)."""
LARGE_GRID_SHAPES = [("a3b down", 128, 768, 2048, 4), ("a3b down", 128, 768, 2048, 8),
                     ("a3b down", 128, 768, 2048, 16), ("a3b down", 128, 768, 2048, 32),
                     ("a22b down", 128, 1536, 4096, 4), ("a22b down", 128, 1536, 4096, 16),
                     ("a3b gate_up", 128, 2048, 1536, 1), ("a3b gate_up", 128, 2048, 1536, 4),
                     ("a3b gate_up", 128, 2048, 1536, 16)]
"""(name, E, K, N, tokens): Qwen3-30B-A3B's down (K 768) and Qwen3-235B-A22B's down (K 1536, N 4096), top-8 of
128, at token counts on both sides of SMALL_GRID programs, and A3B's gate_up (K 2048) at 1 / 4 / 16 tokens
(`--large-grid`): the sweep behind DECODE_WIDE."""


def candidates() -> list[qg.Config]:
    out = [qg.DECODE]
    for bn, warps, stages, bk in itertools.product((16, 32, 64), (1, 2, 4), (3, 5, 8), (64, 128, 256)):
        if warps > 1 and bn // warps < 16 and bn < 32:
            continue
        out.append(qg.Config(16, bn, warps, stages, True, block_k=bk))
    for bn, warps, stages in itertools.product((32, 64), (1, 2), (3, 5)):  # W-first: mma.sync tiles only
        out.append(qg.Config(16, bn, warps, stages, True, block_k=256, w_first=True))
    for bn, warps, stages, bk in itertools.product((64, 128), (4, 8), (3, 5), (128, 256)):  # more warps a program:
        if (bn, warps) != (64, 4):  # at batch 1 one program an SM, one warp an SM sub-partition, nothing hides
            out.append(qg.Config(16, bn, warps, stages, True, block_k=bk))  # its latencies (sm_90 SASS: 16 x 64
    return out  # with 8 warps 601 instructions a thread for the whole kernel against 973 with 4)


def train_candidates() -> list[qg.Config]:
    out = [qg.TRAIN]
    for bm, bn, warps, stages, bk in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4), (64, 128)):
        if bm * bn >= 128 * 256 and warps == 4:
            continue
        out.append(qg.Config(bm, bn, warps, stages, False, block_k=bk))
    return out


def mid_candidates() -> list[qg.Config]:
    out = [qg.TRAIN, qg.DECODE]
    for bm, bn, stages, bk, pre in itertools.product((32, 64), (64, 128), (3, 4), (64, 128, 256), (True, False)):
        out.append(qg.Config(bm, bn, 4, stages, pre, block_k=bk))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for sweep_decode_gemm.json")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--train", action="store_true", help="sweep the TRAIN tiles on training shapes")
    p.add_argument("--mid", action="store_true", help="sweep mid-size tiles on batch-256 decode shapes")
    p.add_argument("--one-token", action="store_true", help="the decode tiles on bench rollout's batch-1 experts")
    p.add_argument("--rollout", action="store_true", help="the decode tiles on bench rollout's batch-16/64 experts")
    p.add_argument("--large-grid", action="store_true", help="the decode tiles on 128-expert shapes around SMALL_GRID")
    p.add_argument("--ab", action="store_true", help="with --large-grid: only DECODE, DECODE_WIDE and the previous "
                   "DECODE_SHORT_K, timed in --rounds interleaved rounds (median of the rounds)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved timing rounds a config (median)")
    args = p.parse_args()
    if args.ab and not args.large_grid:
        p.error("--ab times the three tiles on the --large-grid shapes: pass --large-grid too")
    dev = "cuda"
    gbps = copy_gbps(dev, args.reps)
    spec = GemmSpec("nvfp4")
    results = []
    if args.train:
        shapes, configs = TRAIN_SHAPES, train_candidates()
    elif args.mid:
        shapes, configs = MID_SHAPES, mid_candidates()
    elif args.large_grid:
        shapes, configs = LARGE_GRID_SHAPES, candidates() + [qg.DECODE_WIDE, qg.MID]
        if args.ab:
            configs = [qg.DECODE, qg.DECODE_WIDE, qg.Config(16, 64, 2, 3, True, block_k=128)]
    elif args.one_token or args.rollout:
        shapes = (ONE_TOKEN_SHAPES if args.one_token else []) + (ROLLOUT_SHAPES if args.rollout else [])
        configs = candidates() + [qg.DECODE_WIDE, qg.MID, qg.TRAIN]
    else:
        shapes, configs = SHAPES, candidates() + [qg.TRAIN]
    configs = list(dict.fromkeys(configs))  # candidates() holds DECODE and DECODE_WIDE already: each timed once
    for name, e, k, n, m in shapes:
        w = _weights((e, n, k), dev, 1)
        q0 = quantize(w, "nvfp4", outer="group")
        counts = [m] if e == 1 else _routing(m, e, TOP_K[e], seed=m)
        rows = sum(counts)
        touched = sum(1 for c in counts if c)
        qx = quantize_activation(_weights((rows, k), dev, 2) * 50, spec)
        ct = torch.tensor(counts, device=dev, dtype=torch.int32)
        per_expert = (q0.data.numel() + q0.scale.numel()) // e
        qws = _copies(lambda i: q0 if i == 0 else quantize(_weights((e, n, k), dev, 10 + i), "nvfp4", outer="group"),
                      per_expert * touched, dev)
        ref = qg.grouped_nvfp4(qx, q0, ct, torch.float32, config=qg.TRAIN)
        floor_us = per_expert * touched / gbps / 1e3
        label = f"{name} M={m} ({rows} rows, {touched} experts) K={k} N={n}"
        shape_rows, times = [], {cfg: [] for cfg in configs}
        for _ in range(args.rounds):  # rounds interleave the configs, so drift over the run hits them alike
            for cfg in list(times):
                try:
                    us = time_us([lambda q=q: qg.grouped_nvfp4(qx, q, ct, torch.bfloat16, config=cfg) for q in qws],
                                  dev, args.reps)
                except Exception as err:  # a config that does not compile (shared memory) is reported, not fatal
                    shape_rows.append(dict(shape=label, config=repr(cfg), error=f"{type(err).__name__}: {err}"[:200]))
                    del times[cfg]
                    continue
                times[cfg].append(us)
        for cfg in times:
            try:
                got = qg.grouped_nvfp4(qx, q0, ct, torch.float32, config=cfg)
                same = bool(torch.equal(got.view(torch.int32), ref.view(torch.int32)))
            except Exception as err:  # reported, not fatal, as above
                shape_rows.append(dict(shape=label, config=repr(cfg), error=f"{type(err).__name__}: {err}"[:200]))
                continue
            shape_rows.append(dict(shape=label, name=name, k=k, n=n, tokens=m, config=repr(cfg),
                                   fields=dataclasses.asdict(cfg), us=statistics.median(times[cfg]),
                                   rounds=times[cfg], floor_us=floor_us, bitwise=same))
        shape_rows.sort(key=lambda r: r.get("us", 1e9))
        results += shape_rows
        picked = qg.pick_config(rows, e, n)
        print(f"\n{label}: HBM floor {floor_us:.1f} us (copy {gbps:.0f} GB/s); pick_config: {picked}")
        shown = (repr(qg.DECODE), repr(qg.DECODE_WIDE), repr(qg.MID), repr(qg.TRAIN), repr(picked))
        for r in shape_rows[:8] + [r for r in shape_rows[8:] if r["config"] in shown]:
            tflops = 2.0 * rows * k * n / r["us"] / 1e6 if "us" in r else float("nan")
            spread = f" ({min(r['rounds']):.1f}-{max(r['rounds']):.1f})" if len(r.get("rounds", [])) > 1 else ""
            print(f"  {r.get('us', float('nan')):8.1f} us{spread} {tflops:6.0f} TFLOP/s  bitwise={r.get('bitwise')}  "
                  f"{r['config']}" + (f"  {r['error']}" if "error" in r else ""))
        bad = [r for r in shape_rows if r.get("bitwise") is False]
        print(f"  configs not bitwise equal to TRAIN: {len(bad)} of {len(shape_rows)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_decode_gemm.json"), "w") as f:
            json.dump(dict(copy_gbps=gbps, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
