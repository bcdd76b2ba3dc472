"""Benchmark of the format kernels: µs and GB/s of each beside a measured device-to-device copy.

    python -m rl4bit.bench.kernels --device cuda          # H200: Triton kernels, real shapes
    python -m rl4bit.bench.kernels --device cuda --sweep  # tile sizes / warps of the target kernels
    python -m rl4bit.bench.kernels --quick --device cpu   # smoke run: reference path, small shapes
    rl4bit bench kernels [--quick] [--out DIR]            # same, through the CLI

Shapes are Qwen3-30B-A3B's MoE experts (hidden 2048, expert intermediate 768,
128 experts) at 4k, 16k and 64k tokens, plus 8192x8192. Bytes = what the op
must move at least: every input byte read once plus every output byte written
once (an extra amax pass, e.g. for per-tensor or per-expert outer scales, is
not counted, so it shows as a lower fraction). The ceiling is a
``dst.copy_(src)`` of the same total traffic ((read + write) / 2 bytes each
way), timed the same way; "of copy" = copy time / kernel time. Timing: CUDA
events around each call, L2 flushed (256 MB memset) before every repetition,
median of the repetitions. Targets (issue 3): >= 80% of the copy for NVFP4
quantize with 4/6 and for the fused requantize.

On CUDA it times the Triton wrappers directly (``*_triton.py``), which skip
the dispatch's non-finite check (one device sync per call in the public API).
On CPU (``--quick``) it times the plain-PyTorch reference so the CLI can be
smoke-tested in CI; those numbers say nothing about the GPU.

Leaves out: GEMMs (see the trainer benches) and multi-GPU all-to-all.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rl4bit.bench.common import bench_parser, parse_bench_args

HIDDEN, INTER, EXPERTS = 2048, 768, 128
TOKENS = (4096, 16384, 65536)
TARGET = 0.80
SEED = 0x5EED


@dataclass
class Case:
    name: str
    shape: str
    fn: Callable[[], object]  # returns the output tensors (counted as written bytes)
    read_bytes: int
    target: float | None = None
    group: str | None = None  # sweep: the group's first case is the default, the others are checked against it


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if hasattr(obj, "data") and hasattr(obj, "scale") and hasattr(obj, "outer"):
        return _nbytes((obj.data, obj.scale, obj.outer))
    raise TypeError(f"cannot count bytes of {type(obj).__name__}")


def _time_us(fn, device: str, reps: int) -> float:
    """Median µs of fn() over `reps` calls (CUDA: events, L2 flushed before each; CPU: perf_counter)."""
    fn()  # warm-up / compile
    if device == "cpu":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def _copy_us(total_bytes: int, device: str, reps: int) -> float:
    n = max(1, total_bytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return _time_us(lambda: dst.copy_(src), device, reps)


def _bf16(shape, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16).to(device)


def _triton_cases(device: str, tokens, hidden: int, inter: int, experts: int, square: int | None) -> list[Case]:
    from rl4bit.kernels import mxfp8_triton, nvfp4_triton, s2f6_triton

    cases: list[Case] = []

    def nv(x, **kw):
        return lambda: nvfp4_triton.quantize_nvfp4(x, **kw)[:3]

    def requant(x, outer, stochastic=True):
        data, scale, outer_rows, _ = nvfp4_triton.quantize_nvfp4(x, outer=outer, four_over_six=outer == "row")
        return (lambda: mxfp8_triton.requantize_nvfp4(data, scale, outer_rows, x.shape, stochastic=stochastic,
                                                      seed=SEED),
                _nbytes((data, scale, outer_rows)))

    for t in tokens:
        xh = _bf16((t, hidden), device, 1)
        xi = _bf16((t, inter), device, 2)
        rb = _nbytes(xh)
        cases.append(Case("nvfp4 4/6, per-token outer", f"{t}x{hidden}", nv(xh, outer="row", four_over_six=True), rb,
                          TARGET))
        cases.append(Case("nvfp4 4/6, per-token outer", f"{t}x{inter}", nv(xi, outer="row", four_over_six=True),
                          _nbytes(xi), TARGET))
        cases.append(Case("nvfp4, per-token outer", f"{t}x{hidden}", nv(xh, outer="row"), rb))
        cases.append(Case("nvfp4 SR, per-tensor outer", f"{t}x{hidden}",
                          nv(xh, outer="tensor", stochastic=True, seed=SEED), rb))
        cases.append(Case("mxfp8 rowwise", f"{t}x{hidden}", lambda x=xh: mxfp8_triton.quantize_rows(x)[:2], rb))
        cases.append(Case("mxfp8 rowwise SR", f"{t}x{hidden}",
                          lambda x=xh: mxfp8_triton.quantize_rows(x, stochastic=True, seed=SEED)[:2], rb))
        cases.append(Case("mxfp8 columnwise", f"{t}x{hidden}", lambda x=xh: mxfp8_triton.quantize_cols(x)[:2], rb))
        fn, qb = requant(xh, "row")
        cases.append(Case("requantize nvfp4->mxfp8^T SR", f"{t}x{hidden}", fn, qb, TARGET))
        fn, qb = requant(xh, "row", stochastic=False)
        cases.append(Case("requantize nvfp4->mxfp8^T nearest", f"{t}x{hidden}", fn, qb))
        cases.append(Case("rht + s2f6 encode", f"{t}x{hidden}",
                          lambda x=xh: s2f6_triton.quantize_s2f6(x, rht_seed=SEED)[:2], rb))
        codes, scales, _ = s2f6_triton.quantize_s2f6(xh, rht_seed=SEED)
        cases.append(Case("s2f6 decode + inverse rht", f"{t}x{hidden}",
                          lambda c=codes, s=scales: s2f6_triton.dequantize_s2f6(c, s, c.shape, rht_seed=SEED),
                          _nbytes((codes, scales))))
    for shape in ((experts, inter, hidden), (experts, hidden, inter)):
        w = _bf16(shape, device, 3)
        label = "x".join(map(str, shape))
        cases.append(Case("nvfp4 weights, per-expert outer", label, nv(w, outer="group"), _nbytes(w)))
        fn, qb = requant(w, "group")
        cases.append(Case("requantize nvfp4->mxfp8^T SR", label, fn, qb, TARGET))
    if square:
        xs = _bf16((square, square), device, 4)
        label = f"{square}x{square}"
        cases.append(Case("nvfp4 4/6, per-token outer", label, nv(xs, outer="row", four_over_six=True), _nbytes(xs),
                          TARGET))
        cases.append(Case("mxfp8 rowwise", label, lambda: mxfp8_triton.quantize_rows(xs)[:2], _nbytes(xs)))
        fn, qb = requant(xs, "row")
        cases.append(Case("requantize nvfp4->mxfp8^T SR", label, fn, qb, TARGET))
    return cases


def _reference_cases(device: str, tokens, hidden: int, inter: int, experts: int) -> list[Case]:
    from rl4bit.kernels import dequantize, inverse_rht, quantize_reference, rht
    from rl4bit.kernels.requant import requantize_nvfp4_to_mxfp8
    from rl4bit.kernels.s2f6 import dequantize_s2f6, quantize_s2f6

    cases: list[Case] = []
    for t in tokens:
        x = _bf16((t, hidden), device, 1)
        rb, label = _nbytes(x), f"{t}x{hidden}"
        cases.append(Case("nvfp4 4/6, per-token outer", label,
                          lambda: quantize_reference(x, "nvfp4", outer="row", four_over_six=True), rb, TARGET))
        cases.append(Case("mxfp8 rowwise", label, lambda: quantize_reference(x, "mxfp8"), rb))
        q = quantize_reference(x, "nvfp4", outer="row")
        cases.append(Case("nvfp4 dequantize to bf16", label, lambda: dequantize(q, torch.bfloat16),
                          _nbytes(q) + rb))
        cases.append(Case("requantize nvfp4->mxfp8^T SR", label, lambda: requantize_nvfp4_to_mxfp8(q, seed=SEED),
                          _nbytes(q), TARGET))
        cases.append(Case("rht + s2f6 encode", label, lambda: quantize_s2f6(rht(x, SEED)), rb))
        qs = quantize_s2f6(rht(x, SEED))
        cases.append(Case("s2f6 decode + inverse rht", label, lambda: inverse_rht(dequantize_s2f6(qs), SEED),
                          _nbytes(qs)))
    w = _bf16((experts, inter, hidden), device, 3)
    cases.append(Case("nvfp4 weights, per-expert outer", "x".join(map(str, w.shape)),
                      lambda: quantize_reference(w, "nvfp4", outer="group"), _nbytes(w)))
    return cases


def _sweep_cases(device: str, tokens: int, hidden: int) -> list[Case]:
    """The format kernels of the training step under several tiles / warp counts (to pick defaults): NVFP4 4/6
    and NVFP4 SR (activations), the fused SR requantize, MXFP8 rowwise. Each group's first case is the kernel's
    default; `run` checks every other case's outputs bitwise against it (a tile must not change a bit: amaxes
    and scales are per block, random bits are indexed by element position)."""
    from rl4bit.kernels import mxfp8_triton, nvfp4_triton

    x = _bf16((tokens, hidden), device, 1)
    label = f"{tokens}x{hidden}"
    cases: list[Case] = []
    for group, kw in (("nvfp4 4/6 row", dict(outer="row", four_over_six=True)),
                      ("nvfp4 SR tensor", dict(outer="tensor", stochastic=True, seed=SEED))):
        for name, extra in _variants(group, ("block_elems", "num_warps"),
                                     [(e, w) for e in (1024, 2048, 4096, 8192, 16384) for w in (2, 4, 8, 16)]):
            cases.append(Case(name, label, lambda kw=kw, extra=extra: nvfp4_triton.quantize_nvfp4(
                x, **kw, **extra)[:3], _nbytes(x), TARGET, group))
    data, scale, outer_rows, _ = nvfp4_triton.quantize_nvfp4(x, outer="row", four_over_six=True)
    qb = _nbytes((data, scale, outer_rows))
    tiles = [(32, 256), (32, 128), (64, 128), (32, 512), (32, 64), (64, 64), (128, 64), (128, 128)]  # M: 32s
    for sr in (True, False):
        group = f"requantize {'SR' if sr else 'RN'}"
        for name, extra in _variants(group, ("block_m", "block_k", "num_warps"),
                                     [(bm, bk, w) for bm, bk in tiles for w in (2, 4, 8)]):
            cases.append(Case(name, label, lambda sr=sr, extra=extra: mxfp8_triton.requantize_nvfp4(
                data, scale, outer_rows, x.shape, stochastic=sr, seed=SEED, **extra), qb, TARGET, group))
    for name, extra in _variants("mxfp8 rowwise", ("block_m", "block_k", "num_warps"),
                                 [(bm, bk, w) for bm, bk in ((16, 256), (32, 256), (8, 512), (64, 128))
                                  for w in (4, 8)]):
        cases.append(Case(name, label, lambda extra=extra: mxfp8_triton.quantize_rows(x, **extra)[:2], _nbytes(x),
                          None, "mxfp8 rowwise"))
    return cases


def _variants(group: str, keys: tuple[str, ...], values: list[tuple]):
    """(name, keyword arguments) of a kernel's default (none), then of each config in `values`."""
    yield f"{group} [default]", {}
    for v in values:
        kw = dict(zip(keys, v))
        yield f"{group} [{' '.join(f'{k}={x}' for k, x in kw.items())}]", kw


def _same_bits(a, b) -> bool:
    a, b = (a if isinstance(a, (tuple, list)) else (a,)), (b if isinstance(b, (tuple, list)) else (b,))
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


def run(device: str = "cuda", quick: bool = False, out: str | None = None, sweep: bool = False) -> list[dict]:
    """Time every case, print a table, return one dict per case (and write out/bench_kernels.json if `out`)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_kernels: --device cuda but CUDA is not available here; use --device cpu --quick")
    if device == "cpu" and not quick:
        raise SystemExit("bench_kernels: the CPU runs the reference path only; pass --quick (small shapes)")
    use_triton = device.startswith("cuda")
    if quick:
        tokens, hidden, inter, experts, square, reps = (256,), 256, 128, 4, None, 5
    else:
        tokens, hidden, inter, experts, square, reps = TOKENS, HIDDEN, INTER, EXPERTS, 8192, 50
    if sweep:
        if not use_triton:
            raise SystemExit("bench_kernels: --sweep tunes the Triton kernels; it needs --device cuda")
        cases = _sweep_cases(device, tokens[-1] if quick else 16384, hidden)
        path = "triton"
    elif use_triton:
        cases = _triton_cases(device, tokens, hidden, inter, experts, square)
        path = "triton"
    else:
        cases = _reference_cases(device, tokens, hidden, inter, experts)
        path = "reference"
    results, defaults = [], {}
    for c in cases:
        try:
            got = c.fn()
        except Exception as err:  # a sweep's tile past the registers or shared memory: reported, not fatal
            if c.group is None:
                raise
            print(f"{c.name}: {type(err).__name__}: {str(err)[:160]}")
            continue
        bitwise = None
        if c.group is not None:
            bitwise = _same_bits(got, defaults.setdefault(c.group, got))
        total = c.read_bytes + _nbytes(got)
        del got
        us = _time_us(c.fn, device, reps)
        copy_us = _copy_us(total, device, reps)
        target = c.target if use_triton else None  # the targets are for the GPU kernels
        results.append(dict(kernel=c.name, shape=c.shape, path=path, bytes=total, us=us, gbps=total / us / 1e3,
                            copy_us=copy_us, copy_gbps=total / copy_us / 1e3, of_copy=copy_us / us,
                            target=target, meets_target=None if target is None else copy_us / us >= target,
                            bitwise=bitwise))
    _print_table(results, device)
    if out:
        from rl4bit.common.atomic import atomic_write_text

        atomic_write_text(os.path.join(out, "bench_kernels.json"), json.dumps(results, indent=1))
    return results


def _print_table(results: list[dict], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu (reference path)"
    table = Table(title=f"rl4bit format kernels on {name}")
    swept = any(r.get("bitwise") is not None for r in results)
    for col in ("kernel", "shape", "µs", "GB/s", "copy µs", "copy GB/s", "of copy", "target") + (
            ("bits = default",) if swept else ()):
        table.add_column(col, justify="left" if col in ("kernel", "shape") else "right")
    for r in results:
        target = "" if r["target"] is None else f"{r['target']:.0%} " + ("ok" if r["meets_target"] else "MISS")
        table.add_row(r["kernel"], r["shape"], f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['copy_us']:.1f}",
                      f"{r['copy_gbps']:.0f}", f"{r['of_copy']:.0%}", target,
                      *(("yes" if r["bitwise"] else "NO (do not pick)" if r["bitwise"] is False else "",)
                        if swept else ()))
    Console(width=max(Console().width, 120)).print(table)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("rl4bit.bench.kernels", __doc__, out="directory for bench_kernels.json",
                     quick="small shapes (on CPU: the reference path), for smoke runs")
    p.add_argument("--sweep", action="store_true", help="time the target kernels under several tile sizes (CUDA)")
    args = parse_bench_args(p, argv)
    run(device=args.device, quick=args.quick, out=args.out, sweep=args.sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
