"""Is cuBLAS's BF16 `F.linear` row-invariant: does a row's output depend on how many rows the call has?

    python3 -P scripts/probe_linear_rows.py          # on a GPU

For each (N, K): random BF16 inputs (10,240 rows) and weights, the output of calls of 1 to 8,192 rows compared
element by element with the same rows of an 8,192-row and a 10,240-row call. Prints the fraction of elements and of
rows that differ. N = 85 is the GPU parity job's LM head (its vocabulary); 2048 and 3072 its attention
projections; 151,936 Qwen3's vocabulary. Where a shape differs, the sampler (a decode step's few rows) and the
trainer (a packed micro-batch) round that GEMM differently unless `model.invariant_kernels` is on. (The 8,192-row
cell against the 8,192-row call compares a call with itself: 0 by construction, a check of the comparison.)

Leaves out: other dtypes (FP16, FP32 with TF32), transposed layouts, biases, and cuBLAS's own choice of algorithm
per call (it is what is being observed, not controlled); every figure is for this GPU, torch and cuBLAS build.
"""

import torch
import torch.nn.functional as F

SHAPES = [("lm head, 85-token vocabulary", 85, 2048), ("q/k/v", 3072, 2048), ("o", 2048, 2048),
          ("lm head, Qwen3 vocabulary", 151936, 2048), ("lm head, Qwen3 vocabulary", 151936, 4096)]
ROWS = (1, 16, 32, 64, 256, 1024, 4096, 8192)


def main() -> None:
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


if __name__ == "__main__":
    main()
