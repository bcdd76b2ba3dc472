"""Reward failures are counted by kind, logged with the user's line, run side by side, and reported by evaluation.

Real worker processes run a reward file written here. Timing margins are 2 s or more (2 shared cores).
"""

import json
import time

import pytest

from rl4bit import driver
from rl4bit.reward_log import RewardLog, failure_metrics
from rl4bit.reward_pool import ERROR_KINDS, RewardPool
from rl4bit.rewards import RewardError

from .conftest import QUICKSTART, SMALL

FAILING = '''import math, os, time


def r(prompt, completion, **sample):
    if prompt == "raise":
        return {}["no such key"]  # line 6
    if prompt == "type":
        return "0.5"
    if prompt == "nan":
        return math.nan
    if prompt == "hang":
        time.sleep(60)
    if prompt == "die":
        os._exit(3)
    return 1.0
'''


def test_every_failure_is_counted_by_kind_and_logged_with_the_users_line(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(FAILING)
    prompts = ["ok", "raise", "type", "nan", "hang", "die", "ok"]
    pool = RewardPool([f"{f}:r"], [1.0], workers=2, timeout_s=2.0, max_error_fraction=1.0)
    try:
        s = pool.score([(p, "c", {}) for p in prompts])
    finally:
        pool.close()
    assert s.totals == [1.0, None, None, None, None, None, 1.0], s.messages
    assert s.kinds == {"raised": 1, "timeout": 1, "type": 1, "nonfinite": 1, "died": 1}
    by_kind = {x.kind: x for x in s.failures}
    assert by_kind["raised"].where.startswith(f"{f}:6 in r: return {{}}[\"no such key\"]"), by_kind["raised"].where
    assert "KeyError" in by_kind["raised"].message
    assert "timed out after 2.0 s" in by_kind["timeout"].message
    assert failure_metrics(s, "reward_errors") == {f"reward_errors/{k}": 1.0 for k in ERROR_KINDS}

    (tmp_path / "logs").mkdir()
    line = RewardLog(tmp_path).write(3, "train", s)
    assert line.startswith("step 3 train: 5 of 7 samples failed to score (1 raised, 1 timeout, 1 type, "
                           "1 nonfinite, 1 died)")
    log = (tmp_path / "logs" / "rewards.log").read_text()
    assert f"[raised] sample 1: reward '{f}:r': KeyError: 'no such key' at {f}:6 in r" in log, log
    assert "[timeout] sample 4:" in log and "(prompt 'hang')" in log


def test_past_the_error_fraction_the_message_counts_the_kinds_and_names_the_line(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(FAILING)
    pool = RewardPool([f"{f}:r"], [1.0], workers=1, timeout_s=5.0, max_error_fraction=0.1)
    try:
        with pytest.raises(RewardError, match=r"2/3 samples failed to score \(1 raised, 1 type; .*first: .*KeyError"
                                              rf".* at {f}:6 in r"):
            pool.score([(p, "c", {}) for p in ("raise", "type", "ok")])
    finally:
        pool.close()


def test_hung_calls_run_side_by_side_up_to_the_pool_size(tmp_path):
    """8 hung calls, 4 workers, timeout 1 s, each worker restart importing for 2 s: two rounds of four side by
    side take about 1 + 2 + 1 (+ 2) s (the restarts of a round overlap, and the other workers never wait for
    them); restarting the timed-out workers one after another took 1 + 4 x 2 + 1 + 4 x 2 = 18 s. The bound
    sits between the two with room for process start-up on a loaded 2-core machine."""
    marker = tmp_path / "started_once"
    f = tmp_path / "hangs.py"
    f.write_text(f"import os, time\nif os.path.exists({str(marker)!r}):\n    time.sleep(2.0)\n"
                 f"open({str(marker)!r}, 'w').close()\n"
                 "def r(prompt, completion, **s):\n    time.sleep(60)\n")
    pool = RewardPool([f"{f}:r"], [1.0], workers=4, timeout_s=1.0, max_error_fraction=1.0)
    try:
        t0 = time.monotonic()
        s = pool.score([(f"p{i}", "c", {}) for i in range(8)])
        elapsed = time.monotonic() - t0
    finally:
        pool.close()
    assert s.kinds["timeout"] == 8 and all("timed out after 1.0 s" in m for m in s.messages)
    assert elapsed < 12.0, f"8 hung calls on 4 workers took {elapsed:.1f} s"


def test_a_run_reports_reward_failures_in_metrics_log_and_eval(tmp_path):
    """A reward that raises on odd answers: every step's and every evaluation's failures are counted in the
    metrics, written to logs/rewards.log, and evaluation says how many samples its reward mean left out."""
    f = tmp_path / "odd.py"
    f.write_text("def r(prompt, completion, answer=None, **s):\n"
                 "    if int(answer) % 2:\n"
                 "        raise ValueError('odd answer')\n"
                 "    return 1.0\n")
    out = tmp_path / "run"
    driver.main(QUICKSTART, out=str(out), overrides=SMALL + [
        "rl.steps=1", "run.warmup_sft_steps=0", "rewards.max_error_fraction=1.0", "ray.mode=local",
        "data.eval_every=1", f"rewards.functions=[{{fn: '{f}:r'}}]"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = records[-1]
    assert step["reward_errors/raised"] > 0 and step["reward_errors/raised"] == step["reward/errors"]
    assert step["reward_errors/timeout"] == 0
    for r in records:  # step 0's evaluation and step 1's
        assert r["eval/reward_dropped"] == r["eval/reward_errors/raised"] > 0
        assert r["eval/rollout_errors"] == 0
    log = (out / "logs" / "rewards.log").read_text()
    assert "step 0 eval:" in log and "step 1 train:" in log and f"at {f}:3 in r" in log


def test_a_run_that_fails_keeps_its_error(tmp_path):
    """Every reward call after the start-up check fails: the job stops at its first evaluation, and the run dir
    keeps the traceback in logs/error.txt."""
    f = tmp_path / "fails_later.py"
    f.write_text("import os\nCALLS = [0]\n"
                 "def r(prompt, completion, **s):\n"
                 f"    if os.path.exists({str(tmp_path / 'checked')!r}):\n"
                 "        raise RuntimeError('reward service down')\n"
                 f"    open({str(tmp_path / 'checked')!r}, 'w').close()\n"
                 "    return 1.0\n")
    out = tmp_path / "run"
    with pytest.raises(RewardError, match="reward service down"):
        driver.main(QUICKSTART, out=str(out), overrides=SMALL + [
            "rl.steps=1", "run.warmup_sft_steps=0", "ray.mode=local", f"rewards.functions=[{{fn: '{f}:r'}}]"])
    text = (out / "logs" / "error.txt").read_text()
    assert "RewardError" in text and "reward service down" in text and "Traceback" in text
