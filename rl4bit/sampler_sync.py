"""Weight sync in the job: bring every sampler to the trainer's weights (`sync_weights`; `sync_all` survives a
Sampler dying mid-update). The protocol itself is rl4bit.trainer.weight_sync; its benchmark is rl4bit.bench.sync.

Ships what the trainer's forward computes with: the quantized modules' own QTensors (no recalibration) and the
other tensors as FP32 masters; samplers switch version all-or-nothing. Three paths, one set of checks: direct
(`direct_sync`: trainer and samplers in this process; device tensors handed over, no serialization, hashing or
host copies), CUDA IPC (`shared_sync`: Ray actors on one GPU), SHA-256-stamped buckets otherwise.
`RL4BIT_WEIGHT_SYNC=buckets` forces the buckets (tests of the bucket protocol, benchmarks). A rejected update
raises WeightSyncError: the job stops, the samplers keep serving the previous version.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from rl4bit.actors import ActorDiedError, get, is_local
from rl4bit.config import ConfigError
from rl4bit.trainer.cuda_ipc import described_bytes
from rl4bit.trainer.weight_sync import WeightSyncError, update_bytes
from rl4bit.trainer_group import TrainerGroup

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
