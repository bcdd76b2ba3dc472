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

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")

SMALL = [
    "model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
    "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32",
    "rl.steps=2", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.ppo_epochs=2",
    "run.warmup_sft_steps=3", "run.warmup_batch_size=8", "run.cpu_threads=1", "run.progress=false",
    "data.eval_size=8", "data.eval_every=2", "run.checkpoint_every=1", "sampler.max_new_tokens=6",
    "trainer.device=cpu", "run.tensorboard=false", "ray.mode=local",
    "rewards.functions=[{fn: 'rl4bit.rewards:length_penalty'}]",  # reward spread from step 1: something trains
]
"""tests/rl's small quickstart (seconds a step), local mode, a checkpoint every step."""

TIMING = ("time/", "rollout/tokens_per_s", "sync/seconds")


def strip_timing(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


@pytest.fixture
def small():
    return list(SMALL)


@pytest.fixture
def deadline():
    """Fail (instead of hanging CI) if the test body takes more than 200 s."""
    def boom(*_):
        raise TimeoutError("reliability test exceeded its 200 s deadline")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(200)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


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
