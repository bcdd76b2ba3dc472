"""A tiny real parity sweep (2 recipes, 1 seed, 2 RL steps): the three files, sane numbers, reuse and refusal."""

import json
from pathlib import Path

import pytest

from rl4bit import parity
from rl4bit.config import ConfigError
from rl4bit.metrics import read_metrics

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
    "model.num_heads=2", "rl.steps=2", "rl.prompts_per_step=4", "rl.samples_per_prompt=4",
    "run.warmup_sft_steps=3", "run.warmup_batch_size=8", "data.eval_size=8", "data.eval_every=2",
    "run.checkpoint_every=2", "ray.mode=local", "run.tensorboard=false",
]
"""The quickstart shrunk to seconds per run (same code paths: warm start, recipe conversion, embedded sampler)."""


def test_tiny_parity_run_writes_the_three_files(tmp_path, capsys):
    out = tmp_path / "parity"
    assert parity.main(QUICKSTART, recipes=["nvfp4", "mxfp8"], seeds=1, out=str(out), overrides=TINY) == 0
    rep = json.loads((out / "parity.json").read_text())
    assert (out / "parity.png").stat().st_size > 20_000
    md = (out / "parity.md").read_text()
    assert rep["verdict"]["text"] in md and "| nvfp4 |" in md and "| mxfp8 |" in md
    assert rep["reference"] == "mxfp8" and rep["candidate"] == "nvfp4" and rep["threshold"] == 0.02
    assert rep["seeds"] == [0] and len(rep["runs"]) == 2
    for run in rep["runs"]:
        assert [r["step"] for r in read_metrics(run["run_dir"])] == [0, 1, 2]
        assert 0 <= run["final_accuracy"] <= 1 and 0 <= run["final_reward"] <= 1
        assert run["wall_s"] > 0 and run["tokens_per_s"] > 0 and run["step_s"] > 0
        assert run["mismatch_k3_max"] == 0.0  # embedded sampler and trainer agree bit for bit, per recipe
    for k in ("nvfp4", "mxfp8"):
        a = rep["recipes"][k]["final_accuracy"]
        assert a["lo"] is None and a["hi"] is None and a["seeds"] == 1  # one seed: no interval across seeds
    assert rep["verdict"]["outcome"] == "inconclusive" and "1 seed gives no interval" in rep["verdict"]["text"]
    diffs = {c["metric"]: c for c in rep["comparisons"]}
    assert set(diffs) == {"final_accuracy", "final_reward", "initial_accuracy"}
    by = {r["recipe"]: r for r in rep["runs"]}
    gap = by["nvfp4"]["final_accuracy"] - by["mxfp8"]["final_accuracy"]
    assert diffs["final_accuracy"]["diff"] == pytest.approx(gap)
    # same seed: both recipes' warm starts (fp32, before the recipe conversion) run the same losses
    logs = [(out / "logs" / f"{k}-seed0.log").read_text().splitlines() for k in ("nvfp4", "mxfp8")]
    warm = [next(line for line in lines if line.startswith("warm start:")) for lines in logs]
    assert warm[0].split(" (")[0] == warm[1].split(" (")[0], warm  # the losses; the second run hits the cache
    assert "(trained, cached" in warm[0] and "(reused from the cache" in warm[1], warm

    # a second call reuses the finished runs (no new process) and rewrites the same numbers
    capsys.readouterr()
    assert parity.main(QUICKSTART, recipes=["nvfp4", "mxfp8"], seeds=1, out=str(out), overrides=TINY) == 0
    assert "running" not in capsys.readouterr().out
    assert json.loads((out / "parity.json").read_text())["comparisons"] == rep["comparisons"]

    with pytest.raises(FileExistsError, match="another config.*trainer.lr"):
        parity.main(QUICKSTART, recipes=["nvfp4", "mxfp8"], seeds=1, out=str(out), overrides=TINY + ["trainer.lr=1e-3"])


def test_bad_arguments_fail_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="at least two distinct recipes"):
        parity.main(QUICKSTART, recipes=["nvfp4"], seeds=1, out=str(tmp_path / "p"), overrides=TINY)
    with pytest.raises(ConfigError, match="unknown recipe.*'nvfp5'; choose from bf16, mxfp8, nvfp4"):
        parity.main(QUICKSTART, recipes=["nvfp5", "mxfp8"], seeds=1, out=str(tmp_path / "p"), overrides=TINY)
    with pytest.raises(ConfigError, match="parity.reference: .*has no metrics.jsonl"):
        parity.main(QUICKSTART, recipes=["nvfp4", "mxfp8"], seeds=1, out=str(tmp_path / "p"),
                    overrides=TINY + [f"parity.reference={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="--seeds 0"):
        parity.main(QUICKSTART, recipes=["nvfp4", "mxfp8"], seeds=0, out=str(tmp_path / "p"), overrides=TINY)
    assert not (tmp_path / "p").exists()


def test_live_tracking_logs_the_gap_to_a_reference_run(tmp_path):
    """A run given parity.reference logs parity/reward_gap = its reward minus the reference's, each step."""
    from rl4bit import driver

    ref, run = tmp_path / "ref", tmp_path / "run"
    quiet = ["run.progress=false"]
    assert driver.main(QUICKSTART, out=str(ref), overrides=TINY + ["recipe.name=mxfp8", *quiet]) == 0
    assert driver.main(QUICKSTART, out=str(run), overrides=TINY + [f"parity.reference={ref}", *quiet]) == 0
    theirs = {r["step"]: r for r in read_metrics(ref)}
    steps = [r for r in read_metrics(run) if r["step"] > 0]
    assert len(steps) == 2
    for r in steps:
        assert r["parity/reward_gap"] == pytest.approx(r["reward/mean"] - theirs[r["step"]]["reward/mean"])
        assert r["parity/diverged"] in (0, 1)


def test_a_partial_run_is_resumed_with_its_own_config(tmp_path, monkeypatch):
    """The command `_launch` builds for an unfinished run is one `rl4bit train` accepts: --resume alone (the run
    dir's config.yaml holds the recipe and seed; a config beside --resume is refused)."""
    from rl4bit import cli, driver

    seen = {}
    monkeypatch.setattr(parity.subprocess, "Popen", lambda cmd, **kw: seen.setdefault("cmd", cmd))
    (tmp_path / "logs").mkdir()
    job = {"state": "partial", "run_dir": tmp_path / "run", "recipe": "nvfp4", "seed": 0, "overrides": []}
    parity._launch(Path(QUICKSTART), job, tmp_path)
    args = seen["cmd"][seen["cmd"].index("train") + 1:]
    monkeypatch.setattr(driver, "main", lambda *a, **k: seen.update(main=(a, k)) or 0)
    assert cli.main(["train", *args]) == 0
    assert seen["main"][1]["resume"] == str(tmp_path / "run") and seen["main"][0][0] is None


def test_a_missing_reference_stops_the_job_at_start(tmp_path):
    """parity.reference without metrics.jsonl: a ConfigError when the job starts (before the warm start), and the
    run dir is not kept, so the corrected command runs into the same --out. `load_config` alone accepts it (a
    config for another machine's paths must load where it is edited)."""
    from rl4bit import driver
    from rl4bit.config import load_config

    bad = [f"parity.reference={tmp_path / 'nope'}"]
    assert load_config(QUICKSTART, TINY + bad).parity.reference == str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=r"parity.reference: '.*nope' has no metrics.jsonl.*-o parity.reference=null"):
        driver.main(QUICKSTART, out=str(tmp_path / "run"), overrides=TINY + bad)
    assert not (tmp_path / "run").exists()
