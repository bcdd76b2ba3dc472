"""Full training-state checkpoints: safetensors + JSON, checksummed, written atomically, nothing pickled.

    save_checkpoint(run_dir, step, tensors, meta, keep=2)  -> RUN_DIR/checkpoints/step_000010/
    tensors, meta = load_checkpoint(run_dir)               # the latest one, verified

One process: a checkpoint directory holds `state.safetensors` (model weights,
AdamW moments and step counts, torch RNG states: whatever tensors the caller
gives), `state.json` (step, policy version, data position, Python RNG state,
...) and `manifest.json` (format version, SHA-256 and byte size of both).

Sharded trainer (`trainer.world_size` = N > 1, rl4bit.trainer_group): the same
directory, pointer, manifest and errors; the tensors are N files
`shard_RRRRR.safetensors` that the ranks write themselves into the temporary
directory (`begin_checkpoint`), and `commit_checkpoint` adds `state.json` and
a manifest that also holds `world` and the per-rank tensor index (`tensors`:
global shape, dtype, each rank's dim-0 rows; see rl4bit.trainer.sharding).
`open_checkpoint` verifies the manifest and state.json; each rank verifies its
own shard with `read_verified` (in parallel: no process reads all shards).

Writing: under a temporary name, every file fsynced, then renamed into place
(`rl4bit.common.atomic.replace_dir`), and `checkpoints/latest.json` is replaced
atomically last, so a crash at any point leaves the previous checkpoint intact
and pointed to. A failed save removes its temporary directory; a save that
begins clears any `.step_*.tmp` a killed one left. A write the system refuses
(disk full, quota, permissions: OSError) is a CheckpointError naming the step,
the cause, the size it tried to write and the checkpoint still pointed to.

Rotation (after the pointer moved): the newest `keep` checkpoints up to the
one just written are kept, ordered by step number (not name: step_1000000 is
newer than step_999999), and the one latest.json names is never deleted.
Checkpoints newer than the step just written are deleted: they belong to an
abandoned timeline (the run resumed from an older checkpoint, e.g. after a
crash between renaming step_N into place and moving the pointer), and left
there they would be picked up again as "the newest".

Loading verifies against the manifest: a truncated or corrupted file (or a
manifest that does not list it, or whose `world` is not a rank count) raises
CheckpointError naming it and the intact previous checkpoint; deleting the bad
directory makes `load_checkpoint` (and `--resume`) fall back to the newest
remaining one. Files come only from safetensors and JSON parsers: no pickle.

Leaves out: resuming on another world size (refused, naming the one to use),
asynchronous saves, remote storage, the quantized export (`rl4bit export`,
with its own per-shard checksums).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rl4bit.common.atomic import atomic_write_text, fsync_tree, replace_dir, restore_dir
from rl4bit.common.checkpoint_format import CheckpointError

FORMAT = 2
STATE, MANIFEST = "state.json", "manifest.json"


def shard_file(rank: int) -> str:
    """A sharded checkpoint's tensor file of `rank`."""
    return f"shard_{rank:05d}.safetensors"


def _dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_of(p: Path) -> int | None:
    """The step of a checkpoint directory `step_NNNNNN` (any number of digits), None for anything else."""
    m = re.fullmatch(r"step_(\d+)", p.name)
    return int(m.group(1)) if m and p.is_dir() else None


def step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under `root` (RUN_DIR/checkpoints), oldest step first."""
    return sorted((p for p in root.glob("step_*") if step_of(p) is not None), key=step_of)


def _pointed(root: Path) -> str | None:
    """The directory name latest.json holds, None when it is missing or damaged."""
    try:
        name = json.loads((root / "latest.json").read_text())["dir"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if isinstance(name, str) else None


def _write(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def save_checkpoint(run_dir: str | Path, step: int, tensors: dict[str, torch.Tensor], meta: dict,
                    keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and prune to the newest `keep`; returns its directory."""
    tmp = begin_checkpoint(run_dir, step)
    try:
        files = {"state.safetensors": _write(tmp / "state.safetensors",
                                             st_save({k: v.contiguous() for k, v in tensors.items()}))}
    except BaseException as e:  # a full copy of the training state: do not leave it behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            raise _unwritten(tmp.parent, step, e, size) from e
        raise
    return commit_checkpoint(tmp, step, meta, files, keep=keep)


def _unwritten(root: Path, step: int, err: OSError, size: int | None = None) -> CheckpointError:
    """The error of a checkpoint write the system refused (`err`: ENOSPC, EDQUOT, EACCES...): its temporary
    directory is already gone and the pointer did not move, so the checkpoint latest.json names is what a
    resume loads."""
    pointed = _pointed(root)
    need = "" if not size else (f" ({size / 2**30:.2f} GiB of tensors)" if size >= 2**30 else
                                f" ({size / 2**20:.1f} MiB of tensors)")
    then = (f"{root / pointed} is still the latest checkpoint (what --resume loads). Free space there (or lower "
            f"run.keep_checkpoints), then continue: rl4bit train --resume {root.parent}" if pointed else
            "the run has no earlier checkpoint to resume from. Free space there, then start it again into a new --out")
    return CheckpointError(f"writing checkpoint step {step}{need} into {root} failed: {err.strerror or err}; {then}")


def begin_checkpoint(run_dir: str | Path, step: int) -> Path:
    """A fresh, empty temporary directory for checkpoint `step` (`checkpoints/.step_NNNNNN.tmp`).

    Removes every `.step_*.tmp` left by a save that was killed: saves run one at a time, so none is in use."""
    root = _dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp"):
        shutil.rmtree(stale)
    tmp = root / f".step_{step:06d}.tmp"
    tmp.mkdir()
    return tmp


def commit_checkpoint(tmp: Path, step: int, meta: dict, files: dict[str, dict], *, keep: int = 2,
                      index: dict | None = None) -> Path:
    """Add state.json and manifest.json to `tmp`, fsync it, swap it in as `step_NNNNNN`, move latest.json, prune.

    `files`: {name: {"sha256", "bytes"}} of the tensor files already in `tmp`;
    `index`: extra manifest entries of a sharded checkpoint ({"world", "tensors"}).
    Pruning (`prune`) also deletes checkpoints newer than `step`: an abandoned timeline.
    On failure before the swap, `tmp` is removed."""
    root, name = tmp.parent, f"step_{step:06d}"
    final = root / name
    try:
        state = json.dumps({"format": FORMAT, "step": step, **meta}, indent=1).encode()
        files = {**files, STATE: _write(tmp / STATE, state)}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files, **(index or {})}, indent=1))
        fsync_tree(tmp)
        replace_dir(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _unwritten(root, step, e) from e
        raise
    try:
        atomic_write_text(root / "latest.json", json.dumps({"step": step, "dir": name}))
    except OSError as e:  # step_N is whole on disk but not pointed to: the next save or resume ignores it
        raise _unwritten(root, step, e) from e
    prune(root, step, keep)
    return final


def prune(root: Path, step: int, keep: int) -> None:
    """Delete the checkpoints in `root` newer than `step` (an abandoned timeline) and all but the newest `keep`
    up to `step`, by step number; the directory latest.json names and `step_NNNNNN` of `step` are never deleted."""
    spared = {f"step_{step:06d}", _pointed(root)}
    dirs = step_dirs(root)
    upto = [p for p in dirs if step_of(p) <= step]
    doomed = [p for p in dirs if step_of(p) > step] + upto[:-max(keep, 1)]
    for old in doomed:
        if old.name not in spared:
            shutil.rmtree(old)


def _previous(root: Path, ckpt: Path) -> str:
    mine = step_of(ckpt)
    older = [p for p in step_dirs(root) if mine is not None and step_of(p) < mine]
    if not older:
        return "no earlier checkpoint is on disk; start the run again"
    return (f"the previous checkpoint {older[-1]} is intact: delete {ckpt} and resume "
            f"(--resume falls back to the newest checkpoint left)")


def _bad(ckpt: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{what}; {_previous(ckpt.parent, ckpt)}")


def read_manifest(ckpt: str | Path) -> dict:
    """A checkpoint directory's manifest.json (CheckpointError when missing or not rl4bit's JSON)."""
    ckpt = Path(ckpt)
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        if not isinstance(manifest["files"], dict):
            raise TypeError
    except FileNotFoundError:
        raise _bad(ckpt, f"{ckpt / MANIFEST} is missing (an incomplete checkpoint or one from an older "
                         "rl4bit)") from None
    except (ValueError, KeyError, TypeError):
        raise _bad(ckpt, f"{ckpt / MANIFEST} is corrupt (not the JSON rl4bit writes)") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise _bad(ckpt, f"{ckpt / MANIFEST} is damaged: {problem}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    """What keeps a parsed manifest's `world` and `tensors` from being what `commit_checkpoint` writes, or None.

    Checked before `world` is used (in a world-size refusal's advice, as the number of shards to read)."""
    world = manifest.get("world", 1)
    if type(world) is not int or world < 1:
        return f"world {world!r} is not a number of trainer ranks"
    if world == 1:
        return None
    tensors = manifest.get("tensors")
    if not isinstance(tensors, dict) or not all(isinstance(e, dict) and type(e.get("sharded")) is bool
                                                for e in tensors.values()):
        return "a sharded checkpoint's tensor index (tensors: {name: {sharded, ...}}) is missing or malformed"
    return None


def read_verified(ckpt: str | Path, name: str, manifest: dict | None = None) -> bytes:
    """The bytes of file `name` of a checkpoint, checked against its manifest (size, then SHA-256).

    CheckpointError naming the file and the intact previous checkpoint when it is missing, truncated or corrupted."""
    ckpt = Path(ckpt)
    files = (manifest if manifest is not None else read_manifest(ckpt))["files"]
    want = files.get(name)
    if want is None:  # the data file may be whole; the manifest cannot vouch for it
        raise _bad(ckpt, f"{ckpt / MANIFEST} does not list {name} (the manifest is damaged, so {name} cannot be "
                         "verified)")
    if not (isinstance(want, dict) and type(want.get("bytes")) is int and isinstance(want.get("sha256"), str)):
        raise _bad(ckpt, f"{ckpt / MANIFEST}: the entry of {name} is {want!r}, not {{\"sha256\": ..., \"bytes\": ...}} "
                         "(the manifest is damaged)")
    path = ckpt / name
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _bad(ckpt, f"{path} is missing") from None
    if len(data) != want["bytes"]:
        raise _bad(ckpt, f"{path}: {len(data)} bytes, the manifest says {want['bytes']} (truncated or overwritten)")
    if hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise _bad(ckpt, f"{path}: SHA-256 does not match the manifest (the file is corrupted)")
    return data


def latest_dir(run_dir: str | Path) -> Path:
    """The directory latest.json names; the newest one left when it was deleted (after a corruption report).

    FileNotFoundError when the run has none."""
    root = _dir(run_dir)
    pointer = root / "latest.json"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir} has no checkpoint ({pointer} is missing); it stopped before "
                                "run.checkpoint_every steps")
    ckpt = root / (_pointed(root) or "?")
    restore_dir(ckpt)  # a crash mid-swap of a rewritten step directory left it aside
    if not ckpt.is_dir():  # deleted by hand after a corruption report, or a damaged pointer: newest left
        left = step_dirs(root)
        if not left:
            raise FileNotFoundError(f"{run_dir} has no checkpoint left in {root}")
        ckpt = left[-1]
    return ckpt


def open_checkpoint(run_dir: str | Path, world: int | None = 1) -> tuple[Path, dict, dict]:
    """(directory, manifest, state.json) of the latest checkpoint, written by `world` trainer ranks (None: any);
    state.json verified.

    The tensor files are not read here: `load_checkpoint`, or each rank (`read_verified` of its shard), checks them."""
    ckpt = latest_dir(run_dir)
    manifest = read_manifest(ckpt)
    written = manifest.get("world", 1)  # an int >= 1: read_manifest checked it
    if world is not None and written != world:
        raise CheckpointError(f"{ckpt} was written by {written} trainer rank(s), this job has {world}; "
                              f"resume with -o trainer.world_size={written} (resharding is not supported)")
    meta = json.loads(read_verified(ckpt, STATE, manifest))
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: checkpoint format {meta.get('format')} is not {FORMAT} "
                              "(written by another rl4bit version)")
    return ckpt, manifest, meta


def load_checkpoint(run_dir: str | Path, world: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, meta) of the latest checkpoint of a run dir, checksums verified.

    A sharded checkpoint's tensors are joined here: dim-0 pieces concatenated
    in rank order (the manifest's rows), replicated ones (RNG, AdamW step) as
    rank 0 wrote them; that is the full state, e.g. for `rl4bit export`.
    `world`: refuse a checkpoint of another number of trainer ranks (the
    one-process resume passes 1). FileNotFoundError when the run has none;
    CheckpointError naming a corrupt or truncated file (and the intact previous checkpoint)."""
    ckpt, manifest, meta = open_checkpoint(run_dir, world)
    written = manifest.get("world", 1)
    if written == 1:
        return st_load(read_verified(ckpt, "state.safetensors", manifest)), meta
    shards = [st_load(read_verified(ckpt, shard_file(r), manifest)) for r in range(written)]
    return {k: torch.cat([s[k] for s in shards]) if e["sharded"] else shards[0][k]
            for k, e in manifest["tensors"].items()}, meta
