"""How a started job stops: the errors `rl4bit train` prints as one line, and what the run dir keeps of them.

    except JOB_ERRORS as e: print(e)          # driver.main: one clear line, exit status 1
    keep_error(run_dir, e)                     # RUN_DIR/logs/error.txt: the traceback, after the terminal is gone
    raise out_of_memory(cfg, phase, step, torch_error, run_dir)   # which phase, what shrinks it, where to resume

Leaves out: retrying anything (a job that stops is resumed with `rl4bit train --resume RUN_DIR`).
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch

from rl4bit.actors import ActorDiedError
from rl4bit.common.atomic import atomic_write_text
from rl4bit.common.checkpoint_format import CheckpointError
from rl4bit.config import JobConfig
from rl4bit.trainer.actor import NonFiniteError
from rl4bit.trainer.weight_sync import WeightSyncError


class OutOfMemory(RuntimeError):
    """The job ran out of GPU memory: the message names the phase and the step, the settings that shrink that
    phase (with this job's values) and where to continue from. Checkpoints already written stay as they are.
    `phase`, `step` (0: before the run's first RL step) and `detail` (torch's first two sentences) for callers
    that word their own message (`bench step`)."""

    def __init__(self, message: str, phase: str, step: int, detail: str):
        super().__init__(message)
        self.phase, self.step, self.detail = phase, step, detail


JOB_ERRORS = (ActorDiedError, NonFiniteError, WeightSyncError, CheckpointError, OutOfMemory)
"""Failures that stop a running job: `main` prints them as one clear line and returns 1."""

ERROR_FILE = "error.txt"
"""Under the run dir's logs/: the traceback of every failure that stopped a started run (its actors up), the latest
last. A job refused before that (bad data, a reward that does not load) only prints its error."""


def keep_error(run_dir: Path, err: BaseException) -> Path | None:
    """Append `err` with its traceback to RUN_DIR/logs/error.txt (atomic: the old text plus the new, renamed into
    place), so the run dir says why it stopped after the terminal is gone; the path, or None when it could not be
    written (the original error matters more than this record)."""
    path = Path(run_dir) / "logs" / ERROR_FILE
    try:
        before = path.read_text() if path.is_file() else ""
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, f"{before}--- {stamp}: {type(err).__name__}\n{text}")
    except OSError:
        return None
    return path


def out_of_memory(cfg: JobConfig, phase: str, step: int, err: torch.OutOfMemoryError, run_dir: Path) -> OutOfMemory:
    """The OutOfMemory error for torch's `err` in `phase` at `step` (0: before the run's first RL step): where, what
    makes that phase fit (with this job's values), where to continue."""
    detail = ". ".join(str(err).split(". ")[:2])[:200]  # "CUDA out of memory. Tried to allocate X GiB"
    s, t, r = cfg.sampler, cfg.trainer, cfg.rl
    sampler = (f"lower sampler.gpu_memory_utilization (now {s.gpu_memory_utilization}: vLLM's share of the GPU)"
               if s.backend == "vllm" else
               f"lower sampler.max_batch_size (now {s.max_batch_size}: the KV cache is allocated for that many "
               f"sequences of model.max_seq_len={cfg.model.max_seq_len} tokens)")
    train = (f"lower trainer.tokens_per_microbatch (now {t.tokens_per_microbatch}: the same update in smaller "
             f"micro-batches)" + ("" if t.recompute else " or set trainer.recompute=true (activations recomputed in "
                                  "the backward, the same gradients)"))
    advice = {
        "setup": f"a smaller model (model.*), or {sampler}",
        "warm start": f"lower run.warmup_batch_size (now {cfg.run.warmup_batch_size})",
        "sample": f"{sampler}, or sample fewer rollouts a step (rl.prompts_per_step={r.prompts_per_step} x "
                  f"rl.samples_per_prompt={r.samples_per_prompt})",
        "evaluate": f"{sampler}, or lower data.eval_size (now {cfg.data.eval_size})",
        "train": train,
        "sync": f"{sampler}: trainer and samplers hold their weights while the update passes between them",
        "checkpoint": f"{sampler} (the samplers' caches stay allocated while the trainer's state is copied out)",
        "score": "keep the reward functions off the GPU",
    }[phase]
    where = "before its first RL step" if step == 0 else f"at step {step}"
    message = (f"the job ran out of GPU memory in its {phase} phase {where} ({detail}). To fit: {advice}. "
               f"{resume_hint(run_dir)}")
    return OutOfMemory(message, phase, step, detail)


def resume_hint(run_dir: Path) -> str:
    """Where a stopped run goes on from: the `--resume` command, or a new run when it has no checkpoint."""
    latest = Path(run_dir) / "checkpoints" / "latest.json"
    if not latest.is_file():
        return f"There is no checkpoint yet in {run_dir}; start the run again into a new --out"
    step = json.loads(latest.read_text()).get("step")
    return f"Continue from the last checkpoint (step {step}): rl4bit train --resume {run_dir}"
