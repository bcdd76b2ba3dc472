"""`rl4bit bench step`: the whole RL step of one job under several recipes (default nvfp4, mxfp8, bf16), one card.

The same job runs once per recipe (only `recipe.name` differs), one after the other in this process, in local mode:
trainer and sampler share one allocator, so its peak covers both. The job is decode-heavy, as RL steps are: every
rollout runs to `--new-tokens` (`sampler.ignore_eos`); no warm start. Per recipe: the mean sample / score / train /
sync / step seconds over the steps between the first (warm-up) and the last (final evaluation), rollout tok/s, every
step's times and sampler-trainer mismatch, the peak GPU memory and each phase's. The first recipe is the reference:
ratio columns are <recipe>/<reference> (> 1: the reference faster or smaller; tok/s the other way). Targets: issue
11, nvfp4 vs bf16, step >= 1.3x faster, peak <= 0.6x; the blog has nvfp4 20% faster than all-MXFP8 in RL.
A job that runs out of GPU memory ends the bench with one line naming it, its phase and step and what to shrink; the
finished jobs' figures are printed and `bench_step.json` (`--out`) marks the run incomplete. `--out DIR` keeps each
job's run dir under DIR/runs. Leaves out: Ray actors, several samplers, the warm start (the same under any recipe).

    rl4bit bench step --device cuda                    # configs/gpu-h200.yaml (sized for a 141 GB H200)
    python -m rl4bit.bench.step --device cuda --recipes nvfp4,mxfp8 --out results/step
    python -m rl4bit.bench.step --quick --device cpu   # a tiny smoke run
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rl4bit.bench.common import bench_parser, parse_bench_args
from rl4bit.common.atomic import atomic_write_text
from rl4bit.job_errors import JOB_ERRORS
from rl4bit.job_errors import OutOfMemory as JobOutOfMemory
from rl4bit.metrics import MEMORY_KEYS

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "gpu-h200.yaml"
PHASES = ("sample", "score", "train", "sync")
RECIPES = ("nvfp4", "mxfp8", "bf16")
"""The default `--recipes`: the first is the reference of the ratio columns."""


def _overrides(quick: bool, device: str, steps: int, new_tokens: int) -> list[str]:
    # one optimizer step an RL step (rl.ppo_epochs=1) whatever the config trains with: the step's figures stay
    # comparable across configs and with the earlier runs
    o = [f"rl.steps={steps}", "rl.ppo_epochs=1", "run.warmup_sft_steps=0", "run.checkpoint_every=0",
         "run.progress=false", "run.tensorboard=false", "ray.mode=local", f"trainer.device={device}",
         "sampler.ignore_eos=true", f"sampler.max_new_tokens={new_tokens}", f"data.eval_every={10 * steps}",
         "data.eval_size=8"]
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


class BadRecipes(ValueError):
    """`--recipes` names an unknown recipe, one twice, or none."""


ERRORS = (OutOfMemory, BadRecipes, *JOB_ERRORS)
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
            f"phase {step} ({err.detail}). Shrink every job alike, e.g. -o trainer.tokens_per_microbatch={half} "
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


def parse_recipes(recipes: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The recipes of `--recipes` ("nvfp4,mxfp8,bf16" or a sequence), checked: known names, none twice, at least
    one. BadRecipes (a ValueError) naming the bad ones and the valid ones."""
    from rl4bit.trainer.recipe import RECIPES

    names = tuple(x.strip() for x in (recipes.split(",") if isinstance(recipes, str) else recipes))
    if not names or "" in names:
        raise BadRecipes(f"--recipes {recipes!r}: give comma-separated recipe names, e.g. nvfp4,mxfp8,bf16")
    unknown = [x for x in names if x not in RECIPES]
    if unknown:
        raise BadRecipes(f"--recipes: unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise BadRecipes(f"--recipes: {', '.join(twice)} given more than once; each recipe runs once")
    return names


def _ratio(other: float | None, ref: float | None) -> float | None:
    return other / ref if other is not None and ref else None


def ratios(rows: list[dict]) -> dict[str, dict]:
    """{recipe: {figure: its value / the reference's (rows[0])}} for every recipe but the reference: > 1 = the
    reference faster (seconds) or smaller (GiB); for rollout_tok_s > 1 = the other recipe faster."""
    ref = rows[0]
    out = {}
    for row in rows[1:]:
        r = {f"{p}_s": _ratio(row["seconds"][p], ref["seconds"][p]) for p in (*PHASES, "step")}
        r["rollout_tok_s"] = _ratio(row["rollout_tok_s"], ref["rollout_tok_s"])
        r["peak_gib"] = _ratio(row["peak_gib"], ref["peak_gib"])
        r["memory_gib"] = ({k: _ratio(v, ref["memory_gib"][k]) for k, v in row["memory_gib"].items()}
                           if row["memory_gib"] is not None else None)
        out[row["recipe"]] = r
    return out


def print_table(rows: list[dict], config_name: str, device: str) -> None:
    """One column per recipe, then one <recipe>/<reference> ratio column per recipe but the first (the reference)."""
    ref, others = rows[0], rows[1:]
    name = ref["recipe"]
    w, rw = 12, 14  # value and ratio column widths
    plural = "" if ref["steps_timed"] == 1 else "s"
    vs = f" vs {', '.join(r['recipe'] for r in others)}" if others else ""
    print(f"\nRL step, {config_name}, {device}: {name} (reference){vs} (mean of {ref['steps_timed']} step{plural}, "
          f"{ref['steps_excluded']} excluded)")
    if others:
        print(f"ratio columns: <recipe>/{name} of each figure: > 1 = {name} faster (s) or smaller (GiB); "
              f"for tok/s < 1 = {name} faster")

    def line(label: str, values: list, fmt: str) -> None:
        cells = "".join(f"{v:>{w}{fmt}}" if v is not None else f"{'-':>{w}}" for v in values)
        rs = [_ratio(v, values[0]) for v in values[1:]]
        print(f"{label:<22}{cells}" + "".join(f"{r:>{rw}.2f}" if r is not None else f"{'-':>{rw}}" for r in rs))

    print(f"{'figure':<22}" + "".join(f"{r['recipe']:>{w}}" for r in rows)
          + "".join(f"{r['recipe'] + '/' + name:>{rw}}" for r in others))
    for p in (*PHASES, "step"):
        line(p + " s", [r["seconds"][p] for r in rows], ".3f")
    line("rollout tok/s", [r["rollout_tok_s"] for r in rows], ".0f")
    lists = [(f"{p} s", lambda r, p=p: r["per_step_s"][p]) for p in ("sample", "train")]
    lists += [(k, lambda r, k=k: r["mismatch"][k]) for k in ("k3", "max_abs")]  # sampler vs trainer logprobs
    for label, values in lists:
        print(f"{label}, every step")
        for r in rows:
            print(f"{'  ' + r['recipe']:<22}{values(r)}")
    if ref["peak_gib"] is not None:
        line("peak GPU GiB", [r["peak_gib"] for r in rows], ".1f")
        print(f"{'held at start GiB':<22}" + "".join(f"{r['held_at_start_gib']:>{w}.1f}" for r in rows))
        for k in ref["memory_gib"]:
            line("  " + k, [r["memory_gib"][k] for r in rows], ".1f")


def run(device: str = "cuda", quick: bool = False, out: str | None = None, config: str | Path | None = None,
        steps: int = 4, new_tokens: int = 256, memory_sites: int = 0, override: list[str] | None = None,
        recipes: str | list[str] | tuple[str, ...] = RECIPES) -> dict:
    """One job per recipe (the first is the reference), one table; bench_step.json under `out`."""
    recipes = parse_recipes(recipes)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("bench step on cuda needs a GPU (use --quick --device cpu for a smoke run)")
    config = Path(config) if config else CONFIG
    overrides = _overrides(quick, device, steps, 8 if quick else new_tokens) + list(override or [])
    head = {"device": device, "config": str(config), "quick": quick, "recipes": list(recipes)}
    rows = []
    for i, recipe in enumerate(recipes):
        try:
            rows.append(run_job(config, recipe, overrides, memory_sites, keep=Path(out) / "runs" if out else None))
        except OutOfMemory:
            for row in rows:  # the finished jobs' figures are kept: printed, and in bench_step.json
                print(f"\n{row['recipe']} (finished): " + ", ".join(f"{p} {row['seconds'][p]:.3f} s"
                                                                 for p in (*PHASES, "step"))
                      + (f", peak {row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else ""))
            if out:  # also when no job finished: an earlier run's file must not pass for this one's
                atomic_write_text(Path(out) / "bench_step.json", json.dumps(
                    {**head, "rows": rows, "incomplete": f"the {recipe} job ran out of GPU memory",
                     "not_run": list(recipes[i + 1:])}, indent=1))
            raise
    print_table(rows, config.name, device)
    result = {**head, "rows": rows, "reference": recipes[0], "ratios": ratios(rows),
              "ratios_are": f"<recipe>/{recipes[0]} of each figure: > 1 = {recipes[0]} faster (seconds) or smaller "
                            "(GiB); for rollout_tok_s > 1 = <recipe> faster"}
    if out:
        atomic_write_text(Path(out) / "bench_step.json", json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("rl4bit.bench.step", __doc__, out="directory for the results and each job's run dir")
    p.add_argument("--config")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="comma-separated recipes, one job each; the first is the reference of the ratio columns "
                        f"(default {','.join(RECIPES)})")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every job, e.g. -o model.invariant_kernels=true (repeatable)")
    p.add_argument("--memory-sites", type=int, default=0,
                   help="print the N allocation sites holding the most memory after the first step (records live "
                        "blocks' stacks until then: slower)")
    a = parse_bench_args(p, argv)
    try:
        recipes = parse_recipes(a.recipes)
    except ValueError as err:
        p.error(str(err))
    try:
        run(a.device, a.quick, a.out, a.config, a.steps, a.new_tokens, a.memory_sites, a.override, recipes)
    except ERRORS as err:
        raise SystemExit(f"rl4bit bench step: error: {err}") from None


if __name__ == "__main__":
    main()
