"""`rl4bit parity CONFIG --recipes nvfp4,mxfp8,bf16 --seeds 3 [--out DIR]`: reward parity of numerics recipes.

Runs the same job once per (recipe, seed), overriding only `recipe.name` and
`run.seed` (seeds are run.seed, run.seed+1, ...). Everything else is shared,
so runs of one seed start identical across recipes: `run.seed` keys the model
init and the supervised warm start (which runs in fp32 before the recipe
converts the model), `data.seed` the prompts and their order, and
`derive_seed(run.seed, step, prompt)` the sampling. Each run is `rl4bit train`
in its own process (Ray caches its auth token per process, so one process
cannot host several private clusters in turn), writing `DIR/<recipe>-seed<k>/`
and its console output to `DIR/logs/`. Runs go one at a time by default (a
2-core CPU gains nothing from more); `jobs=N` runs N at once.

Then it writes, from the runs' metrics.jsonl:
- `DIR/parity.png`: reward and eval-accuracy curves per recipe (mean across
  seeds, min..max band), mismatch/k3, rollout tokens/s, step time, and the final
  accuracy with its interval;
- `DIR/parity.json`: every number below, for machines;
- `DIR/parity.md`: a table per recipe (final reward and accuracy with 95%
  t intervals across seeds, steps to the target reward, wall time, the time of
  a step without its evaluation), each recipe's paired difference to the
  reference (mxfp8) with its intervals, and the verdict on NVFP4 - MXFP8: an
  equivalence test that holds, fails or is inconclusive (statistics in
  `rl4bit.parity_stats`; threshold `parity.threshold`, default 0.02 = 2 points
  of accuracy).

Re-running the command with the same DIR reuses finished runs, resumes
unfinished ones from their checkpoint, and refuses a DIR whose runs were made
with another config. Leaves out: spreading runs over several machines or Ray
placement of whole jobs (each job starts its own private cluster).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from rl4bit import parity_stats as ps
from rl4bit.common.atomic import atomic_write_text
from rl4bit.config import ConfigError, anchored, dump_yaml, load_config
from rl4bit.metrics import read_metrics
from rl4bit.trainer.recipe import RECIPES

REFERENCE = "mxfp8"
"""The recipe every other one is compared with."""
CANDIDATE = "nvfp4"
"""The recipe the verdict is about."""
RUN_OVERRIDES = ["run.progress=false"]
"""Applied to every run: no live progress display in a log file."""


def main(config, recipes=("nvfp4", "mxfp8", "bf16"), seeds: int = 3, out=None, overrides=None, *, jobs: int = 1) -> int:
    recipes = [r.strip() for r in recipes if r.strip()]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ConfigError(f"--recipes {','.join(recipes)}: unknown recipe(s) {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(RECIPES)}")
    if len(recipes) < 2 or len(set(recipes)) != len(recipes):
        raise ConfigError(f"--recipes {','.join(recipes)}: give at least two distinct recipes, e.g. nvfp4,mxfp8")
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: must be >= 1")
    overrides = list(overrides or [])
    base = load_config(config, overrides)  # validates the overrides before any run starts
    if base.parity.reference:  # each run would check it only once it starts
        ps.check_reference(base.parity.reference)
    out = Path(out) if out is not None else Path("runs") / f"parity-{base.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    plan = [(r, base.run.seed + k) for k in range(seeds) for r in recipes]
    runs = run_all(Path(config).resolve(), plan, out, overrides, jobs=jobs)
    report = analyze(runs, recipes, threshold=base.parity.threshold, eval_size=base.data.eval_size, steps=base.rl.steps)
    report.update(config=str(config), overrides=overrides, seeds=[s for _, s in plan[:: len(recipes)]], out=str(out))
    atomic_write_text(out / "parity.json", json.dumps(report, indent=1))
    plot(runs, recipes, report, out / "parity.png")
    atomic_write_text(out / "parity.md", markdown(report, config, recipes, seeds, overrides))
    print(report["verdict"]["text"])
    print(f"parity report: {out / 'parity.md'}")
    return 0


# --------------------------------------------------------------------------- running the jobs


def run_dir_name(recipe: str, seed: int) -> str:
    return f"{recipe}-seed{seed}"


def run_all(config: Path, plan: list[tuple[str, int]], out: Path, overrides: list[str], *, jobs: int = 1) -> list[dict]:
    """Run (or reuse) every (recipe, seed) job; returns [{recipe, seed, run_dir, wall_s, records}] in plan order."""
    pending, runs = [], []
    for recipe, seed in plan:
        job = {"recipe": recipe, "seed": seed, "run_dir": out / run_dir_name(recipe, seed),
               "overrides": overrides + RUN_OVERRIDES + [f"recipe.name={recipe}", f"run.seed={seed}"]}
        job["cfg"] = load_config(config, job["overrides"])
        job["state"] = _state(job)
        runs.append(job)
        if job["state"] != "done":
            pending.append(job)
    (out / "logs").mkdir(exist_ok=True)
    active: list[tuple[dict, subprocess.Popen, float]] = []
    while pending or active:
        while pending and len(active) < jobs:
            job = pending.pop(0)
            active.append((job, _launch(config, job, out), time.perf_counter()))
        time.sleep(0.2)
        for item in list(active):
            job, proc, t0 = item
            if proc.poll() is None:
                continue
            active.remove(item)
            wall = time.perf_counter() - t0 + _wall(job["run_dir"])
            atomic_write_text(job["run_dir"] / "parity_run.json",
                              json.dumps({"wall_s": wall, "returncode": proc.returncode}))
            if proc.returncode != 0:
                for _, p, _ in active:
                    p.terminate()
                for _, p, _ in active:
                    p.wait()
                log = out / "logs" / f"{run_dir_name(job['recipe'], job['seed'])}.log"
                raise RuntimeError(f"run {job['run_dir']} failed (exit {proc.returncode}); its output is in {log}. "
                                   f"Fix the cause and re-run the same command: finished runs are reused.")
    for job in runs:
        job["records"] = read_metrics(job["run_dir"])
        job["wall_s"] = _wall(job["run_dir"])
        print(f"{job['run_dir'].name}: {job['wall_s']:.0f} s")
    return runs


def _state(job: dict) -> str:
    """'new', 'partial' (resume from its checkpoint) or 'done'; refuses a run dir made with another config."""
    d = job["run_dir"]
    if not (d / "config.yaml").exists():
        return "new"
    # both sides' file paths absolute, as `rl4bit train` now stores them (older runs stored them as written)
    stored = yaml.safe_load(dump_yaml(anchored(load_config(d / "config.yaml"))))
    wanted = yaml.safe_load(dump_yaml(anchored(job["cfg"])))
    if stored != wanted:
        diff = sorted(f"{s}.{k}" for s in wanted for k in wanted[s] if stored.get(s, {}).get(k) != wanted[s][k])
        raise FileExistsError(f"{d} holds a run of another config (differs in {', '.join(diff)}); "
                              f"choose another --out or remove {d}")
    records = read_metrics(d)
    if records and records[-1]["step"] == job["cfg"].rl.steps and "eval/accuracy" in records[-1]:
        return "done"
    if not (d / "checkpoints" / "latest.json").exists():
        raise FileExistsError(f"{d} holds an unfinished run without a checkpoint to resume; remove {d} and re-run")
    return "partial"


def _launch(config: Path, job: dict, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-P", "-m", "rl4bit.cli", "train"]
    if job["state"] == "partial":
        cmd += ["--resume", str(job["run_dir"])]  # its stored config.yaml holds the recipe and seed
    else:
        cmd += [str(config), "--out", str(job["run_dir"])]
        for o in job["overrides"]:
            cmd += ["-o", o]
    log = open(out / "logs" / f"{run_dir_name(job['recipe'], job['seed'])}.log", "a")
    print(f"{'resuming' if job['state'] == 'partial' else 'running'} {job['run_dir'].name} (log: {log.name})",
          flush=True)
    with log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _wall(run_dir: Path) -> float:
    p = run_dir / "parity_run.json"
    return json.loads(p.read_text())["wall_s"] if p.exists() else 0.0


# --------------------------------------------------------------------------- numbers


def analyze(runs: list[dict], recipes: list[str], *, threshold: float, eval_size: int, steps: int) -> dict:
    """Per-run and per-recipe numbers, each recipe's difference to the reference, and the verdict."""
    window = ps.reward_window(steps)
    per_run = []
    for r in runs:
        recs = r["records"]
        rr = [x for x in recs if "reward/mean" in x]
        per_run.append({
            "recipe": r["recipe"], "seed": r["seed"], "run_dir": str(r["run_dir"]), "wall_s": r["wall_s"],
            "final_reward": float(ps.final_reward_obs(recs, window).mean()),
            "final_accuracy": float(ps.final_accuracy_obs(recs, eval_size).mean()),
            "initial_accuracy": ps.curve(recs, "eval/accuracy")[1][0],
            "tokens_per_s": float(np.mean([x["rollout/tokens_per_s"] for x in rr])),
            "step_s": _step_seconds(rr),
            "mismatch_k3_max": float(max(x["mismatch/k3"] for x in rr)),
        })
    by = {k: [r for r in runs if r["recipe"] == k] for k in recipes}
    reward_obs = {k: [ps.final_reward_obs(r["records"], window) for r in v] for k, v in by.items()}
    acc_obs = {k: [ps.final_accuracy_obs(r["records"], eval_size) for r in v] for k, v in by.items()}
    acc0_obs = {k: [ps.final_accuracy_obs(r["records"], eval_size, index=0) for r in v] for k, v in by.items()}
    ref = REFERENCE if REFERENCE in recipes else recipes[-1]
    cand = CANDIDATE if CANDIDATE in recipes else recipes[0]
    curves = {k: ps.mean_curve([ps.curve(r["records"], "reward/mean") for r in v]) for k, v in by.items()}
    start = float(np.mean([c[1][0] for c in curves.values() if len(c[1])]))
    ref_final = float(np.mean([o.mean() for o in reward_obs[ref]]))
    target = ps.target_level(start, ref_final)
    per_recipe = {}
    for k in recipes:
        rows = [p for p in per_run if p["recipe"] == k]
        s, m, _, _ = curves[k]
        per_recipe[k] = {
            "final_reward": ps.across_seeds(reward_obs[k]), "final_accuracy": ps.across_seeds(acc_obs[k]),
            "initial_accuracy": ps.across_seeds(acc0_obs[k]),
            "steps_to_target": ps.steps_to_reach(s, m, target),
            "wall_s": float(np.mean([p["wall_s"] for p in rows])),
            "tokens_per_s": float(np.mean([p["tokens_per_s"] for p in rows])),
            "step_s": float(np.mean([p["step_s"] for p in rows])),
            "mismatch_k3_max": max(p["mismatch_k3_max"] for p in rows),
        }
    comparisons = []
    for k in recipes:
        if k == ref:
            continue
        for metric, obs in (("final_accuracy", acc_obs), ("final_reward", reward_obs), ("initial_accuracy", acc0_obs)):
            d = ps.paired_difference(obs[k], obs[ref])
            comparisons.append({"a": k, "b": ref, "metric": metric, **d,
                                "verdict": ps.verdict(d, threshold, what=f"{metric} {k} - {ref}")})
    # the verdict is on the end of RL; the step-0 (warm start, recipe forward) gap is reported beside it
    head = [c for c in comparisons if c["a"] == cand and c["metric"] != "initial_accuracy"]
    outcomes = [c["verdict"]["outcome"] for c in head]
    outcome = "fails" if "fails" in outcomes else "holds" if all(o == "holds" for o in outcomes) else "inconclusive"
    word = {"holds": "parity holds", "fails": "parity FAILS", "inconclusive": "parity not established"}[outcome]
    text = (f"VERDICT ({cand} vs {ref}, threshold {threshold:g}): {word} | "
            + " | ".join(c["verdict"]["text"] for c in head))
    return {
        "threshold": threshold, "reference": ref, "candidate": cand, "reward_window": window, "eval_size": eval_size,
        "rl_steps": steps, "target_reward": target, "target_rule": "start + 0.8 x (reference final reward - start), "
        "start = mean first-step reward; first step whose trailing 3-step mean of the seed-mean curve reaches it",
        "runs": per_run, "recipes": per_recipe, "comparisons": comparisons,
        "verdict": {"outcome": outcome, "holds": outcome == "holds", "text": text},
    }


# --------------------------------------------------------------------------- report


def _span(lo: float | None, hi: float | None, fmt: str = ".3f") -> str:
    """An interval as "[lo, hi]", or "(one seed: no interval)"."""
    return "(one seed: no interval)" if lo is None else f"[{lo:{fmt}}, {hi:{fmt}}]"


def _step_seconds(records: list[dict]) -> float:
    """Mean seconds of an RL step without its evaluation (`time/step_s` - `time/eval_s`), leaving out step 1 (its
    compiles and allocations) when there are others: the time a recipe's steps take, not its eval cadence."""
    steps = [r for r in records if r["step"] > 1] or records
    return float(np.mean([r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steps]))


def plot(runs: list[dict], recipes: list[str], report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward/mean", "reward (mean, min..max over seeds)"), ("eval/accuracy", "eval accuracy"),
              ("mismatch/k3", "mismatch k3 (sampler vs trainer)"), ("rollout/tokens_per_s", "rollout tokens/s"),
              ("time/step_s", "step time (s)")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    colors = {k: f"C{i}" for i, k in enumerate(recipes)}
    for ax, (key, title) in zip(axes.flat, panels):
        for k in recipes:
            s, m, lo, hi = ps.mean_curve([ps.curve(r["records"], key) for r in runs if r["recipe"] == k])
            if len(s):
                ax.plot(s, m, color=colors[k], label=k, marker="o" if len(s) < 12 else None)
                ax.fill_between(s, lo, hi, color=colors[k], alpha=0.2)
        if key == "reward/mean":
            ax.axhline(report["target_reward"], color="gray", ls="--", lw=0.8, label="target")
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[5]
    for i, k in enumerate(recipes):
        a = report["recipes"][k]["final_accuracy"]
        spread = [[a["mean"] - a["lo"]], [a["hi"] - a["mean"]]] if a["lo"] is not None else None  # one seed: none
        ax.errorbar([i], [a["mean"]], yerr=spread, fmt="o", color=colors[k], capsize=6)
    ax.set_xticks(range(len(recipes)), recipes)
    ax.set_title("final eval accuracy (95% t interval over seeds)")
    ax.grid(alpha=0.3)
    head = [c for c in report["comparisons"] if c["a"] == report["candidate"] and c["metric"] != "initial_accuracy"]
    diffs = "; ".join(f"{c['metric']} diff {c['diff']:+.3f} {_span(c['lo'], c['hi'], '+.3f')}" for c in head)
    fig.suptitle(f"{report['candidate']} vs {report['reference']}: parity {report['verdict']['outcome']}"
                 f" (threshold {report['threshold']:g}); {diffs}", fontsize=10)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)


def markdown(report: dict, config, recipes: list[str], seeds: int, overrides: list[str]) -> str:
    cmd = f"rl4bit parity {config} --recipes {','.join(recipes)} --seeds {seeds} --out {report['out']}"
    cmd += "".join(f" -o {o}" for o in overrides)
    L = ["# Reward parity", "", f"`{cmd}`", "",
         f"**{report['verdict']['text']}**", "",
         f"{len(report['seeds'])} seed(s) {report['seeds']} per recipe, {report['rl_steps']} RL steps; "
         f"final reward = mean of the last {report['reward_window']} steps, final accuracy = last eval on "
         f"{report['eval_size']} prompts; intervals: 95% Student-t over seeds (differences paired by seed). "
         f"Target reward {report['target_reward']:.3f} ({report['target_rule']}).", "",
         "| recipe | final accuracy (95% CI) | final reward (95% CI) | steps to target | wall time / run (s) "
         "| step without eval (s) "
         "| rollout tok/s | max k3 | step-0 accuracy |",
         "|---|---|---|---|---|---|---|---|---|"]
    for k in recipes:
        r = report["recipes"][k]
        a, w = r["final_accuracy"], r["final_reward"]
        stt = r["steps_to_target"] if r["steps_to_target"] is not None else f"not reached in {report['rl_steps']}"
        L.append(f"| {k} | {a['mean']:.3f} {_span(a['lo'], a['hi'])} | {w['mean']:.3f} {_span(w['lo'], w['hi'])} "
                 f"| {stt} | {r['wall_s']:.0f} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} "
                 f"| {r['mismatch_k3_max']:.2g} "
                 f"| {r['initial_accuracy']['mean']:.3f} |")
    L += ["", "## Differences to the reference", "",
          "| a - b | metric | difference | 95% CI (t) | 90% CI (t) | 95% seed bootstrap | verdict |",
          "|---|---|---|---|---|---|---|"]
    for c in report["comparisons"]:
        judged = "(step 0, not judged)" if c["metric"] == "initial_accuracy" else c["verdict"]["outcome"]
        L.append(f"| {c['a']} - {c['b']} | {c['metric']} | {c['diff']:+.4f} | {_span(c['lo'], c['hi'], '+.4f')} "
                 f"| {_span(c['eq_lo'], c['eq_hi'], '+.4f')} | {_span(c['boot_lo'], c['boot_hi'], '+.4f')} "
                 f"| {judged} |")
    t = report["threshold"]
    L += ["", f"Parity holds when the 90% interval lies inside +/-{t:g} (`parity.threshold`; two one-sided tests "
          f"at 5%), for both final accuracy and final reward; it fails when the 95% interval lies wholly beyond "
          f"+/-{t:g}; otherwise it is not established (inconclusive). The seed bootstrap is narrower than the t "
          "interval at a few seeds and is shown, not judged on. The step-0 row is the warm-started model under each "
          "recipe's forward, before any RL step: the part of the final gap that RL did not cause.", "",
          "## Runs", "", "| run | final accuracy | initial accuracy | final reward | wall (s) |",
          "|---|---|---|---|---|"]
    for p in report["runs"]:
        L.append(f"| {Path(p['run_dir']).name} | {p['final_accuracy']:.3f} | {p['initial_accuracy']:.3f} "
                 f"| {p['final_reward']:.3f} | {p['wall_s']:.0f} |")
    L += ["", "![parity](parity.png)", ""]
    return "\n".join(L)
