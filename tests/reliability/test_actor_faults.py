"""Killed actors in a real Ray run: a Sampler SIGKILLed mid-rollout is restarted and the job loses nothing; a
Trainer SIGKILLed stops the job with an error naming it, and `--resume` continues from the last checkpoint.

One `rl4bit train` subprocess (Ray caches its auth token per process, and a user runs it so), faults injected
from outside with SIGKILL on the actor processes (found by an environment tag and Ray's process title), then
the resumed run is compared with an uninterrupted one: every non-timing metric equal.
"""

import json
import os
import signal
import threading
import time
import uuid

import pytest

from rl4bit import driver
from rl4bit.metrics import read_metrics

from .conftest import QUICKSTART, cli_args, finish, learned, start

STEPS = 3


def _title(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None


def _tagged(tag: str) -> list[int]:
    """Pids of every process carrying RL4BIT_TEST_TAG=tag in its environment."""
    needle, found = f"RL4BIT_TEST_TAG={tag}".encode(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


class Killer(threading.Thread):
    """Kills, in order, the first process titled like each `(title prefix, ready())` once ready() holds.

    A step's generate on the tiny model is short, so the titles of the tagged processes are polled every
    few milliseconds from a cached pid list (a scan of /proc, slow on a loaded machine, refreshes it twice
    a second): a scan per poll could miss a whole generate under load.
    """

    def __init__(self, tag, plan):
        super().__init__(daemon=True)
        self.tag, self.plan, self.killed, self.stop = tag, list(plan), [], False

    def run(self):
        pids, scanned = [], 0.0
        while self.plan and not self.stop:
            if time.monotonic() - scanned > 0.5:
                pids, scanned = _tagged(self.tag), time.monotonic()
            prefix, ready = self.plan[0]
            if ready():
                for pid in pids:
                    title = _title(pid)
                    if title is not None and title.startswith(prefix):
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append((prefix, pid))
                        self.plan.pop(0)
                        break
            time.sleep(0.005)


def _lines(path):
    return path.read_text().count("\n") if path.exists() else 0


def _checkpointed(run_dir, step):
    p = run_dir / "checkpoints" / "latest.json"
    try:
        return json.loads(p.read_text())["step"] >= step
    except (OSError, ValueError):
        return False


@pytest.mark.slow
def test_sampler_killed_mid_rollout_then_trainer_killed_then_resume(tmp_path, small, deadline):
    pytest.importorskip("ray")
    # 16 tokens a completion, no early stop: step 1's generate lasts long enough for the killer to see it
    cfg = small + [f"rl.steps={STEPS}", "data.eval_every=10", "sampler.max_new_tokens=16", "sampler.ignore_eos=true"]
    killed_dir, tag = tmp_path / "killed", uuid.uuid4().hex
    proc = start(cli_args("train", QUICKSTART, "--out", str(killed_dir),
                          overrides=cfg + ["ray.mode=ray", "ray.num_cpus=2"]),
                 RL4BIT_TEST_TAG=tag)
    killer = Killer(tag, [
        # step 1's rollouts: step 0 (the eval) is logged, so the next generate is step 1's
        ("ray::Sampler.generate", lambda: _lines(killed_dir / "metrics.jsonl") >= 1),
        # step 2's train_step: step 1 is checkpointed
        ("ray::Trainer.train_step", lambda: _checkpointed(killed_dir, 1)),
    ])
    killer.start()
    try:
        code, out, err = finish(proc, timeout=170)
    finally:
        killer.stop = True
    killed = [k[0] for k in killer.killed]
    assert killed == ["ray::Sampler.generate", "ray::Trainer.train_step"], (killer.killed, err[-3000:])
    assert code == 1, err[-3000:]
    assert "the Sampler actor died" in err and "redoing the rollouts" in err, err[-3000:]
    assert "rl4bit train: error: the Trainer actor died" in err, err[-3000:]
    assert f"rl4bit train --resume {killed_dir}" in err and "step 1" in err, err[-3000:]
    before = read_metrics(killed_dir)
    assert [r["step"] for r in before] == [0, 1] and before[1]["rollout/sampler_restarts"] == 1.0

    # --resume (in this process, local mode: the resume path does not depend on the mode) finishes the job
    assert driver.main(None, resume=str(killed_dir), overrides=["ray.mode=local"]) == 0
    full = tmp_path / "full"
    assert driver.main(QUICKSTART, out=str(full), overrides=cfg) == 0
    # the resumed steps ran in local mode (direct in-process weight sync), the reference run under Ray (buckets):
    # the sync path and its byte count differ by design; what was learned must not
    got = learned(read_metrics(killed_dir), also=("rollout/sampler_restarts",))
    want = learned(read_metrics(full), also=("rollout/sampler_restarts",))
    assert [r["step"] for r in got] == list(range(STEPS + 1))
    assert got == want, ("a killed sampler and a killed trainer must lose nothing: "
                         "metrics differ from an uninterrupted run")
    assert any(r.get("loss", 0) != 0 for r in want[1:]), "equality is vacuous if nothing trains"
