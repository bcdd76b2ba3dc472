"""The RL loop end to end on a small quickstart: local and Ray modes, reward swapping, fail-fast, resume."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl4bit import driver
from rl4bit.metrics import EVAL_KEYS, STEP_KEYS, read_metrics
from rl4bit.rewards import RewardError

from .conftest import QUICKSTART, deadline_of, strip_timing


@pytest.fixture
def deadline():
    """Fail (instead of hanging CI) if a run takes more than 240 s."""
    with deadline_of(240, "RL run"):
        yield


def _check_run(run_dir, steps):
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(steps + 1))
    assert set(EVAL_KEYS) <= set(records[0]), f"step 0 lacks {set(EVAL_KEYS) - set(records[0])}"
    for r in records[1:]:
        missing = set(STEP_KEYS) - set(r)
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["mismatch/k3"] == 0.0 and r["mismatch/max_abs"] == 0.0  # sampler and trainer agree bit for bit
        assert r["rollout/errors"] == 0.0  # every request the driver builds is served
        assert "sync/reload_s" not in r  # the embedded engine does not time its update's phases (vLLM's does)
    assert "eval/accuracy" in records[-1]
    for name in ("reward", "accuracy", "mismatch", "throughput"):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 1000
    assert list((run_dir / "tensorboard").iterdir())
    assert json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] == steps
    return records


def test_local_mode_run_logs_every_metric(tmp_path, small, deadline, capsys):
    out = tmp_path / "run"
    assert driver.main(QUICKSTART, out=str(out), overrides=small + ["ray.mode=local"]) == 0
    _check_run(out, 2)
    assert f"run dir: {out}" in capsys.readouterr().out


@pytest.mark.slow
def test_ray_mode_run_logs_every_metric(tmp_path, small, deadline):
    """`rl4bit train` in Ray mode, as a user runs it: its own process, its own private cluster.

    A subprocess, not driver.main in this process: Ray caches its auth token per
    process, so a cluster started earlier by another test would refuse this one.
    """
    pytest.importorskip("ray")
    out = tmp_path / "run"
    cli = Path(sys.executable).with_name("rl4bit")
    args = [str(cli), "train", str(QUICKSTART), "--out", str(out)]
    for o in small + ["ray.mode=ray", "ray.num_cpus=2"]:
        args += ["-o", o]
    r = subprocess.run(args, capture_output=True, text=True, timeout=230)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert str(out) in r.stdout, "the run ends by printing its run dir"
    _check_run(out, 2)
    assert any((out / "ray").glob("session_*")), "Ray's session files belong under the run dir"
    mode = (out / "ray" / "auth_token").stat().st_mode
    assert mode & 0o077 == 0, "the cluster's auth token: under the run dir, private"


def test_swapping_the_reward_changes_the_rewards(tmp_path, small, deadline):
    f = tmp_path / "my_rewards.py"
    f.write_text("def constant(prompt, completion, **sample):\n    return 0.25\n")
    one_step = small + ["ray.mode=local", "rl.steps=1", "run.warmup_sft_steps=0", "run.tensorboard=false"]
    by_file = driver.main(QUICKSTART, out=str(tmp_path / "a"),
                          overrides=one_step + [f"rewards.functions=[{{fn: '{f}:constant'}}]"])
    by_import = driver.main(QUICKSTART, out=str(tmp_path / "b"), overrides=one_step + [
        "rewards.functions=[{fn: 'rl4bit.rewards:length_penalty', weight: 2.0}]"])
    assert by_file == by_import == 0
    a, b = read_metrics(tmp_path / "a")[1], read_metrics(tmp_path / "b")[1]
    assert a["reward/mean"] == 0.25 and a["reward/constant"] == 0.25
    assert b["reward/mean"] < 0 and b["reward/mean"] == pytest.approx(2 * b["reward/length_penalty"])


def test_a_broken_reward_fails_fast_with_its_name(tmp_path, small):
    f = tmp_path / "broken.py"
    f.write_text("def explode(prompt, completion, **sample):\n    return 1 / 0\n")
    with pytest.raises(RewardError, match=r"explode.*ZeroDivisionError"):
        driver.main(QUICKSTART, out=str(tmp_path / "run"),
                    overrides=small + [f"rewards.functions=[{{fn: '{f}:explode'}}]"])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # failed before any actor or step
    # nothing started, so the same --out takes the corrected command (no "already holds a run")
    f.write_text("def explode(prompt, completion, **sample):\n    return 1.0\n")
    one_step = small + ["rl.steps=1", "run.warmup_sft_steps=0", "ray.mode=local",
                        "run.tensorboard=false", f"rewards.functions=[{{fn: '{f}:explode'}}]"]
    assert driver.main(QUICKSTART, out=str(tmp_path / "run"), overrides=one_step) == 0


def test_resuming_a_run_without_a_checkpoint_says_what_to_do(tmp_path, small, monkeypatch):
    """A run that logged steps but never reached run.checkpoint_every: --resume stops before any actor starts,
    and says to run the config again into a new directory."""
    from rl4bit.config import load_config
    from rl4bit.rundir import create_run_dir

    run = create_run_dir(load_config(QUICKSTART, small), tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')

    def never(*a, **k):
        raise AssertionError("the job started")

    monkeypatch.setattr(driver, "run", never)
    with pytest.raises(FileNotFoundError, match=r"has no checkpoint to resume .*run it again with `rl4bit train "
                                                r".*config.yaml --out NEW_DIR -o rl.steps=3`"):
        driver.main(None, resume=str(run), overrides=["rl.steps=3"])
    with pytest.raises(FileExistsError, match="wrote no checkpoint, so there is nothing to resume; choose another"):
        driver.main(QUICKSTART, out=str(run), overrides=small)


def test_a_failed_start_leaves_no_empty_run_dir(tmp_path, small, monkeypatch):
    """Without --out, a start that fails (here: a reward file that does not exist) leaves no empty
    runs/<name>-<ts>/ skeleton; a directory that existed before is never removed."""
    monkeypatch.chdir(tmp_path)
    bad = small + ["rewards.functions=[{fn: 'missing.py:f'}]"]
    with pytest.raises(RewardError, match="missing.py"):
        driver.main(QUICKSTART, overrides=bad)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    with pytest.raises(RewardError, match="missing.py"):
        driver.main(QUICKSTART, out=str(mine), overrides=bad)
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoints", "logs", "notes", "plots", "tensorboard"]


@pytest.mark.slow
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_resumed_run_matches_an_uninterrupted_one(tmp_path, small, deadline, kl_coef):
    """With kl_coef > 0 the KL reference (the warm-started policy) travels in the checkpoint: a resume that rebuilt
    it would anchor the KL to the untrained model and `kl/ref` would differ."""
    cfg = small + ["ray.mode=local", "run.tensorboard=false", "rl.steps=4", "run.checkpoint_every=2",
                   f"rl.kl_coef={kl_coef}",
                   "rewards.functions=[{fn: 'rl4bit.rewards:length_penalty'}]"]  # spread from step 1: something trains
    full = tmp_path / "full"
    driver.main(QUICKSTART, out=str(full), overrides=cfg)
    part = tmp_path / "part"
    driver.main(QUICKSTART, out=str(part), overrides=cfg + ["rl.steps=2"])
    driver.main(None, resume=str(part), overrides=["rl.steps=4"])
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert strip_timing(a) == strip_timing(b)
    assert any(r.get("loss", 0) != 0 for r in a[3:]), "resume equality is vacuous if nothing trains"


def test_eval_scores_a_failed_sample_as_an_empty_completion(monkeypatch):
    """A failed eval sample (finish_reason "error": a bad request, NaN logits; vLLM's keep their text) counts as
    an empty completion in eval/accuracy and eval/reward_mean, whatever partial text it carries. The samplers'
    rollouts are given (the engines' error paths are tested in tests/sampler and tests/vllm); the reward pool and
    the request building are the real ones."""
    from rl4bit import rollouts
    from rl4bit.actors import _LocalProxy
    from rl4bit.config import load_config
    from rl4bit.reward_pool import RewardPool
    from rl4bit.sampler.types import Rollout
    from rl4bit.trainer.tokenizer import build_tokenizer

    cfg = load_config(QUICKSTART)
    eval_set = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    given = [Rollout("eval-0", 0, [1], [5], "2", [-0.1], "stop", 0),
             Rollout("eval-1", 0, [1], [6], "4", [float("nan")], "error", 0, error="NaN logits")]
    monkeypatch.setattr(rollouts, "generate", lambda samplers, requests, recover=None: given)
    pool = RewardPool(["rl4bit.rewards:exact_match"], [1.0])
    try:
        m = rollouts.evaluate(cfg, build_tokenizer(), [], _LocalProxy(pool, "RewardPool"), eval_set)
    finally:
        pool.close()
    assert m["eval/accuracy"] == 0.5 and m["eval/reward_mean"] == 0.5
