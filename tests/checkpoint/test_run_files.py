"""The run's files under damage, kills and other users: metrics.jsonl, manifests, export temporaries, file modes.

A last metrics line cut short is dropped (damage before it is named); a manifest that does not vouch for a file
says so; a killed export's temporary copy is removed by the next export, a live writer's never; what rl4bit
writes is readable under the umask like any file (not tempfile's 0o600 / 0o700).

Run: .venv/bin/python -P -m pytest tests/checkpoint/test_run_files.py -q
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import rl4bit.common.checkpoint as ck
from rl4bit.common import atomic
from rl4bit.common import checkpoint_format as ckf
from rl4bit.common.checkpoint_format import CheckpointError
from rl4bit.metrics import MetricsLogger, read_metrics

T = {"w": torch.ones(2)}


def _record(step: int) -> str:
    return json.dumps({"step": step, "loss": float(step)}) + "\n"


def _logger(run: Path, start: int) -> MetricsLogger:
    (run / "logs").mkdir(exist_ok=True)
    return MetricsLogger(run, total_steps=30, tensorboard=False, progress=False, start_step=start)


# ------------------------------------------------------------------ metrics.jsonl


def test_a_last_metrics_line_cut_short_is_dropped_on_resume_and_read(tmp_path):
    """A crash or a full disk mid-append leaves half a line; `--resume` (truncate) and readers drop it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(_record(9) + _record(10) + _record(11) + '{"step": 12, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [9, 10, 11]
    _logger(tmp_path, 10).truncate(10)
    assert path.read_text() == _record(9) + _record(10)
    assert "line 4: dropped" in (tmp_path / "logs" / "warnings.log").read_text()


def test_metrics_damage_before_the_last_line_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_record(1) + '{"step": 2, "lo\n' + _record(3))
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"metrics\.jsonl, line 2: not a metrics record"):
        _logger(tmp_path, 3).truncate(3)
    with pytest.raises(CheckpointError, match="line 2"):
        read_metrics(tmp_path)
    assert path.read_bytes() == before, "nothing is dropped from inside the file"


# ------------------------------------------------------------------ manifest.json


def _manifest(run: Path) -> tuple[Path, dict]:
    path = run / "checkpoints" / "step_000001" / "manifest.json"
    return path, json.loads(path.read_text())


def test_a_manifest_that_does_not_list_a_file_says_so(tmp_path):
    ck.save_checkpoint(tmp_path, 1, T, {})
    path, m = _manifest(tmp_path)
    m["files"]["state.safetensorz"] = m["files"].pop("state.safetensors")
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="does not list state.safetensors") as err:
        ck.load_checkpoint(tmp_path)
    assert "truncated" not in str(err.value)


@pytest.mark.parametrize("entry", ["abc", {"bytes": "12", "sha256": "00"}, {"sha256": "00"}])
def test_a_malformed_manifest_entry_is_a_checkpoint_error(tmp_path, entry):
    ck.save_checkpoint(tmp_path, 1, T, {})
    path, m = _manifest(tmp_path)
    m["files"]["state.safetensors"] = entry
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="the entry of state.safetensors"):
        ck.load_checkpoint(tmp_path)


@pytest.mark.parametrize("world", ["two", 0, 2.5, True, 2])  # 2: a sharded manifest without its tensor index
def test_a_manifest_world_that_is_not_a_rank_count_is_damage_not_advice(tmp_path, world):
    ck.save_checkpoint(tmp_path, 1, T, {})
    path, m = _manifest(tmp_path)
    m["world"] = world
    path.write_text(json.dumps(m))
    for call in (lambda: ck.load_checkpoint(tmp_path), lambda: ck.open_checkpoint(tmp_path, world=1)):
        with pytest.raises(CheckpointError, match="manifest.json is damaged") as err:
            call()
        assert "world_size" not in str(err.value)


# ------------------------------------------------------------------ export temporaries

HOLD_LOCK = ("import fcntl, os, sys, time\n"
             "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
             "fcntl.flock(fd, fcntl.LOCK_EX)\n"
             "print('locked', flush=True)\n"
             "time.sleep(600)\n")


def test_an_export_removes_killed_exports_temporaries_and_never_a_live_writers(trainer_model, tmp_path):
    """Two other processes each writing an export to the same `out` (holding the temporary's lock, as
    `atomic.temp_dir` does); one is SIGKILLed. The next export removes the killed one's copy only."""
    model, plan = trainer_model
    out = tmp_path / "ckpt"
    temps, procs = {}, {}
    for who in ("killed", "live"):
        temps[who] = Path(tempfile.mkdtemp(prefix=".ckpt.tmp-", dir=tmp_path))
        (temps[who] / "shard-00000.tmp").write_bytes(b"x" * 1000)
        procs[who] = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(temps[who])], stdout=subprocess.PIPE,
                                      text=True)
        assert procs[who].stdout.readline() == "locked\n"
    fresh = Path(tempfile.mkdtemp(prefix=".ckpt.tmp-", dir=tmp_path))  # a writer between mkdtemp and its lock
    mine = tmp_path / ".ckpt.tmp-mine"  # a user's directory that only looks like one
    mine.mkdir()
    old = time.time() - 3600  # unchanged for longer than atomic.STALE_AFTER_S
    for d in (*temps.values(), mine):
        os.utime(d, (old, old))
    try:
        procs["killed"].send_signal(signal.SIGKILL)
        procs["killed"].wait()
        ckf.write_checkpoint(out, model, plan)
        assert not temps["killed"].exists(), "a killed export's full copy was left behind"
        assert temps["live"].is_dir() and (temps["live"] / "shard-00000.tmp").is_file(), "a live writer's was removed"
        assert fresh.is_dir() and mine.is_dir()
    finally:
        procs["live"].kill()
        procs["live"].wait()
        procs["live"].stdout.close()
        procs["killed"].stdout.close()
    ckf.write_checkpoint(out, model, plan)  # the live writer is gone now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, mine.name, "ckpt"])


# ------------------------------------------------------------------ modes


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_written_files_get_the_umask_modes_not_tempfiles_private_ones(trainer_model, tmp_path, umask_027):
    """Under umask 027 a plain open / mkdir gives 0o640 / 0o750: so must config.yaml, latest.json, metrics.jsonl
    and an export (a vLLM server or a teammate in the group reads them)."""
    model, plan = trainer_model
    atomic.atomic_write_text(tmp_path / "config.yaml", "a: 1\n")
    ck.save_checkpoint(tmp_path, 1, T, {})
    (tmp_path / "metrics.jsonl").write_text(_record(1) + _record(2))
    _logger(tmp_path, 1).truncate(1)
    out = ckf.write_checkpoint(tmp_path / "export", model, plan)
    files = [tmp_path / "config.yaml", tmp_path / "checkpoints" / "latest.json", tmp_path / "metrics.jsonl",
             *(tmp_path / "checkpoints" / "step_000001").iterdir(), *out.iterdir()]
    assert {str(f): oct(_mode(f)) for f in files if _mode(f) != 0o640} == {}
    assert oct(_mode(out)) == oct(0o750) and oct(_mode(tmp_path / "checkpoints" / "step_000001")) == oct(0o750)
