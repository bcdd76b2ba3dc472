"""Would a fixed split of K help the NVFP4 decode GEMM? A probe on the GPU, before any kernel is written.

    source scripts/device_env.sh && python3 -P scripts/probe_split_k.py

At decode sizes the DECODE tile's call is latency-bound: the bench model's gate_up at one token is 96 programs
(4 experts x 24 column tiles) that each walk K = 2048 in eight 256-wide steps, 10.2 µs against a 2.9 µs HBM
floor (eighteenth session, H100). A split of K into a FIXED number of chunks (never chosen from the batch, so
rows stay batch-invariant), each chunk a program of its own and the chunks' FP32 partials added in chunk
order, would run s times the programs with 1/s of the K loop each. Its bits differ from today's one k16 chain
(the training forward would have to sum the same chunks in the same order), so before paying for that, this
probe times what the split's programs would cost: the same weight bytes laid out as [E, N * s, K / s] (the
same rows, s times the column tiles, 1/s of the K steps), against [E, N, K], with today's kernel (DECODE, and
DECODE_WIDE where the split call passes SMALL_GRID programs). What it leaves out is the reduction (a partial write, a
last-program hand-off, an ordered add): the probe's times are lower bounds on a split GEMM's.

Prints µs a call (CUDA graphs of rotating weight copies, median) beside the HBM floor of the bytes read.
"""

from __future__ import annotations

import argparse

import torch

from rl4bit.bench_gemm import _copies, _routing, _time_us, _weights, copy_gbps
from rl4bit.kernels import qgemm_triton as qg
from rl4bit.kernels import quantize
from rl4bit.trainer.qgemm import GemmSpec, quantize_activation

SHAPES = [("1b gate_up", 32, 2048, 1536, 1), ("1b down", 32, 768, 2048, 1), ("1b gate_up", 32, 2048, 1536, 16),
          ("1b down", 32, 768, 2048, 16), ("1b gate_up", 32, 2048, 1536, 64), ("1b down", 32, 768, 2048, 64),
          ("dense", 1, 4096, 14336, 1)]
"""(name, E, K, N, tokens): bench rollout's experts (top-4) at batch 1 / 16 / 64 and the issue's dense shape."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = "cuda"
    gbps = copy_gbps(dev, args.reps)
    spec = GemmSpec("nvfp4")
    print(f"copy {gbps:.0f} GB/s; µs a call, [E, N*s, K/s] with today's kernel (no reduction: a lower bound)")
    print(f"{'shape':<28} {'floor':>6} " + " ".join(f"{'s=' + str(s):>14}" for s in (1, 2, 4, 8)))
    for name, e, k, n, m in SHAPES:
        counts = [m] if e == 1 else _routing(m, e, 4, seed=m)
        rows, touched = sum(counts), sum(1 for c in counts if c)
        ct = torch.tensor(counts, device=dev, dtype=torch.int32)
        cells, floor = [], None
        for s in (1, 2, 4, 8):
            ks, ns = k // s, n * s
            if ks < 256 or ks % 256:
                cells.append(f"{'-':>14}")
                continue
            q0 = quantize(_weights((e, ns, ks), dev, 1), "nvfp4", outer="group")
            per_expert = (q0.data.numel() + q0.scale.numel()) // e
            floor = floor or per_expert * touched / gbps / 1e3
            qws = _copies(lambda i: q0 if i == 0 else quantize(_weights((e, ns, ks), dev, 10 + i), "nvfp4",
                                                               outer="group"), per_expert * touched, dev)
            qx = quantize_activation(_weights((rows, ks), dev, 2) * 50, spec)
            cfg = qg.pick_config(rows, e, ns)
            # as served: x decoded by the quantize kernel, outside the timed GEMM
            xh = qg.predecode(qx, qg.GPU_DECODE) if cfg.predecode_x else None
            us = _time_us([lambda q=q: qg.grouped_nvfp4(qx, q, ct, torch.bfloat16, config=cfg, xh=xh) for q in qws],
                          dev, args.reps)
            progs = qg.decode_programs(rows, e, ns) if qg.decode_rows(rows, e) else 0
            cells.append(f"{us:7.1f} ({progs:>4}p)" if progs else f"{us:7.1f} (mid)  ")
        print(f"{name + f' T={m} K={k} N={n}':<28} {floor:6.1f} " + " ".join(f"{c:>14}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
