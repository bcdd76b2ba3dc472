"""Parity statistics on synthetic curves: a known gap is detected, no gap passes, and the live reward gap."""

import json

import numpy as np
import pytest

from rl4bit import parity
from rl4bit import parity_stats as ps

THRESHOLD = 0.02


def _runs(mean: float, *, seeds: int, n: int, noise: float, rng) -> list[np.ndarray]:
    """Per-seed observations around `mean` (a seed effect plus per-observation noise)."""
    return [mean + rng.normal(0, noise / 4) + rng.normal(0, noise, n) for _ in range(seeds)]


def test_a_known_gap_is_detected():
    rng = np.random.default_rng(1)
    a = _runs(0.60, seeds=3, n=20, noise=0.03, rng=rng)
    b = _runs(0.50, seeds=3, n=20, noise=0.03, rng=rng)
    d = ps.paired_difference(a, b)
    assert d["lo"] <= 0.10 <= d["hi"], d  # the interval covers the true gap
    v = ps.verdict(d, THRESHOLD)
    assert v["outcome"] == "fails" and not v["holds"] and not v["interval_contains_0"] and not v["under_threshold"]
    assert "FAILS" in v["text"] and f"{d['lo'] - THRESHOLD:.4f}" in v["text"]


@pytest.mark.parametrize("seed", range(5))
def test_no_gap_passes_with_enough_seeds(seed):
    rng = np.random.default_rng(100 + seed)
    a = _runs(0.55, seeds=8, n=20, noise=0.02, rng=rng)
    b = _runs(0.55, seeds=8, n=20, noise=0.02, rng=rng)
    v = ps.verdict(ps.paired_difference(a, b), THRESHOLD)
    assert v["outcome"] == "holds" and v["holds"], v["text"]
    assert "parity holds" in v["text"]


def test_a_wide_interval_around_zero_is_not_parity():
    """The old rule (interval contains 0, |difference| < threshold) passed this: the less precise the runs, the
    easier. An equivalence test cannot pass it."""
    d = {"diff": 0.0, "lo": -0.04, "hi": 0.04, "eq_lo": -0.03, "eq_hi": 0.03, "seeds": 3}
    v = ps.verdict(d, THRESHOLD)
    assert v["outcome"] == "inconclusive" and v["interval_contains_0"] and v["under_threshold"] and not v["holds"]
    assert v["past_threshold"] == pytest.approx(0.01) and "not established" in v["text"]


def test_a_precisely_measured_small_gap_holds():
    """The old rule failed this (the interval misses 0); a gap known to be far under the threshold is parity."""
    d = {"diff": -0.004, "lo": -0.006, "hi": -0.002, "eq_lo": -0.0055, "eq_hi": -0.0025, "seeds": 8}
    v = ps.verdict(d, THRESHOLD)
    assert v["outcome"] == "holds" and not v["interval_contains_0"]


def test_one_seed_gives_no_interval_and_no_verdict():
    a, b = [np.array([0.5, 0.6])], [np.array([0.5, 0.5])]
    d = ps.paired_difference(a, b)
    assert d["lo"] is None and d["eq_hi"] is None and d["diff"] == pytest.approx(0.05)
    v = ps.verdict(d, THRESHOLD)
    assert v["outcome"] == "inconclusive" and "1 seed gives no interval" in v["text"]
    assert ps.across_seeds(a)["lo"] is None


def test_the_difference_is_paired_by_seed_and_not_resampled_within_runs():
    """Identical runs differ by exactly 0 with a zero-width interval (the old two-level bootstrap gave +/-3 points
    here: it resampled each run's eval items again, separately per recipe). The interval is the t interval of the
    per-seed differences, computed here by hand."""
    rng = np.random.default_rng(3)
    a = _runs(0.5, seeds=5, n=10, noise=0.05, rng=rng)
    same = ps.paired_difference(a, a)
    assert same["diff"] == 0.0 and same["lo"] == same["hi"] == 0.0 and same["boot_lo"] == same["boot_hi"] == 0.0
    b = [x + rng.normal(0, 0.01) for x in a]
    d = ps.paired_difference(a, b, level=0.95)
    per = np.array([x.mean() - y.mean() for x, y in zip(a, b)])
    half = 2.7764451051977934 * per.std(ddof=1) / np.sqrt(5)  # t(0.975, 4 df)
    assert d["lo"] == pytest.approx(per.mean() - half) and d["hi"] == pytest.approx(per.mean() + half)
    assert d["per_seed"] == pytest.approx(per.tolist())
    assert ps.paired_difference(a, b, seed=7) == ps.paired_difference(a, b, seed=7)
    m = ps.across_seeds(a)
    assert m["lo"] <= m["mean"] <= m["hi"] and m["seeds"] == 5
    with pytest.raises(ValueError, match="same number of seeds"):
        ps.paired_difference(a, a[:1])


def test_t_critical_matches_scipy():
    """The peer check of the closed-form Student-t quantile (scipy is in the test environment, not a dependency)."""
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 5, 7, 10, 29, 100):
        for level in (0.90, 0.95, 0.99):
            assert ps.t_critical(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df), rel=1e-9)
    with pytest.raises(ValueError):
        ps.t_critical(0.95, 0)


def test_accuracy_observations_and_curves():
    recs = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.3,
                                                                                    "eval/accuracy": 0.625}]
    obs = ps.final_accuracy_obs(recs, 8)
    assert obs.sum() == 5 and len(obs) == 8
    recs[2]["eval/n"] = 16.0  # the eval set held 16 items, not data.eval_size: the count follows what ran
    assert ps.final_accuracy_obs(recs, 200).tolist() == [1.0] * 10 + [0.0] * 6
    assert len(ps.final_accuracy_obs(recs, 200, index=0)) == 200  # a record without eval/n: eval_size
    assert ps.final_reward_obs(recs, 5).tolist() == [0.1, 0.3]
    s, m, lo, hi = ps.mean_curve([([1, 2, 3], [0.0, 1.0, 2.0]), ([1, 2], [2.0, 3.0])])
    assert s.tolist() == [1, 2] and m.tolist() == [1.0, 2.0] and lo.tolist() == [0.0, 1.0] and hi.tolist() == [2.0, 3.0]
    assert ps.steps_to_reach([1, 2, 3, 4, 5], [0.1, 0.2, 0.9, 0.9, 0.9], 0.6, smooth=2) == 4
    assert ps.steps_to_reach([1, 2], [0.1, 0.2], 0.6) is None
    assert ps.target_level(0.2, 0.7) == pytest.approx(0.6)


def _fake_run(tmp_path, recipe, seed, reward_end, acc_end, steps=20, rng=None):
    """A run's records: reward rising linearly from 0.3 to `reward_end` plus noise; eval at 0, 10, 20."""
    recs = [{"step": 0, "eval/accuracy": 0.40}]
    for t in range(1, steps + 1):
        r = {"step": t, "reward/mean": 0.3 + (reward_end - 0.3) * t / steps + rng.normal(0, 0.01),
             "rollout/tokens_per_s": 1000.0, "time/step_s": 1.0, "mismatch/k3": 0.0}
        if t % 10 == 0:
            r["eval/accuracy"] = round(acc_end * 256) / 256 if t == steps else 0.5
        recs.append(r)
    return {"recipe": recipe, "seed": seed, "run_dir": tmp_path / f"{recipe}-seed{seed}", "wall_s": 60.0,
            "records": recs}


@pytest.mark.parametrize("gap, holds", [(0.0, True), (0.12, False)])
def test_analyze_on_synthetic_runs(tmp_path, gap, holds):
    rng = np.random.default_rng(11)
    def lower(r):  # the gap the nvfp4 runs trail by
        return gap if r == "nvfp4" else 0.0

    runs = [_fake_run(tmp_path, r, s, 0.8 - lower(r), 0.7 - lower(r), rng=rng)
            for s in range(3) for r in ("nvfp4", "mxfp8")]
    rep = parity.analyze(runs, ["nvfp4", "mxfp8"], threshold=THRESHOLD, eval_size=256, steps=20)
    assert rep["verdict"]["holds"] is holds, rep["verdict"]["text"]
    assert rep["verdict"]["outcome"] == ("holds" if holds else "fails")
    acc = next(c for c in rep["comparisons"] if c["metric"] == "final_accuracy")
    assert acc["diff"] == pytest.approx(-gap, abs=1 / 256)
    nv, mx = rep["recipes"]["nvfp4"]["steps_to_target"], rep["recipes"]["mxfp8"]["steps_to_target"]
    assert mx is not None and (nv is None or nv > mx if gap else abs(nv - mx) <= 2)


def test_reward_gap_reads_the_reference(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        [{"step": 0, "eval/accuracy": 0.5}] + [{"step": t, "reward/mean": 0.5} for t in range(1, 4)])))
    assert ps.reward_gap(ref, 2, 0.53) == pytest.approx(0.03)
    assert ps.reward_gap(ref, 9, 0.5) is None
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.50}) + "\n")
    m = ps.live_parity_metrics(ref, run, 2, 0.56, THRESHOLD)
    assert m["parity/reward_gap"] == pytest.approx(0.06)
    assert m["parity/reward_gap_trailing"] == pytest.approx(0.03) and m["parity/diverged"] == 1.0
    assert ps.live_parity_metrics(ref, run, 2, 0.51, THRESHOLD)["parity/diverged"] == 0.0
    with pytest.raises(FileNotFoundError, match="parity.reference"):
        ps.reward_gap(tmp_path / "missing", 1, 0.0)
