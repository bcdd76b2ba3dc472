"""What the benchmarks share: timing (CUDA graphs on the GPU, perf_counter on the CPU), the device copy
bandwidth every memory-bound figure is set against, and a host-device sync.

Used by `rl4bit bench gemm|rollout|train|comm` and the sweeps in scripts/.
"""

from __future__ import annotations

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
