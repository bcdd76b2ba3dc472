"""Where one expert GEMM's forward + backward goes, per recipe: wall, host and device time, kernel by kernel.

    source scripts/device_env.sh && python3 -P scripts/profile_qgemm.py [--recipes nvfp4,mxfp8,bf16] [--rows 32768]

The GEMM is `bench train`'s gate_up or down (`--gemm`): x [rows, K] BF16 grouped over `--experts` equal
experts, W [E, N, K] FP32, `qgemm.grouped_gemm(...).backward(dy)`. Per recipe it prints
- wall: the call and its backward, synchronized (what `bench train`'s GEMM table times);
- host: the same without the synchronize, i.e. how long the host takes to issue the work (wall ≈ host means
  the GPU waits on Python); the quantize kernels' NaN/Inf checks are deferred, as in the trainer;
- device: the sum of the kernels' times under torch.profiler, each kernel's count and time, and the host's
  synchronize calls;
- with `--cprofile`, the Python functions by own host time.

Leaves out: the rest of the step (`profile_train.py`)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from rl4bit.kernels import deferred_checks
from rl4bit.trainer.qgemm import GemmSpec, grouped_gemm

SHAPES = {"gate_up": (1024, 1024), "down": (512, 1024)}
"""K, N of `bench train`'s expert GEMMs (hidden 1024, expert width 512)."""


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--recipes", default="nvfp4,mxfp8,bf16")
    a.add_argument("--gemm", default="gate_up", choices=sorted(SHAPES))
    a.add_argument("--rows", type=int, default=32768)
    a.add_argument("--experts", type=int, default=32)
    a.add_argument("--reps", type=int, default=10)
    a.add_argument("--top", type=int, default=20)
    a.add_argument("--cprofile", action="store_true")
    args = a.parse_args()
    k, n = SHAPES[args.gemm]
    counts = [args.rows // args.experts] * args.experts
    rows = sum(counts)
    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(args.experts, n, k, device="cuda") * 0.02).requires_grad_()
    dy = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    print(f"{args.gemm}: {rows} rows x K {k} x N {n}, {args.experts} experts; "
          f"{6 * rows * n * k / 1e9:.1f} GFLOP forward + backward")
    for recipe in args.recipes.split(","):
        spec = GemmSpec(recipe)

        def call(i: int) -> None:
            grouped_gemm(x, w, counts, spec, keys=(0, 1, 0, i)).backward(dy)
            x.grad = w.grad = None

        # every call below inside deferred_checks, as the trainer runs a micro-batch: the NaN/Inf flag is read at
        # the block's end, not by each quantize (a host sync each)
        with deferred_checks(host=True):
            measure(recipe, call, args, rows * n * k)


def measure(recipe: str, call, args, mnk: int) -> None:
    """Time `call` (wall, host, device by kernel; cProfile if asked) and print it."""
    for i in range(3):
        call(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.reps):
        call(i)
    host = (time.perf_counter() - t0) / args.reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.reps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call(0)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    device = sum(e.self_device_time_total for e in kernels)
    syncs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU
             and ("Synchronize" in e.key or e.key == "aten::_local_scalar_dense")]
    print(f"\n### {recipe}: wall {1e3 * wall:.3f} ms, host {1e3 * host:.3f} ms (issue only), device "
          f"{device / 1e3:.3f} ms in {sum(e.count for e in kernels)} kernels; "
          f"{6 * mnk / wall / 1e12:.0f} TFLOP/s")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"  {e.self_device_time_total:>9.1f} us {100 * e.self_device_time_total / device:>5.1f}% "
              f"{e.count:>4}x  {e.key[:100]}")
    for e in syncs:
        print(f"  host sync: {e.count}x {e.key}, {e.cpu_time_total / 1e3:.3f} ms")
    if args.cprofile:
        prof_py = cProfile.Profile()
        prof_py.enable()
        for i in range(args.reps):
            call(i)
        torch.cuda.synchronize()
        prof_py.disable()
        stats = pstats.Stats(prof_py)
        by_file: dict[str, float] = defaultdict(float)
        for (file, _, _), (_, _, tottime, _, _) in stats.stats.items():
            by_file[file.rsplit("/", 2)[-1] if "/" in file else file] += tottime
        print("  cProfile, own host ms a call by file: " + ", ".join(
            f"{f} {1e3 * t / args.reps:.2f}" for f, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:8]))
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
