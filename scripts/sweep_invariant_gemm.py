"""Which tiles make the invariant mode's product (`invariant_triton.bmm`) fastest, and what does it cost beside cuBLAS?

    source scripts/device_env.sh && python3 -P scripts/sweep_invariant_gemm.py [--quick] [--only-current]
        [--against OLD.py]     # another version of kernels/invariant_triton.py: bits and time before and after

Times candidate configurations (`invariant_triton.tiles` picks from K, N and the dtype alone) on the products a
job in the mode runs, in its layouts (`F.linear`'s x @ wᵀ, the input gradient g @ w, the weight gradient gᵀ @ x),
beside cuBLAS on the same operands, and checks bits: each candidate against the current configuration (a
difference changes what a job computes), and calls of 1, 7 and 16 rows against the same rows of the full call
(row invariance: must hold for every candidate). Shapes: configs/gpu-h200.yaml's model and Qwen3's 151,936-token
LM head at 16, 64 and 8,192 rows, and a micro-batch's backward. Timing: CUDA events, median of 5.

Leaves out: FP32 operands, the grouped product (same `tiles`), CUDA graphs, a choice per row count."""

from __future__ import annotations

import argparse
import importlib.util

import torch

from rl4bit.kernels import invariant_triton as it
from rl4bit.kernels.invariant_triton import Tiles

CANDIDATES = [Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3), Tiles(64, 128, 64, 4, 4), Tiles(64, 256, 64, 4, 3),
              Tiles(64, 256, 64, 8, 3), Tiles(128, 64, 64, 4, 4), Tiles(128, 128, 64, 4, 3), Tiles(128, 128, 64, 8, 3),
              Tiles(128, 128, 64, 8, 4), Tiles(128, 256, 64, 8, 3), Tiles(64, 128, 128, 4, 3),
              Tiles(128, 128, 128, 8, 3)]


def shapes(quick: bool):
    """(label, M, N, K, layout): layout "fwd" x [M, K] @ wᵀ (w [N, K]), "dgrad" g [M, K] @ w [K, N],
    "wgrad" gᵀ ([K, M] stored, M rows of the result) @ x [K, N]."""
    out = []
    for name, n, k in (("q/k/v", 3072, 2048), ("o", 2048, 2048), ("router", 16, 2048), ("lm head 85", 85, 2048),
                       ("lm head 151936", 151936, 2048)):
        for m in (16, 64, 8192):
            if quick and m == 64:
                continue
            out.append((f"{name} fwd", m, n, k, "fwd"))
    for name, n, k in (("q/k/v", 2048, 3072), ("o", 2048, 2048), ("lm head 151936", 2048, 151936)):
        out.append((f"{name} dgrad", 8192, n, k, "dgrad"))
    for name, m, n in (("q/k/v", 3072, 2048), ("o", 2048, 2048)):
        out.append((f"{name} wgrad", m, n, 8192, "wgrad"))
    return out


def operands(m: int, n: int, k: int, layout: str, gen: torch.Generator):
    def r(*s):
        return torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)
    if layout == "fwd":
        return r(m, k), r(n, k).t()
    if layout == "dgrad":
        return r(m, k), r(k, n)
    return r(k, m).t(), r(k, n)


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, int(2.0 / max(start.elapsed_time(end), 1e-3)))
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="no 64-row decode shapes")
    p.add_argument("--against", help="another version of invariant_triton.py to compare bits and time with")
    p.add_argument("--only-current", action="store_true", help="time the current configuration alone")
    args = p.parse_args()
    old = None
    if args.against:
        spec = importlib.util.spec_from_file_location("old_invariant_triton", args.against)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    print(torch.__version__, torch.cuda.get_device_name())
    gen = torch.Generator(device="cuda").manual_seed(0)
    totals: dict = {}
    for label, m, n, k, layout in shapes(args.quick):
        a, b = operands(m, n, k, layout, gen)
        current = it.tiles(k, n, torch.bfloat16)
        ref = it.bmm(a[None], b[None], config=current)[0]
        cub = time_us(lambda: a @ b)
        cells = []
        if old is not None:  # at the current configuration where its bmm takes one, else at its own
            kw = dict(config=old.Tiles(*current)) if hasattr(old, "Tiles") else {}
            prev = old.bmm(a[None], b[None], **kw)[0]
            us = time_us(lambda: old.bmm(a[None], b[None], **kw))
            cells.append(f"other kernel{' at the current configuration' if kw else ''}: {us:8.1f} ({us / cub:4.2f}x);"
                         f" elements differing from this kernel's: {int((prev != ref).sum())}")
        candidates = [current] if args.only_current else CANDIDATES
        for c in candidates:
            totals.setdefault(c, 0.0)
            try:
                out = it.bmm(a[None], b[None], config=c)[0]
            except Exception as e:  # a configuration the compiler or the GPU refuses (shared memory)
                cells.append(f"{c.block_m}x{c.block_n}x{c.block_k}/{c.warps}w{c.stages}s: {type(e).__name__}: "
                             f"{str(e)[:100]}")
                totals[c] = float("inf")
                continue
            diff = int((out != ref).sum())
            rows_ok = all(torch.equal(it.bmm(a[None, :r], b[None], config=c)[0], out[:r]) for r in (1, 7, 16))
            us = time_us(lambda: it.bmm(a[None], b[None], config=c))
            totals[c] += us
            cells.append(f"{c.block_m}x{c.block_n}x{c.block_k}/{c.warps}w{c.stages}s: {us:8.1f} ({us / cub:4.2f}x)"
                         f"{'' if diff == 0 else f' bits differ: {diff}'}{'' if rows_ok else ' ROWS DEPEND ON M'}"
                         f"{' <- current' if c == current else ''}")
        print(f"{label} M={m} N={n} K={k}: cuBLAS {cub:.1f} µs")
        print("    " + "\n    ".join(cells))
    print("summed µs over the shapes, per configuration timed (one configuration for every shape):")
    for c, t in sorted(totals.items(), key=lambda kv: kv[1]):
        print(f"    {c}: {t:.1f}")


if __name__ == "__main__":
    main()
