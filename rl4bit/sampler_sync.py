"""Weight sync in the job: bring every sampler to the trainer's weights (`sync_weights`; `sync_all` survives a
Sampler dying mid-update). The protocol itself is rl4bit.trainer.weight_sync; its benchmark is rl4bit.bench.sync.

Ships what the trainer's forward computes with: the quantized modules' own QTensors (no recalibration) and the
other tensors as FP32 masters; samplers switch version all-or-nothing. Four paths, one set of checks: direct
(`direct_sync`: trainer and samplers in this process; device tensors handed over, no serialization, hashing or
host copies), CUDA IPC (`shared_sync`: Ray actors on one GPU), a broadcast of the same tensors over NCCL
(`broadcast_sync`: Ray actors, each sampler on a GPU of its own), SHA-256-stamped buckets otherwise.
`RL4BIT_WEIGHT_SYNC=buckets` forces the buckets (tests of the bucket protocol, benchmarks), `=broadcast` the
broadcast (gloo between CPU actors: its tests). A rejected update raises WeightSyncError: the job stops, the
samplers keep serving the previous version.
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
"""Environment switch: unset or `auto` (the fastest path the actors allow), `buckets` (always buckets),
`broadcast` (always the torch.distributed broadcast: Ray mode, one trainer rank)."""
SYNC_GROUP_TIMEOUT_S = 600.0
"""How long a member of the weight-sync group waits in one collective (a peer died mid-update) before failing."""


def _mode() -> str:
    mode = os.environ.get(WEIGHT_SYNC_ENV, "auto") or "auto"
    if mode not in ("auto", "buckets", "broadcast"):
        raise ConfigError(f"{WEIGHT_SYNC_ENV}={mode!r}: use auto (the fastest path the actors allow), buckets or "
                          "broadcast")
    return mode


def direct_sync(trainer, samplers) -> bool:
    """Whether `sync_weights` hands device tensors over directly: the trainer and every sampler are in-process
    (`local` mode) actors, the trainer is one rank (not a TrainerGroup), every sampler `accepts_tensors()`."""
    mode = _mode()
    if mode == "broadcast":
        _check_broadcast(trainer)
    if mode != "auto" or isinstance(trainer, TrainerGroup) or not is_local(trainer):
        return False
    return all(is_local(s) for s in samplers) and all(get([s.accepts_tensors() for s in samplers]))


def shared_sync(trainer, samplers) -> bool:
    """Whether `sync_weights` shares device memory by CUDA IPC: Ray actors in other processes, one trainer rank,
    and every sampler's engine on the trainer's GPU (the same UUID) and taking tensor updates."""
    if _mode() != "auto" or isinstance(trainer, TrainerGroup):
        return False
    uuid = get(trainer.gpu_uuid())
    return uuid is not None and all(get([s.accepts_tensors() for s in samplers])) and all(
        u == uuid for u in get([s.gpu_uuid() for s in samplers]))


def _check_broadcast(trainer) -> None:
    if isinstance(trainer, TrainerGroup) or is_local(trainer):
        raise ConfigError(f"{WEIGHT_SYNC_ENV}=broadcast needs Ray mode (actors in processes of their own) and one "
                          "trainer rank; unset it (local mode hands tensors over directly)")


def broadcast_sync(trainer, samplers) -> str | None:
    """The torch.distributed backend `sync_weights` broadcasts the update's tensors with (`tensor_broadcast`), or
    None. `nccl` for Ray actors (one trainer rank) whose samplers each have a GPU of their own, none the trainer's
    (NCCL takes one rank a GPU), all taking tensor updates; `RL4BIT_WEIGHT_SYNC=broadcast` forces it (`gloo` off
    CUDA), and is refused in local mode or with a trainer group."""
    mode = _mode()
    if mode == "buckets" or (mode == "auto" and (isinstance(trainer, TrainerGroup) or is_local(trainer))):
        return None
    if mode == "broadcast":
        _check_broadcast(trainer)
    if not all(get([s.accepts_tensors() for s in samplers])):
        return None
    uuid, uuids = get(trainer.gpu_uuid()), get([s.gpu_uuid() for s in samplers])
    on_gpus = uuid is not None and None not in uuids
    if mode == "broadcast":
        return "nccl" if on_gpus else "gloo"
    return "nccl" if on_gpus and uuid not in uuids and len(set(uuids)) == len(uuids) else None


def _join_group(trainer, samplers, backend: str) -> None:
    """Every actor in one weight-sync group (trainer rank 0, sampler i rank i + 1); rebuilt when the members'
    groups differ (first sync, a restarted sampler)."""
    groups = get([trainer.sync_group()] + [s.sync_group() for s in samplers])
    if groups[0] is not None and all(g == groups[0] for g in groups):
        return
    address, world = get(trainer.sync_address()), len(samplers) + 1
    get([trainer.join_sync_group(address, world, backend, SYNC_GROUP_TIMEOUT_S)]
        + [s.join_sync_group(address, world, i + 1, backend, SYNC_GROUP_TIMEOUT_S) for i, s in enumerate(samplers)])


def sync_weights(trainer, samplers) -> tuple[int, float]:
    """Push the trainer's weights into every sampler; (bytes handed over in all, seconds).

    Direct (`direct_sync`: all in this process): one `Trainer.weight_tensors` update, applied by each sampler
    (`Sampler.apply_tensors`); bytes are the update's tensor bytes (`update_bytes`) per sampler. CUDA IPC
    (`shared_sync`: Ray actors on one GPU): the samplers read the trainer's device tensors, described by
    `Trainer.weight_shared`; no bytes on the host. Broadcast (`broadcast_sync`: Ray actors on GPUs of their own):
    `Trainer.broadcast_weights` sends the same tensors to every `Sampler.receive_weights` over one NCCL group.
    Buckets otherwise: in ray mode each bucket goes trainer -> object store -> samplers (the future is passed on,
    never fetched here). Whichever path, any failure aborts the update on every sampler and raises
    WeightSyncError: fail-stop, the old version keeps serving.
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
        elif backend := broadcast_sync(trainer, samplers):  # the same tensors, broadcast to the samplers' GPUs
            _join_group(trainer, samplers, backend)
            sent = get([trainer.broadcast_weights()] + [s.receive_weights() for s in samplers])[0]
            shipped = len(samplers) * sent
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


def update_phases(samplers) -> dict[str, float]:
    """`sync/<phase>_s` of the first sampler's last update (`Sampler.update_phases`: vLLM's check, encode,
    reload, repack, reset ...); {} where its engine does not time them."""
    return {f"sync/{k}_s": v for k, v in get(samplers[0].update_phases()).items()}


def sync_all(trainer, samplers, recover: Callable[[ActorDiedError], bool] | None = None) -> tuple[int, float]:
    """`sync_weights` that survives a Sampler dying mid-update: `recover` re-sends the weights to the restarted one
    (and to the others, whose update was aborted)."""
    try:
        return sync_weights(trainer, samplers)
    except ActorDiedError as e:
        if recover is None or not recover(e):
            raise
        return recover.last_sync
