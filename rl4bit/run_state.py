"""What a run keeps between its invocations: the trainer's checkpoints and `--resume`.

`save_trainer` / `load_trainer` are one path for any trainer: every rank writes and reads its own state in
rl4bit.common.checkpoint's one format (a Trainer actor its one file, a TrainerGroup a shard per rank).
`restore` checks the latest checkpoint against the job's config before any state loads, then loads the trainer's
state and the prompt stream's position; `check_steps_left` refuses a resume with no step left before any actor
starts; `open_logger` drops what was logged past the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from rl4bit import samples as samples_log
from rl4bit.actors import get
from rl4bit.common.checkpoint import latest_dir, open_checkpoint, step_of
from rl4bit.common.checkpoint_format import CheckpointError
from rl4bit.config import ConfigError, JobConfig
from rl4bit.metrics import MetricsLogger
from rl4bit.rundir import record_config
from rl4bit.tasks import PromptStream
from rl4bit.trainer.resume_checks import config_problem
from rl4bit.trainer_group import TrainerGroup


def save_trainer(trainer, run_dir: Path, step: int, meta: dict, keep: int) -> None:
    """Checkpoint `step` (rl4bit.common.checkpoint's one format): every rank writes its own state, a Trainer actor
    its one file (`Trainer.save_checkpoint`), a trainer group a shard per rank (`TrainerGroup.save_checkpoint`);
    `meta` goes into state.json beside the trainer's."""
    done = trainer.save_checkpoint(str(Path(run_dir).resolve()), step, meta, keep=keep)
    if not isinstance(trainer, TrainerGroup):  # an actor's call is a future; the group's returns once written
        get(done)


def load_trainer(trainer, run_dir: Path) -> dict:
    """Restore the trainer from the run's latest checkpoint (after setup_rl), each rank its own part; state.json."""
    meta = trainer.load_checkpoint(str(Path(run_dir).resolve()))
    return meta if isinstance(trainer, TrainerGroup) else get(meta)


def restore(trainer, stream: PromptStream, run_dir: Path, cfg: JobConfig) -> int:
    """A resumed run: the RL set-up, then the trainer's state and the prompt stream's position from the latest
    checkpoint, once its state.json was checked against `cfg` (`_check_job`, before any state loads); config.yaml
    then says what this resume runs (`record_config`). The step the checkpoint was written at."""
    _check_job(open_checkpoint(run_dir, int(getattr(cfg.trainer, "world_size", 1)))[2], cfg)
    get(trainer.setup_rl())
    meta = load_trainer(trainer, run_dir)
    stream.load_state(meta["data"])
    record_config(run_dir, cfg, meta["step"])
    return meta["step"]


def _check_job(meta: dict, cfg: JobConfig) -> None:
    """CheckpointError when the checkpoint was written under other model or recipe settings than `cfg`'s."""
    problem = config_problem(meta.get("job"), cfg)
    if problem:
        raise CheckpointError(problem)


def check_steps_left(run_dir: Path, cfg: JobConfig) -> None:
    """ConfigError when the checkpoint a resume would load (`checkpoint.latest_dir`: the pointed one, or the newest
    left after a damaged one was deleted) is already at or past `rl.steps`: such a resume would start every actor,
    run nothing and exit as if it had trained. A run with no checkpoint left is left to the loader's errors."""
    try:
        step = step_of(latest_dir(run_dir))
    except FileNotFoundError:
        return
    if step is not None and step >= cfg.rl.steps:
        raise ConfigError(f"--resume {run_dir}: its last checkpoint is at step {step} and rl.steps is {cfg.rl.steps}, "
                          f"so there is no step left to run; to train further pass -o rl.steps=N with N > {step}")


def open_logger(cfg: JobConfig, run_dir: Path, start: int, resume: bool) -> MetricsLogger:
    """metrics.jsonl, TensorBoard and the progress bar; a resume drops what was logged past its checkpoint."""
    logger = MetricsLogger(run_dir, total_steps=cfg.rl.steps, tensorboard=cfg.run.tensorboard,
                           progress=cfg.run.progress, start_step=start)
    if resume:
        logger.truncate(start)
        samples_log.truncate(run_dir, start)
    return logger
