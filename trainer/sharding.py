"""FSDP2 sharding of the Trainer's model: the process group, `fully_shard` units, gathers and sharded checkpoints.

    init_group(rank, world, addr, port)           # gloo on CPU, nccl on CUDA
    shard_model(model, device)                    # fully_shard per decoder layer, lm_head, then the base model
    with gathered(model, ["model.layers.0.mlp.experts", ...]):   # all ranks: all-gather those FSDP units
        ...                                       # the modules hold full, plain tensors here (weight sync)
    info = save_shard(tmp_dir, rank, world, tensors, global_shapes, meta)   # every rank, into the checkpoint's tmp dir
    files, index = merge_shards(infos)            # the group: manifest entries for
                                                  #   rl4bit.common.checkpoint.commit_checkpoint
    tensors, meta = load_shard(ckpt_dir, rank, world)                       # every rank: its own piece, verified

Every parameter is a DTensor sharded along dim 0 (masters, gradients and AdamW moments 1/world per rank); FSDP
all-gathers a unit before its forward, so the quantized modules quantize full tensors exactly as one process
does. Gradients are summed over ranks against a globally normalised loss: the one-process gradient up to
reduction order. Checkpoints use rl4bit.common.checkpoint's format, one `shard_RRRRR.safetensors` per rank.

Leaves out: resuming on another world size (load_shard refuses with the fix), multi-node rendezvous, HSDP / 2D
meshes, mixed-precision all-gathers."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save

from rl4bit.common.checkpoint import CheckpointError, read_manifest, read_verified, shard_file

# --------------------------------------------------------------------------- group and units


def init_group(rank: int, world: int, addr: str, port: int, device: torch.device) -> None:
    """Join the trainer group (gloo on CPU, nccl on CUDA); CUDA ranks use the device they were given."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialised in this process; "
                           "one trainer rank per process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    bind_world_defaults_early()
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)


def bind_world_defaults_early() -> None:
    """Import `torch.distributed.nn.functional` now, before any process group exists.

    Its functions take `group=group.WORLD` as a default argument, evaluated at its first import, and building a
    transformers model imports it (via `torch.distributed.fsdp`). Imported after `init_process_group`, it holds
    the default group for the life of the process: `destroy_process_group` then frees nothing, and gloo's
    threads and sockets are torn down inside interpreter finalization, where a gloo thread waiting for the GIL
    aborts the process ("terminate called without an active exception"). Call it before every
    `init_process_group` (the trainer group, the benchmarks' and the tests' worker processes)."""
    importlib.import_module("torch.distributed.nn.functional")


def close_group() -> None:
    """Barrier, then destroy the group (gloo can abort at exit without both)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def decoder_layers(model: torch.nn.Module):
    base = getattr(model, model.base_model_prefix)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `{model.base_model_prefix}.layers`; sharding expects a "
                         "transformers decoder-only model (Qwen3-MoE, OLMoE, Mixtral, Llama ...)")
    return base, layers


def shard_model(model: torch.nn.Module, device: torch.device, ignored_params=None) -> torch.nn.Module:
    """Apply FSDP2 in place; gradients are summed over ranks.

    Units: each decoder layer (attention, router, the QuantExperts' [E, N, K] masters, any QuantLinear),
    `lm_head`, then the base model (embeddings, final norm): the base model and lm_head are separate units
    because `sequence_logprobs` calls them separately. Gradients are reduce-scattered with divide factor 1: the
    loss is normalised by the global token / sequence count, so the sum is the one-process gradient up to the
    reduction order. `clip_grad_norm_` clips by the group's norm; `sr_step` folds the rank into the
    stochastic-rounding key.

    `ignored_params`: parameters FSDP leaves alone (the expert-parallel slices, already sharded).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    base, layers = decoder_layers(model)
    units = [*layers, model.get_output_embeddings(), base]
    ignored = set(ignored_params or ())
    for unit in units:
        fully_shard(unit, mesh=mesh, ignored_params=ignored or None)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (then / 1.0): gloo has no PREMUL_SUM
    return model


def is_sharded(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor as it is)."""
    return t.to_local() if is_sharded(t) else t


def full_value(t) -> torch.Tensor:
    """A DTensor gathered to every rank (a collective), a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


def _units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return {n: m for n, m in model.named_modules() if isinstance(m, FSDPModule)}


@contextmanager
def gathered(model: torch.nn.Module, module_names):
    """All-gather the FSDP units that own `module_names` (every rank must call it with the same names)."""
    units = _units(model)
    owners = []
    for name in module_names:
        parts = name.split(".") if name else []
        for i in range(len(parts), -1, -1):
            owner = ".".join(parts[:i])
            if owner in units:
                break
        else:
            raise ValueError(f"module {name!r} is in no FSDP unit; shard the model with shard_model first")
        if owner not in owners:
            owners.append(owner)
    for o in owners:
        units[o].unshard()
    try:
        yield
    finally:
        for o in owners:
            units[o].reshard()


def all_reduce(values: list[float], op=None) -> list[float]:
    """Sum (or `op`) Python floats over the group, in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.cpu().tolist()


def clip_grad_norm_(params, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ for a sharded model: the group's global L2 norm, every grad scaled by one coef.

    Every gradient here is this rank's disjoint piece of the whole (FSDP2 Shard(0)
    DTensors, expert-parallel slices), so the squared norm is the sum over ranks of
    the local pieces' squares (float64). Returns the norm (the same on every rank).
    """
    grads = [local(p.grad) for p in params if p.grad is not None]
    sq = float(torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()) if grads else 0.0  # one sync
    total = all_reduce([sq])[0] ** 0.5
    coef = min(max_norm / (total + 1e-6), 1.0)  # torch's rule; not applied to non-finite norms (the step is skipped)
    if coef < 1.0 and math.isfinite(total):
        for g in grads:
            g.mul_(coef)
    return total


def sr_step(step: int, rank: int, world: int) -> int:
    """The step key of the stochastic rounding on `rank`: step * world + rank (== step when world == 1).

    numerics.md: SR bits are keyed by (seed, step, layer, tensor id) so that runs are
    reproducible AND ranks do not share streams. Data-parallel ranks run the same
    modules at the same step on different data, so the rank is folded into the step
    key (injective for a fixed world size); one process keeps its keys bit for bit.
    Expert-parallel modules fold the rank into their call key instead (their combine
    RHT seed uses the plain step, which both ends of an all-to-all must agree on).
    """
    return step * world + rank


# --------------------------------------------------------------------------- sharded checkpoints


def shard_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """(start, length) of rank's dim-0 piece under torch.chunk (FSDP2's Shard(0) rule)."""
    chunk = -(-n // world) if n else 0
    start = min(rank * chunk, n)
    return start, min(chunk, n - start)


def save_shard(dir_: str | Path, rank: int, world: int, tensors: dict[str, torch.Tensor],
               global_shapes: dict[str, tuple], meta: dict) -> dict:
    """Write this rank's tensors and JSON meta; returns its index info. `global_shapes`: the DTensors' full shapes.

    The file holds the rank's local pieces (`DTensor.to_local()`: params, AdamW moments; replicated tensors such
    as the step count and its own RNG state as they are); the manifest adds `world` and, per tensor, its global
    shape, dtype and the dim-0 row range every rank holds. Nothing pickled (hence not torch.distributed.checkpoint,
    whose metadata file is pickled)."""
    info = {}
    for k, v in tensors.items():
        shape = tuple(global_shapes.get(k, tuple(v.shape)))
        sharded = k in global_shapes  # the DTensors: Shard(0) pieces
        rows = shard_rows(shape[0], rank, world) if sharded else None
        if sharded and (rows[1], *shape[1:]) != tuple(v.shape):
            raise ValueError(f"{k}: local shape {tuple(v.shape)} is not rank {rank}'s Shard(0) piece of {shape}")
        info[k] = {"shape": list(shape), "dtype": str(v.dtype).removeprefix("torch."),
                   "rows": list(rows) if rows else None}
    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                metadata={"meta": json.dumps(meta), "rank": str(rank), "world": str(world)})
    path = Path(dir_) / shard_file(rank)
    with open(path, "wb") as f:  # the caller fsyncs the directory tree and renames it into place
        f.write(data)
    return {"tensors": info, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def merge_shards(infos: list[dict]) -> tuple[dict, dict]:
    """The ranks' `save_shard` infos (rank order) -> (manifest files, manifest index {"world", "tensors"})."""
    tensors = {}
    for rank, info in enumerate(infos):
        for k, v in info["tensors"].items():
            e = tensors.setdefault(k, {"shape": v["shape"], "dtype": v["dtype"], "sharded": v["rows"] is not None,
                                       "rows": []})
            if v["shape"] != e["shape"]:
                raise ValueError(f"{k}: rank {rank} reports global shape {v['shape']}, rank 0 {e['shape']}")
            e["rows"].append(v["rows"])
    files = {shard_file(r): {"sha256": info["sha256"], "bytes": info["bytes"]} for r, info in enumerate(infos)}
    return files, {"world": len(infos), "tensors": tensors}


def load_shard(dir_: str | Path, rank: int, world: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(this rank's local tensors, its meta) from a sharded checkpoint written by the same world size, verified.

    CheckpointError (rl4bit.common.checkpoint's: naming the file and the previous intact
    checkpoint) for a missing, truncated or corrupted shard or another world size."""
    dir_ = Path(dir_)
    manifest = read_manifest(dir_)
    written = int(manifest.get("world", 1))
    if written != world:
        raise CheckpointError(f"{dir_} was written by {written} trainer rank(s), this group has {world}; "
                              f"resume with trainer.world_size={written}")
    name = shard_file(rank)
    data = read_verified(dir_, name, manifest)
    tensors = st_load(data)
    missing = set(manifest.get("tensors", {})) - set(tensors)
    if missing:
        raise CheckpointError(f"{dir_ / name} lacks {sorted(missing)[:3]}; the checkpoint is incomplete")
    meta = json.loads(_metadata(data)["meta"])
    return tensors, meta


def _metadata(data: bytes) -> dict:
    """The safetensors header's __metadata__ (JSON, read without deserialising any tensor)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8: 8 + n]).get("__metadata__", {})
