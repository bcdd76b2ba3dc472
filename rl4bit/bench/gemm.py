"""Benchmark of the quantized GEMMs: NVFP4 decode / grouped forward and the MXFP8 backward, each beside its baseline.

    python -m rl4bit.bench.gemm --device cuda     # H200: real shapes, CUDA graphs, rotating weights
    python -m rl4bit.bench.gemm --quick           # CPU smoke run (trainer reference path, tiny shapes)
    rl4bit bench gemm [--quick] [--out DIR]       # same, through the CLI

Cases (issue 6 decode targets, issue 4 speed):
- decode GEMM at M = 1, 4, 16 on K=4096, N=14336 and on Qwen3-30B-A3B's experts
  (hidden 2048, moe_intermediate 768, 128 experts, top-8 routing: gate_up
  [128, 1536, 2048] and down [128, 2048, 768]), NVFP4 weights decoded in
  registers (``kernels/qgemm_triton.py``), against cuBLAS BF16 (``F.linear``;
  experts: ``torch._grouped_mm``) and against the HBM floor = bytes the GEMM
  must move (weights touched + x + y) / copy bandwidth measured in the same run.
  Targets: >= 3.5x cuBLAS BF16 and >= 85% of HBM bandwidth.
- the grouped forward at training shapes (32768 routed rows, 256 an expert) vs
  BF16 ``torch.bmm`` of the same shapes (TFLOP/s both).
- the MXFP8 backward (dgrad, wgrad) on the FP8 tensor cores and through the
  BF16 dequantize path (``kernels/mxfp8_gemm_triton.py``) vs BF16 bmm.
Timing (CUDA): each call captured in a CUDA graph (decode steps run as graphs;
launch overhead is not the kernel's), replayed between CUDA events; for
decode, the graph calls the GEMM on enough rotating copies of the weights
that they cannot sit in the 50 MB L2, and the time is per call. Median of reps.

Leaves out: end-to-end decode steps (``rl4bit bench rollout``) and tuning sweeps.
"""

from __future__ import annotations

import json
import math
import os

import torch

from rl4bit.bench.common import bench_parser, copy_gbps, parse_bench_args, time_us

DENSE = (4096, 14336)
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
DECODE_M = (1, 4, 16)
TRAIN_ROWS = 32768
SPEEDUP_TARGET, HBM_TARGET = 3.5, 0.85
ROTATE_BYTES = 400 * 2**20  # > 8x the H200's L2


def _nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _qbytes(q) -> int:
    return _nbytes(q.data, q.scale, q.outer)


def _copies(make, bytes_each: int, device: str) -> list:
    """Enough copies of make() that cycling through them defeats the L2 (one on CPU)."""
    n = 1 if device == "cpu" else min(16, max(2, math.ceil(ROTATE_BYTES / max(bytes_each, 1))))
    return [make(i) for i in range(n)]


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return torch.bincount(idx.reshape(-1), minlength=experts).tolist()


def _weights(shape, device, seed, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype)


def decode_cases(device: str, shapes, ms, experts_shapes, top_k: int, gbps: float, reps: int) -> list[dict]:
    from rl4bit.kernels import quantize
    from rl4bit.trainer.qgemm import GemmSpec, quantize_activation
    from rl4bit.trainer.qgemm import grouped_forward as fwd

    spec = GemmSpec("nvfp4")
    rows = []
    cases = [("dense", 1, k, n) for k, n in shapes] + [(name, e, k, n) for name, e, k, n in experts_shapes]
    for name, e, k, n in cases:
        w = _weights((e, n, k), device, 1)
        q0 = quantize(w, "nvfp4", outer="group")
        per_expert = _qbytes(q0) // e
        for m in ms:
            counts = [m] if e == 1 else _routing(m, e, top_k, seed=m)
            r = sum(counts)
            touched = sum(1 for c in counts if c)
            x = _weights((r, k), device, 2, torch.bfloat16) * 50
            qx = quantize_activation(x, spec)
            qws = _copies(lambda i: q0 if i == 0 else quantize(_weights((e, n, k), device, 10 + i), "nvfp4",
                                                                 outer="group"),
                          per_expert * touched, device)
            us = time_us([lambda q=q: fwd(qx, q, counts, torch.bfloat16) for q in qws], device, reps)
            us_q = time_us([lambda q=q: fwd(quantize_activation(x, spec), q, counts, torch.bfloat16) for q in qws],
                            device, reps)
            wbs = _copies(lambda i: w if i == 0 else _weights((e, n, k), device, 10 + i), 2 * n * k * touched, device)
            base_name, base = _bf16_baseline(x, counts, e)
            base_us = time_us([lambda wb=wb: base(wb) for wb in wbs], device, reps)
            moved = per_expert * touched + _qbytes(qx) + r * n * 2
            floor_us = moved / gbps / 1e3
            label = f"{name} M={m}" + (f" ({r} rows, {touched} experts)" if e > 1 else "")
            rows.append(dict(case="decode nvfp4", device=x.device.type, shape=f"{label} K={k} N={n}", us=us,
                             us_with_quantize=us_q,
                             baseline=base_name, baseline_us=base_us, speedup=base_us / us,
                             speedup_with_quantize=base_us / us_q, floor_us=floor_us,
                             of_hbm=floor_us / us, bytes=moved,
                             ok=base_us / us >= SPEEDUP_TARGET and floor_us / us >= HBM_TARGET))
    return rows


def _bf16_baseline(x, counts, experts):
    """(name, fn(w_bf16 [E, N, K]) -> y): cuBLAS BF16 for one matrix (torch's CPU GEMM on the CPU),
    torch._grouped_mm for experts."""
    if experts == 1:
        name = "cuBLAS bf16 F.linear" if x.is_cuda else "torch bf16 F.linear (CPU)"
        return name, lambda w: torch.nn.functional.linear(x, w[0])
    offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)

    def grouped(w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        try:
            grouped(torch.zeros(experts, 16, x.shape[1], dtype=x.dtype, device=x.device))
            return "bf16 torch._grouped_mm", grouped
        except (RuntimeError, TypeError) as err:  # older torch / unsupported layout: the per-expert loop
            print(f"bench_gemm: torch._grouped_mm unavailable ({err}); baseline = per-expert F.linear")

    def loop(w):
        out, start = x.new_empty(x.shape[0], w.shape[1]), 0
        for e, m in enumerate(counts):
            if m:
                out[start:start + m] = x[start:start + m] @ w[e].t()
            start += m
        return out

    return "bf16 per-expert mm", loop


def train_cases(device: str, rows: int, experts: int, shapes, reps: int, mxfp8: bool | None = None) -> list[dict]:
    """Grouped NVFP4 forward and MXFP8 dgrad/wgrad (both paths) at balanced routing vs BF16 bmm, TFLOP/s.

    mxfp8: include the Triton MXFP8 GEMMs (default: on CUDA; tests run them under the interpreter).
    """
    from rl4bit.kernels import quantize, requantize
    from rl4bit.trainer.qgemm import GemmSpec, quantize_activation, quantize_weight
    from rl4bit.trainer.qgemm import grouped_forward as fwd

    m = rows // experts
    counts = [m] * experts
    out = []
    for name, k, n in shapes:
        flops = 2.0 * rows * k * n
        x, w = _weights((rows, k), device, 3) * 50, _weights((experts, n, k), device, 4)
        dy = _weights((rows, n), device, 5)
        bmm_us = {}
        for what, a, b in (("fwd", (experts, m, k), (experts, k, n)), ("dgrad", (experts, m, n), (experts, n, k)),
                           ("wgrad", (experts, n, m), (experts, m, k))):
            ta, tb = _weights(a, device, 6), _weights(b, device, 7)
            bmm_us[what] = time_us([lambda ta=ta, tb=tb: torch.bmm(ta, tb)], device, reps)
        spec = GemmSpec("nvfp4")
        qx, qw = quantize_activation(x, spec), quantize_weight(w, spec)
        rows_out = [("nvfp4 grouped forward", "fwd", lambda: fwd(qx, qw, counts, torch.bfloat16))]
        if device != "cpu" if mxfp8 is None else mxfp8:
            from rl4bit.kernels import mxfp8_gemm_triton as mg

            qdy, qdyt = quantize(dy, "mxfp8"), quantize(dy.t().contiguous(), "mxfp8")
            qwt = requantize(qw, seed=1)  # [E, K, N]
            qxt = requantize(qx, seed=2)  # [K, R]
            counts_t = torch.tensor(counts, device=device)  # built before the graph capture (no H2D copy inside)
            for fp8 in (False, True):
                tag = "FP8 cores" if fp8 else "BF16 dequant"
                rows_out.append((f"mxfp8 dgrad ({tag})", "dgrad",
                                 lambda fp8=fp8: mg.grouped_mxfp8(qdy, qwt, counts_t, torch.float32, fp8=fp8)))
                rows_out.append((f"mxfp8 wgrad ({tag})", "wgrad",
                                 lambda fp8=fp8: mg.wgrad_mxfp8(qdyt, qxt, counts_t, torch.float32, fp8=fp8)))
        for case, what, fn in rows_out:
            us = time_us([fn], device, reps)
            out.append(dict(case=case, shape=f"{name}: {rows} rows, {experts}x{m}, K={k} N={n}", us=us,
                            tflops=flops / us / 1e6, baseline=f"bf16 torch.bmm ({what})", baseline_us=bmm_us[what],
                            baseline_tflops=flops / bmm_us[what] / 1e6, speedup=bmm_us[what] / us))
    return out


def run(device: str = "cuda", quick: bool = False, out: str | None = None, decode_only: bool = False) -> list[dict]:
    """Time every case (decode_only: the decode cases alone), print one table, return the rows (and write
    out/bench_gemm.json if `out`)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench_gemm: --device cuda but CUDA is not available here; use --device cpu --quick")
    if device == "cpu" and not quick:
        raise SystemExit("bench_gemm: the CPU runs the reference path only; pass --quick (tiny shapes)")
    if quick:
        shapes, ms, exp = [(64, 96)], (1, 4), [("experts up", 8, 64, 32)]
        top_k, train_rows, experts, reps = 2, 256, 8, 3
        train_shapes = [("gate_up", 64, 32)]
    else:
        shapes, ms, top_k, train_rows, experts, reps = [DENSE], DECODE_M, TOP_K, TRAIN_ROWS, EXPERTS, 30
        exp = [("experts gate_up", EXPERTS, HIDDEN, 2 * INTER), ("experts down", EXPERTS, INTER, HIDDEN)]
        train_shapes = [("gate_up", HIDDEN, 2 * INTER), ("down", INTER, HIDDEN)]
    gbps = copy_gbps(device, reps, 2**24 if quick else 2**30)
    rows = decode_cases(device, shapes, ms, exp, top_k, gbps, reps)
    if not decode_only:
        rows += train_cases(device, train_rows, experts, train_shapes, reps)
    _print_table(rows, device, gbps)
    if out:
        from rl4bit.common.atomic import atomic_write_text

        atomic_write_text(os.path.join(out, "bench_gemm.json"), json.dumps(dict(copy_gbps=gbps, rows=rows), indent=1))
    return rows


def _print_table(rows: list[dict], device: str, gbps: float) -> None:
    from rich.console import Console
    from rich.table import Table

    name = (torch.cuda.get_device_name() if device.startswith("cuda") else
            "cpu (the PyTorch reference path: its speed-ups and floors say nothing about the GPU kernels)")
    table = Table(title=f"rl4bit quantized GEMMs on {name}; copy bandwidth {gbps:.0f} GB/s")
    for col in ("case", "shape", "µs", "baseline", "base µs", "speed-up", "TFLOP/s (base)", "HBM floor µs",
                "of HBM", "target"):
        table.add_column(col, justify="left" if col in ("case", "shape", "baseline") else "right")
    for r in rows:
        decode = "floor_us" in r
        us = f"{r['us']:.1f}" + (f" (+quant {r['us_with_quantize']:.1f})" if decode else "")
        tfl = "" if decode else f"{r['tflops']:.0f} ({r['baseline_tflops']:.0f})"
        target = ""
        if decode and device != "cpu":
            target = f">= {SPEEDUP_TARGET}x, {HBM_TARGET:.0%}: " + ("ok" if r["ok"] else "MISS")
        speedup = f"{r['speedup']:.2f}x" + (f" ({r['speedup_with_quantize']:.2f}x +quant)" if decode else "")
        table.add_row(r["case"], r["shape"], us, r["baseline"], f"{r['baseline_us']:.1f}", speedup, tfl,
                      f"{r['floor_us']:.1f}" if decode else "", f"{r['of_hbm']:.0%}" if decode else "", target)
    Console(width=max(Console().width, 160)).print(table)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("rl4bit.bench.gemm", __doc__, quick="tiny shapes (on CPU: the reference path), for smoke runs",
                     out="directory for bench_gemm.json")
    p.add_argument("--decode", action="store_true", help="the decode cases alone (NVFP4 against cuBLAS BF16)")
    args = parse_bench_args(p, argv)
    run(device=args.device, quick=args.quick, out=args.out, decode_only=args.decode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
