"""Which tiles of the MXFP8 backward GEMMs (dgrad, wgrad; BF16-dequantize path) are fastest at training shapes?

    source scripts/device_env.sh && python3 -P scripts/sweep_mxfp8_gemm.py [--out DIR] [--reps 10]

Like ``sweep_decode_gemm.py --train``: every config is first compared bitwise with its kernel's default
(``MX_TRAIN[False]`` / ``WGRAD[False]``) on the same operands, then timed (CUDA graph over rotating operand
copies, median). The K order is fixed by the K step (``BF16_BLOCK_K``), not the tile, so equal bits are
expected; a config that differs is reported and must not be picked. The winner goes into
``kernels/mxfp8_gemm_triton.py`` by hand. Shapes: the backward of the bench model's experts and of
Qwen3-30B-A3B's (dgrad and wgrad of gate_up and down).

Leaves out: the FP8-core path, the quantize kernels."""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch

from rl4bit.bench.common import time_us
from rl4bit.bench.gemm import _routing, _weights
from rl4bit.kernels import mxfp8_gemm_triton as mg
from rl4bit.kernels import quantize
from rl4bit.kernels.qgemm_triton import Config

MODELS = [("bench", 16, 4, 2048, 768, 16384), ("a3b", 128, 8, 2048, 768, 4096)]
"""(name, experts, top-k, hidden, expert width, tokens)."""
DEVICE = ["cuda"]
"""Where it runs (a CPU smoke test under TRITON_INTERPRET=1 sets "cpu")."""


def candidates(default: Config) -> list[Config]:
    out = [default]
    for bm, bn, warps, stages in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if bm * bn >= 128 * 256 and warps == 4:
            continue
        c = Config(bm, bn, warps, stages)
        if c != default:
            out.append(c)
    return out


def sweep(label: str, run, default: Config, reps: int) -> list[dict]:
    ref = run(default)
    rows = []
    for cfg in candidates(default):
        try:
            got = run(cfg)
            same = bool(torch.equal(got.view(torch.int32), ref.view(torch.int32)))
            us = time_us([lambda c=cfg: run(c)], DEVICE[0], reps)
        except Exception as err:  # shared memory or register limits: reported, not fatal
            rows.append(dict(shape=label, config=repr(cfg), error=f"{type(err).__name__}: {err}"[:160]))
            continue
        rows.append(dict(shape=label, config=repr(cfg), us=us, bitwise=same))
    rows.sort(key=lambda r: r.get("us", 1e9))
    base = next(r for r in rows if r["config"] == repr(default))
    if "us" not in base:
        print(f"\n{label}: the default config failed: {base['error']}")
        return rows
    print(f"\n{label}: default {base['us']:.1f} us")
    for r in rows[:6]:
        print(f"  {r.get('us', float('nan')):8.1f} us  x{base['us'] / r['us']:.2f}  bitwise={r.get('bitwise')}  "
              f"{r['config']}" + (f"  {r['error']}" if "error" in r else ""))
    bad = [r for r in rows if r.get("bitwise") is False]
    print(f"  configs not bitwise equal to the default: {len(bad)} of {len(rows)}")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    dev, results = DEVICE[0], []
    for name, e, top_k, h, i, tokens in MODELS:
        counts = _routing(tokens, e, top_k, seed=tokens)
        rows = sum(counts)
        padded = [-(-c // 32) * 32 for c in counts]
        for gemm, n_out, k_in in (("gate_up", 2 * i, h), ("down", h, i)):
            # dgrad: dX [R, K_in] = dY [R, N_out] @ W [E, K_in, N_out] (blocks along N_out)
            qa = quantize(_weights((rows, n_out), dev, 1) * 50, "mxfp8")
            qb = quantize(_weights((e, k_in, n_out), dev, 2), "mxfp8")
            ct = torch.tensor(counts, device=dev, dtype=torch.int32)
            results += sweep(f"{name} {gemm} dgrad ({rows} rows, K={n_out}, N={k_in})",
                             lambda c: mg.grouped_mxfp8(qa, qb, ct, torch.float32, fp8=False, config=c),
                             mg.MX_TRAIN[False], args.reps)
            # wgrad: dW [E, N_out, K_in] from dYᵀ [N_out, R_pad] and xᵀ [K_in, R_pad]
            rp = sum(padded)
            wa = quantize(_weights((n_out, rp), dev, 3) * 50, "mxfp8")
            wb = quantize(_weights((k_in, rp), dev, 4), "mxfp8")
            pct = torch.tensor(padded, device=dev, dtype=torch.int64)  # on the device: a list would be copied
            results += sweep(f"{name} {gemm} wgrad ({rp} padded rows, N={n_out}, K={k_in})",  # in the CUDA graph
                             lambda c: mg.wgrad_mxfp8(wa, wb, pct, torch.float32, fp8=False, config=c),
                             mg.WGRAD[False], args.reps)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_mxfp8_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
