"""A Trainer's resumable state as tensors and JSON-able metadata: what `Trainer.state` collects and
`Trainer.load_state` restores (`rl4bit.common.checkpoint` writes them; `resume_checks` vets them first).

    tensors, meta = collect(trainer)      # model, AdamW moments, torch RNG, the KL reference model when there is one
    restore(trainer, tensors, meta)       # after setup_rl; CheckpointError before anything changes if they do not fit

Sharded trainers (world > 1) hold and restore their own pieces; meta["global_shapes"] names the sharded ones.
"""

from __future__ import annotations

import random

import torch

from rl4bit.common.checkpoint_format import CheckpointError


def collect(trainer) -> tuple[dict[str, torch.Tensor], dict]:
    """Everything to resume: tensors (model, AdamW moments, torch RNG, the KL reference model when there is
    one) and JSON-able metadata.

    Sharded (world > 1): this rank's pieces, and meta["global_shapes"] of the sharded ones.
    """
    from_local = {}
    if trainer.world > 1:
        from rl4bit.trainer.expert_parallel import expert_params
        from rl4bit.trainer.sharding import is_sharded, local

        ep_shapes = {}  # the expert slices and their AdamW moments are Shard(0) pieces of the global [E, ...]
        for n, (p, shape) in expert_params(trainer.model).items():
            global_shape = list(shape)
            ep_shapes[f"model.{n}"] = ep_shapes[f"optim.{n}.exp_avg"] = global_shape
            ep_shapes[f"optim.{n}.exp_avg_sq"] = global_shape
        if trainer.ref_model is not None:
            for n, (p, shape) in expert_params(trainer.ref_model).items():
                ep_shapes[f"ref.{n}"] = list(shape)

        def cpu(name, v):
            if is_sharded(v):
                from_local[name] = list(v.shape)
            elif name in ep_shapes:
                from_local[name] = ep_shapes[name]
            return local(v).detach().to("cpu", copy=True)
    else:
        def cpu(name, v):
            return v.detach().to("cpu", copy=True)
    tensors = {f"model.{k}": cpu(f"model.{k}", v) for k, v in trainer.model.state_dict().items()}
    if trainer.ref_model is not None:  # the KL reference: the policy at RL start, which a resume cannot rebuild
        tensors |= {f"ref.{k}": cpu(f"ref.{k}", v) for k, v in trainer.ref_model.state_dict().items()}
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for p, st in trainer.optimizer.state.items():
        for k, v in st.items():
            key = f"optim.{names[id(p)]}.{k}"
            tensors[key] = cpu(key, torch.as_tensor(v))
    tensors["rng.torch_cpu"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        tensors["rng.torch_cuda"] = torch.cuda.get_rng_state(trainer.device)
    meta = {
        "opt_steps": trainer.opt_steps,
        "version": trainer.version,
        "nonfinite_in_a_row": trainer.nonfinite_in_a_row,
        "python_rng": _py_rng_state(),
    }
    if trainer.world > 1:
        meta["global_shapes"] = from_local
    return tensors, meta


def restore(trainer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Restore `state()` (call after setup_rl). CheckpointError, before anything changes, when the state
    does not fit this trainer (`resume_checks.state_problems`: dtypes, shapes, NaN/Inf, missing parts)."""
    from rl4bit.trainer.resume_checks import state_problems

    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    missing = set(trainer.model.state_dict()) - set(model_sd)
    if missing:
        raise CheckpointError(f"checkpoint lacks model tensors {sorted(missing)[:3]}; it was written for another "
                              f"model config")
    problems = state_problems(trainer, tensors, meta)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"the checkpoint's trainer state does not fit this trainer: {'; '.join(problems[:5])}"
                              f"{more}. Resume from an earlier checkpoint (delete this one) or start a new run")
    if trainer.world == 1:
        trainer.model.load_state_dict(model_sd, strict=True)
    else:
        _load_local_pieces(trainer.model, model_sd)
    if trainer.ref_model is not None:
        ref_sd = {k[len("ref."):]: v for k, v in tensors.items() if k.startswith("ref.")}  # present: checked
        if trainer.world == 1:
            trainer.ref_model.load_state_dict(ref_sd, strict=True)
        else:
            _load_local_pieces(trainer.ref_model, ref_sd)
    for name, p in trainer.model.named_parameters():
        st = {k.rsplit(".", 1)[1]: v for k, v in tensors.items()
              if k.startswith(f"optim.{name}.") and k.count(".") == name.count(".") + 2}
        if st:
            trainer.optimizer.state[p] = {k: _like(trainer, p, v) if k != "step" else v.clone() for k, v in st.items()}
    torch.set_rng_state(tensors["rng.torch_cpu"])
    if "rng.torch_cuda" in tensors and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(tensors["rng.torch_cuda"], trainer.device)
    trainer.opt_steps, trainer.version = int(meta["opt_steps"]), int(meta["version"])
    trainer.nonfinite_in_a_row = int(meta["nonfinite_in_a_row"])
    random.setstate(_to_py_rng(meta["python_rng"]))


def _like(trainer, p, v: torch.Tensor) -> torch.Tensor:
    """An optimizer moment for parameter p from its stored piece (a DTensor shaped like p when sharded)."""
    v = v.to(trainer.device, copy=True)
    if trainer.world == 1 or not hasattr(p, "device_mesh"):  # one process, or a plain (expert-parallel) slice
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

def _load_local_pieces(model, model_sd: dict[str, torch.Tensor]) -> None:
    from rl4bit.trainer.sharding import local

    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    with torch.no_grad():
        for k, v in model_sd.items():
            dst = local(targets[k])
            if dst.shape != v.shape:
                raise ValueError(f"checkpoint piece {k} is {tuple(v.shape)}, this rank holds {tuple(dst.shape)}; "
                                 "resume with the trainer.world_size the checkpoint was written with")
            dst.copy_(v)



def _py_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _to_py_rng(state: list) -> tuple:
    return (state[0], tuple(state[1]), state[2])
