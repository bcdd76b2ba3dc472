"""Atomic file writes: write a temporary sibling, fsync it, rename over the target, fsync the directory.

A reader (or a resumed run) sees either the old file or the new one, never a
torn write, even if the process is killed mid-write. Directories (checkpoints,
exports) are written to a temporary sibling, synced with `fsync_tree`, and
swapped in with `replace_dir`; a crash between its two renames leaves only the
hidden previous copy, which `restore_dir` (run by `replace_dir` and by the
export and checkpoint readers) puts back. `temp_dir` makes such a temporary
directory, locked while its writer lives, and first removes those of writers
that were killed (`clear_stale_temps`).

What is written gets the modes of a plain `open` / `mkdir` (0o666 / 0o777 less
the umask), not tempfile's private 0o600 / 0o700, so a server or a teammate
under another uid reads it as it would any file of the run.

Leaves out: cross-device moves (the temporary always sits beside its target);
the few-byte temporaries of `atomic_write_bytes` that a kill leaves (removed
only on an exception).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

_UMASK_AT_IMPORT = os.umask(0)
os.umask(_UMASK_AT_IMPORT)


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc/self/status; elsewhere the one at import:
    setting it to read it would, for that instant, let other threads create files writable by anyone)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return _UMASK_AT_IMPORT


def public_mode(directory: bool = False) -> int:
    """The mode `open` (0o666) or `mkdir` (0o777) would give under the umask; what tempfile's 0o600 / 0o700
    temporaries are set to before they are renamed into place. Not the replaced file's own mode: files that an
    earlier rl4bit wrote 0o600 would keep it on every rewrite."""
    return (0o777 if directory else 0o666) & ~umask()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` atomically (see the module docstring), with `public_mode()`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), public_mode())
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


TEMP = ".{name}.tmp-"
"""Prefix of the temporary directory (`tempfile.mkdtemp`, beside `out`) that `temp_dir` makes for writing `out`."""
STALE_AFTER_S = 60.0
"""An unlocked temporary directory this much older than its last change is a killed writer's: the grace covers
the instant between a writer's `mkdtemp` and its lock."""


def _lock(path: Path, wait: bool) -> int | None:
    """An open descriptor of the directory `path` holding an exclusive `flock` on it (released when it is
    closed or its process dies, SIGKILL included); None when another descriptor holds it (`wait` False), the
    directory is gone, or the file system has no flock on directories (NFS: there nothing counts as stale)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def clear_stale_temps(out: str | Path) -> list[Path]:
    """Remove the temporary directories of `out` (`temp_dir`'s: TEMP + mkdtemp's 8-character suffix) that writers
    killed mid-write left (a full copy each); returns those removed.

    A temporary counts as stale when nobody holds its lock (a live writer, in this process or another, holds it
    until its directory is renamed into place or removed) and it has not changed for STALE_AFTER_S. A lock, not
    a pid in the name: pids are reused and are another namespace's in another container or host sharing the
    directory, so a pid that is not alive here does not mean its writer is gone."""
    out = Path(out)
    prefix = TEMP.format(name=out.name)
    removed = []
    for d in out.parent.glob(glob.escape(prefix) + "*"):
        if not re.fullmatch(re.escape(prefix) + r"[a-z0-9_]{8}", d.name) or d.is_symlink() or not d.is_dir():
            continue
        fd = _lock(d, wait=False)
        if fd is None:
            continue
        try:
            if time.time() - d.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:  # removed meanwhile by another writer's clean-up
            pass
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def temp_dir(out: str | Path) -> Iterator[Path]:
    """`with temp_dir(out) as tmp:` a fresh temporary directory beside `out` (mode `public_mode(True)`), locked
    until the block ends and removed when it raises (rename it into place, e.g. with `replace_dir`, inside the
    block). Stale temporaries of `out` are cleared first (`clear_stale_temps`)."""
    out = Path(out)
    clear_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=TEMP.format(name=out.name), dir=out.parent))
    fd = _lock(tmp, wait=True)  # waits only for a clean-up that is looking at it (and leaves it: it is new)
    try:
        os.chmod(tmp, public_mode(directory=True))
        yield tmp
    except BaseException:  # a full copy of the weights: do not leave it behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd is not None:
            os.close(fd)


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
