"""Shared pieces of the fault-injection tests: the small quickstart, a deadline, `rl4bit train` subprocesses.

Every test here is bounded in time (the `deadline` fixture, or a subprocess
timeout) and kills what it started by process id (never by name).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..rl.conftest import QUICKSTART, deadline_of, learned, strip_timing  # noqa: F401 (re-exported for the tests)
from ..rl.conftest import SMALL as RL_SMALL

SMALL = RL_SMALL + [
    "run.checkpoint_every=1", "run.tensorboard=false", "ray.mode=local",
    "rewards.functions=[{fn: 'rl4bit.rewards:length_penalty'}]",  # reward spread from step 1: something trains
]
"""tests/rl's small quickstart (seconds a step), local mode, a checkpoint every step (later overrides win)."""


@pytest.fixture
def small():
    return list(SMALL)


@pytest.fixture
def deadline():
    """Fail (instead of hanging CI) if the test body takes more than 200 s."""
    with deadline_of(200, "reliability test"):
        yield


def cli_args(*args: str, overrides=()) -> list[str]:
    out = [str(Path(sys.executable).with_name("rl4bit")), *args]
    for o in overrides:
        out += ["-o", o]
    return out


def start(args: list[str], **env) -> subprocess.Popen:
    """A child in its own session (so `kill_group` reaps it and everything it started, Ray included)."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **env})


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """Wait at most `timeout` s; on expiry kill the child's process group (by its id) and fail."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"subprocess exceeded {timeout} s\n{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group id is the child's pid (start_new_session)
    except ProcessLookupError:
        pass
