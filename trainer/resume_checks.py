"""What keeps a checkpoint's trainer state from resuming this trainer: checked whole before anything is loaded.

    problems = state_problems(trainer, tensors, meta)     # [] or one line per problem
    problem = config_problem(saved, cfg)                   # the job settings the state depends on

A checkpoint whose checksums match can still be wrong for this job: written for another model or recipe (the
parameters of every recipe are FP32 masters of the same shapes, so a resume under another recipe would load
without a complaint), or holding a tensor of another dtype or shape, NaN/Inf, or no optimizer moments after
optimizer steps. Each problem names the tensor or setting and what to do; `Trainer.load_state` raises them as
one CheckpointError before it changes any state.

Leaves out: the pieces of a sharded trainer (world > 1) are checked for dtype and NaN/Inf only (their shapes are
local pieces; the manifest's global shapes are checked where they are loaded), and a sharded resume meets
`config_problem` after its ranks loaded their pieces (the job stops there, before any step or write).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from rl4bit.kernels.checks import all_finite

CONFIG_SECTIONS = {
    "model": ("path", "tiny", "hidden_size", "num_layers", "num_experts", "experts_per_token",
              "expert_intermediate_size", "num_heads"),
    "recipe": None,  # every recipe field
}
"""The settings a trainer state is tied to (None: the whole section); the others (dtype, max_seq_len, kernels,
learning rate, batch sizes) may change on resume."""

META_KEYS = ("opt_steps", "version", "nonfinite_in_a_row", "python_rng")


def job_settings(cfg) -> dict:
    """The CONFIG_SECTIONS settings of a job config, JSON-able (stored in each checkpoint's meta)."""
    out = {}
    for section, keys in CONFIG_SECTIONS.items():
        values = dataclasses.asdict(getattr(cfg, section))
        out[section] = values if keys is None else {k: values[k] for k in keys}
    return out


def job_differences(saved: dict | None, cfg, label: str = "this job") -> list[str]:
    """Each model or recipe setting in which `cfg` differs from the job that wrote a checkpoint (`saved`, from
    `job_settings`), as "section.key: checkpoint X, <label> Y". A checkpoint without them (written before they
    were stored), or a section it lacks, is not checked."""
    if not isinstance(saved, dict):
        return []
    return [f"{section}.{k}: checkpoint {saved[section].get(k)!r}, {label} {v!r}"
            for section, values in job_settings(cfg).items() if isinstance(saved.get(section), dict)
            for k, v in values.items() if saved[section].get(k) != v]


def config_problem(saved: dict | None, cfg) -> str | None:
    """What makes the checkpoint's job (`saved`) another than `cfg`'s for a resume (`job_differences`), or None."""
    diffs = job_differences(saved, cfg)
    if not diffs:
        return None
    return (f"the checkpoint was written by a job with other settings ({'; '.join(diffs)}): its state only fits "
            f"that model and recipe. Resume without overriding them, or start a new run")


def state_problems(trainer, tensors: dict[str, torch.Tensor], meta: dict) -> list[str]:
    """Every reason `trainer.load_state(tensors, meta)` would load a state that does not fit `trainer`."""
    problems = [f"state.json lacks trainer.{k}" for k in META_KEYS if k not in meta]
    problems += [f"trainer.{k}: {meta[k]!r} is not a count" for k in META_KEYS[:3]
                 if k in meta and (type(meta[k]) is not int or meta[k] < 0)]
    if "python_rng" in meta:
        try:
            state = meta["python_rng"]
            random.Random().setstate((state[0], tuple(state[1]), state[2]))
        except (TypeError, ValueError, IndexError):
            problems.append("trainer.python_rng: not a Python random state")
    if trainer.ref_model is not None and not any(k.startswith("ref.") for k in tensors):
        problems.append("no KL reference model (written with rl.kl_coef=0, or by an rl4bit that did not save it), so "
                        "rl.kl_coef > 0 cannot resume against the run's reference; resume with -o rl.kl_coef=0")
    whole = trainer.world == 1
    for prefix, model in (("model.", trainer.model), ("ref.", trainer.ref_model)):
        if model is None:
            continue
        for name, live in model.state_dict().items():
            v = tensors.get(prefix + name)
            if v is not None:
                problems += _tensor_problems(prefix + name, v, live, whole)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    moments = 0
    for p in (q for g in trainer.optimizer.param_groups for q in g["params"]):
        name = names[id(p)]
        for k in ("exp_avg", "exp_avg_sq"):
            v = tensors.get(f"optim.{name}.{k}")
            if v is not None:
                moments += 1
                problems += _tensor_problems(f"optim.{name}.{k}", v, p, whole)
    steps = meta.get("opt_steps")
    if type(steps) is int and steps > 0 and moments == 0:
        problems.append(f"no AdamW moments for a state after {meta['opt_steps']} optimizer steps (optim.* tensors "
                        f"missing)")
    rng = tensors.get("rng.torch_cpu")
    if rng is None or rng.dtype != torch.uint8 or rng.dim() != 1:
        problems.append("rng.torch_cpu: missing or not a uint8 vector (torch's CPU generator state)")
    cuda = tensors.get("rng.torch_cuda")
    if cuda is not None and (cuda.dtype != torch.uint8 or cuda.dim() != 1):
        problems.append("rng.torch_cuda: not a uint8 vector (torch's CUDA generator state)")
    return problems


def _tensor_problems(name: str, v: torch.Tensor, live: torch.Tensor, whole: bool) -> list[str]:
    live_local = live.to_local() if hasattr(live, "to_local") else live
    if v.dtype != live_local.dtype:
        return [f"{name}: dtype {v.dtype}, the trainer's is {live_local.dtype}"]
    if whole and tuple(v.shape) != tuple(live_local.shape):
        return [f"{name}: shape {tuple(v.shape)}, the trainer's is {tuple(live_local.shape)}"]
    if v.is_floating_point() and not all_finite(v):
        return [f"{name}: holds NaN/Inf values"]
    return []
