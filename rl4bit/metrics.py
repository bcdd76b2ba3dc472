"""Run metrics: `RUN_DIR/metrics.jsonl`, TensorBoard, a live `rich` display, warnings and end-of-run plots.

`MetricsLogger.log(step, metrics)` appends one JSON object a line (`{"step":
N, key: value, ...}`, keys as in `STEP_KEYS` / `EVAL_KEYS`), mirrors the
scalars to TensorBoard (`RUN_DIR/tensorboard`) and advances the progress bar.
It warns loudly (red on the console and `logs/warnings.log`) when learning
has silently stopped: every completion clipped at the length cap, or every
GRPO group with zero reward spread (all advantages 0). `plot()` writes
`plots/{reward,accuracy,mismatch,throughput}.png` from metrics.jsonl.
`truncate(step)` drops records after a checkpoint's step on resume, so the
file reads as one uninterrupted run. A last line cut short (a crash or a full
disk mid-append) is dropped with a warning by `truncate` and `read_metrics`;
damage before it is a CheckpointError naming the line.

Leaves out: remote trackers (W&B, MLflow); point them at metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from rl4bit.common.atomic import atomic_write_text

STEP_KEYS = (
    "reward/mean", "reward/std", "reward/errors", "reward/zero_spread_frac",
    "rollout/clipped_frac", "rollout/completion_len_mean", "rollout/completion_len_max", "rollout/prompt_len_mean",
    "rollout/tokens_per_s", "ppo/clip_frac", "ratio/mean", "ratio/min", "ratio/max", "tis/truncated_frac",
    "mismatch/k3", "mismatch/max_abs", "policy/entropy", "policy/version", "loss", "grad_norm", "sync/bytes",
    "sync/seconds", "sync/direct", "time/sample_s", "time/score_s", "time/train_s", "time/sync_s", "time/step_s",
)
"""Logged every RL step. A vLLM sampler adds where its update's time went: `sync/<phase>_s` for its check, encode,
(write,) reload, repack and reset (`Sampler.update_phases`)."""
MEMORY_KEYS = ("memory/step_start_gib", "memory/graph_pools_gib", "memory/sample_peak_gib", "memory/train_peak_gib",
               "memory/sync_peak_gib", "memory/job_peak_gib")
"""Logged every RL step when this process holds the GPU (local mode on CUDA): allocated GiB at the start of the
step (weights, optimizer state, KV cache), what private pools reserve (the sampler's CUDA graphs; their freed
intermediates are not in step_start, which counts allocated blocks only), the allocator's peak within each phase,
and the job's peak so far (every phase, evaluation, checkpoints and setup included) (`PhasePeaks`)."""
EVAL_KEYS = ("eval/accuracy", "eval/reward_mean", "time/eval_s")
"""Logged before the first step and every data.eval_every steps."""

def private_pool_bytes(segments: list[dict], device: int | None = None) -> int:
    """Bytes reserved by private memory pools (CUDA graph captures, `torch.cuda.MemPool`) in a
    `torch.cuda.memory_snapshot()`: segments whose `segment_pool_id` is not the default pool's (0, 0), on
    `device` (an index; None: every device).

    Reserved, not allocated: a graph's intermediates are freed when its capture ends, but their memory stays
    with the graph (replays write there), so it is neither free nor counted by `memory_allocated`. What the
    graphs keep allocated (their outputs) is counted by both."""
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0)
               and (device is None or s.get("device") == device))


class PhasePeaks:
    """Peak CUDA memory of this process per phase of a step, and of the whole job so far.

    `start()` folds the allocator's peak into the job's and resets it; `end(name, m)` stores the phase's peak as
    m["memory/{name}_peak_gib"]; `job(m)` stores the job's peak (what ran outside the phases, e.g. evaluation,
    included). A no-op where this process has not touched CUDA (Ray mode: the actors hold the GPUs; CPU runs).
    `device`: the trainer's CUDA device (None: the current one).
    """

    def __init__(self, device=None):
        self.device = device
        self.job_peak = 0

    def _on(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def _fold(self) -> int:
        self.job_peak = max(self.job_peak, torch.cuda.max_memory_allocated(self.device))
        return self.job_peak

    def step_start(self, m: dict) -> None:
        if self._on():
            m["memory/step_start_gib"] = torch.cuda.memory_allocated(self.device) / 2**30
            index = torch.cuda.current_device() if self.device is None else torch.device(self.device).index
            m["memory/graph_pools_gib"] = private_pool_bytes(torch.cuda.memory_snapshot(), index) / 2**30

    def start(self) -> None:
        if self._on():
            self._fold()
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, name: str, m: dict) -> None:
        if self._on():
            m[f"memory/{name}_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30

    def job(self, m: dict) -> None:
        if self._on():
            m["memory/job_peak_gib"] = self._fold() / 2**30


class StepPhases:
    """Which phase the job is in, and what each phase of an RL step took.

        with phases("sample", peak=True):   # phases.name is "sample" until the next phase begins
            ...
        phases.seconds["sample"]             # its wall time; phases.memory: memory/sample_peak_gib (PhasePeaks)

    `name` is what an out-of-memory error reports ("setup" before the first phase); `step` is the RL step being
    run (0 before the run's first). `begin_step(step)` starts a step's clock, `end_step(m)` adds time/step_s and
    the job's memory peak to the step's metrics `m`.
    """

    def __init__(self, peaks: PhasePeaks):
        self.peaks, self.name, self.step = peaks, "setup", 0
        self.seconds: dict[str, float] = {}
        self.memory: dict[str, float] = {}
        self._t_step = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, name: str, *, peak: bool = False):
        self.name = name
        if peak:
            self.peaks.start()
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0
        if peak:
            self.peaks.end(name, self.memory)

    def begin_step(self, step: int) -> None:
        self.step, self.seconds, self.memory = step, {}, {}
        self._t_step = time.perf_counter()
        self.peaks.step_start(self.memory)

    def times(self, *names: str) -> dict[str, float]:
        """time/{name}_s of the phases `names`."""
        return {f"time/{n}_s": self.seconds[n] for n in names}

    def end_step(self, m: dict) -> None:
        m["time/step_s"] = time.perf_counter() - self._t_step
        self.peaks.job(m)  # after the evaluation: the job's peak so far, every phase included


PLOTS = {
    "reward": ["reward/mean"],
    "accuracy": ["eval/accuracy"],
    "mismatch": ["mismatch/k3"],
    "throughput": ["rollout/tokens_per_s"],
}


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, tensorboard: bool = True, progress: bool = True,
                 start_step: int = 0):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)
        from rich.console import Console

        self.console = Console(stderr=True)
        self.progress = None
        if progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("{task.description}"), console=self.console, transient=False)
            self.task = self.progress.add_task("", total=total_steps, completed=start_step)
            self.progress.start()
        self.last_eval = math.nan

    def log(self, step: int, metrics: dict) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before the step's checkpoint is, so a resume finds its record
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if "eval/accuracy" in metrics:
            self.last_eval = metrics["eval/accuracy"]
        self._warn_if_stalled(step, metrics)
        if self.progress is not None and "reward/mean" in metrics:
            self.progress.update(self.task, completed=step, description=(
                f"reward {metrics['reward/mean']:.3f}  eval acc {self.last_eval:.3f}  "
                f"k3 {metrics.get('mismatch/k3', math.nan):.2e}  {metrics.get('rollout/tokens_per_s', 0):.0f} tok/s"))

    def text(self, tag: str, text: str, step: int) -> None:
        """A TensorBoard text summary (markdown), when TensorBoard is on."""
        if self.tb is not None:
            self.tb.add_text(tag, text, step)

    def warn(self, message: str) -> None:
        self.console.print(f"[bold red]WARNING: {message}[/]")
        with open(self.run_dir / "logs" / "warnings.log", "a") as f:
            f.write(message + "\n")

    def _warn_if_stalled(self, step: int, m: dict) -> None:
        if m.get("rollout/clipped_frac") == 1.0:
            self.warn(f"step {step}: EVERY completion hit sampler.max_new_tokens; rewards cannot tell them apart. "
                      "Raise sampler.max_new_tokens or add a stop string.")
        if m.get("reward/zero_spread_frac") == 1.0:
            self.warn(f"step {step}: EVERY group has zero reward spread, so every advantage is 0 and nothing is "
                      "learned. "
                      "The task is too hard or too easy for the policy: change the prompts (data.digits for the "
                      "arithmetic task, the prompt file otherwise), the warm start or the reward.")

    def truncate(self, step: int) -> None:
        """Keep only the records of steps <= `step` (resume from a checkpoint at `step`)."""
        if not self.path.exists():
            return
        records, torn = parse_metrics(self.path)
        if torn:
            self.warn(torn)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records if r["step"] <= step))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.tb is not None:
            self.tb.close()


def parse_metrics(path: str | Path) -> tuple[list[dict], str | None]:
    """(records, note) of a metrics.jsonl: its records in order, and a note when its last line was cut short
    (a crash or a full disk mid-append: dropped), else None.

    CheckpointError naming the file and line for a line before the last that is not a record (`{"step": N,
    ...}`): not the mark of an interrupted append, so it is not dropped silently."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records, note = [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError both are
            r = None
        if isinstance(r, dict) and type(r.get("step")) is int:
            records.append(r)
        elif n == len(lines):  # no newline after it: the append never finished (a complete one ends with "\n")
            note = (f"{path}, line {n}: dropped {len(line)} bytes that are not a whole record (a write cut short "
                    "by a crash or a full disk)")
        else:
            from rl4bit.common.checkpoint_format import CheckpointError

            raise CheckpointError(f"{path}, line {n}: not a metrics record (damaged inside the file, not a write "
                                  "cut short at its end); delete or repair that line (the other records are "
                                  "intact), then run again")
    return records, note


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl ([] when there is none); a last line cut short is dropped with a note
    on stderr (`parse_metrics`)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records, torn = parse_metrics(path)
    if torn:
        print(f"rl4bit: {torn}", file=sys.stderr)
    return records


def plot(run_dir: str | Path) -> list[Path]:
    """One PNG per entry of PLOTS under RUN_DIR/plots; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = []
    for name, keys in PLOTS.items():
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key)
        ax.set_xlabel("RL step")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(run_dir) / "plots" / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf
    return v
