"""How many warps and rows a program should the experts' activation quantize take at decode sizes?

    source scripts/device_env.sh && python3 -P scripts/sweep_quantize.py [--hidden 2048 --inter 768 --top-k 4]
    TRITON_INTERPRET=1 python3 -P scripts/sweep_quantize.py --device cpu --quick    # the equality checks only

The two NVFP4 quantizes a served MoE layer runs a decode step (`qgemm_triton.quantize_and_multiply`): the
gate-up input (rows gathered to expert order in the kernel, 4/6, per-row outer scale, the pre-decoded operand)
and the down input (the SwiGLU of the gate-up product, computed in the kernel), at 1, 16 and 64 tokens, over
1-16 warps and one or two rows a program. No variant may change a bit (a row's codes come from its amax,
per-block pairwise sums and elementwise rounding): each is checked against the default on every output before
it is timed (CUDA graphs, median over rotating inputs). The choice is made by hand from the table
(`nvfp4_triton.SWIGLU_PER_THREAD`). Exit status 1 if any variant's outputs differ."""

from __future__ import annotations

import argparse
import sys

import torch

from rl4bit.bench.common import time_us
from rl4bit.kernels.nvfp4_triton import quantize_nvfp4

WARPS = (None, 1, 2, 4, 8, 16)
"""None: the default (`quantize_nvfp4`'s own choice)."""


def case_inputs(tokens: int, hidden: int, inter: int, top_k: int, device: str, copies: int):
    """`copies` (x [T, hidden] BF16, rows [T * top_k] gather index, h [T * top_k, 2 * inter] BF16)."""
    g = torch.Generator().manual_seed(tokens)
    out = []
    for _ in range(copies):
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        # each token's row top_k times, in a shuffled (expert) order: the routing's gather
        rows = torch.arange(tokens).repeat_interleave(top_k)[torch.randperm(tokens * top_k, generator=g)]
        h = (torch.randn(tokens * top_k, 2 * inter, generator=g) * 2).to(torch.bfloat16)
        out.append((x.to(device), rows.to(device), h.to(device)))
    return out


def run(kind: str, inp, decode: str, warps, block_elems):
    x, rows, h = inp
    if kind == "gate_up":
        k = x.shape[1]
        xh = torch.empty((rows.numel(), k), dtype=torch.float16, device=x.device)
        got = quantize_nvfp4(x, outer="row", four_over_six=True, decoded=xh, decode=decode, rows=rows,
                             cast=torch.bfloat16, num_warps=warps, block_elems=block_elems)
    else:
        k = h.shape[1] // 2
        xh = torch.empty((h.shape[0], k), dtype=torch.float16, device=h.device)
        got = quantize_nvfp4(h, outer="row", four_over_six=True, decoded=xh, decode=decode, swiglu=True,
                             num_warps=warps, block_elems=block_elems)
    return (*got[:3], xh)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="1 and 4 tokens, one input each, no timing (CPU)")
    args = p.parse_args()
    decode = "asm" if args.device == "cuda" else "bits"
    batches, copies = ((1, 4), 1) if args.quick else ((1, 16, 64), 32)
    variants = [(w, None) for w in WARPS] + [(w, 1024) for w in (None, 4, 8)]  # 1024: one 768-wide row a program
    print(f"NVFP4 activation quantize (4/6, per-row outer, pre-decoded operand), hidden {args.hidden}, expert "
          f"width {args.inter}, top-{args.top_k}; µs a call (CUDA graphs, median)")
    print(f"{'input':>8} {'tokens':>6} " + " ".join(f"{(str(w) if w else 'dflt') + (' /1k' if b else ''):>8}"
                                                    for w, b in variants))
    bad = 0
    for t in batches:
        inputs = case_inputs(t, args.hidden, args.inter, args.top_k, args.device, copies)
        for kind in ("gate_up", "down"):
            want = run(kind, inputs[0], decode, None, None)
            cells = []
            for w, b in variants:
                got = run(kind, inputs[0], decode, w, b)
                same = all(torch.equal(a.view(torch.uint8), c.view(torch.uint8)) for a, c in zip(got, want))
                bad += not same
                if args.quick or not same:
                    cells.append("same" if same else "DIFFERS")
                    continue
                calls = [lambda i=i: run(kind, i, decode, w, b) for i in inputs]
                cells.append(f"{time_us(calls, args.device, args.reps):.2f}")
            print(f"{kind:>8} {t:>6} " + " ".join(f"{c:>8}" for c in cells))
    if bad:
        print(f"{bad} variants' outputs differ from the default launch's", file=sys.stderr)
    else:
        print("every variant's outputs equal the default launch's, bit for bit")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
