"""The run directory every command writes into.

Layout of `RUN_DIR` (default `runs/<name>-<timestamp>`, or `--out DIR`):
`config.yaml` (the resolved config), `metrics.jsonl` (one JSON object a
line), `logs/`, `plots/`, `checkpoints/`, `tensorboard/`. The default dir is
claimed with one atomic mkdir, so jobs started in the same second get
`<name>-<timestamp>-1`, `-2`, ... instead of sharing one. `--out` is resolved
and checked before anything is written (`checked_out_dir`); a new run that
stopped before it logged or saved anything is taken away again
(`forget_unstarted`); a resume whose overrides change the config rewrites
config.yaml, the previous one kept in logs/ (`record_config`). Leaves out:
remote storage; a run dir is a local folder.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from rl4bit.common.atomic import atomic_write_text
from rl4bit.config import ConfigError, JobConfig, dump_yaml

SUBDIRS = ("logs", "plots", "checkpoints", "tensorboard")


def default_run_dir(name: str, root: str | Path = "runs") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(root) / f"{name}-{stamp}"


def claim_default_run_dir(name: str, root: str | Path = "runs") -> Path:
    """Create and return a fresh `root/<name>-<timestamp>[-k]`: the first of those names no one holds yet."""
    base = default_run_dir(name, root)
    base.parent.mkdir(parents=True, exist_ok=True)
    run_dir, k = base, 0
    while True:
        try:
            run_dir.mkdir()  # atomic: of jobs racing for one name exactly one gets it, the others try the next
            return run_dir
        except FileExistsError:
            k += 1
            run_dir = base.with_name(f"{base.name}-{k}")


def create_run_dir(cfg: JobConfig, out: str | Path | None = None) -> Path:
    """Create the run dir (refusing to overwrite another run's config) and store the resolved config."""
    run_dir = Path(out) if out is not None else claim_default_run_dir(cfg.run.name)
    if (run_dir / "config.yaml").exists():
        if (run_dir / "checkpoints" / "latest.json").is_file():
            raise FileExistsError(f"{run_dir} already holds a run (config.yaml exists); pass --resume {run_dir} to "
                                  "continue it from its last checkpoint or choose another --out")
        raise FileExistsError(f"{run_dir} already holds a run (config.yaml exists) that wrote no checkpoint, so there "
                              "is nothing to resume; choose another --out (its metrics stay where they are)")
    for sub in SUBDIRS:
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", dump_yaml(cfg))
    return run_dir


def checked_out_dir(out: str | Path) -> Path:
    """`--out` resolved (~, symlinks, ..) and checked before anything is written: a directory we may write."""
    path = Path(out).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out}: {path} exists and is not a directory; choose a directory path")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: cannot create or write {path} ({parent} is not a writable directory); "
                          "choose a directory you can write")
    return path


def forget_unstarted(run_dir: Path, created: bool = False) -> None:
    """A new run that failed before it logged a metric or wrote a checkpoint (bad data, a reward that does not
    import, no GPU): its config.yaml goes, so the same command can run again into the same --out (which would
    otherwise refuse it as "already holds a run" with nothing to resume). Where this command `created` the run
    dir, its subfolders and the dir itself go too while they are empty (its parents, such as runs/, stay);
    anything written into them (a log) stays, and nothing else is removed."""
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints" / "latest.json").exists():
        return
    (run_dir / "config.yaml").unlink(missing_ok=True)
    if created:
        for path in (*(run_dir / sub for sub in SUBDIRS), run_dir):
            with contextlib.suppress(OSError):  # not empty (or already gone): kept
                path.rmdir()


def record_config(run_dir: Path, cfg: JobConfig, step: int) -> None:
    """Make config.yaml say what a resumed run now runs: where the resume's overrides changed it, the previous file
    moves to logs/config-before-step-N.yaml (N the first step this resume runs; -1, -2... where one is kept
    already) and config.yaml holds the resolved config (both writes atomic).
    Called by `run_state.restore` once the checkpoint was checked against `cfg`, so a refused resume changes nothing."""
    path = run_dir / "config.yaml"
    text = dump_yaml(cfg)
    before = path.read_text()
    if text == before:
        return
    kept = run_dir / "logs" / f"config-before-step-{step + 1}.yaml"
    k = 0
    while kept.exists():  # a second resume from the same checkpoint (the first one stopped before its next)
        k += 1
        kept = run_dir / "logs" / f"config-before-step-{step + 1}-{k}.yaml"
    kept.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(kept, before)
    atomic_write_text(path, text)
    print(f"resume: {path} now holds this run's settings (the overrides, paths made absolute); the previous one is "
          f"{kept}", file=sys.stderr)
