"""Up to how many rows does splitting decode attention over key chunks pay (`decode_graph.SPLIT_MAX_ROWS`)?

    source scripts/device_env.sh && python3 -P scripts/sweep_attention.py [--out DIR]
    TRITON_INTERPRET=1 python3 -P scripts/sweep_attention.py --device cpu --quick   # tiny sizes: the bits only

Decode steps of B rows at context L over a BF16 cache (bench rollout's 1B attention shape), split as the
engine's decode graphs do (`DecodeLayout.key_chunks`, shared chunk counters) against unsplit. Each case checks
split and unsplit outputs bitwise, times each in CUDA graphs over rotating cache slots (past the L2; median),
then rechecks the split's bits on `--recheck` more calls and that the counters are back at zero. The choice is
made by hand from the table; it cannot change a bit. Exit status 1 if any case's outputs differ."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rl4bit.bench.common import time_us
from rl4bit.bench.gemm import ROTATE_BYTES
from rl4bit.kernels.attention_triton import KEY_CHUNK, attention, seq_table, split_counters, split_fits, tile_table
from rl4bit.sampler.decode_graph import SPLIT_MAX_ROWS

SHAPE = dict(hq=16, hkv=4, d=128)
"""bench rollout's "1b" model's attention (`bench_rollout.MODELS`)."""


def caches(b: int, max_len: int, device: str, hkv: int, d: int, min_ctx: int):
    """(k, v, copies): one BF16 cache of b x copies slots, enough copies that cycling through them reads past the
    L2 at the shortest context (`bench_gemm.ROTATE_BYTES` of the keys and values a call touches; 1 on CPU)."""
    touched = 2 * b * hkv * min_ctx * d * 2
    copies = 1 if device == "cpu" else min(4096, max(2, -(-ROTATE_BYTES // touched)))
    g = torch.Generator(device=device).manual_seed(b)
    k, v = (torch.randn(b * copies, hkv, max_len, d, generator=g, device=device).to(torch.bfloat16) for _ in "kv")
    return k, v, copies


def case(b: int, ctx: int, kv, device: str, reps: int, recheck: int, hq: int, hkv: int, d: int) -> dict:
    """One (batch, context) case: split and unsplit µs and whether their outputs are bitwise equal (before the
    timing and on `recheck` split calls after it, with the counters back at zero)."""
    k, v, copies = kv
    c, max_len = torch.bfloat16, k.shape[-2]
    g = torch.Generator().manual_seed(1000 * b + ctx)
    q = torch.randn(b, hq, d, generator=g).to(c).to(device)
    tiles = tile_table([1] * b, hq // hkv, device)
    seqs = [seq_table(list(range(b)), [1] * b, [ctx - 1] * b, [(i * b + s) * hkv * max_len for s in range(b)], device)
            for i in range(copies)]  # copy i: slots i*b .. i*b + b - 1
    chunks = -(-max_len // KEY_CHUNK)
    splits = split_fits(tiles.shape[1], hkv, chunks, d)
    counters = split_counters(tiles.shape[1], hkv, device)
    whole, split = torch.empty_like(q), torch.empty_like(q)

    def run(out, n, st=seqs[0]):
        return attention(q, k, v, st, tiles, d ** -0.5, c, out, key_chunks=n, counters=counters)

    run(whole, 0)
    same = bool(torch.equal(whole.view(torch.int16), run(split, chunks).view(torch.int16)))
    us = {}
    for name, n in (("unsplit", 0), ("split", chunks)):
        out = torch.empty_like(q)
        us[name] = time_us([lambda st=st, n=n: run(out, n, st) for st in seqs], device, reps)
    for _ in range(recheck):
        same &= bool(torch.equal(whole.view(torch.int16), run(split, chunks).view(torch.int16)))
    same &= not bool(counters.any())
    return dict(batch=b, context=ctx, max_len=max_len, chunks=chunks, split_runs=splits, unsplit_us=us["unsplit"],
                split_us=us["split"], bitwise=same, copies=copies)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU under TRITON_INTERPRET=1: the bits only)")
    p.add_argument("--max-len", type=int, default=2176, help="cache positions (the engine's max_seq_len)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--recheck", type=int, default=50, help="split calls checked bitwise after the timing")
    p.add_argument("--out", help="directory for sweep_attention.json")
    args = p.parse_args()
    if args.quick:
        shape, batches, contexts, max_len, reps = dict(hq=4, hkv=2, d=16), (1, 3), (5, 130, 300), 320, 1
        args.recheck = 1
    else:
        shape, batches, contexts, max_len, reps = SHAPE, (1, 4, 8, 16, 64, 128), (128, 256, 512, 1024, 2048), \
            args.max_len, args.reps
    rows = []
    for b in batches:
        kv = caches(b, max_len, args.device, shape["hkv"], shape["d"], min(contexts))
        rows += [case(b, L, kv, args.device, reps, args.recheck, **shape) for L in contexts if L <= max_len]
        del kv
    print(f"decode attention, {shape}, cache of {max_len} positions ({rows[0]['chunks']} key chunks when split); "
          f"the engine splits steps of <= {SPLIT_MAX_ROWS} rows")
    print(f"{'batch':>6} {'context':>8} {'unsplit µs':>11} {'split µs':>9} {'split/unsplit':>14}  bitwise")
    for r in rows:
        print(f"{r['batch']:>6} {r['context']:>8} {r['unsplit_us']:>11.1f} {r['split_us']:>9.1f} "
              f"{r['split_us'] / r['unsplit_us']:>14.2f}  {r['bitwise']}"
              + ("" if r["split_runs"] else "  (split over SPLIT_MAX_BYTES: ran unsplit)"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep_attention.json"), "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r["bitwise"]]
    if bad:
        print(f"split and unsplit outputs differ in {len(bad)} cases", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
