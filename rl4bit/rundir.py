"""The run directory every command writes into.

Layout of `RUN_DIR` (default `runs/<name>-<timestamp>`, or `--out DIR`):
`config.yaml` (the resolved config), `metrics.jsonl` (one JSON object a
line), `logs/`, `plots/`, `checkpoints/`, `tensorboard/`. The default dir is
claimed with one atomic mkdir, so jobs started in the same second get
`<name>-<timestamp>-1`, `-2`, ... instead of sharing one. Leaves out: remote
storage; a run dir is a local folder.
"""

from __future__ import annotations

import time
from pathlib import Path

from rl4bit.common.atomic import atomic_write_text
from rl4bit.config import JobConfig, dump_yaml

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
