"""Statistics of reward parity: pure functions over per-run curves, plus the live reward gap.

A parity sweep runs the same job once per (recipe, seed). For each run this
module reduces the curves to one "final" value and the observations behind it:

- final reward: the mean of `reward/mean` over the last `window` RL steps
  (observations: those steps' values);
- final accuracy: the last `eval/accuracy`, a mean of `eval_size` 0/1 items.

Intervals are across seeds, on each run's final value. Runs of one seed share
initial weights, prompts, eval items and sampling seeds, so a difference of two
recipes is paired: `paired_difference` takes one difference per seed and gives
its mean with a Student-t interval (n - 1 degrees of freedom), and beside it a
seed-level paired percentile bootstrap (seeded, reproducible; narrower than the
t interval at a few seeds, so it is reported, not judged on). A run's own
noise (which eval items, which steps) is already inside its final value, so it
is not resampled again: a second level would count it twice, and unpaired (both
recipes see the same items).

`verdict` is an equivalence test (two one-sided tests at 5%): parity **holds**
when the 90% interval lies inside (-threshold, +threshold); it **fails** when
the 95% interval lies wholly beyond the threshold on one side (a larger gap is
established); anything else is **inconclusive**, and the text says how far the
interval reaches past the threshold. Issue 8's first rule ("the interval
contains 0 and |difference| < threshold") made a wide interval easier to pass
than a narrow one: it is still reported (`interval_contains_0`,
`under_threshold`) but no longer decides.

Live tracking: `reward_gap(reference_run_dir, step, reward)` is this run's
reward minus the reference run's at the same step (the reference's
metrics.jsonl is read once per process); `live_parity_metrics` adds the gap's
trailing mean over the last `LIVE_WINDOW` steps and a divergence flag.

Leaves out: multiple-comparison corrections (accuracy and reward are judged
separately, each at 5%), per-item pairing of the eval set (only its accuracy
is logged), smoothing beyond a trailing window. One seed gives no interval
(its bounds are None): the verdict is then inconclusive.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from rl4bit.config import ConfigError
from rl4bit.metrics import read_metrics

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


# --------------------------------------------------------------------------- intervals across seeds


def t_critical(level: float, df: int) -> float:
    """The two-sided Student-t critical value: P(|T| < t) = level for T with `df` (>= 1) degrees of freedom.

    Bisection on the closed-form CDF of integer degrees of freedom (Abramowitz & Stegun 26.7.3-4, in theta =
    atan(t / sqrt(df))); `tests/parity/test_parity_stats.py` checks it against scipy.stats.t."""
    if df < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"t_critical needs df >= 1 and 0 < level < 1, got df={df}, level={level}")

    def inside(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(df))
        c2 = math.cos(theta) ** 2
        if df % 2:
            term, total = math.cos(theta), (math.cos(theta) if df > 1 else 0.0)
            for k in range(3, df - 1, 2):
                term *= c2 * (k - 1) / k
                total += term
            return 2.0 / math.pi * (theta + math.sin(theta) * total)
        term, total = 1.0, 1.0
        for k in range(2, df - 1, 2):
            term *= c2 * (k - 1) / k
            total += term
        return math.sin(theta) * total

    lo, hi = 0.0, 1.0
    while inside(hi) < level:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if inside(mid) < level else (lo, mid)
    return 0.5 * (lo + hi)


def _t_interval(values: np.ndarray, level: float) -> tuple[float | None, float | None]:
    """mean -/+ t x sd / sqrt(n) of `values` (one per seed); Nones for a single seed (no spread to measure)."""
    n = len(values)
    if n < 2:
        return None, None
    half = t_critical(level, n - 1) * float(np.std(values, ddof=1)) / math.sqrt(n)
    m = float(np.mean(values))
    return m - half, m + half


def across_seeds(runs: list[np.ndarray], *, level: float = 0.95) -> dict:
    """Mean over seeds of each run's final value (the mean of its observations), with a t interval over seeds."""
    values = np.array([np.mean(r) for r in runs], dtype=np.float64)
    lo, hi = _t_interval(values, level)
    return {"mean": float(values.mean()), "lo": lo, "hi": hi, "seeds": len(runs)}


def paired_difference(a: list[np.ndarray], b: list[np.ndarray], *, level: float = 0.95, n_boot: int = 10000,
                      seed: int = 0) -> dict:
    """mean(a) - mean(b) over seeds, a[i] and b[i] the runs of seed i: the mean of the per-seed differences with
    its t interval at `level` (`lo`, `hi`) and at 90% (`eq_lo`, `eq_hi`: the equivalence test's), and a seed-level
    paired percentile bootstrap at `level` (`boot_lo`, `boot_hi`) beside them."""
    if len(a) != len(b) or not a:
        raise ValueError(f"a paired difference needs the same number of seeds on both sides, got {len(a)} and {len(b)}")
    d = np.array([np.mean(x) - np.mean(y) for x, y in zip(a, b)], dtype=np.float64)
    lo, hi = _t_interval(d, level)
    eq_lo, eq_hi = _t_interval(d, 0.90)
    picks = np.random.default_rng(seed).integers(0, len(d), size=(n_boot, len(d)))
    boot_lo, boot_hi = (float(q) for q in np.quantile(d[picks].mean(1), [(1 - level) / 2, (1 + level) / 2]))
    return {"diff": float(d.mean()), "lo": lo, "hi": hi, "eq_lo": eq_lo, "eq_hi": eq_hi, "boot_lo": boot_lo,
            "boot_hi": boot_hi, "level": level, "seeds": len(a), "per_seed": d.tolist()}


# --------------------------------------------------------------------------- verdicts and targets


def verdict(diff: dict, threshold: float, *, what: str = "difference") -> dict:
    """The equivalence verdict on a `paired_difference` (module docstring): outcome "holds", "fails" or
    "inconclusive", with the text saying why and by how much."""
    d, lo, hi, eq_lo, eq_hi = diff["diff"], diff["lo"], diff["hi"], diff["eq_lo"], diff["eq_hi"]
    contains = lo is not None and lo <= 0.0 <= hi
    small = abs(d) < threshold
    past = 0.0 if lo is None else max(-threshold - eq_lo, eq_hi - threshold)  # how far the 90% interval overreaches
    if lo is None:
        outcome, why = "inconclusive", f"{diff.get('seeds', 1)} seed gives no interval; run at least 3 seeds"
    elif -threshold < eq_lo and eq_hi < threshold:
        outcome, why = "holds", (f"the 90% interval [{eq_lo:+.4f}, {eq_hi:+.4f}] lies inside +/-{threshold:g} "
                                 f"(95%: [{lo:+.4f}, {hi:+.4f}])")
    elif lo >= threshold or hi <= -threshold:
        outcome, why = "fails", (f"the 95% interval [{lo:+.4f}, {hi:+.4f}] lies beyond {threshold:g} by "
                                 f"{min(abs(lo), abs(hi)) - threshold:.4f}")
    else:
        outcome, why = "inconclusive", (f"the 90% interval [{eq_lo:+.4f}, {eq_hi:+.4f}] reaches {past:.4f} past "
                                        f"+/-{threshold:g}: neither parity nor a larger gap is established "
                                        f"({diff.get('seeds')} seeds; more seeds narrow it)")
    word = {"holds": "parity holds", "fails": "parity FAILS", "inconclusive": "parity not established"}[outcome]
    return {"outcome": outcome, "holds": outcome == "holds", "interval_contains_0": contains, "under_threshold": small,
            "past_threshold": 0.0 if outcome == "holds" else float(past),
            "text": f"{word}: {what} {d:+.4f}; {why}"}


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
    return {int(r["step"]): float(r["reward/mean"]) for r in read_metrics(run_dir)
            if isinstance(r.get("reward/mean"), (int, float))}


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
    for r in reversed(read_metrics(run_dir)):  # this run's earlier records ([] before the first)
        if len(gaps) >= LIVE_WINDOW:
            break
        if r["step"] < step and isinstance(r.get("reward/mean"), (int, float)):
            g = reward_gap(reference_run_dir, r["step"], r["reward/mean"])
            if g is not None:
                gaps.append(g)
    trail = float(np.mean(gaps))
    return {"parity/reward_gap": gap, "parity/reward_gap_trailing": trail,
            "parity/diverged": float(abs(trail) > threshold)}
