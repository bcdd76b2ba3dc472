"""Run dirs: jobs started in the same second each get their own default dir; an explicit --out is unchanged."""

import threading

import pytest

from rl4bit import rundir
from rl4bit.config import JobConfig
from rl4bit.rundir import create_run_dir


@pytest.fixture
def frozen_clock(tmp_path, monkeypatch):
    """Every default dir name in the same second, under tmp_path/runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20250101-000000")
    return tmp_path / "runs"


def test_same_second_jobs_get_their_own_dirs(frozen_clock):
    cfg = JobConfig()
    dirs = [create_run_dir(cfg) for _ in range(3)]
    assert [d.name for d in dirs] == ["rl4bit-20250101-000000", "rl4bit-20250101-000000-1", "rl4bit-20250101-000000-2"]
    assert all((d / "config.yaml").is_file() and (d / "checkpoints").is_dir() for d in dirs)


def test_a_claimed_but_unwritten_default_dir_is_not_shared(frozen_clock):
    """Another job's mkdir won the name but has not written config.yaml yet: this job must not move in."""
    (frozen_clock / "rl4bit-20250101-000000").mkdir(parents=True)
    assert create_run_dir(JobConfig()).name == "rl4bit-20250101-000000-1"


def test_racing_jobs_claim_distinct_dirs(frozen_clock):
    cfg, out, errors = JobConfig(), [], []
    start = threading.Barrier(8)

    def job():
        start.wait()
        try:
            out.append(create_run_dir(cfg))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=job) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(out)) == 8


def test_explicit_out_keeps_refusing_a_used_dir(tmp_path):
    out = tmp_path / "run"
    assert create_run_dir(JobConfig(), out) == out
    with pytest.raises(FileExistsError, match="wrote no checkpoint"):
        create_run_dir(JobConfig(), out)
    (out / "checkpoints" / "latest.json").write_text("{}")
    with pytest.raises(FileExistsError, match="--resume"):
        create_run_dir(JobConfig(), out)
