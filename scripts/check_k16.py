"""Which form of the NVFP4 grouped GEMM goes wrong at a 16-wide K step on this GPU (diagnostic, one minute).

    source scripts/device_env.sh && python3 -P scripts/check_k16.py [--quick]

The seventeenth session's open question (`qgemm_triton.MIN_COMPILED_BLOCK_K`): on an H100 the W-first and
x-first forms of a 16 x 32, 2-warp, 1-stage tile at block_k=16 gave different values. For each 16- and
32-wide-step config, x-first and W-first, x pre-decoded or not, this prints whether its outputs equal TRAIN's
bit for bit (every correct config's bits on a GPU: each output is one k16 MMA chain in K order) and its largest
error against the exact FP64 product of the dequantized operands, over the largest output magnitude (an NVFP4
product's rounding is ~1e-7 of it; a wrong form is off by order 1). It lifts MIN_COMPILED_BLOCK_K for its own
calls only and changes nothing else. Under TRITON_INTERPRET=1 (CPU) it runs too, but there a 64-wide step
sums in numpy's order, so only the error column means anything.

The eighteenth session's run (H100) found BOTH forms wrong at 16, pre-decoded x or not, and every 32-wide
config right. Pre-decoded x is decoded at a 64-wide step by its own kernel, so the fault is in the weights'
tile at a 16-wide step: its decode (`_decode_tile` on [R, 2] words) or the k16 dot. Two further sections say
which: the 16-wide GEMM under each decode ("asm", the GPU default; "bits", the same trick in Triton ops; "f32"),
and `_predecode_kernel` (the same `_decode_tile`) run at 16- and 32-wide steps against its 64-wide tile, bit
for bit, for each decode. A decode that is wrong at 16 alone shows in the second; a right decode with a wrong
GEMM points at the dot.

Leaves out: timing (these steps are not candidates), MXFP8.
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from rl4bit.kernels import dequantize, quantize, qgemm_triton as qg

SHAPES = [([9, 0, 21, 7], 80, 40), ([40, 3, 0, 77, 12, 5, 30, 33], 2048, 1536)]
"""(rows an expert, K, N): the failing test's shape (partial K and N tiles, an empty expert), then a decode-size
expert GEMM."""
BAD = 1e-3
"""Relative error above which a config is called wrong."""


def operands(counts, k, n, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    w = torch.randn(len(counts), n, k, generator=g) * 0.05
    return (quantize(x.to(device), "nvfp4", outer="row", four_over_six=True),
            quantize(w.to(device), "nvfp4", outer="group"))


def exact(qx, qw, counts) -> torch.Tensor:
    x, w = dequantize(qx, torch.float64), dequantize(qw, torch.float64)
    starts = [0] + list(itertools.accumulate(counts))
    return torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(starts, starts[1:]))])


def configs() -> list[qg.Config]:
    out = []
    for bk, w_first, pre, (warps, stages) in itertools.product((16, 32), (False, True), (True, False),
                                                               ((2, 1), (2, 3), (1, 1), (1, 3))):
        out.append(qg.Config(16, 32, warps, stages, pre, block_k=bk, w_first=w_first))
    return out


def decodes(device: str) -> list[str]:
    return ["asm", "bits", "f32"] if device == "cuda" else ["bits", "f32"]  # no inline PTX under the interpreter


def decode_sections(qx, qw, counts, want, scale, device) -> int:
    """The 16-wide GEMM under each decode, then the decode alone at 16 / 32 against 64; the count of wrong ones."""
    wrong = 0
    print(f"{'block_k':>7} {'warps':>5} {'decode':>6} {'rel error':>9}   (x-first, x decoded in the loop, 3 stages)")
    for warps, decode in itertools.product((2, 1), decodes(device)):
        y = qg.grouped_nvfp4(qx, qw, counts, torch.float32, decode=decode,
                             config=qg.Config(16, 32, warps, 3, False, block_k=16))
        rel = float((y.double() - want).abs().max()) / scale
        wrong += rel > BAD
        print(f"{16:>7} {warps:>5} {decode:>6} {rel:>9.2e}")
    print(f"{'block_k':>7} {'decode':>6}  _predecode_kernel tile = its 64-wide tile (values off)")
    for decode in decodes(device):
        ref = qg.predecode(qx, decode, 64).view(torch.int16)
        for bk in (16, 32):
            off = int((qg.predecode(qx, decode, bk).view(torch.int16) != ref).sum())
            wrong += off > 0
            print(f"{bk:>7} {decode:>6}  {str(off == 0):>5} ({off} of {ref.numel()})")
    return wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the small shape and the failing tile's neighbours only")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    shapes = SHAPES[:1] if args.quick else SHAPES
    cands = [c for c in configs() if c.num_warps == 2] if args.quick else configs()
    wrong = 0
    saved, qg.MIN_COMPILED_BLOCK_K = qg.MIN_COMPILED_BLOCK_K, 16
    try:
        for counts, k, n in shapes:
            qx, qw = operands(counts, k, n, device)
            ref = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=qg.TRAIN)
            want = exact(qx, qw, counts)
            scale = float(want.abs().max())
            print(f"\n{sum(counts)} rows over {len(counts)} experts, K={k}, N={n} ({device}); TRAIN's error "
                  f"{float((ref.double() - want).abs().max()) / scale:.2e}")
            print(f"{'block_k':>7} {'w_first':>7} {'pre_x':>5} {'warps':>5} {'stages':>6} {'= TRAIN':>7} "
                  f"{'rel error':>9}  columns off (of the first wrong row)")
            for c in cands:
                y = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=c)
                err = (y.double() - want).abs()
                rel = float(err.max()) / scale
                off = ""
                if rel > BAD:
                    wrong += 1
                    row = int((err.amax(1) > BAD * scale).nonzero()[0])
                    off = f"  row {row}: {(err[row] > BAD * scale).nonzero().flatten().tolist()[:40]}"
                print(f"{c.block_k:>7} {str(c.w_first):>7} {str(c.predecode_x):>5} {c.num_warps:>5} "
                      f"{c.num_stages:>6} {str(torch.equal(y, ref)):>7} {rel:>9.2e}{off}")
            wrong += decode_sections(qx, qw, counts, want, scale, device)
    finally:
        qg.MIN_COMPILED_BLOCK_K = saved
    print(f"\n{wrong} checks wrong (off by more than {BAD:g} of the output scale, or a decoded tile unlike the "
          f"64-wide one)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
