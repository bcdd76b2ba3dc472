"""`bench step` when a job runs out of GPU memory: a clear error naming the job, its phase and step and what to
shrink, the finished jobs' figures printed and kept in bench_step.json (with the jobs not run), whichever of the
recipes fails, through `python -m rl4bit.bench.step` and `rl4bit bench step` alike (the eighteenth session's H100
run of configs/gpu-h200.yaml ended in a bare torch traceback in the bf16 job)."""

import json

import pytest

from rl4bit import cli
from rl4bit.bench import step as bench_step
from rl4bit.driver import OutOfMemory


def _fake_run(failing: str):
    """The driver's record stream; the `failing` recipe's job runs out of memory at its first train step (the
    driver's error: tests/reliability/test_local_faults.py checks the driver raises it)."""
    def run(cfg, run_dir, on_step=None):
        if cfg.recipe.name == failing:
            raise OutOfMemory("the job ran out of GPU memory ...", "train", 1, "CUDA out of memory")
        for step in range(4):
            yield {"step": step, **{f"time/{p}_s": 0.1 * (step + 1) for p in (*bench_step.PHASES, "step")},
                   "reward/mean": 0.5, "rollout/tokens_per_s": 100.0}
    return run


@pytest.mark.parametrize("recipes, failing, finished, not_run", [
    ("nvfp4,mxfp8,bf16", "bf16", ["nvfp4", "mxfp8"], []),  # the default recipes, the last one fails
    ("nvfp4,mxfp8,bf16", "mxfp8", ["nvfp4"], ["bf16"]),
    ("nvfp4,bf16", "bf16", ["nvfp4"], []),
])
def test_out_of_memory_names_the_job_and_keeps_the_finished_rows(monkeypatch, tmp_path, capsys, recipes, failing,
                                                                  finished, not_run):
    monkeypatch.setattr("rl4bit.driver.run", _fake_run(failing))
    argv = ["--quick", "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        bench_step.main(argv if recipes == ",".join(bench_step.RECIPES) else [*argv, "--recipes", recipes])
    msg = str(exc.value)
    assert msg.startswith(f"rl4bit bench step: error: the {failing} job of gpu-h200.yaml (sized for a 141 GB H200"), msg
    assert "ran out of GPU memory in its train phase at step 1 (CUDA out of memory)" in msg, msg
    assert "-o trainer.tokens_per_microbatch=8192" in msg and "trainer.recompute=true" in msg, msg  # 16384 / 2
    out = capsys.readouterr().out
    for recipe in finished:
        assert f"{recipe} (finished): sample 0.300 s" in out, out
    assert f"{failing} (finished)" not in out and "RL step, " not in out  # no table of a partial run
    saved = json.loads((tmp_path / "bench_step.json").read_text())
    assert [r["recipe"] for r in saved["rows"]] == finished
    assert saved["recipes"] == recipes.split(",")
    assert saved["incomplete"] == f"the {failing} job ran out of GPU memory" and saved["not_run"] == not_run
    assert "ratios" not in saved
    assert saved["rows"][0]["seconds"]["step"] == pytest.approx(0.3)  # steps 1..3 kept, step 1 and the last dropped


def test_cli_prints_one_line_and_an_earlier_result_is_not_left_as_this_runs(monkeypatch, tmp_path, capsys):
    (tmp_path / "bench_step.json").write_text(json.dumps({"rows": ["an earlier run's"]}))
    monkeypatch.setattr("rl4bit.driver.run", _fake_run("nvfp4"))
    assert cli.main(["bench", "step", "--quick", "--device", "cpu", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rl4bit bench step: error: the nvfp4 job of gpu-h200.yaml") and err.count("\n") == 1, err
    saved = json.loads((tmp_path / "bench_step.json").read_text())
    assert saved["rows"] == [] and saved["incomplete"] == "the nvfp4 job ran out of GPU memory"
    assert saved["not_run"] == ["mxfp8", "bf16"]


def test_without_out_the_run_dirs_are_temporary_and_say_so(monkeypatch, capsys):
    """The driver prints each job's run dir; without --out that is a temporary directory, removed when the job
    ends, and bench step says so and how to keep it (with --out: tests/foundation/test_bench_all.py)."""
    seen = []

    def run(cfg, run_dir, on_step=None):
        seen.append(run_dir)
        yield from _fake_run("none")(cfg, run_dir, on_step)
    monkeypatch.setattr("rl4bit.driver.run", run)
    bench_step.main(["--quick", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(seen) == len(bench_step.RECIPES) == 3
    for recipe, run_dir in zip(bench_step.RECIPES, seen):
        assert not run_dir.exists(), run_dir
        assert f"({recipe}: that run dir is temporary and is removed now; bench step --out DIR keeps" in out
