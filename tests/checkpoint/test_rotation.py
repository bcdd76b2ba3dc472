"""Training-checkpoint rotation and leftovers: which step directories a save keeps, deletes and cleans up.

The newest `keep` up to the step just written are kept, by step number; the one latest.json names is never
deleted; newer ones (an abandoned timeline after a resume from an older checkpoint) are deleted; a failed
or killed save leaves no `.step_*.tmp` behind.

Run: .venv/bin/python -P -m pytest tests/checkpoint/test_rotation.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rl4bit.common.checkpoint as ck
from rl4bit.common.checkpoint_format import CheckpointError

T = {"w": torch.ones(2)}


def _dirs(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name != "latest.json")


def _pointer(run_dir) -> str:
    return json.loads((run_dir / "checkpoints" / "latest.json").read_text())["dir"]


def test_resume_from_older_checkpoint_drops_the_abandoned_timeline(tmp_path, monkeypatch):
    ck.save_checkpoint(tmp_path, 10, T, {}, keep=1)

    def killed(*_):  # step_000020 is renamed into place, then the process dies before moving the pointer
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:
        m.setattr(ck, "atomic_write_text", killed)
        with pytest.raises(KeyboardInterrupt):
            ck.save_checkpoint(tmp_path, 20, T, {}, keep=1)
    assert _dirs(tmp_path) == ["step_000010", "step_000020"]
    assert ck.latest_dir(tmp_path).name == "step_000010"  # resume: the pointer still names step 10

    ck.save_checkpoint(tmp_path, 15, {"w": torch.full((2,), 15.0)}, {}, keep=1)  # the resumed run's next save
    assert _dirs(tmp_path) == ["step_000015"], "step 20 belongs to the abandoned run; step 15 must survive keep=1"
    assert _pointer(tmp_path) == "step_000015"
    tensors, meta = ck.load_checkpoint(tmp_path)
    assert meta["step"] == 15 and tensors["w"].tolist() == [15.0, 15.0]


def test_rotation_orders_steps_by_number_not_name(tmp_path):
    for step in (999_998, 999_999, 1_000_000):  # "step_1000000" < "step_999999" as strings
        ck.save_checkpoint(tmp_path, step, T, {}, keep=2)
    assert _dirs(tmp_path) == ["step_1000000", "step_999999"]
    assert ck.load_checkpoint(tmp_path)[1]["step"] == 1_000_000


def test_fallbacks_order_steps_by_number(tmp_path):
    for step in (999_999, 1_000_000):
        ck.save_checkpoint(tmp_path, step, T, {}, keep=2)
    bad = tmp_path / "checkpoints" / "step_1000000" / "state.safetensors"
    bad.write_bytes(bad.read_bytes()[:-5])
    with pytest.raises(ck.CheckpointError, match="step_999999 is intact"):
        ck.load_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps({"step": 5, "dir": "step_gone"}))
    assert ck.latest_dir(tmp_path).name == "step_1000000", "a damaged pointer falls back to the newest step"


def test_prune_spares_the_directory_latest_json_names(tmp_path):
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, T, {}, keep=3)
    (tmp_path / "checkpoints" / "latest.json").write_text(json.dumps({"step": 1, "dir": "step_000001"}))
    ck.prune(tmp_path / "checkpoints", 3, keep=1)
    assert _dirs(tmp_path) == ["step_000001", "step_000003"]


@pytest.mark.parametrize("where", ["tensors", "swap"])
def test_a_failed_save_leaves_no_temporary_directory(tmp_path, monkeypatch, where):
    ck.save_checkpoint(tmp_path, 1, T, {})

    def disk_full(*_):
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ck, "_write" if where == "tensors" else "replace_dir", disk_full)
        with pytest.raises(CheckpointError, match=r"writing checkpoint step 2 .*failed: disk full; .*step_000001 is "
                                                  r"still the latest checkpoint"):
            ck.save_checkpoint(tmp_path, 2, T, {})
    assert _dirs(tmp_path) == ["step_000001"], "the failed save's full training state was left behind"
    assert ck.load_checkpoint(tmp_path)[1]["step"] == 1


def test_a_save_clears_temporary_directories_of_killed_saves(tmp_path):
    ck.save_checkpoint(tmp_path, 1, T, {})
    for step in (2, 7):  # a killed process cannot clean up: the next save does
        stale = tmp_path / "checkpoints" / f".step_{step:06d}.tmp"
        stale.mkdir()
        (stale / "state.safetensors").write_bytes(b"x" * 100)
    ck.save_checkpoint(tmp_path, 3, T, {}, keep=5)
    assert _dirs(tmp_path) == ["step_000001", "step_000003"]


def test_a_failed_sharded_save_leaves_no_tmp_dir(tmp_path):
    """A rank that fails while writing its shard: the group's save removes the temporary directory (the shards
    already there are a copy of the training state) and re-raises."""
    from types import SimpleNamespace

    from rl4bit.trainer_group import TrainerGroup

    def fail(method, tmp):
        (Path(tmp) / "shard_00000.safetensors").write_bytes(b"partial")
        raise RuntimeError("rank 1 died while saving")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        TrainerGroup.save_checkpoint(SimpleNamespace(_all=fail), tmp_path, 3, {})
    assert not list((tmp_path / "checkpoints").glob(".step_*.tmp"))


def test_a_failed_first_save_does_not_advise_a_resume(tmp_path, monkeypatch):
    def disk_full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck, "_write", disk_full)
    with pytest.raises(CheckpointError, match="no earlier checkpoint to resume from.*start it again into a new --out"):
        ck.save_checkpoint(tmp_path, 1, T, {})
    assert not (tmp_path / "checkpoints" / "latest.json").exists()
