"""Full training-state checkpoints: safetensors + JSON, written atomically, nothing pickled.

    save_checkpoint(run_dir, step, tensors, meta, keep=2)  -> RUN_DIR/checkpoints/step_000010/
    tensors, meta = load_checkpoint(run_dir)               # the latest one

A checkpoint directory holds `state.safetensors` (model weights, AdamW moments
and step counts, torch RNG states: whatever tensors the caller gives) and
`state.json` (step, policy version, data position, Python RNG state, ...).
It is written under a temporary name, every file fsynced, then renamed into
place, and `checkpoints/latest.json` is replaced atomically last, so a crash
at any point leaves the previous checkpoint intact and pointed to. Only the
newest `keep` checkpoints are kept.

Leaves out: sharded or asynchronous saves, remote storage, the quantized
export (`rl4bit export`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rl4bit.atomic import atomic_write_text, fsync_tree, replace_dir

FORMAT = 1


def _dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep`; returns its directory."""
    root = _dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "state.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "step": step, **meta}, indent=1))
    fsync_tree(tmp)
    replace_dir(tmp, final)
    atomic_write_text(root / "latest.json", json.dumps({"step": step, "dir": name}))
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of the latest checkpoint of a run dir; FileNotFoundError says what is missing."""
    root = _dir(run_dir)
    pointer = root / "latest.json"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({pointer} is missing); it stopped before run.checkpoint_every steps")
    ckpt = root / json.loads(pointer.read_text())["dir"]
    meta = json.loads((ckpt / "state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{ckpt}: checkpoint format {meta.get('format')} is not {FORMAT} (written by another rl4bit version)")
    return load_file(str(ckpt / "state.safetensors")), meta
