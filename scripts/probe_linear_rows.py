"""Is cuBLAS's BF16 `F.linear` row-invariant: does a row's output depend on how many rows the call has? And what
does the fixed-order kernel (`invariant_triton.bmm`, `model.invariant_kernels`) cost beside it?

    python3 -P scripts/probe_linear_rows.py [--time]          # on a GPU

For each (N, K): random BF16 inputs (10,240 rows) and weights, the output of calls of 1 to 8,192 rows compared
element by element with the same rows of an 8,192-row and a 10,240-row call. Prints the fraction of elements and of
rows that differ. N = 85 is the GPU parity job's LM head (its vocabulary); 2048 and 3072 its attention
projections; 151,936 Qwen3's vocabulary. Where a shape differs, the sampler (a decode step's few rows) and the
trainer (a packed micro-batch) round that GEMM differently unless `model.invariant_kernels` is on. (The 8,192-row
cell against the 8,192-row call compares a call with itself: 0 by construction, a check of the comparison.)

`--time` adds, per shape and row count, the forward's µs a call for cuBLAS and for the fixed-order kernel
(`sweep_invariant_gemm.time_us`: CUDA events around about 2 ms of calls, median of 5, after a warm-up call; the
twenty-sixth session's run timed 20 calls a repeat), their ratio, and whether the
fixed-order kernel's rows equal the same rows of its 8,192-row call (they must: that is its construction).

Leaves out: other dtypes (FP16, FP32 with TF32), transposed layouts, biases, backward products, and cuBLAS's own
choice of algorithm per call (it is what is being observed, not controlled); every figure is for this GPU, torch
and cuBLAS build.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from rl4bit.kernels import invariant_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_invariant_gemm import time_us  # noqa: E402

SHAPES = [("lm head, 85-token vocabulary", 85, 2048), ("q/k/v", 3072, 2048), ("o", 2048, 2048),
          ("lm head, Qwen3 vocabulary", 151936, 2048), ("lm head, Qwen3 vocabulary", 151936, 4096)]
ROWS = (1, 16, 32, 64, 256, 1024, 4096, 8192)
TIMED_ROWS = (16, 64, 1024, 8192)


def fixed_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T through the fixed-order kernel (what `model.invariant_kernels` routes `F.linear` to)."""
    return invariant_triton.bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true", help="also time cuBLAS against the fixed-order kernel")
    a = p.parse_args()
    print(torch.__version__, torch.cuda.get_device_name())
    torch.manual_seed(0)
    for name, n, k in SHAPES:
        x = torch.randn(10240, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for ref_rows in (8192, 10240):
            full = F.linear(x[:ref_rows], w)
            cells = []
            for m in ROWS:
                d = F.linear(x[:m], w) != full[:m]
                cells.append(f"{m}: {d.float().mean().item():.4f}/{d.any(1).float().mean().item():.2f}")
            print(f"{name} N={n} K={k} against {ref_rows} rows (elements/rows differing): " + "  ".join(cells))
        if a.time:
            full = fixed_order(x[:8192], w)
            cells = []
            for m in TIMED_ROWS:
                xm = x[:m]
                same = torch.equal(fixed_order(xm, w), full[:m])
                cub, fix = time_us(lambda: F.linear(xm, w)), time_us(lambda: fixed_order(xm, w))
                cells.append(f"{m}: {cub:.1f} / {fix:.1f} ({fix / cub:.2f}x{'' if same else ', ROWS DIFFER'})")
            print(f"{name} N={n} K={k} µs a call cuBLAS / fixed-order: " + "  ".join(cells))


if __name__ == "__main__":
    main()
