"""Atomic file writes: write a temporary sibling, fsync it, rename over the target, fsync the directory.

A reader (or a resumed run) sees either the old file or the new one, never a
torn write, even if the process is killed mid-write. Directories (checkpoints,
exports) are written to a temporary sibling, synced with `fsync_tree`, and
swapped in with `replace_dir`; a crash between its two renames leaves only the
hidden previous copy, which `restore_dir` (run by `replace_dir` and by the
export and checkpoint readers) puts back. Leaves out: cross-device moves (the
temporary always sits beside its target).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file directly inside `path`, then `path` itself."""
    for f in Path(path).iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


HOLDER = ".{name}.old-"
"""Prefix of the directory (`tempfile.mkdtemp`, beside `out`) that `replace_dir` moves an existing `out` into."""


def _holders(out: Path) -> list[Path]:
    """`replace_dir`'s holders of `out`: directories named HOLDER + mkdtemp's 8-character suffix holding nothing but
    `out.name` (or nothing: emptied), newest first. A user's own `.NAME.old-*` is not one unless it has exactly
    that form and content."""
    prefix = HOLDER.format(name=out.name)
    held = []
    for d in out.parent.glob(glob.escape(prefix) + "*"):
        if not re.fullmatch(re.escape(prefix) + r"[a-z0-9_]{8}", d.name):
            continue
        try:
            inside = [c.name for c in d.iterdir()] if d.is_dir() and not d.is_symlink() else None
            if inside is not None and inside in ([], [out.name]):
                held.append((d.stat().st_mtime_ns, d))
        except OSError:  # gone meanwhile (another process's clean-up)
            continue
    return [d for _, d in sorted(held, reverse=True)]


def restore_dir(out: str | Path) -> bool:
    """Put back the previous copy of `out` when a crash between `replace_dir`'s two renames left `out` missing
    (that copy sits in a holder beside it); True when it did. Readers call it: it only ever renames a holder's
    copy back to a missing `out`, never deletes (`replace_dir` removes spent holders). Two readers restoring at
    once: one renames, the other finds `out` back.

    Leaves out: a reader racing a writer in another process. The reader may put the old copy back between the
    writer's two renames; the writer's second rename then fails and the old copy stays: no version is lost."""
    out = Path(out)
    if out.exists() or not out.parent.is_dir():
        return False
    held = [d for d in _holders(out) if (d / out.name).is_dir()]
    if not held:
        return False
    try:
        os.rename(held[0] / out.name, out)
    except OSError:  # another reader restored it first (or the writer renamed its new copy in)
        return False
    fsync_dir(out.parent)
    return True


def replace_dir(tmp: str | Path, out: str | Path) -> None:
    """Rename the finished directory `tmp` over `out`.

    An existing `out` is moved aside first and deleted only once the new one is
    in place, so at every instant one complete version exists on disk (between
    the two renames, only aside: `restore_dir` puts it back).
    """
    tmp, out = Path(tmp), Path(out)
    restore_dir(out)
    for spent in _holders(out):  # an earlier swap's, left by a crash after its second rename
        shutil.rmtree(spent, ignore_errors=True)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=HOLDER.format(name=out.name), dir=out.parent))
        os.rename(out, old / out.name)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
