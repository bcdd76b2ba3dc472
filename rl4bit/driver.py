"""`rl4bit train CONFIG [--out DIR] [--resume RUN_DIR]`: the GRPO loop, top to bottom.

    for step in 1..rl.steps:
        sample    prompts_per_step prompts x samples_per_prompt completions   (Sampler actors)
        score     every completion with the configured rewards                (RewardPool actor)
        advantage group-normalized per prompt                                 (trainer.grpo)
        train     ppo_epochs optimizer steps                                  (Trainer actor)
        sync      the new weights into every sampler                          (rl4bit.trainer.weight_sync)
        evaluate  greedy accuracy on the eval split, every data.eval_every
        log       metrics.jsonl + TensorBoard + progress bar
        checkpoint every run.checkpoint_every steps (and at the end)

`run` is that loop, one call a phase; the set-up before it is in named helpers
(`load_inputs`, `start_actors`, `warm_start` or `restore`, `open_logger`).
Actors are plain classes (`Trainer`, `Sampler`, `RewardPool`) built through
`rl4bit.actors.Cluster`: Ray actors in `ray` mode, in-process objects in
`local` mode; every call below is `get(actor.method(...))` either way.
`trainer.world_size` = N > 1: the Trainer is a `rl4bit.trainer_group.TrainerGroup`
of N ranks (FSDP2, and expert parallelism when `trainer.expert_parallel` = N):
Ray actors in `ray` mode, `python -m rl4bit.trainer_group` processes in `local`
mode, with the Trainer's methods. Checkpoints take one path for both
(`save_trainer`, `restore`): every rank writes its own state into
rl4bit.common.checkpoint's one format (one rank: `state.safetensors`; N ranks:
`shard_RRRRR.safetensors` each, the same manifest, pointer and errors);
`--resume` needs the same N, and the group is shut down (barrier, process
group destroyed) before the cluster. Its
train_step metrics are logged as they come, including the expert-parallel
wire bytes `comm/*`.
Before any actor starts, every reward is imported and called once in a
reward worker (fail fast, naming the reward). The first `eval/accuracy` (step 0) is
the warm-started model's, before any RL step. `--resume RUN_DIR` reloads the
run's stored config (overrides still apply, e.g. `-o rl.steps=40`) and its
latest checkpoint, and continues; on CPU the metrics after the checkpoint
equal an uninterrupted run's (time and throughput aside). A resume whose
overrides change the config rewrites the run's config.yaml once the checkpoint
has been checked against it (the previous one kept in logs/), so a later plain
`--resume` goes on with the same settings; a resume with no step left to run
is refused before anything starts.

Weight sync ships what the trainer's forward computes with: the quantized
modules' own QTensors (NVFP4 codes + scales, or MXFP8) and the other tensors
as FP32 masters; samplers serve those QTensors (no recalibration) and switch
version all-or-nothing. Two paths, one set of checks (`sync_weights`):
SHA-256-stamped buckets (Ray actors, the trainer group, vLLM samplers), or,
when the trainer (one rank) and every sampler (embedded engine) live in this
process (`local` mode), the direct path: the trainer's device tensors handed
to the samplers as they are (`Trainer.weight_tensors` ->
`Sampler.apply_tensors`), bitwise the same served weights, without
serialization, hashing or host copies. The metric `sync/direct` says which
(1/0); `RL4BIT_WEIGHT_SYNC=buckets` forces the buckets in local mode (tests of
the bucket protocol, benchmarks). A rejected update stops the job
(WeightSyncError); the samplers keep serving the previous version.

Sampling randomness is keyed by (run.seed, step, prompt index), so no sampler
RNG state needs saving. Faults (tests/reliability): a Sampler actor that dies
mid-rollout or mid-sync is restarted by Ray (up to `ray.sampler_restarts` times
a job), the samplers get the current weights again and the step's rollouts
are redone (same seeds, so the same rollouts); a dead Trainer, K non-finite steps in a
row, a rejected weight update, a corrupt checkpoint or running out of GPU
memory (`OutOfMemory`: which phase at which step, the settings that shrink
that phase with this job's values) stop the job with a clear error
(`rl4bit train: error: ...`, exit status 1) that names what failed and,
where it applies, the `--resume` command. Output paths are resolved
and checked before anything is written.

Leaves out: asynchronous (off-policy) rollouts, partial-group retries,
multi-node placement, restarting the Trainer in place (resume instead),
resuming on another trainer.world_size.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rl4bit import samples as samples_log
from rl4bit.actors import ActorDiedError, Cluster, get, is_local, wait_alive
from rl4bit.common.atomic import atomic_write_text
from rl4bit.common.checkpoint import (
    latest_dir,
    load_checkpoint,  # noqa: F401 - re-exported: tests read a run's checkpoint here
    open_checkpoint,
    step_of,
)
from rl4bit.common.checkpoint_format import CheckpointError
from rl4bit.config import (
    ConfigError,
    JobConfig,
    absolute_reward_spec,
    anchored,
    dump_yaml,
    load_config,
    trainer_args,
    warm_start_args,
)
from rl4bit.job_errors import (
    ERROR_FILE,
    JOB_ERRORS,
    OutOfMemory,  # noqa: F401 - re-exported: callers catch driver.OutOfMemory
    keep_error,
    out_of_memory,
    resume_hint,
)
from rl4bit.kernels import invariant
from rl4bit.kernels.philox import derive_seed
from rl4bit.metrics import MetricsLogger, PhasePeaks, StepPhases, plot, read_metrics
from rl4bit.parity_stats import check_reference, live_parity_metrics
from rl4bit.reward_log import RewardLog, failure_metrics
from rl4bit.rewards import RewardPool, check_rewards, exact_match
from rl4bit.rundir import SUBDIRS, create_run_dir
from rl4bit.sampler.types import MAX_SEED, Request, SamplingParams
from rl4bit.tasks import PromptStream, check_batch_fits, check_prompt_lengths, load_task, warmup_split
from rl4bit.trainer.actor import TrainBatch, Trainer
from rl4bit.trainer.cuda_ipc import described_bytes
from rl4bit.trainer.grpo import group_advantages
from rl4bit.trainer.models import autocast_dtype, build_policy_model
from rl4bit.trainer.resume_checks import config_problem, job_settings
from rl4bit.trainer.tokenizer import build_tokenizer, check_chat_template, prompt_ids
from rl4bit.trainer.weight_sync import WeightSyncError, update_bytes
from rl4bit.trainer_group import TrainerGroup


def main(config_path, out=None, resume=None, overrides=None) -> int:
    if resume is not None:
        run_dir = Path(resume).expanduser().resolve()
        if not run_dir.is_dir():
            raise FileNotFoundError(f"--resume {resume}: {run_dir} does not exist; "
                                    "pass the run dir a `rl4bit train` wrote")
        if not (run_dir / "config.yaml").is_file():
            raise FileNotFoundError(f"--resume {resume}: {run_dir / 'config.yaml'} is missing; "
                                    "pass the run dir a `rl4bit train` wrote")
        if not (run_dir / "checkpoints" / "latest.json").is_file():  # before any actor starts
            again = " ".join([f"rl4bit train {run_dir / 'config.yaml'} --out NEW_DIR",
                              *(f"-o {o}" for o in overrides or [])])
            raise FileNotFoundError(
                f"--resume {resume}: the run has no checkpoint to resume (it stopped before its first one: "
                f"run.checkpoint_every, or the last step when 0); run it again with `{again}` (its metrics so far "
                f"stay in {run_dir})")
        cfg = anchored(load_config(run_dir / "config.yaml", overrides))
        _check_steps_left(run_dir, cfg)
    else:
        cfg = anchored(load_config(config_path, overrides))
        target = checked_out_dir(out) if out is not None else None
        created = target is None or not target.exists()
        run_dir = create_run_dir(cfg, target)
    finished = False
    try:
        run(cfg, run_dir, resume=resume is not None)
        finished = True
    except JOB_ERRORS as e:
        kept = run_dir / "logs" / ERROR_FILE
        print(f"rl4bit train: error: {e}" + (f" (kept in {kept})" if kept.is_file() else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the actors are shut down by `run`; what was saved stays
        print(f"rl4bit train: interrupted. {resume_hint(run_dir)}", file=sys.stderr)
        return 130
    finally:
        if not finished and resume is None:
            _forget_unstarted(run_dir, created)
    return 0



def _forget_unstarted(run_dir: Path, created: bool = False) -> None:
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



def run(cfg: JobConfig, run_dir: Path, *, resume: bool = False,
        on_step: Callable[[int, dict], None] | None = None) -> list[dict]:
    """The job; `on_step(step, metrics)` is called after each step is logged (the soak bench's hook)."""
    if cfg.run.cpu_threads:
        torch.set_num_threads(cfg.run.cpu_threads)
    data = load_inputs(cfg)  # prompts, tokenizer and rewards, checked before any actor starts
    reward_log = RewardLog(run_dir)
    cluster = Cluster(cfg, run_dir)
    phases = StepPhases(PhasePeaks(torch.device(cfg.trainer.device) if cfg.trainer.device.startswith("cuda") else None))
    actors = logger = None
    G = cfg.rl.samples_per_prompt
    try:
        actors = start_actors(cfg, cluster, data)
        trainer, samplers, pool, recover = actors.trainer, actors.samplers, actors.pool, actors.recover
        start = restore(trainer, data.stream, run_dir, cfg) if resume else warm_start(trainer, data, cfg, phases)
        logger = open_logger(cfg, run_dir, start, resume)
        with phases("sync"):
            sync_all(trainer, samplers, recover)
        if not resume:  # step 0: the warm-started model, before any RL step
            with phases("evaluate"):
                logger.log(0, evaluate(cfg, data.tokenizer, samplers, pool, data.eval_set, recover, log=reward_log))
        try:
            for step in range(start + 1, cfg.rl.steps + 1):
                phases.begin_step(step)
                with phases("sample", peak=True):
                    prompts = data.stream.next(cfg.rl.prompts_per_step)
                    rollouts = generate(samplers, rollout_requests(cfg, data.tokenizer, prompts, step), recover)
                with phases("score"):
                    scores, totals = score(pool, prompts, rollouts, G)
                if line := reward_log.write(step, "train", scores):
                    print(f"rl4bit: {line}", file=sys.stderr)
                adv = advantages(totals, cfg)
                batch = train_batch(rollouts, totals, adv)
                with phases("train", peak=True):
                    m = get(trainer.train_step(batch))
                with phases("sync", peak=True):
                    sync_bytes, sync_s = sync_all(trainer, samplers, recover)
                m |= phases.memory | rollout_metrics(rollouts, totals, scores, G, phases.seconds["sample"])
                m |= {"sync/bytes": sync_bytes, "sync/seconds": sync_s, "sync/direct": float(actors.direct),
                      **phases.times("sample", "score", "train"), "time/sync_s": sync_s,
                      "rollout/sampler_restarts": float(recover.used)}
                if step % cfg.data.eval_every == 0 or step == cfg.rl.steps:
                    with phases("evaluate"):
                        m |= evaluate(cfg, data.tokenizer, samplers, pool, data.eval_set, recover, log=reward_log,
                                      step=step)
                if cfg.parity.reference:  # live parity against a finished reference run
                    m |= parity_metrics(cfg, run_dir, step, m, logger)
                phases.end_step(m)
                logger.log(step, m)
                every = cfg.run.samples_every
                if every and (step % every == 0 or step == start + 1):  # the first step too: an early look
                    keep_samples(run_dir, logger, samples_log.sample_record(
                        step, prompts, rollouts, totals, adv, G, cfg.run.samples_prompts, m))
                if on_step is not None:
                    on_step(step, m)
                with phases("checkpoint"):
                    if _due(cfg.run.checkpoint_every, step) or step == cfg.rl.steps:
                        save_trainer(trainer, run_dir, step, {"data": data.stream.state(), "job": job_settings(cfg)},
                                     keep=cfg.run.keep_checkpoints)
        except ActorDiedError as e:  # a Sampler past its restarts, the Trainer, the reward pool
            raise ActorDiedError(e.actor, e.detail, f"the job stops at step {phases.step}. {resume_hint(run_dir)}",
                                 label=e.label) from None
    except torch.OutOfMemoryError as e:  # an actor's, re-raised as itself by `get`, or this process's (local mode)
        err = out_of_memory(cfg, phases.name, phases.step, e, run_dir)  # step 0: before the run's first RL step
        keep_error(run_dir, err)
        raise err from None
    except Exception as e:  # the run started (its actors did): the run dir keeps why it stopped
        keep_error(run_dir, e)
        raise
    finally:
        invariant.set_mode(False)  # local mode: the trainer and samplers turned it on in this process
        if logger is not None:
            logger.close()
        if actors is not None:
            stop_actors(actors)
        cluster.shutdown()

    records = read_metrics(run_dir)
    plot(run_dir)
    print_summary(run_dir, records)
    return records


# --------------------------------------------------------------------------- set-up


@dataclass
class Inputs:
    """What a job reads before any actor starts, checked (`load_inputs`)."""

    tokenizer: Any
    train_set: list[dict]  # the prompts RL trains on
    eval_set: list[dict]  # the held-out split `evaluate` scores
    warm_set: list[dict]  # the supervised warm start's prompts (run.warmup_prompts)
    stream: PromptStream  # train_set in the seeded order the steps draw it
    reward_specs: list[str]  # each reward's import path, made absolute
    reward_limits: dict  # RewardPool's per-call limits (`reward_limits`)


def load_inputs(cfg: JobConfig) -> Inputs:
    """The task's prompts, the tokenizer and the rewards, each checked: prompt lengths against model.max_seq_len
    (a warning), a step's batch against the trainer's budget, every reward imported and called once in a reward
    worker (fail fast, naming the reward)."""
    tokenizer = build_tokenizer(cfg.model)
    train_set, eval_set = load_task(cfg.data)
    train_set, warm_set = warmup_split(train_set, cfg.data, cfg.run)
    if cfg.parity.reference:
        check_reference(cfg.parity.reference)
    chat = cfg.data.chat_template
    check_chat_template(tokenizer, chat)
    lengths: dict[str, int] = {}  # prompt -> tokens, counted once for both checks

    def count_tokens(texts):
        for t in texts:
            if t not in lengths:
                lengths[t] = len(prompt_ids(tokenizer, t, chat))
        return [lengths[t] for t in texts]

    warning = check_prompt_lengths(train_set, eval_set, count_tokens, cfg.model.max_seq_len)
    if warning:
        print(warning, file=sys.stderr)
    check_batch_fits(cfg, train_set, count_tokens([s["prompt"] for s in train_set]),
                     cfg.data.train_file or f"the arithmetic task ({cfg.data.digits} digits)")
    specs = [absolute_reward_spec(r.fn) for r in cfg.rewards.functions]
    limits = reward_limits(cfg)
    check_rewards(specs, train_set[0], **limits)
    return Inputs(tokenizer, train_set, eval_set, warm_set, PromptStream(train_set, cfg.data.seed), specs, limits)


@dataclass
class Actors:
    """The job's actors (`start_actors`); every call on them is `get(actor.method(...))`."""

    trainer: Any = None  # a Trainer actor, or a TrainerGroup of trainer.world_size ranks
    samplers: list = field(default_factory=list)  # sampler.replicas Sampler actors
    pool: Any = None  # the RewardPool actor
    recover: SamplerRecovery | None = None  # what a dead Sampler's restart needs
    direct: bool = False  # the path every sync_weights takes (`direct_sync`; logged as sync/direct)


def start_actors(cfg: JobConfig, cluster: Cluster, data: Inputs) -> Actors:
    """The Trainer (or trainer group), the Samplers and the RewardPool on `cluster`; those started are stopped
    again (`stop_actors`) when a later one fails."""
    from rl4bit.sampler.actor import Sampler

    actors = Actors()
    try:
        device = _device(cfg)
        gpu = 1 if device.startswith("cuda") else 0
        world = int(getattr(cfg.trainer, "world_size", 1))
        actors.trainer = (TrainerGroup(cfg, world, cluster=cluster) if world > 1 else
                          cluster.actor(Trainer, **trainer_args(cfg), num_gpus=gpu))
        builder = functools.partial(build_policy_model, cfg.model, cfg.recipe, cfg.run.seed)
        restarts = int(getattr(cfg.ray, "sampler_restarts", 3))
        actors.samplers = [
            cluster.actor(Sampler, builder, data.tokenizer, cfg.sampler, device=device,
                          max_seq_len=cfg.model.max_seq_len, autocast=autocast_dtype(cfg.model),
                          invariant_kernels=cfg.model.invariant_kernels, num_gpus=gpu, restarts=restarts,
                          label=_replica(i, cfg.sampler.replicas))
            for i in range(cfg.sampler.replicas)]
        actors.pool = cluster.actor(RewardPool, data.reward_specs, [r.weight for r in cfg.rewards.functions],
                                    workers=cfg.rewards.workers, max_error_fraction=cfg.rewards.max_error_fraction,
                                    **data.reward_limits)
        actors.recover = SamplerRecovery(actors.trainer, actors.samplers, restarts)
        actors.direct = direct_sync(actors.trainer, actors.samplers)
    except BaseException:
        stop_actors(actors)
        raise
    return actors


def stop_actors(actors: Actors) -> None:
    """Close the reward pool; shut a trainer group down (barrier, process group destroyed) while its ranks still
    live. The cluster's shutdown ends whatever is left."""
    if actors.pool is not None:
        try:
            get(actors.pool.close())
        except Exception:  # the actor may be the thing that failed; Ray shutdown reaps it
            pass
    if isinstance(actors.trainer, TrainerGroup):
        try:
            actors.trainer.shutdown()
        except Exception as e:  # a failed rank: the group ends its processes; Ray shutdown reaps its actors
            print(f"rl4bit: trainer group shutdown: {type(e).__name__}: {e}", file=sys.stderr)


def _device(cfg: JobConfig) -> str:
    """The samplers' device (trainer.device, `auto` resolved), checked against what this torch sees."""
    device = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device: {device!r}, but this torch sees no CUDA device (a CPU build, or no "
                          f"GPU visible); use trainer.device=auto or cpu, or run on a GPU machine")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"trainer.device: {device!r}, but this machine shows {torch.cuda.device_count()} CUDA "
                          f"device(s) (cuda:0 ..); pick one of them or trainer.device=cuda")
    return device


def warm_start(trainer, data: Inputs, cfg: JobConfig, phases: StepPhases) -> int:
    """A new run: the supervised warm start (when run.warmup_sft_steps), then the RL set-up; the step RL starts
    after (0)."""
    if cfg.run.warmup_sft_steps:
        with phases("warm start"):
            warm = get(trainer.warm_start(data.warm_set, **warm_start_args(cfg)))
        phases.name = "setup"
        which = ("RL's own train prompts (run.warmup_prompts: train)" if cfg.run.warmup_prompts == "train"
                 else f"{len(data.warm_set)} held-out prompts RL does not train on")
        how = (f"reused from the cache {warm['warmup/cache']}" if warm.get("warmup/cached")
               else "trained" + (f", cached in {warm['warmup/cache']}" if warm.get("warmup/cache") else ""))
        print(f"warm start: {cfg.run.warmup_sft_steps} steps on {which}, loss {warm['warmup/loss_first']:.3f} "
              f"-> {warm['warmup/loss_last']:.3f} ({how})")
    get(trainer.setup_rl())
    return 0


def restore(trainer, stream: PromptStream, run_dir: Path, cfg: JobConfig) -> int:
    """A resumed run: the RL set-up, then the trainer's state and the prompt stream's position from the latest
    checkpoint, once its state.json was checked against `cfg` (`_check_job`, before any state loads); config.yaml
    then says what this resume runs (`_record_config`). The step the checkpoint was written at."""
    _check_job(open_checkpoint(run_dir, int(getattr(cfg.trainer, "world_size", 1)))[2], cfg)
    get(trainer.setup_rl())
    meta = load_trainer(trainer, run_dir)
    stream.load_state(meta["data"])
    _record_config(run_dir, cfg, meta["step"])
    return meta["step"]


def open_logger(cfg: JobConfig, run_dir: Path, start: int, resume: bool) -> MetricsLogger:
    """metrics.jsonl, TensorBoard and the progress bar; a resume drops what was logged past its checkpoint."""
    logger = MetricsLogger(run_dir, total_steps=cfg.rl.steps, tensorboard=cfg.run.tensorboard,
                           progress=cfg.run.progress, start_step=start)
    if resume:
        logger.truncate(start)
        samples_log.truncate(run_dir, start)
    return logger


# --------------------------------------------------------------------------- checkpoints: one path for any trainer


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


def _due(every: int, step: int) -> bool:
    """Whether `step` is one of every `every` steps (0: never)."""
    return bool(every) and step % every == 0


# --------------------------------------------------------------------------- the steps' pieces


def rollout_requests(cfg: JobConfig, tokenizer, prompts: list[dict], step: int) -> list[Request]:
    """A request of rl.samples_per_prompt completions per prompt, seeded by (run.seed, step, prompt index) so
    a redone step samples the same rollouts."""
    # seeds folded to 63 bits, as the engines fold them into their noise keys anyway (the same noise)
    return [_request(cfg, tokenizer, p, n=cfg.rl.samples_per_prompt,
                     seed=derive_seed(cfg.run.seed, step, i) & MAX_SEED, rid=f"{step}-{i}")
            for i, p in enumerate(prompts)]


def score(pool, prompts: list[dict], rollouts, group: int):
    """Every rollout scored by the RewardPool against its prompt's sample; (scores, totals), a total None where
    the rollout failed (finish_reason "error") or its reward did."""
    samples = [prompts[k // group] for k in range(len(rollouts))]
    scores = get(pool.score([(s["prompt"], r.text, s) for s, r in zip(samples, rollouts)]))
    return scores, [None if r.finish_reason == "error" else v for r, v in zip(rollouts, scores.totals)]


def advantages(totals: list[float | None], cfg: JobConfig) -> list[float]:
    """GRPO advantages, normalized within each prompt's group; a failed sample (None) takes no part in its group."""
    rewards = torch.tensor([0.0 if v is None else v for v in totals])
    valid = torch.tensor([v is not None for v in totals])
    return group_advantages(rewards, cfg.rl.samples_per_prompt, valid=valid,
                            normalize_std=cfg.rl.normalize_std).tolist()


def train_batch(rollouts, totals: list[float | None], adv: list[float]) -> TrainBatch:
    """The trainer's batch; a failed sample keeps its row with no completion (it trains nothing)."""
    return TrainBatch(
        prompt_ids=[r.prompt_ids for r in rollouts],
        completion_ids=[r.completion_ids if v is not None else [] for r, v in zip(rollouts, totals)],
        sampler_logprobs=[r.logprobs for r in rollouts],
        advantages=adv,
    )


def parity_metrics(cfg: JobConfig, run_dir: Path, step: int, m: dict, logger: MetricsLogger) -> dict:
    """parity/* against the finished reference run (parity.reference); a warning when the reward diverges."""
    p = live_parity_metrics(cfg.parity.reference, run_dir, step, m["reward/mean"], cfg.parity.threshold)
    if p.get("parity/diverged"):
        logger.warn(f"reward diverges from the reference run {cfg.parity.reference}: "
                    f"trailing gap {p['parity/reward_gap_trailing']:+.3f} beyond {cfg.parity.threshold}")
    return p


def keep_samples(run_dir: Path, logger: MetricsLogger, record: dict) -> None:
    """A step's samples record into samples.jsonl and TensorBoard (run.samples_every; the first step too)."""
    samples_log.append(run_dir, record)
    logger.text("samples", samples_log.as_markdown(record), record["step"])


def reward_limits(cfg: JobConfig) -> dict:
    """RewardPool's per-call limits from the rewards section (memory_mb / cpu_s default where the config lacks them)."""
    r = cfg.rewards
    return {"timeout_s": r.timeout_s, "memory_mb": int(getattr(r, "memory_mb", 2048)),
            "cpu_s": getattr(r, "cpu_s", None)}



def _check_steps_left(run_dir: Path, cfg: JobConfig) -> None:
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


def _record_config(run_dir: Path, cfg: JobConfig, step: int) -> None:
    """Make config.yaml say what a resumed run now runs: where the resume's overrides changed it, the previous file
    moves to logs/config-before-step-N.yaml (N the first step this resume runs; -1, -2... where one is kept
    already) and config.yaml holds the resolved config (both writes atomic).
    Called after the checkpoint was checked against `cfg` (`_check_job`), so a refused resume changes nothing."""
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


def _check_job(meta: dict, cfg: JobConfig) -> None:
    """CheckpointError when the checkpoint was written under other model or recipe settings than `cfg`'s."""
    problem = config_problem(meta.get("job"), cfg)
    if problem:
        raise CheckpointError(problem)



def _replica(i: int, replicas: int) -> str:
    """The name a sampler replica's errors give it."""
    return "Sampler" if replicas == 1 else f"Sampler {i + 1} of {replicas}"


class SamplerRecovery:
    """What `generate` does when a Sampler actor died: wait for Ray's restart, re-send the current weights.

    Called with the ActorDiedError; returns True when the rollouts may be redone,
    False (the caller re-raises) for another actor or past `budget` restarts.
    """

    def __init__(self, trainer, samplers, budget: int):
        self.trainer, self.samplers, self.budget, self.used = trainer, samplers, budget, 0
        self.last_sync = (0, 0.0)  # (bytes, seconds) of the re-send

    def __call__(self, err: ActorDiedError) -> bool:
        if err.actor != "Sampler" or self.used >= self.budget:
            return False
        self.used += 1
        print(f"rl4bit: {err}; Ray restarts it ({self.used}/{self.budget} restarts this job); "
              "re-sending the current weights and redoing the rollouts or the update it cut off", file=sys.stderr)
        health = [wait_alive(s) for s in self.samplers]
        version = get(self.trainer.weight_header())[0]
        stale = [s for s, h in zip(self.samplers, health) if h["version"] < version]
        self.last_sync = sync_weights(self.trainer, stale) if stale else (0, 0.0)
        return True


def _request(cfg: JobConfig, tokenizer, sample: dict, *, n: int, seed: int, rid: str, greedy: bool = False) -> Request:
    s = cfg.sampler
    params = SamplingParams(
        temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop=list(s.stop), n=n, seed=seed,
        ignore_eos=s.ignore_eos and not greedy,
    )
    ids = prompt_ids(tokenizer, sample["prompt"], cfg.data.chat_template)
    return Request(id=rid, prompt_ids=ids, params=params, prompt=sample["prompt"])


def generate(samplers, requests: list[Request], recover: Callable[[ActorDiedError], bool] | None = None):
    """Split requests into contiguous shards, one per sampler; rollouts come back in request order.

    A dead sampler: `recover(err)` (SamplerRecovery) readies the restarted one and
    every shard is generated again (seeded requests: the same rollouts).
    """
    k = len(samplers)
    bounds = [round(i * len(requests) / k) for i in range(k + 1)]
    shards = [requests[bounds[i]: bounds[i + 1]] for i in range(k)]
    while True:
        try:
            results = get([s.generate(shard) for s, shard in zip(samplers, shards) if shard])
            return [r for part in results for r in part]
        except ActorDiedError as e:
            if recover is None or not recover(e):
                raise


WEIGHT_SYNC_ENV = "RL4BIT_WEIGHT_SYNC"
"""Environment switch: unset or `auto` (direct path where `direct_sync` allows it), `buckets` (always buckets)."""


def direct_sync(trainer, samplers) -> bool:
    """Whether `sync_weights` hands device tensors over directly: the trainer and every sampler are in-process
    (`local` mode) actors, the trainer is one rank (not a TrainerGroup), every sampler `accepts_tensors()`."""
    mode = os.environ.get(WEIGHT_SYNC_ENV, "auto") or "auto"
    if mode not in ("auto", "buckets"):
        raise ConfigError(f"{WEIGHT_SYNC_ENV}={mode!r}: use auto (direct in local mode where possible) or buckets")
    if mode == "buckets" or isinstance(trainer, TrainerGroup) or not is_local(trainer):
        return False
    return all(is_local(s) for s in samplers) and all(get([s.accepts_tensors() for s in samplers]))


def shared_sync(trainer, samplers) -> bool:
    """Whether `sync_weights` shares device memory by CUDA IPC: Ray actors in other processes, one trainer rank,
    and every sampler's engine on the trainer's GPU (the same UUID) and taking tensor updates."""
    if os.environ.get(WEIGHT_SYNC_ENV, "auto") == "buckets" or isinstance(trainer, TrainerGroup):
        return False
    uuid = get(trainer.gpu_uuid())
    return uuid is not None and all(get([s.accepts_tensors() for s in samplers])) and all(
        u == uuid for u in get([s.gpu_uuid() for s in samplers]))


def sync_weights(trainer, samplers) -> tuple[int, float]:
    """Push the trainer's weights into every sampler; (bytes handed over in all, seconds).

    CUDA IPC (`shared_sync`: Ray actors on one GPU): the samplers read the trainer's device tensors, described
    by `Trainer.weight_shared`; no bytes on the host. Buckets otherwise: in ray mode each bucket goes trainer ->
    object store -> samplers
    (the future is passed on, never fetched here). Direct (`direct_sync`: all
    in this process): one `Trainer.weight_tensors` update, applied by each
    sampler (`Sampler.apply_tensors`); bytes are the update's tensor bytes
    (`update_bytes`) per sampler. Either way any failure aborts the update on
    every sampler and raises WeightSyncError: fail-stop, the old version keeps serving.
    """
    t0 = time.perf_counter()
    direct = direct_sync(trainer, samplers)
    version, count, layout = get(trainer.weight_header())
    shipped = 0
    try:
        if direct:  # the whole update at once: one extra copy of the quantized weights, on the trainer's device
            update, quantized = get(trainer.weight_tensors())
            get([s.apply_tensors(update, quantized) for s in samplers])
            shipped = len(samplers) * update_bytes(update, quantized)
            del update, quantized
        elif shared_sync(trainer, samplers):  # the same, read by the samplers from the trainer's memory
            desc = get(trainer.weight_shared())
            try:
                get([s.apply_shared(desc) for s in samplers])
            finally:
                get(trainer.release_shared())
            shipped = len(samplers) * described_bytes(desc)
        else:
            get([s.begin_update(version, count, layout) for s in samplers])
            for i in range(count):
                bucket = trainer.weight_bucket(i)  # a future: one bucket in flight
                shipped += sum(get([s.receive_bucket(bucket) for s in samplers]))
            get([s.commit_update(version) for s in samplers])
    except Exception as e:
        for s in samplers:
            try:
                get(s.abort_update(str(e)))
            except Exception:  # a dead sampler cannot abort; the job stops anyway
                pass
        if isinstance(e, (ActorDiedError, torch.OutOfMemoryError)):  # the run loop names them, adds the resume hint
            raise
        if isinstance(e, WeightSyncError):
            raise WeightSyncError(f"{e}; the job stops (fail-stop)") from e
        raise WeightSyncError(f"weight sync to v{version} failed ({type(e).__name__}: {e}); "
                              "samplers keep serving their previous version; the job stops") from e
    return shipped, time.perf_counter() - t0


def sync_all(trainer, samplers, recover: Callable[[ActorDiedError], bool] | None = None) -> tuple[int, float]:
    """`sync_weights` that survives a Sampler dying mid-update: `recover` re-sends the weights to the restarted one
    (and to the others, whose update was aborted)."""
    try:
        return sync_weights(trainer, samplers)
    except ActorDiedError as e:
        if recover is None or not recover(e):
            raise
        return recover.last_sync


def rollout_metrics(rollouts, totals, scores, group: int, sample_s: float) -> dict:
    ok = [v for v in totals if v is not None]
    groups = [[v for v in totals[g: g + group] if v is not None] for g in range(0, len(totals), group)]
    comp = [len(r.completion_ids) for r in rollouts]
    m = {
        "reward/mean": sum(ok) / len(ok) if ok else 0.0,
        "reward/std": statistics.pstdev(ok) if len(ok) > 1 else 0.0,
        "reward/errors": float(scores.errors),
        "reward/zero_spread_frac": sum(1 for g in groups if len(g) < 2 or max(g) == min(g)) / len(groups),
        "rollout/clipped_frac": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        "rollout/errors": float(sum(r.finish_reason == "error" for r in rollouts)),
        "rollout/completion_len_mean": sum(comp) / len(comp),
        "rollout/completion_len_max": float(max(comp)),
        "rollout/prompt_len_mean": sum(len(r.prompt_ids) for r in rollouts) / len(rollouts),
        "rollout/tokens_per_s": sum(comp) / max(sample_s, 1e-9),
        "rollout/policy_version": float(min(r.policy_version for r in rollouts)),
    }
    for name, vals in scores.per_reward.items():
        good = [v for v in vals if v is not None]
        m[f"reward/{name}"] = sum(good) / len(good) if good else 0.0
    m.update(failure_metrics(scores, "reward_errors"))
    return m


def evaluate(cfg: JobConfig, tokenizer, samplers, pool, eval_set: list[dict], recover=None, *,
             log: RewardLog | None = None, step: int = 0) -> dict:
    """Greedy completions of the eval split: exact-match accuracy (when answers exist) and mean reward.

    What was left out and why is reported: `eval/rollout_errors` (failed rollouts, scored as empty completions),
    `eval/reward_dropped` (samples whose reward failed: not in eval/reward_mean), `eval/reward_errors/<kind>`,
    and the failures themselves in `log` (logs/rewards.log)."""
    if not eval_set:
        return {}
    t0 = time.perf_counter()
    requests = [_request(cfg, tokenizer, s, n=1, seed=0, rid=f"eval-{i}", greedy=True) for i, s in enumerate(eval_set)]
    rollouts = generate(samplers, requests, recover)
    # a failed sample (finish_reason "error": a bad request, NaN logits) scores as an empty completion, whatever
    # partial text it carries
    texts = ["" if r.finish_reason == "error" else r.text for r in rollouts]
    m = {"eval/n": float(len(eval_set))}  # the items evaluated (a prompt file may hold fewer than data.eval_size)
    if all(s.get("answer") is not None for s in eval_set):
        hits = sum(exact_match(s["prompt"], t, s["answer"]) for s, t in zip(eval_set, texts))
        m["eval/accuracy"] = hits / len(eval_set)
    scores = get(pool.score([(s["prompt"], t, s) for s, t in zip(eval_set, texts)]))
    ok = [v for v in scores.totals if v is not None]
    m["eval/reward_mean"] = sum(ok) / len(ok) if ok else 0.0
    m["eval/rollout_errors"] = float(sum(r.finish_reason == "error" for r in rollouts))
    m["eval/reward_dropped"] = float(len(eval_set) - len(ok))
    m.update(failure_metrics(scores, "eval/reward_errors"))
    if log is not None and (line := log.write(step, "eval", scores)):
        print(f"rl4bit: eval/reward_mean leaves out {len(eval_set) - len(ok)} samples: {line}", file=sys.stderr)
    m["time/eval_s"] = time.perf_counter() - t0
    return m


def print_summary(run_dir: Path, records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    evals = [r for r in records if "eval/accuracy" in r]
    steps = [r for r in records if "reward/mean" in r]
    table = Table(title=f"run dir: {run_dir}")
    table.add_column("")
    table.add_column("before RL", justify="right")
    table.add_column("after RL", justify="right")
    if evals:
        table.add_row(f"eval/accuracy (step {evals[0]['step']} -> {evals[-1]['step']})",
                      f"{evals[0]['eval/accuracy']:.3f}", f"{evals[-1]['eval/accuracy']:.3f}")
    if steps:
        table.add_row("reward/mean (first -> last step)", f"{steps[0]['reward/mean']:.3f}",
                      f"{steps[-1]['reward/mean']:.3f}")
        table.add_row("mismatch/k3 (max over steps)", "", f"{max(r['mismatch/k3'] for r in steps):.3g}")
        wall = sum(r.get("time/step_s", 0) for r in steps)
        table.add_row("RL wall time (s)", "", f"{wall:.0f}")
    Console().print(table)
    print(f"run dir: {run_dir}")
