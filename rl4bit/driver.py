"""`rl4bit train CONFIG [--out DIR] [--resume RUN_DIR]`: the GRPO loop, top to bottom.

    for step in 1..rl.steps:
        sample    prompts_per_step prompts x samples_per_prompt completions   (Sampler actors)
        score     every completion with the configured rewards                (RewardPool actor)
        advantage group-normalized per prompt                                 (trainer.grpo)
        train     ppo_epochs optimizer steps                                  (Trainer actor)
        sync      the new weights into every sampler                          (rl4bit.sampler_sync)
        evaluate  greedy accuracy on the eval split, every data.eval_every
        log       metrics.jsonl + TensorBoard + progress bar
        checkpoint every run.checkpoint_every steps (and at the end)

`run` is that loop, one call a phase; the set-up before it is in named helpers
(`load_inputs`, `start_actors`, `warm_start` or `restore`, `open_logger`). What
the loop calls lives in one module a concept: rl4bit.rollouts (requests,
`generate`, `evaluate`, a dead sampler's recovery), rl4bit.sampler_sync (weight
sync), rl4bit.run_state (checkpoints, `--resume`), rl4bit.rundir (the run dir).
Actors are plain classes (`Trainer`, `Sampler`, `RewardPool`) built through
`rl4bit.actors.Cluster`: Ray actors in `ray` mode, in-process objects in
`local` mode; every call below is `get(actor.method(...))` either way.
`trainer.world_size` = N > 1: the Trainer is a `rl4bit.trainer_group.TrainerGroup`
of N ranks (FSDP2, and expert parallelism when `trainer.expert_parallel` = N)
with the Trainer's methods: Ray actors in `ray` mode, `python -m
rl4bit.trainer_group` processes in `local` mode. Its train_step metrics are
logged as they come, including the expert-parallel wire bytes `comm/*`;
checkpoints take the one path (every rank writes its own state), `--resume`
needs the same N, and the group is shut down (barrier, process group destroyed)
before the cluster.

Before any actor starts, every reward is imported and called once in a
reward worker (fail fast, naming the reward). The first `eval/accuracy` (step 0) is
the warm-started model's, before any RL step. `--resume RUN_DIR` reloads the
run's stored config (overrides still apply, e.g. `-o rl.steps=40`, and config.yaml
then records them) and its latest checkpoint, and continues; on CPU the metrics
after the checkpoint equal an uninterrupted run's (time and throughput aside). A
resume with no step left to run is refused before anything starts.

Weight sync ships the quantized modules' own QTensors (NVFP4 codes + scales, or
MXFP8) and the other tensors as FP32 masters; samplers serve those QTensors and
switch version all-or-nothing. In `local` mode with one trainer rank and embedded
samplers the trainer's device tensors are handed over directly (`sync/direct` = 1;
`RL4BIT_WEIGHT_SYNC=buckets` forces SHA-256-stamped buckets).

Sampling randomness is keyed by (run.seed, step, prompt index), so no sampler
RNG state needs saving. Faults (tests/reliability): a Sampler actor that dies
mid-rollout or mid-sync is restarted by Ray (up to `ray.sampler_restarts` times
a job), the samplers get the current weights again and the step's rollouts
are redone (same seeds, so the same rollouts); a dead Trainer, K non-finite steps in a
row, a rejected weight update (the samplers keep serving the previous version), a
corrupt checkpoint or running out of GPU memory (`OutOfMemory`: which phase at
which step, the settings that shrink that phase with this job's values) stop the
job with a clear error (`rl4bit train: error: ...`, exit status 1) that names
what failed and, where it applies, the `--resume` command. Output paths are
resolved and checked before anything is written.

Leaves out: asynchronous (off-policy) rollouts, partial-group retries,
multi-node placement, restarting the Trainer in place (resume instead),
resuming on another trainer.world_size.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rl4bit import samples as samples_log
from rl4bit.actors import ActorDiedError, Cluster, get
from rl4bit.config import (
    ConfigError,
    JobConfig,
    absolute_reward_spec,
    anchored,
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
from rl4bit.metrics import MetricsLogger, PhasePeaks, StepPhases, plot, read_metrics
from rl4bit.parity_stats import check_reference, live_parity_metrics
from rl4bit.reward_log import RewardLog
from rl4bit.reward_pool import RewardPool, check_rewards
from rl4bit.rollouts import SamplerRecovery, evaluate, generate, rollout_metrics, rollout_requests
from rl4bit.run_state import check_steps_left, open_logger, restore, save_trainer
from rl4bit.rundir import checked_out_dir, create_run_dir, forget_unstarted
from rl4bit.sampler_sync import direct_sync, sync_all, update_phases
from rl4bit.tasks import PromptStream, check_batch_fits, check_prompt_lengths, load_task, warmup_split
from rl4bit.trainer.actor import TrainBatch, Trainer
from rl4bit.trainer.grpo import group_advantages
from rl4bit.trainer.models import autocast_dtype, build_policy_model
from rl4bit.trainer.resume_checks import job_settings
from rl4bit.trainer.tokenizer import build_tokenizer, check_chat_template, prompt_ids
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
        check_steps_left(run_dir, cfg)
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
            forget_unstarted(run_dir, created)
    return 0


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
                      **update_phases(samplers), **phases.times("sample", "score", "train"), "time/sync_s": sync_s,
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


def reward_limits(cfg: JobConfig) -> dict:
    """RewardPool's per-call limits from the rewards section (memory_mb / cpu_s default where the config lacks them)."""
    r = cfg.rewards
    return {"timeout_s": r.timeout_s, "memory_mb": int(getattr(r, "memory_mb", 2048)),
            "cpu_s": getattr(r, "cpu_s", None)}


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


def _replica(i: int, replicas: int) -> str:
    """The name a sampler replica's errors give it."""
    return "Sampler" if replicas == 1 else f"Sampler {i + 1} of {replicas}"


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


# --------------------------------------------------------------------------- the steps' pieces


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


def _due(every: int, step: int) -> bool:
    """Whether `step` is one of every `every` steps (0: never)."""
    return bool(every) and step % every == 0


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
