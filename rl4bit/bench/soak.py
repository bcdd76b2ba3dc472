"""`rl4bit bench soak CONFIG --steps N`: memory per RL step over a long run; it must stay flat after warm-up.

Runs the job in local mode (trainer, sampler and driver in this one process,
so one resident-set figure covers them all; reward workers are separate
processes and reported beside it) for `--steps` steps, with checkpoints and
evaluation as configured, and records after every step: this process's
resident memory (RSS), the reward workers' RSS, and on CUDA the allocated and
reserved GPU memory. A leak shows as growth after warm-up.

The bound (the bench's verdict, also asserted by `tests/reliability`): over the
steps after warm-up (the first `max(2, steps // 4)` steps: allocator pools,
lazily built kernels and caches fill there), RSS may grow by at most
`RSS_BOUND_MIB` MiB plus `RSS_BOUND_FRAC` of the warm-up RSS, and GPU
allocated memory by at most `CUDA_BOUND_MIB` MiB. Also reported: the
least-squares slope of RSS per step after warm-up (MiB/step), the figure that
extrapolates to a long job.

    rl4bit bench soak configs/quickstart.yaml --steps 200        # (CLI hook: see the lead's patch list)
    python -m rl4bit.bench.soak configs/quickstart.yaml --steps 50 --device cpu
    python -m rl4bit.bench.soak --quick                            # a tiny smoke run

Leaves out: Ray mode (per-actor memory would need each actor's RSS), the
memory of a separate inference server.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

import psutil
import torch

from rl4bit.bench.common import bench_parser, parse_bench_args
from rl4bit.common.atomic import atomic_write_text

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
RSS_BOUND_MIB = 64.0
"""Allowed RSS growth after warm-up, absolute part (allocator and Python heap noise)."""
RSS_BOUND_FRAC = 0.05
"""Allowed RSS growth after warm-up, relative part (of the RSS at the end of warm-up)."""
CUDA_BOUND_MIB = 16.0
"""Allowed growth of allocated GPU memory after warm-up."""

QUICK = ["model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
         "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32", "rl.prompts_per_step=4",
         "rl.samples_per_prompt=4", "run.warmup_sft_steps=0", "run.cpu_threads=1", "data.eval_size=8",
         "sampler.max_new_tokens=6"]


def _mib(n: float) -> float:
    return n / 2**20


def _slope(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def verdict(rows: list[dict], warmup: int) -> dict:
    """Growth after warm-up and the bound it is held to (rows: one per step, as `run` records them)."""
    after = [r for r in rows if r["step"] >= warmup]
    if len(after) < 2:
        raise ValueError(f"soak: {len(rows)} steps leave fewer than 2 after the {warmup}-step warm-up; raise --steps")
    base = after[0]["rss_mib"]
    growth = max(r["rss_mib"] for r in after) - base
    bound = RSS_BOUND_MIB + RSS_BOUND_FRAC * base
    out = {"warmup_steps": warmup, "rss_at_warmup_mib": base, "rss_growth_mib": growth, "rss_bound_mib": bound,
           "rss_slope_mib_per_step": _slope([r["step"] for r in after], [r["rss_mib"] for r in after]),
           "flat": growth <= bound}
    if after[0].get("cuda_alloc_mib") is not None:
        cg = max(r["cuda_alloc_mib"] for r in after) - after[0]["cuda_alloc_mib"]
        out.update(cuda_growth_mib=cg, cuda_bound_mib=CUDA_BOUND_MIB, flat=out["flat"] and cg <= CUDA_BOUND_MIB)
    return out


def run(device: str = "cpu", quick: bool = False, out: str | None = None, config: str | Path | None = None,
        steps: int | None = None, override: list[str] | None = None, check: bool = True) -> dict:
    """Soak the job; returns {"rows": [...], "verdict": {...}}; raises AssertionError past the bound when `check`."""
    from rl4bit import driver
    from rl4bit.config import ConfigError, load_config
    from rl4bit.rundir import create_run_dir

    steps = steps or (8 if quick else 100)
    warmup = max(2, steps // 4)
    if steps - warmup + 1 < 2:  # steps are numbered from 1: warmup..steps must hold the 2 the verdict compares
        raise ConfigError(f"--steps {steps} leaves fewer than 2 steps after the {warmup}-step warm-up; "
                          f"give --steps {warmup + 1} or more")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("bench soak on cuda needs a GPU (use --device cpu)")
    o = (QUICK if quick else []) + [f"rl.steps={steps}", "ray.mode=local", "run.progress=false",
                                    f"trainer.device={device}"]
    cfg = load_config(config or CONFIG, o + list(override or []))
    me = psutil.Process()
    rows: list[dict] = []

    def on_step(step: int, m: dict) -> None:
        kids = sum(c.memory_info().rss for c in me.children(recursive=True) if c.is_running())
        row = {"step": step, "rss_mib": _mib(me.memory_info().rss), "reward_workers_rss_mib": _mib(kids),
               "step_s": m.get("time/step_s")}
        if torch.cuda.is_available() and device.startswith("cuda"):
            row.update(cuda_alloc_mib=_mib(torch.cuda.memory_allocated()),
                       cuda_reserved_mib=_mib(torch.cuda.memory_reserved()))
        rows.append(row)
        gpu = f"  cuda alloc {row['cuda_alloc_mib']:.1f} MiB" if "cuda_alloc_mib" in row else ""
        print(f"soak step {step:>5}: rss {row['rss_mib']:.1f} MiB  "
              f"reward workers {row['reward_workers_rss_mib']:.1f} MiB{gpu}", flush=True)

    with tempfile.TemporaryDirectory(prefix="rl4bit-soak-") as tmp:
        run_dir = create_run_dir(cfg, Path(out) / "run" if out else Path(tmp) / "run")
        driver.run(cfg, run_dir, on_step=on_step)
        if not out:
            print("(that run dir is temporary and is removed now; bench soak --out DIR keeps it as DIR/run)")
    v = verdict(rows, warmup)
    print(f"soak: RSS after the {v['warmup_steps']}-step warm-up {v['rss_at_warmup_mib']:.1f} MiB, grew "
          f"{v['rss_growth_mib']:+.1f} MiB over {steps - v['warmup_steps']} steps "
          f"(bound {v['rss_bound_mib']:.1f} MiB = "
          f"{RSS_BOUND_MIB:.0f} + {RSS_BOUND_FRAC:.0%}), slope {v['rss_slope_mib_per_step']:+.3f} MiB/step"
          + (f"; GPU allocated grew {v['cuda_growth_mib']:+.1f} MiB (bound {CUDA_BOUND_MIB:.0f})"
             if "cuda_growth_mib" in v else "")
          + f": {'FLAT' if v['flat'] else 'NOT FLAT'}")
    result = {"config": str(config or CONFIG), "device": device, "steps": steps, "rows": rows, "verdict": v}
    if out:
        atomic_write_text(Path(out) / "bench_soak.json", json.dumps(result, indent=1))
    if check:
        assert v["flat"], f"memory grew past the soak bound after warm-up: {v}"
    return result


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("rl4bit.bench.soak", __doc__, quick="a short run (8 steps)")
    p.add_argument("config", nargs="?", help=f"job YAML (default {CONFIG.name})")
    p.add_argument("--steps", type=int, help="RL steps (default 100; 8 with --quick)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    a = parse_bench_args(p, argv)
    run(a.device, a.quick, a.out, a.config, a.steps, a.override)


if __name__ == "__main__":
    main()
