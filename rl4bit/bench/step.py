"""`rl4bit bench step`: the whole RL step, `nvfp4` everywhere beside `bf16` everywhere, in one process.

Runs the same job twice in local mode (trainer and sampler in this process, so
one allocator's peak covers both): once with the config's recipe (`nvfp4`:
NVFP4 expert GEMMs in the trainer, NVFP4 expert weights in the sampler) and
once with `recipe.name: bf16` (BF16 expert GEMMs, BF16 serving). The workload
is made decode-heavy, as RL steps are in practice: `sampler.ignore_eos`, so
every rollout runs to `sampler.max_new_tokens` (default here 256). No warm
start and no evaluation: only the timed RL steps.

For each recipe it reports the mean step time over the steps between the first
(warm-up: kernel compilation, caches) and the last (it also runs the final evaluation),
split into sample / score / train / sync (the driver's `time/*` metrics), the
rollout tokens/s and peak GPU memory; the ratio column is bf16 / nvfp4 (> 1:
nvfp4 faster or smaller). Targets from issue 11: step >= 1.3x faster, peak
memory <= 0.6x.

`--memory-sites N` records the Python stack of every live CUDA block until the first step ends (slower: its
timings are not comparable) and prints the N call sites in rl4bit's code that hold the most memory then:
what the step-start figure is made of. `-o KEY=VALUE` overrides a config value in both jobs.

The jobs run one after the other: before each, the process frees what it can (`gc`, the allocator's cache)
and the job's result records what was still allocated (`held_at_start_gib`: counted in its peak). A job that
runs out of GPU memory ends the bench with an error naming the job, its phase and step, the device's memory
and the overrides that shrink both jobs alike; the finished job's figures are printed first and
`bench_step.json` (`--out`) says the run is incomplete. With `--out DIR` each job's run dir (its config,
metrics.jsonl, logs) is kept under `DIR/runs/<recipe>-<time>`; without, it is a temporary directory, removed
when the job ends (the driver's "run dir:" line is followed by a note saying so).

`configs/gpu-h200.yaml` is sized for a 141 GB H200 (its bf16 job peaked at 77.3 GiB there and ran out of memory
on an 80 GB H100 at full micro-batches; `scripts/gpu_check.sh step` runs it there at half-size ones).

Leaves out: Ray actors (the device image has no Ray), several samplers, and the
warm start (its cost is the same under both recipes).

    rl4bit bench step --device cuda                 # configs/gpu-h200.yaml
    python -m rl4bit.bench.step --quick --device cpu  # a tiny smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rl4bit.common.atomic import atomic_write_text
from rl4bit.job_errors import JOB_ERRORS
from rl4bit.job_errors import OutOfMemory as JobOutOfMemory
from rl4bit.metrics import MEMORY_KEYS

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpu-h200.yaml"
PHASES = ("sample", "score", "train", "sync")


def _overrides(quick: bool, device: str, steps: int, new_tokens: int) -> list[str]:
    o = [f"rl.steps={steps}", "run.warmup_sft_steps=0", "run.checkpoint_every=0", "run.progress=false",
         "run.tensorboard=false", "ray.mode=local", f"trainer.device={device}", "sampler.ignore_eos=true",
         f"sampler.max_new_tokens={new_tokens}", f"data.eval_every={10 * steps}", "data.eval_size=8"]
    if quick:
        o += ["model.hidden_size=64", "model.num_layers=2", "model.num_experts=4", "model.expert_intermediate_size=64",
              "model.num_heads=4", "model.max_seq_len=64", "model.dtype=float32", "rl.prompts_per_step=4",
              "rl.samples_per_prompt=2", "run.cpu_threads=1"]
    return o


OWN_CODE = ("rl4bit", "/kernels/", "/trainer/", "/sampler/")


def memory_sites(snapshot: dict, top: int) -> list[tuple[str, float]]:
    """(site, GiB) of the live blocks in a `torch.cuda.memory._snapshot()` taken with stack recording on,
    grouped by the innermost frame in rl4bit's code (else the innermost frame), largest first; blocks in a
    private pool (CUDA graphs) are marked as such."""
    sizes: dict[str, int] = {}
    for seg in snapshot["segments"]:
        pool = " [graph pool]" if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0) else ""
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = b.get("frames") or []
            own = [f for f in frames
                   if any(k in f["filename"] for k in OWN_CODE) and "site-packages" not in f["filename"]]
            f = (own or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
            site = f"{Path(f['filename']).name}:{f['line']} {f['name']}{pool}"
            sizes[site] = sizes.get(site, 0) + b["size"]
    return [(k, v / 2**30) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:top]]


class OutOfMemory(RuntimeError):
    """A bench job ran out of GPU memory; the message says which, on what device and what to shrink."""


ERRORS = (OutOfMemory, *JOB_ERRORS)
"""Failures `rl4bit bench step` prints as one line (exit status 1)."""


def _free_cuda() -> int:
    """Bytes still allocated by torch on the current CUDA device once garbage is collected and the cache freed."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _oom_message(recipe: str, cfg, config: Path, held: int, err) -> str:
    """`err`: the driver's OutOfMemory (phase, step, detail); `cfg` the job's config, loaded from `config`."""
    where = ""
    if cfg.trainer.device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(cfg.trainer.device))
        where = f" on {props.name} ({props.total_memory / 2**30:.1f} GiB; {held / 2**30:.1f} GiB held before the job)"
    step = "before its first RL step" if err.step == 0 else f"at step {err.step}"
    size = " (sized for a 141 GB H200: its bf16 job peaked at 77.3 GiB there)" if config == CONFIG else ""
    half = max(1, cfg.trainer.tokens_per_microbatch // 2)
    return (f"the {recipe} job of {config.name}{size} ran out of GPU memory{where} in its {err.phase} "
            f"phase {step} ({err.detail}). Shrink both jobs alike, e.g. -o trainer.tokens_per_microbatch={half} "
            f"(the same rollouts and update in smaller micro-batches) or -o trainer.recompute=true (activations "
            f"recomputed in the backward); -o rl.prompts_per_step={max(1, cfg.rl.prompts_per_step // 2)} halves "
            f"the workload itself.")


def run_job(config: Path, recipe: str, overrides: list[str], sites: int = 0, keep: Path | None = None) -> dict:
    """One job in this process; its per-step metrics and the allocator's peak (and its largest allocation
    sites after the first step when `sites` > 0). Its run dir goes under `keep` (`bench step --out`), else into a
    temporary directory that is removed when the job ends."""
    from rl4bit.config import load_config
    from rl4bit.driver import run
    from rl4bit.rundir import create_run_dir

    cfg = load_config(config, [*overrides, f"recipe.name={recipe}"])
    cuda = cfg.trainer.device.startswith("cuda")
    held = 0
    if cuda:
        held = _free_cuda()  # what an earlier job left (a cache, a graph pool) would count in this job's peak
        torch.cuda.reset_peak_memory_stats()
    found: list = []
    recording = bool(sites and cuda)

    def after_step(step: int, metrics: dict) -> None:
        nonlocal recording
        if recording:
            found.extend(memory_sites(torch.cuda.memory._snapshot(), sites))
            torch.cuda.memory._record_memory_history(enabled=None)
            recording = False
            print(f"\n{recipe}: live memory after step {step}, by allocation site (GiB):")
            for site, gib in found:
                print(f"  {gib:8.2f}  {site}")

    if recording:  # the stacks of live blocks only, no event history
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    try:
        with contextlib.ExitStack() as stack:
            if keep is not None:
                run_dir = keep / f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
            else:
                temporary = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"bench-step-{recipe}-"))
                run_dir = Path(temporary) / "run"
            records = [r for r in run(cfg, create_run_dir(cfg, run_dir), on_step=after_step) if r.get("step", 0) >= 1]
            if keep is None:
                print(f"({recipe}: that run dir is temporary and is removed now; bench step --out DIR keeps the jobs' "
                      "run dirs under DIR/runs)")
    except JobOutOfMemory as err:
        raise OutOfMemory(_oom_message(recipe, cfg, config, held, err)) from None
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)
    # The driver resets the allocator's peak per phase (memory/*_peak_gib) and folds every phase, evaluation and
    # setup into memory/job_peak_gib: the job's peak is its last value.
    peak = max((r.get("memory/job_peak_gib", 0.0) for r in records), default=None) if cuda else None
    phase_peaks = {k.split("/")[1]: max((r.get(k, 0.0) for r in records), default=0.0)
                   for k in MEMORY_KEYS if k != "memory/job_peak_gib"}
    # The first step compiles kernels and fills caches; the last one also runs the final evaluation.
    timed = records[1:-1] if len(records) >= 3 else (records[1:] or records)
    excluded = "first and last" if len(records) >= 3 else ("first" if len(records) == 2 else "none")
    mean = {p: statistics.fmean(r[f"time/{p}_s"] for r in timed) for p in PHASES}
    mean["step"] = statistics.fmean(r["time/step_s"] for r in timed)
    tokens = statistics.fmean(r.get("rollout/tokens_per_s", 0.0) for r in timed)
    return {"recipe": recipe, "steps_timed": len(timed), "steps_excluded": excluded, "seconds": mean,
            "rollout_tok_s": tokens, "peak_gib": peak,
            "held_at_start_gib": held / 2**30 if cuda else None,
            "memory_gib": phase_peaks if cuda else None,
            "per_step_s": {p: [round(r[f"time/{p}_s"], 3) for r in records] for p in ("sample", "train", "sync")},
            "mismatch": {k: [float(f"{r.get(f'mismatch/{k}', math.nan):.3g}") for r in records]
                         for k in ("k3", "max_abs")},
            "reward": statistics.fmean(r["reward/mean"] for r in records), "memory_sites": found}


def run(device: str = "cuda", quick: bool = False, out: str | None = None, config: str | Path | None = None,
        steps: int = 4, new_tokens: int = 256, memory_sites: int = 0, override: list[str] | None = None) -> dict:
    """Both jobs, one table; results.json under `out`."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("bench step on cuda needs a GPU (use --quick --device cpu for a smoke run)")
    config = Path(config) if config else CONFIG
    overrides = _overrides(quick, device, steps, 8 if quick else new_tokens) + list(override or [])
    rows = []
    for recipe in ("nvfp4", "bf16"):
        try:
            rows.append(run_job(config, recipe, overrides, memory_sites, keep=Path(out) / "runs" if out else None))
        except OutOfMemory:
            for row in rows:  # the finished job's figures are kept: printed, and in bench_step.json
                print(f"\n{row['recipe']} (finished): " + ", ".join(f"{p} {row['seconds'][p]:.3f} s"
                                                                 for p in (*PHASES, "step"))
                      + (f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""))
            if out:  # also when no job finished: an earlier run's file must not pass for this one's
                atomic_write_text(Path(out) / "bench_step.json", json.dumps(
                    {"device": device, "config": str(config), "quick": quick, "rows": rows,
                     "incomplete": f"the {recipe} job ran out of GPU memory"}, indent=1))
            raise
    q, b = rows
    plural = "" if q["steps_timed"] == 1 else "s"
    print(f"\nRL step, {config.name}, {device}: nvfp4 vs bf16 (mean of {q['steps_timed']} step{plural}, "
          f"{q['steps_excluded']} excluded)")
    print(f"{'figure':<22}{'nvfp4':>12}{'bf16':>12}{'bf16/nvfp4':>12}")
    for p in (*PHASES, "step"):
        qs, bs = q["seconds"][p], b["seconds"][p]
        print(f"{p + ' s':<22}{qs:>12.3f}{bs:>12.3f}{bs / qs if qs else float('nan'):>12.2f}")
    print(f"{'rollout tok/s':<22}{q['rollout_tok_s']:>12.0f}{b['rollout_tok_s']:>12.0f}"
          f"{q['rollout_tok_s'] / b['rollout_tok_s'] if b['rollout_tok_s'] else float('nan'):>12.2f}  (nvfp4/bf16)")
    for p in ("sample", "train"):
        print(f"{p + ' s, every step':<22}{q['per_step_s'][p]} / {b['per_step_s'][p]}")
    for k in ("k3", "max_abs"):  # sampler vs trainer logprobs of the sampled tokens
        print(f"{k + ', every step':<22}{q['mismatch'][k]} / {b['mismatch'][k]}")
    if q["peak_gib"] is not None:
        print(f"{'peak GPU GiB':<22}{q['peak_gib']:>12.1f}{b['peak_gib']:>12.1f}"
              f"{q['peak_gib'] / b['peak_gib']:>12.2f}  (nvfp4/bf16)")
        print(f"{'held at start GiB':<22}{q['held_at_start_gib']:>12.1f}{b['held_at_start_gib']:>12.1f}")
        for k in q["memory_gib"]:
            qm, bm = q["memory_gib"][k], b["memory_gib"][k]
            print(f"{'  ' + k:<22}{qm:>12.1f}{bm:>12.1f}{qm / bm if bm else float('nan'):>12.2f}")
    result = {"device": device, "config": str(config), "quick": quick, "rows": rows,
              "step_speedup": b["seconds"]["step"] / q["seconds"]["step"],
              "peak_ratio": q["peak_gib"] / b["peak_gib"] if q["peak_gib"] else None}
    if out:
        atomic_write_text(Path(out) / "bench_step.json", json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--config")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for both jobs, e.g. -o model.invariant_kernels=true (repeatable)")
    p.add_argument("--memory-sites", type=int, default=0,
                   help="print the N allocation sites holding the most memory after the first step (records live "
                        "blocks' stacks until then: slower)")
    a = p.parse_args(argv)
    try:
        run(a.device, a.quick, a.out, a.config, a.steps, a.new_tokens, a.memory_sites, a.override)
    except ERRORS as err:
        raise SystemExit(f"rl4bit bench step: error: {err}") from None


if __name__ == "__main__":
    main()
