"""`rl4bit bench all`: every benchmark in one run, then one table of each headline figure beside its baseline.

Runs, in this order and in this process, each section's own bench (they print
their full tables as they go): `kernels` (format kernels vs the measured copy
bandwidth), `gemm` (quantized GEMMs vs cuBLAS BF16 and the HBM floor), `train`
(trainer tokens/s and peak memory per recipe), `rollout` (embedded engine
NVFP4 vs BF16 weights vs Hugging Face `generate`), `sync` (weight-sync bytes
and seconds; needs Ray), `step` (the RL step, nvfp4 vs mxfp8 and bf16, time
split into sample/score/train/sync, peak memory). A section that fails or
cannot run here is reported as such in the summary; the others still run.

The summary's ratio column is always "better than baseline" > 1 where a
target is stated (speedups: baseline time / ours; memory and bytes: ours /
baseline, target <= the bound), so a reader can check each target at a glance.

Leaves out: `comm` (expert-parallel all-to-all; it needs several processes and
is its own `rl4bit bench comm`), `ce` (the loss kernel bench).

    rl4bit bench all --device cuda --out results/h200
    rl4bit bench all --device cuda --sections rollout,step --new-tokens 128 --steps 3   # a shorter workload
"""

from __future__ import annotations

import importlib
import inspect
import json
import time
import traceback
from pathlib import Path

import torch

from rl4bit.common.atomic import atomic_write_text

SECTIONS = ("kernels", "gemm", "train", "rollout", "sync", "step")


def _call(name: str, device: str, quick: bool, out: str | None, options: dict) -> dict:
    """Run section `name`, passing it those of `options` (steps, new_tokens, batches) its `run` takes."""
    mod = importlib.import_module(f"rl4bit.bench.{name}")
    sub = str(Path(out) / name) if out else None
    if sub:
        Path(sub).mkdir(parents=True, exist_ok=True)
    params = inspect.signature(mod.run).parameters
    kwargs = {k: v for k, v in options.items() if v is not None and k in params}
    t0 = time.perf_counter()
    res = mod.run(device=device, quick=quick, out=sub, **kwargs)
    return {"ok": True, "seconds": time.perf_counter() - t0, "result": res}


def _rows_kernels(res) -> list[tuple]:
    rows = []
    for r in res:
        target = r.get("target")
        rows.append((f"kernel {r['kernel']} {r['shape']}", f"{r['gbps']:.0f} GB/s", f"copy {r['copy_gbps']:.0f} GB/s",
                     r["of_copy"], None if target is None else f">= {target:.2f}"))
    return rows


def _rows_gemm(res) -> list[tuple]:
    """`bench_gemm.run`'s rows: the decode cases beside the BF16 baseline and the HBM floor (their targets: the
    speed-up and the share of HBM bandwidth), the training cases beside `torch.bmm`."""
    from rl4bit.bench.gemm import HBM_TARGET, SPEEDUP_TARGET

    rows = []
    for r in res:
        base = f"{r['baseline']} {r['baseline_us']:.1f} µs"
        if "floor_us" in r:  # the targets are the GPU kernel's: none beside the CPU's reference path
            rows.append((f"gemm {r['case']} {r['shape']}", f"{r['us']:.1f} µs",
                         f"{base}; HBM floor {r['floor_us']:.1f} µs ({r['of_hbm']:.0%})", r["speedup"],
                         None if r.get("device") == "cpu" else f">= {SPEEDUP_TARGET}x, >= {HBM_TARGET:.0%} HBM"))
        else:
            rows.append((f"gemm {r['case']} {r['shape']}", f"{r['us']:.1f} µs", base, r["speedup"], None))
    return rows


def _rows_train(res) -> list[tuple]:
    rows = []
    by = {r["recipe"]: r for r in res.get("train", [])}
    base = by.get("bf16")
    for name, r in by.items():
        if base is None:
            continue
        mem = r.get("peak_mem_gib")
        rows.append((f"trainer {name} tokens/s", f"{r['tokens_per_s']:.0f}", f"bf16 {base['tokens_per_s']:.0f}",
                     r["tokens_per_s"] / base["tokens_per_s"], ">= 0.87 (1.15x overhead)" if name == "nvfp4" else None))
        if mem is not None and base.get("peak_mem_gib"):
            rows.append((f"trainer {name} peak memory", f"{mem:.1f} GiB", f"bf16 {base['peak_mem_gib']:.1f} GiB",
                         mem / base["peak_mem_gib"], None))
    return rows


def _rows_rollout(res) -> list[tuple]:
    rows = []
    for r in res.get("rows", []):
        b, e, h, q, v = r["batch"], r["engine"], r.get("hf"), r.get("engine_nvfp4"), r.get("vllm_bf16")
        if h:
            rows.append((f"rollout batch {b}: engine BF16 tok/s", f"{e['gen_tok_s']:.0f}",
                         f"HF generate {h['gen_tok_s']:.0f}", e["gen_tok_s"] / h["gen_tok_s"],
                         ">= 20" if b == 64 else None))
        if q:
            target = ">= 2.5" if b <= 16 else (">= 1.8" if b == 64 else None)
            rows.append((f"rollout batch {b}: engine NVFP4 tok/s", f"{q['gen_tok_s']:.0f}",
                         f"engine BF16 {e['gen_tok_s']:.0f}", q["gen_tok_s"] / e["gen_tok_s"], target))
        if q and v:
            rows.append((f"rollout batch {b}: engine NVFP4 tok/s", f"{q['gen_tok_s']:.0f}",
                         f"vLLM BF16 {v['gen_tok_s']:.0f}", q["gen_tok_s"] / v["gen_tok_s"], ">= 1.3"))
    return rows


def _rows_sync(res) -> list[tuple]:
    nv, bf = res["rows"]["nvfp4"], res["rows"]["bf16"]
    return [("sync expert bytes (nvfp4)", f"{nv['expert_bytes']:,}", f"bf16 {bf['expert_bytes']:,}",
             nv["expert_bytes"] / bf["expert_bytes"], "<= 0.30"),
            ("sync seconds (nvfp4)", f"{nv['seconds']:.3f}", f"bf16 {bf['seconds']:.3f}",
             bf["seconds"] / nv["seconds"], None)]


def _rows_step(res) -> list[tuple]:
    """The reference recipe (`bench step`'s first, nvfp4 by default) beside each other recipe: times as other /
    reference (the targets of issue 11 against bf16), memory as reference / other."""
    ref, *others = res["rows"]
    name = ref["recipe"]
    rows = []
    for b in others:
        # against bf16 the figure keeps its plain name (the issue-11 targets); against another recipe it names both
        tag = name if b["recipe"] == "bf16" else f"{name} vs {b['recipe']}"
        target = b["recipe"] == "bf16" and name == "nvfp4"
        rows += [(f"RL step {p} s ({tag})", f"{ref['seconds'][p]:.3f}", f"{b['recipe']} {b['seconds'][p]:.3f}",
                  b["seconds"][p] / ref["seconds"][p] if ref["seconds"][p] else float("nan"),
                  ">= 1.3" if target and p == "step" else None)
                 for p in ("sample", "score", "train", "sync", "step")]
        if ref.get("peak_gib") and b.get("peak_gib"):
            rows.append((f"RL job peak GPU memory ({tag})", f"{ref['peak_gib']:.1f} GiB",
                         f"{b['recipe']} {b['peak_gib']:.1f} GiB", ref["peak_gib"] / b["peak_gib"],
                         "<= 0.6" if target else None))
            for k, qm in (ref.get("memory_gib") or {}).items():  # where the peak comes from
                bm = b["memory_gib"][k]
                rows.append((f"  RL job {k.replace('_', ' ')} ({tag})", f"{qm:.1f} GiB", f"{b['recipe']} {bm:.1f} GiB",
                             qm / bm if bm else None, None))
    return rows


SUMMARY = {"kernels": _rows_kernels, "gemm": _rows_gemm, "train": _rows_train, "rollout": _rows_rollout,
           "sync": _rows_sync, "step": _rows_step}


def run(device: str = "cuda", quick: bool = False, out: str | None = None, sections=SECTIONS, steps: int | None = None,
        new_tokens: int | None = None, batches: list[int] | None = None) -> dict:
    """Every section (or those named), then the summary table; all results in out/bench_all.json.

    steps, new_tokens, batches: passed to the sections that take them (step: RL steps and new tokens; rollout:
    new tokens and batch sizes); None keeps each section's default (the issues' workloads).
    """
    if isinstance(sections, str):
        sections = tuple(x.strip() for x in sections.split(",") if x.strip())
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown:
        raise ValueError(f"bench all: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    options = dict(steps=steps, new_tokens=new_tokens, batches=batches)
    results: dict[str, dict] = {}
    for name in sections:
        print(f"\n=== rl4bit bench {name} ({device}{', quick' if quick else ''}) ===", flush=True)
        try:
            results[name] = _call(name, device, quick, out, options)
        except ModuleNotFoundError as e:
            results[name] = {"ok": False, "error": f"not available here: {e}"}
        except BaseException as e:  # SystemExit from a section's own checks, too: report and go on
            if isinstance(e, KeyboardInterrupt):
                raise
            traceback.print_exc()
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    rows = []
    for name in sections:
        r = results[name]
        if not r["ok"]:
            rows.append((f"[{name}]", "not run", r["error"][:90], None, None))
            continue
        try:
            rows.extend(SUMMARY[name](r["result"]))
        except Exception as e:  # a summary that cannot be built loses neither the other rows nor the JSON
            traceback.print_exc()
            rows.append((f"[{name}]", "no summary", f"{type(e).__name__}: {e}", None, None))
    _print_summary(rows, device)
    if out:
        atomic_write_text(Path(out) / "bench_all.json",
                          json.dumps({"device": device, "quick": quick, "summary": rows, "sections": results},
                                     indent=1, default=str))
    return {"summary": rows, "sections": results}


def _print_summary(rows: list[tuple], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device
    t = Table(title=f"rl4bit bench all: {gpu} "
                    "(ratio > 1 = better than the baseline, except memory/bytes: ours / baseline)")
    for col in ("figure", "ours", "baseline / ceiling", "ratio", "target"):
        t.add_column(col, justify="left" if col in ("figure", "baseline / ceiling") else "right")
    for fig, ours, base, ratio, target in rows:
        t.add_row(fig, ours, base, "" if ratio is None else f"{ratio:.2f}", target or "")
    Console(width=max(Console().width, 150)).print(t)
