"""Device tensors shared between processes on one GPU by CUDA IPC, described as plain data.

    shared = share({"w": t})       # owner process: {name: description}; keep `t` alive until the peer is done
    views = open_shared(shared)     # another process on the same GPU: {name: tensor viewing the owner's memory}

A description holds only str / int / bool / bytes / lists (PyTorch's own IPC
handle, `torch.multiprocessing.reductions.reduce_tensor`, with its classes and
dtype written as names), so it crosses Ray, vLLM's RPC or JSON-like channels
without pickling. The GPU is named by its UUID: the peer finds it under its own
device index (its CUDA_VISIBLE_DEVICES may differ). No bytes are copied: the
peer reads the owner's memory, so the owner must not free or overwrite the
tensors until the peer has copied what it keeps (the caller's protocol, e.g. a
synchronous call that returns after the peer's copy). Leaves out: tensors on
another GPU (NCCL's business) and CPU tensors.
"""

from __future__ import annotations

import math

import torch

from rl4bit.common.weight_update import WeightUpdate
from rl4bit.kernels import QTensor

_FIELDS = ("size", "stride", "offset", "dtype", "device", "handle", "storage_size", "storage_offset",
           "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_uuid(device: torch.device) -> str | None:
    """The UUID of `device`'s GPU, or None off CUDA (where nothing is shared by IPC)."""
    return gpu_uuid(device.index or 0) if device.type == "cuda" else None


def share(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """{name: plain-data IPC description} of CUDA tensors (raises ValueError naming any that is not on CUDA)."""
    from torch.multiprocessing.reductions import reduce_tensor

    out = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: CUDA IPC shares CUDA tensors only (got {where}); send it another way")
        _, args = reduce_tensor(t.detach())
        d = dict(zip(_FIELDS, (list(args[1]), list(args[2]), args[3], str(args[5]).removeprefix("torch."),
                               *args[6:])))
        d["uuid"] = gpu_uuid(d["device"])
        out[name] = d
    return out


def _local_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise ValueError(f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES); CUDA IPC needs the "
                     "sender and receiver on the same GPU")


def open_shared(shared: dict[str, dict]) -> dict[str, torch.Tensor]:
    """{name: tensor} viewing the memory `share` described, on this process's index of the same GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    out = {}
    for name, d in shared.items():
        missing = [f for f in _FIELDS + ("uuid",) if f not in d]
        if missing:
            raise ValueError(f"{name}: not a CUDA IPC description (missing {missing}); build it with cuda_ipc.share")
        dtype = getattr(torch, d["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {d['dtype']!r}")
        out[name] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"], torch.storage.TypedStorage, dtype,
            _local_index(d["uuid"]), d["handle"], d["storage_size"], d["storage_offset"], d["requires_grad"],
            d["ref_counter_handle"], d["ref_counter_offset"], d["event_handle"], d["event_sync_required"])
    return out


def share_update(update: WeightUpdate, quantized: dict) -> dict:
    """Plain-data description of a weight update (`WeightUpdate` + {module: {param: QTensor}}, the values
    `Trainer.weight_tensors` returns) for a process on the same GPU; `open_update` reverses it."""
    qs = {}
    for module, params in quantized.items():
        for param, q in params.items():
            parts = {f: getattr(q, f) for f in ("data", "scale", "outer")}
            qs.setdefault(module, {})[param] = {"fmt": q.fmt, "shape": list(q.shape), "parts": share(parts)}
    return {"version": update.version, "dense": share(dict(update.tensors)), "quantized": qs}


def open_update(desc: dict) -> tuple[WeightUpdate, dict]:
    """(WeightUpdate, {module: {param: QTensor}}) viewing the sender's memory (see `share`'s lifetime rule)."""
    quantized = {}
    for module, params in desc["quantized"].items():
        for param, d in params.items():
            p = open_shared(d["parts"])
            quantized.setdefault(module, {})[param] = QTensor(p["data"], p["scale"], p["outer"], d["fmt"],
                                                              torch.Size(d["shape"]))
    return WeightUpdate(desc["version"], open_shared(desc["dense"])), quantized


def described_bytes(desc: dict) -> int:
    """Bytes of the tensors a `share_update` description names (what a receiver reads from the GPU)."""
    def nbytes(d: dict) -> int:
        return math.prod(d["size"]) * getattr(torch, d["dtype"]).itemsize

    total = sum(nbytes(d) for d in desc["dense"].values())
    return total + sum(nbytes(d) for params in desc["quantized"].values() for q in params.values()
                       for d in q["parts"].values())
