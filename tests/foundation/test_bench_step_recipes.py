"""`bench step --recipes`: one job per recipe (default nvfp4, mxfp8, bf16), one column each and one
<recipe>/<reference> ratio column per recipe but the first; bad names refused before any job runs. The job itself
on the CPU end to end (~25 s on a 2-core machine); the table's GPU-only lines (memory) from fake rows."""

import json

import pytest
import yaml

from rl4bit.bench import step as bench_step

SCALE = {"nvfp4": 1.0, "mxfp8": 1.25, "bf16": 2.0}
"""The fake driver's times per recipe: mxfp8 1.25x and bf16 2x nvfp4's."""


def _fake_run(cfg, run_dir, on_step=None):
    k = SCALE[cfg.recipe.name]
    for step in range(4):
        yield {"step": step, **{f"time/{p}_s": 0.1 * k for p in (*bench_step.PHASES, "step")},
               "reward/mean": 0.5, "rollout/tokens_per_s": 100.0 / k}


def _row(recipe: str, k: float, peak: float) -> dict:
    """A finished GPU job's row as `run_job` returns it: times k x 0.1 s, memory `peak` GiB and phases below it."""
    return {"recipe": recipe, "steps_timed": 2, "steps_excluded": "first and last",
            "seconds": {p: 0.1 * k for p in (*bench_step.PHASES, "step")}, "rollout_tok_s": 1000.0 / k,
            "peak_gib": peak, "held_at_start_gib": 0.5,
            "memory_gib": {"step_start_gib": peak / 2, "train_peak_gib": peak, "sync_peak_gib": 0.0},
            "per_step_s": {p: [0.1 * k] * 4 for p in ("sample", "train", "sync")},
            "mismatch": {"k3": [1e-8] * 4, "max_abs": [0.01] * 4}, "reward": 0.5, "memory_sites": []}


@pytest.mark.parametrize("recipes, says", [
    ("nvfp4,fp4", "unknown recipe(s) fp4; choose from bf16, mxfp8, nvfp4"),
    ("nvfp4,bf16,nvfp4", "nvfp4 given more than once"),
    ("nvfp4,,bf16", "give comma-separated recipe names"),
])
def test_an_unknown_or_repeated_recipe_is_refused_before_any_job(monkeypatch, capsys, recipes, says):
    def run(cfg, run_dir, on_step=None):
        raise AssertionError("a job ran")
    monkeypatch.setattr("rl4bit.driver.run", run)
    with pytest.raises(SystemExit) as exc:
        bench_step.main(["--quick", "--device", "cpu", "--recipes", recipes])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    with pytest.raises(ValueError, match="recipe"):  # run() checks as well, for callers from Python
        bench_step.run(device="cpu", quick=True, recipes=recipes)


def test_ratios_are_other_over_the_reference_in_table_and_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("rl4bit.driver.run", _fake_run)
    bench_step.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("figure"))
    assert header.split() == ["figure", "nvfp4", "mxfp8", "bf16", "mxfp8/nvfp4", "bf16/nvfp4"]
    assert "ratio columns: <recipe>/nvfp4 of each figure: > 1 = nvfp4 faster (s) or smaller (GiB)" in out
    step = next(line for line in out.splitlines() if line.startswith("step s"))
    assert step.split() == ["step", "s", "0.100", "0.125", "0.200", "1.25", "2.00"]
    saved = json.loads((tmp_path / "bench_step.json").read_text())
    assert saved["recipes"] == ["nvfp4", "mxfp8", "bf16"] and saved["reference"] == "nvfp4"
    assert [r["recipe"] for r in saved["rows"]] == saved["recipes"]
    assert set(saved["ratios"]) == {"mxfp8", "bf16"}
    for recipe in ("mxfp8", "bf16"):
        r = saved["ratios"][recipe]
        for p in ("sample", "score", "train", "sync", "step"):
            assert r[f"{p}_s"] == pytest.approx(SCALE[recipe]), (recipe, p)
        assert r["rollout_tok_s"] == pytest.approx(1 / SCALE[recipe])
        assert r["peak_gib"] is None and r["memory_gib"] is None  # no GPU memory on the CPU


def test_the_reference_is_the_first_recipe_given(monkeypatch, capsys):
    monkeypatch.setattr("rl4bit.driver.run", _fake_run)
    res = bench_step.run(device="cpu", quick=True, recipes="bf16,nvfp4")
    assert res["reference"] == "bf16" and set(res["ratios"]) == {"nvfp4"}
    assert res["ratios"]["nvfp4"]["step_s"] == pytest.approx(0.5)
    assert "RL step, gpu-h200.yaml, cpu: bf16 (reference) vs nvfp4" in capsys.readouterr().out
    one = bench_step.run(device="cpu", quick=True, recipes="mxfp8")  # one recipe: no ratio columns
    assert one["ratios"] == {} and "figure                       mxfp8\n" in capsys.readouterr().out


def test_gpu_memory_lines_have_a_column_and_a_ratio_per_recipe(capsys):
    rows = [_row("nvfp4", 1.0, 40.0), _row("mxfp8", 1.25, 50.0), _row("bf16", 2.0, 80.0)]
    bench_step.print_table(rows, "gpu-h200.yaml", "cuda")
    out = capsys.readouterr().out
    lines = {line[:22].strip(): line[22:].split() for line in out.splitlines()}
    assert lines["peak GPU GiB"] == ["40.0", "50.0", "80.0", "1.25", "2.00"]
    assert lines["held at start GiB"] == ["0.5", "0.5", "0.5"]
    assert lines["train_peak_gib"] == ["40.0", "50.0", "80.0", "1.25", "2.00"]
    assert lines["sync_peak_gib"] == ["0.0", "0.0", "0.0", "-", "-"]  # nothing to divide by
    every = out[out.index("train s, every step"):out.index("k3, every step")].splitlines()[1:]
    assert every == [f"  {name:<20}{[0.1 * k] * 4}" for name, k in (("nvfp4", 1.0), ("mxfp8", 1.25), ("bf16", 2.0))]
    r = bench_step.ratios(rows)
    assert r["bf16"]["peak_gib"] == pytest.approx(2.0) and r["mxfp8"]["memory_gib"]["step_start_gib"] == 1.25


def test_three_recipes_end_to_end_on_the_cpu(tmp_path, capsys):
    res = bench_step.run(device="cpu", quick=True, out=str(tmp_path), recipes="nvfp4,mxfp8,bf16")
    assert [r["recipe"] for r in res["rows"]] == ["nvfp4", "mxfp8", "bf16"]
    for row in res["rows"]:
        assert row["seconds"]["step"] > 0 and row["rollout_tok_s"] > 0 and row["steps_timed"] == 2
        kept = list((tmp_path / "runs").glob(f"{row['recipe']}-*/config.yaml"))
        assert len(kept) == 1 and yaml.safe_load(kept[0].read_text())["recipe"]["name"] == row["recipe"]
    for recipe in ("mxfp8", "bf16"):
        assert res["ratios"][recipe]["step_s"] > 0
    out = capsys.readouterr().out
    assert "mxfp8/nvfp4" in out and "bf16/nvfp4" in out
    assert json.loads((tmp_path / "bench_step.json").read_text())["ratios"].keys() == {"mxfp8", "bf16"}


def test_bench_all_summary_has_the_reference_beside_each_other_recipe():
    """`bench all`'s summary: times as other / reference, memory as reference / other (its convention); the issue-11
    targets only on nvfp4 against bf16."""
    from rl4bit.bench import all as bench_all

    rows = [_row("nvfp4", 1.0, 40.0), _row("mxfp8", 1.25, 50.0), _row("bf16", 2.0, 80.0)]
    figures = {r[0]: r for r in bench_all._rows_step({"rows": rows})}
    assert figures["RL step step s (nvfp4 vs mxfp8)"][2:] == ("mxfp8 0.125", pytest.approx(1.25), None)
    assert figures["RL job peak GPU memory (nvfp4 vs mxfp8)"][2:] == ("mxfp8 50.0 GiB", pytest.approx(0.8), None)
    assert figures["RL step step s (nvfp4)"][2:] == ("bf16 0.200", pytest.approx(2.0), ">= 1.3")
    assert figures["RL job peak GPU memory (nvfp4)"][2:] == ("bf16 80.0 GiB", pytest.approx(0.5), "<= 0.6")
