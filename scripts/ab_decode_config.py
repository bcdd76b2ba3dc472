"""Does a swept decode tile speed up the whole NVFP4 rollout, not one GEMM? The default beside the sweep's pick (GPU).

    source scripts/device_env.sh
    python3 -P scripts/sweep_decode_gemm.py --one-token --rollout --out DIR
    python3 -P scripts/ab_decode_config.py --sweep DIR/sweep_decode_gemm.json [--batches 1,16,64] [--new 512]

The candidate is the config with the least summed µs over the sweep's shapes at the rollout's batches, among
the configs bitwise equal to TRAIN on all of them. Run A uses `qgemm_triton`'s defaults; run B sets DECODE and
DECODE_WIDE to the candidate. `bench rollout`'s 1B model and prompts, NVFP4 experts, greedy; per batch the
order is A, B, A, B (drift shows as A-to-A spread), and B's completions must equal A's token for token (exit
status 1 otherwise). Prints per batch generated tok/s and ms a decode step for each run and B / A; writes
ab_decode.json under `--out`.

Leaves out: the BF16 engine (unchanged by the tile), prefill (TRAIN / MID tiles), batches above 64."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import defaultdict

import torch

from rl4bit.bench.rollout import MODELS, _figures, bench_engine, build_model, served_model
from rl4bit.kernels import qgemm_triton as qg

ROLLOUT_TOKENS = (1, 16, 64)
"""Decode tokens a step of the rollout batches the candidate is chosen for (and the default A/B batches)."""


def pick_candidate(rows: list[dict], tokens=ROLLOUT_TOKENS) -> tuple[qg.Config, dict]:
    """(config, {shape: µs}): the least summed µs over the sweep's shapes at `tokens`, among configs timed and
    bitwise equal to TRAIN on all of them (repeated timings of a config on a shape: their mean)."""
    shapes = {r["shape"] for r in rows if r.get("tokens") in tokens}
    if not shapes:
        raise SystemExit(f"the sweep has no shapes at {tokens} tokens: run sweep_decode_gemm.py --one-token --rollout")
    per = defaultdict(lambda: defaultdict(list))  # a config the sweep timed twice (DECODE: the default and again
    for r in rows:                                # in the grid) counts with its mean
        if r["shape"] in shapes and r.get("bitwise") and "us" in r:
            per[r["config"]][r["shape"]].append((r["us"], r["fields"]))
    per = {c: {s: (sum(us for us, _ in v) / len(v), v[0][1]) for s, v in d.items()} for c, d in per.items()}
    whole = {c: v for c, v in per.items() if len(v) == len(shapes)}
    if not whole:
        raise SystemExit("no config is timed and bitwise equal to TRAIN on every shape of the sweep")
    best = min(whole, key=lambda c: sum(us for us, _ in whole[c].values()))
    fields = next(iter(whole[best].values()))[1]
    return qg.Config(**fields), {s: us for s, (us, _) in sorted(whole[best].items())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", required=True, help="sweep_decode_gemm.json of --one-token --rollout")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--new", type=int, default=512, help="generated tokens a sequence (bench rollout: 512)")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--model", default="1b", choices=sorted(MODELS),
                   help="bench rollout's model (small: a CPU smoke run)")
    p.add_argument("--device", default="cuda", help="cpu: the script's logic only (the CPU experts run no tiles)")
    p.add_argument("--out")
    args = p.parse_args()
    with open(args.sweep) as f:
        sweep = json.load(f)
    cand, shape_us = pick_candidate(sweep["rows"])
    print(f"candidate: {cand}")
    for s, us in shape_us.items():
        print(f"  sweep {us:7.1f} us  {s}")
    default = (qg.DECODE, qg.DECODE_WIDE)
    print(f"defaults: DECODE {qg.DECODE}, DECODE_WIDE {qg.DECODE_WIDE}")
    dev = args.device
    model = build_model(args.model, args.prompt + args.new + 1, torch.bfloat16, dev)
    qmodel = served_model(model, "nvfp4")
    gen = torch.Generator().manual_seed(0)
    rows, same = [], True
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = torch.randint(1, MODELS[args.model]["vocab_size"], (b, args.prompt), generator=gen)
        runs = {"A": [], "B": []}
        outs = {}
        for label in ("A", "B", "A", "B"):
            qg.DECODE, qg.DECODE_WIDE = default if label == "A" else (cand, cand)
            try:
                r = bench_engine(qmodel, prompts, args.new, dev, completions=True)
            finally:
                qg.DECODE, qg.DECODE_WIDE = default
            outs.setdefault(label, r.pop("completions"))
            runs[label].append(_figures(r, b, args.prompt))
        equal = outs["A"] == outs["B"]
        same &= equal
        row = dict(batch=b, equal_completions=equal,
                   **{f"{k}_tok_s": [x["gen_tok_s"] for x in v] for k, v in runs.items()},
                   **{f"{k}_ms_step": [x["ms_per_step"] for x in v] for k, v in runs.items()})
        rows.append(row)
        a, bb = (sum(row[f"{k}_tok_s"]) / 2 for k in ("A", "B"))
        print(f"batch {b:>3}: A {row['A_tok_s'][0]:.0f} / {row['A_tok_s'][1]:.0f} tok/s "
              f"({row['A_ms_step'][0]:.3f} / {row['A_ms_step'][1]:.3f} ms a step), B {row['B_tok_s'][0]:.0f} / "
              f"{row['B_tok_s'][1]:.0f} ({row['B_ms_step'][0]:.3f} / {row['B_ms_step'][1]:.3f}); B / A {bb / a:.3f}x; "
              f"completions equal: {equal}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ab_decode.json"), "w") as f:
            json.dump(dict(candidate=dataclasses.asdict(cand), sweep_us=shape_us, rows=rows,
                           defaults=[dataclasses.asdict(c) for c in default]), f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
