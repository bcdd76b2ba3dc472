"""`rl4bit bench soak`: resident memory per step stays within the stated bound after warm-up."""

import json

import pytest

from rl4bit.bench import soak as bench_soak


def test_verdict_flags_growth_past_the_bound():
    flat = [{"step": s, "rss_mib": 500.0 + (s % 2)} for s in range(1, 11)]
    leak = [{"step": s, "rss_mib": 500.0 + 20 * s} for s in range(1, 11)]
    assert bench_soak.verdict(flat, 3)["flat"]
    v = bench_soak.verdict(leak, 3)
    assert not v["flat"] and v["rss_slope_mib_per_step"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="raise --steps"):
        bench_soak.verdict(flat[:3], 3)


@pytest.mark.slow
def test_quick_soak_is_flat_after_warm_up(tmp_path, capsys):
    result = bench_soak.run(device="cpu", quick=True, out=str(tmp_path), steps=10, override=["run.tensorboard=false"])
    rows, v = result["rows"], result["verdict"]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["rss_mib"] > 50 and r["reward_workers_rss_mib"] > 0 for r in rows)
    assert v["flat"] and v["rss_growth_mib"] <= v["rss_bound_mib"]
    assert json.loads((tmp_path / "bench_soak.json").read_text())["verdict"] == v
    assert "FLAT" in capsys.readouterr().out


def test_too_few_steps_are_refused_before_the_job_runs(monkeypatch, capsys):
    """`--steps 2` leaves one step after the warm-up: refused in one line before anything is built."""
    from rl4bit import driver
    from rl4bit.cli import main

    def never(*a, **k):
        raise AssertionError("the job ran")

    monkeypatch.setattr(driver, "run", never)
    assert main(["bench", "soak", "--steps", "2", "--device", "cpu", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "error: --steps 2 leaves fewer than 2 steps after the 2-step warm-up; give --steps 3" in err
