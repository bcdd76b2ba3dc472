"""A weight update's tensors broadcast over torch.distributed: trainer and samplers in different processes and on
different GPUs (NCCL), or CPU processes (gloo). No serialization, no hashing, no host copy on GPUs.

    broadcast_tensors(0, update=update, quantized=quantized, group=g)      # rank 0: `Trainer.weight_tensors()`
    broadcast_tensors(0, apply=sampler.apply_tensors, device=dev, group=g)  # every other rank

The values are `Trainer.weight_tensors`' (the QTensors the trainer's next forward uses, the FP32 masters), so a
receiver gets what the direct in-process path hands over, bit for bit, and applies it with the same call
(`Sampler.apply_tensors`: checked whole, all-or-nothing). Three phases, every rank in each:

1. the header (JSON: version, each tensor's name, dtype, shape), or an abort marker when the sender cannot build
   it; every receiver allocates the whole update on its device; the ranks agree that every one is ready
   (`weight_sync.first_failure`), else nothing moves;
2. one broadcast a tensor, as bytes (any dtype, FP8 included, crosses NCCL and gloo as uint8), in header order
   (an NCCL group carries the header and the agreements over gloo: `group_backend`);
3. each receiver applies the update; the ranks agree on the outcome. On any failure every rank raises
   WeightSyncError with the lowest failing rank's message: a receiver that failed keeps serving its previous
   version, one that applied serves the new one (the job stops: fail-stop, as the other paths).

Leaves out: integrity checks beyond the transport's (the bucket path's SHA-256), several trainer ranks (a
sharded trainer syncs by buckets), overlapping the transfer with the apply.
"""

from __future__ import annotations

import json
from typing import Callable

import torch

from rl4bit.common.weight_update import WeightUpdate
from rl4bit.kernels import QTensor
from rl4bit.trainer.weight_sync import WeightSyncError, bcast_header, first_failure

QFIELDS = ("data", "scale", "outer")


def group_backend(backend: str) -> str:
    """The backend string a weight-sync group is created with: NCCL groups also get gloo for CPU tensors (the
    header and the agreements, `weight_sync.bcast_bytes` / `first_failure`), which NCCL cannot carry."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def _check_device(device, backend: str, what: str) -> None:
    """The update's tensors cross NCCL as CUDA tensors, gloo as CPU ones: a ValueError naming `what` otherwise
    (before anything moves). `backend`: the group's, e.g. `cpu:gloo,cuda:nccl`."""
    kind = torch.device(device).type
    want = "cuda" if "nccl" in backend else "cpu"
    if kind != want:
        raise ValueError(f"{what} is on {device}, but this group ({backend}) moves the update as {want} tensors; "
                         f"{'put the update on the GPU' if want == 'cuda' else 'use an NCCL group for GPU tensors'}")


def _header(update: WeightUpdate, quantized: dict, backend: str) -> tuple[bytes, list[torch.Tensor]]:
    """(the header's bytes, the tensors in header order) of an update."""
    entries, tensors = [], []

    def add(key: list, t) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{'.'.join(map(str, key))} is a {type(t).__name__}, not a tensor")
        _check_device(t.device, backend, ".".join(map(str, key)))
        entries.append([key, str(t.dtype).removeprefix("torch."), list(t.shape)])
        tensors.append(t)

    for name, t in update.tensors.items():
        add(["dense", name], t)
    for module, params in quantized.items():
        for param, q in params.items():
            if not isinstance(q, QTensor):
                raise TypeError(f"{module}.{param} is a {type(q).__name__}, not a QTensor")
            for f in QFIELDS:
                add(["q", module, param, q.fmt, list(q.shape), f], getattr(q, f))
    header = {"version": update.version, "entries": entries}
    return json.dumps(header).encode(), tensors


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous uint8 view (a copy only when `t` is not contiguous) of t's bytes."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _allocate(header: dict, device) -> list[torch.Tensor]:
    out = []
    for _key, dtype, shape in header["entries"]:
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r} in the update header")
        out.append(torch.empty(shape, dtype=dt, device=device))
    return out


def _rebuild(header: dict, tensors: list[torch.Tensor]) -> tuple[WeightUpdate, dict]:
    dense, parts = {}, {}
    for (key, _dtype, _shape), t in zip(header["entries"], tensors):
        if key[0] == "dense":
            dense[key[1]] = t
        else:
            _, module, param, fmt, shape, field = key
            parts.setdefault((module, param, fmt, tuple(shape)), {})[field] = t
    quantized = {}
    for (module, param, fmt, shape), p in parts.items():
        quantized.setdefault(module, {})[param] = QTensor(p["data"], p["scale"], p["outer"], fmt, torch.Size(shape))
    return WeightUpdate(header["version"], dense), quantized


def broadcast_tensors(src: int, *, update: WeightUpdate | None = None, quantized: dict | None = None,
                      apply: Callable[[WeightUpdate, dict], object] | None = None, device=None, group=None) -> int:
    """Collective (every rank of `group` calls it): rank `src` passes `update` and `quantized` (on the device the
    backend moves: CUDA for NCCL, CPU for gloo); every other rank `apply` (called with the received update) and
    `device` (where to receive it). Returns the update's version; WeightSyncError on every rank when any failed."""
    import torch.distributed as dist

    me, backend = dist.get_rank(), str(dist.get_backend(group))
    version, header, tensors = None, None, []
    if me == src:
        def build() -> bytes:
            blob, tensors[:] = _header(update, quantized, backend)
            return blob

        _, error = bcast_header(src, build, group)
        version = update.version if error is None else None
    else:
        blob, error = bcast_header(src, None, group)
        if blob is not None:
            try:
                header = json.loads(blob)
                version = header["version"]
                _check_device(device, backend, f"rank {me}'s receiving device")
                tensors = _allocate(header, device)
            except Exception as e:  # a device OOM, most likely: nothing has moved yet
                error = (f"receiver on rank {me} could not take the update ({type(e).__name__}: {e}); "
                         "it keeps serving its previous version")
                tensors = []
    failed, msg = first_failure(error, group)  # every rank ready, or nothing moves
    if failed is None:
        for t in tensors:
            buf = _as_bytes(t)
            dist.broadcast(buf, src, group=group)
        if me != src:
            try:
                apply(*_rebuild(header, tensors))
            except WeightSyncError as e:
                error = str(e)
            except Exception as e:
                error = (f"receiver failed on rank {me} while applying v{version} ({type(e).__name__}: {e}); "
                         "it may be partly updated")
        failed, msg = first_failure(error, group)
    if failed is not None:
        raise WeightSyncError(error if error is not None else
                              f"weight sync v{version} by broadcast failed on rank {failed}: {msg}")
    return version


def local_address() -> str:
    """`tcp://IP:PORT` on this host with a free port, for the other members of a `SyncGroup` to reach: the IP of
    the interface that routes outward (no packet is sent), else the host name's, else the loopback."""
    import socket

    ip = "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            ip = s.getsockname()[0]
    except OSError:
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


class SyncGroup:
    """This process's membership of the weight-sync group: the trainer (rank 0) and the samplers (ranks 1..n), the
    process's torch.distributed default group. A process already in another group (a sharded trainer's ranks;
    vLLM's worker in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`) cannot join: ValueError saying so."""

    def __init__(self):
        self.address: str | None = None
        """The `init_method` of the group this process is in (None: none); the driver compares the members'."""

    def join(self, address: str, world: int, rank: int, backend: str, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        if self.address == address:
            return
        self.leave()
        if dist.is_initialized():
            raise ValueError("this process already has a torch.distributed group (a sharded trainer's, or vLLM's "
                             "worker in-process): updates by broadcast need one of their own; run vLLM in its own "
                             "process (unset VLLM_ENABLE_V1_MULTIPROCESSING) or set RL4BIT_WEIGHT_SYNC=buckets")
        dist.init_process_group(group_backend(backend), init_method=address, world_size=world, rank=rank,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.address = address

    def leave(self) -> None:
        """Leave the group (a member restarted: the rest rebuild it); no-op outside one."""
        import torch.distributed as dist

        if self.address is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.address = None
