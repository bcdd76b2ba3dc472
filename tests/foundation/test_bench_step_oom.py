"""`bench step` when a job runs out of GPU memory: a clear error naming the job and what to shrink, and the
finished job's row kept in bench_step.json (the eighteenth session's H100 run of configs/gpu-h200.yaml ended in a
bare torch traceback in the bf16 job)."""

import json

import pytest
from rl4bit import bench_step
from rl4bit.driver import OutOfMemory


def _fake_run(cfg, run_dir, on_step=None):
    """The driver's record stream for the nvfp4 job; the bf16 job's first train step runs out of memory (the
    driver's error: tests/reliability/test_local_faults.py checks the driver raises it)."""
    if cfg.recipe.name == "bf16":
        raise OutOfMemory("the job ran out of GPU memory ...", "train", 1, "CUDA out of memory")
    for step in range(4):
        yield {"step": step, **{f"time/{p}_s": 0.1 * (step + 1) for p in (*bench_step.PHASES, "step")},
               "reward/mean": 0.5, "rollout/tokens_per_s": 100.0}


def test_out_of_memory_names_the_job_and_keeps_the_finished_row(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("rl4bit.driver.run", _fake_run)
    with pytest.raises(SystemExit) as exc:
        bench_step.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    msg = str(exc.value)
    assert "the bf16 job ran out of GPU memory in its train phase at step 1 (CUDA out of memory)" in msg, msg
    assert "trainer.tokens_per_microbatch" in msg and "trainer.recompute=true" in msg
    saved = json.loads((tmp_path / "bench_step.json").read_text())
    assert [r["recipe"] for r in saved["rows"]] == ["nvfp4"]
    assert saved["incomplete"] == "the bf16 job ran out of GPU memory"
    assert saved["rows"][0]["seconds"]["step"] == pytest.approx(0.3)  # steps 1..3 kept, step 1 and the last dropped
