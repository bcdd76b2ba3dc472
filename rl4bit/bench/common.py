"""What the benchmarks share: timing (CUDA graphs on the GPU, perf_counter on the CPU), the device copy
bandwidth every memory-bound figure is set against, a host-device sync, and the arguments every bench takes
(`bench_parser`: --device, --quick, --out; `rl4bit bench` and each `python -m rl4bit.bench.X`).

Used by `rl4bit bench gemm|rollout|train|comm` and the sweeps in scripts/.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch


def sync(device) -> None:
    """Wait for `device`'s queued work (a no-op on the CPU): before reading a timer."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_us(fns, device: str, reps: int) -> float:
    """Median µs per call of the callables in `fns` (CUDA: one graph of all of them; CPU: perf_counter)."""
    for f in fns:
        f()
    if device == "cpu":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for f in fns:
                f()
            times.append((time.perf_counter() - t0) * 1e6 / len(fns))
        return statistics.median(times)
    return replay_us(capture(fns), reps) / len(fns)


def capture(fns) -> "torch.cuda.CUDAGraph":
    """One CUDA graph of the callables in `fns`, called in order (run them once before: compiles, allocator); the
    quantize kernels' non-finite checks deferred (a capture cannot read the flag)."""
    from rl4bit.kernels.triton_dispatch import deferred_checks

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with deferred_checks(), torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def replay_us(graph, reps: int) -> float:
    """Median µs of a replay of `graph` (one warm-up replay, then `reps` between CUDA events)."""
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def copy_gbps(device: str, reps: int, nbytes: int = 2**30) -> float:
    """Device copy bandwidth in GB/s, counting read + write bytes."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / time_us([lambda: dst.copy_(src)], device, reps) / 1e3


def resolve_device(name: str) -> str:
    """`--device`: auto -> cuda where a GPU is visible, else cpu. Raises ValueError, naming what to pass instead,
    for a device this process cannot use (checked here once, before any bench builds a model on it)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not re.fullmatch(r"[0-9]+", index))):
        raise ValueError(f"--device {name!r}: choose cpu, cuda, cuda:N or auto")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"{'no GPU visible' if torch.backends.cuda.is_built() else 'a CPU-only build'}); "
                         "use --device cpu (with --quick for the small shapes)")
    if colon and int(index) >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ValueError(f"--device {name}: this process sees {n} GPU(s); choose "
                         + ("cuda:0" if n == 1 else f"one of cuda:0 to cuda:{n - 1}"))
    return name


def bench_parser(prog: str, doc: str, *, quick: str = "small shapes, for smoke runs on a CPU",
                 out: str = "directory for the JSON results") -> argparse.ArgumentParser:
    """An entry point's parser with the arguments every bench takes: --device (auto: cuda where a GPU is visible,
    else cpu), --quick, --out. Parse with `parse_bench_args`, which resolves and checks the device."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.strip().split("\n")[0])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--out", help=out)
    return p


def parse_bench_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    try:
        args.device = resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    return args
