"""Statistics of reward parity: pure functions over per-run curves, plus the live reward gap.

A parity sweep runs the same job once per (recipe, seed). For each run this
module reduces the curves to one "final" value and the observations behind it:

- final reward: the mean of `reward/mean` over the last `window` RL steps
  (observations: those steps' values);
- final accuracy: the last `eval/accuracy`, a mean of `eval_size` 0/1 items
  (observations: that many 0s and 1s, so resampling them is the binomial
  bootstrap of the eval set).

`bootstrap_diff` gives the difference of two recipes' means with a percentile
confidence interval from a two-level bootstrap: resample seeds (paired: runs of
one seed share initial weights, prompts and sampling seeds, so the same seed
indices are drawn for both recipes), then resample each drawn run's
observations. It runs on numpy with a fixed seed, so a report is reproducible.
`verdict` applies the rule of issue 8: parity holds when the interval contains
0 and |difference| < threshold; otherwise it says by how much it fails.

Live tracking: `reward_gap(reference_run_dir, step, reward)` is this run's
reward minus the reference run's at the same step (the reference's
metrics.jsonl is read once per process); `live_parity_metrics` adds the gap's
trailing mean over the last `LIVE_WINDOW` steps and a divergence flag.

Leaves out: multiple-comparison corrections, BCa intervals, smoothing beyond a
trailing window; with 2-3 seeds the seed level of the bootstrap is coarse and
the report says how many seeds it used.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from rl4bit.config import ConfigError

LIVE_WINDOW = 5
"""Steps in the trailing mean of the live reward gap (one step's reward is a noisy mean of one batch)."""


# --------------------------------------------------------------------------- curves


def _holding(records: list[dict], key: str) -> list[dict]:
    """The records with a numeric value of `key`."""
    return [r for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]


def curve(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in a run's metrics records, skipping records without a numeric value."""
    held = _holding(records, key)
    return [r["step"] for r in held], [float(r[key]) for r in held]


def mean_curve(curves: list[tuple[list[int], list[float]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Across seeds, on the steps every run has: (steps, mean, lo, hi) where [lo, hi] is the min..max band."""
    common = sorted(set.intersection(*(set(s) for s, _ in curves))) if curves else []
    if not common:
        e = np.zeros(0)
        return e, e, e, e
    vals = np.array([[dict(zip(s, v))[t] for t in common] for s, v in curves])
    return np.array(common), vals.mean(0), vals.min(0), vals.max(0)


def final_reward_obs(records: list[dict], window: int) -> np.ndarray:
    """The last `window` RL steps' `reward/mean` (the observations behind a run's final reward)."""
    _, vals = curve(records, "reward/mean")
    if not vals:
        raise ValueError("run has no reward/mean records; did it finish any RL step?")
    return np.array(vals[-window:])


def final_accuracy_obs(records: list[dict], eval_size: int, *, index: int = -1) -> np.ndarray:
    """An eval/accuracy (default the last; 0 = the warm start's) as n 0/1 items (accuracy x n is a count): n the
    items that eval evaluated (`eval/n`, logged beside it), `eval_size` for records that lack it."""
    held = _holding(records, "eval/accuracy")
    if not held:
        raise ValueError("run has no eval/accuracy records; set data.eval_size > 0 and a task with answers")
    n = int(held[index].get("eval/n", eval_size))
    ones = int(round(float(held[index]["eval/accuracy"]) * n))
    return np.array([1.0] * ones + [0.0] * (n - ones))


def reward_window(steps: int) -> int:
    """Default final-reward window: the last fifth of the RL steps, at least 1."""
    return max(1, steps // 5)


# --------------------------------------------------------------------------- bootstrap


def bootstrap_mean(runs: list[np.ndarray], *, n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> dict:
    """Mean over runs of each run's observation mean, with a two-level percentile bootstrap interval."""
    reps = _two_level([runs], n_boot, seed)[0]
    point = float(np.mean([r.mean() for r in runs]))
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return {"mean": point, "lo": float(lo), "hi": float(hi), "seeds": len(runs)}


def bootstrap_diff(a: list[np.ndarray], b: list[np.ndarray], *, n_boot: int = 4000, seed: int = 0,
                   level: float = 0.95) -> dict:
    """mean(a) - mean(b) with a paired two-level percentile bootstrap interval; a[i] and b[i] share seed i."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired bootstrap needs the same number of seeds on both sides, got {len(a)} and {len(b)}")
    ra, rb = _two_level([a, b], n_boot, seed)
    diffs = ra - rb
    point = float(np.mean([x.mean() for x in a]) - np.mean([x.mean() for x in b]))
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return {"diff": point, "lo": float(lo), "hi": float(hi), "level": level, "seeds": len(a), "n_boot": n_boot}


def _two_level(groups: list[list[np.ndarray]], n_boot: int, seed: int) -> list[np.ndarray]:
    """Bootstrap replicates of each group's mean-of-run-means; seed indices drawn once and shared by the groups."""
    rng = np.random.default_rng(seed)
    n = len(groups[0])
    picks = rng.integers(0, n, size=(n_boot, n))
    out = []
    for runs in groups:
        run_means = np.empty((n_boot, n))
        for i, obs in enumerate(runs):
            obs = np.asarray(obs, dtype=np.float64)
            idx = rng.integers(0, len(obs), size=(n_boot, len(obs)))
            run_means[:, i] = obs[idx].mean(1)
        out.append(np.take_along_axis(run_means, picks, 1).mean(1))
    return out


# --------------------------------------------------------------------------- verdicts and targets


def verdict(diff: dict, threshold: float, *, what: str = "difference") -> dict:
    """Parity holds iff lo <= 0 <= hi and |diff| < threshold; otherwise the text says by how much it fails."""
    d, lo, hi = diff["diff"], diff["lo"], diff["hi"]
    contains = lo <= 0.0 <= hi
    small = abs(d) < threshold
    reasons = []
    if not contains:
        reasons.append(f"the {diff.get('level', 0.95):.0%} interval [{lo:+.4f}, {hi:+.4f}] misses 0 by {min(abs(lo), abs(hi)):.4f}")
    if not small:
        reasons.append(f"|{what}| = {abs(d):.4f} exceeds the threshold {threshold:.4f} by {abs(d) - threshold:.4f}")
    holds = contains and small
    text = (f"parity holds: {what} {d:+.4f}, interval [{lo:+.4f}, {hi:+.4f}] contains 0, |{what}| < {threshold:.4f}"
            if holds else f"parity FAILS: {what} {d:+.4f}; " + "; ".join(reasons))
    return {"holds": holds, "interval_contains_0": contains, "under_threshold": small,
            "miss_by": 0.0 if contains else min(abs(lo), abs(hi)), "excess": max(0.0, abs(d) - threshold), "text": text}


def steps_to_reach(steps, values, level: float, *, smooth: int = 3) -> int | None:
    """First step where the trailing `smooth`-step mean of `values` reaches `level` (None: never)."""
    v = np.asarray(values, dtype=np.float64)
    for i in range(len(v)):
        if v[max(0, i - smooth + 1): i + 1].mean() >= level:
            return int(steps[i])
    return None


def target_level(start: float, reference_final: float, fraction: float = 0.8) -> float:
    """The reward level of "steps to target": `fraction` of the way from the start to the reference's final reward."""
    return start + fraction * (reference_final - start)


# --------------------------------------------------------------------------- live tracking


def check_reference(reference: str) -> None:
    """Raise ConfigError unless `reference` (parity.reference) is a run dir holding metrics.jsonl: checked when the
    job starts, where the data and the rewards are, since the gap is first logged after the warm start."""
    if not (Path(reference).expanduser() / "metrics.jsonl").is_file():
        raise ConfigError(f"parity.reference: {reference!r} has no metrics.jsonl; point it at a run dir that "
                          "`rl4bit train` wrote (relative paths are taken from the working directory), or drop it "
                          "with -o parity.reference=null")


@functools.lru_cache(maxsize=8)
def _reference_rewards(run_dir: str) -> dict[int, float]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"parity.reference {run_dir}: no metrics.jsonl there; point it at a finished run dir")
    out = {}
    for line in path.read_text().splitlines():
        if line:
            r = json.loads(line)
            if isinstance(r.get("reward/mean"), (int, float)):
                out[int(r["step"])] = float(r["reward/mean"])
    return out


def reward_gap(reference_run_dir: str | Path, step: int, reward: float) -> float | None:
    """This run's reward minus the reference run's at `step`; None when the reference has no such step."""
    ref = _reference_rewards(str(Path(reference_run_dir).expanduser().resolve()))
    return None if step not in ref else float(reward) - ref[step]


def live_parity_metrics(reference_run_dir: str | Path, run_dir: str | Path, step: int, reward: float,
                        threshold: float) -> dict:
    """Per-step metrics against a reference run: `parity/reward_gap`, its trailing mean, `parity/diverged` (0/1).

    The trailing mean uses this run's earlier steps from its own metrics.jsonl (so a resumed run
    needs no extra state) and the current step's reward; divergence is |trailing mean| > threshold.
    """
    gap = reward_gap(reference_run_dir, step, reward)
    if gap is None:
        return {}
    gaps = [gap]
    own = Path(run_dir) / "metrics.jsonl"
    if own.exists():
        prior = [json.loads(line) for line in own.read_text().splitlines() if line]
        for r in reversed(prior):
            if len(gaps) >= LIVE_WINDOW:
                break
            if r["step"] < step and isinstance(r.get("reward/mean"), (int, float)):
                g = reward_gap(reference_run_dir, r["step"], r["reward/mean"])
                if g is not None:
                    gaps.append(g)
    trail = float(np.mean(gaps))
    return {"parity/reward_gap": gap, "parity/reward_gap_trailing": trail, "parity/diverged": float(abs(trail) > threshold)}
