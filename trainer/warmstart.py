"""Supervised warm start: teach the freshly built model the task's format before RL.

`supervised_warm_start(model, tokenizer, samples, steps, lr, batch_size, seed, chat)`
runs `steps` AdamW steps of teacher-forced cross-entropy on `prompt + answer +
<eos>` (loss on the answer and eos tokens only; the prompt's ids as the sampler
sends them, `rl4bit.trainer.tokenizer.prompt_ids`), `batch_size` samples drawn with a
seeded `random.Random`, through the model's stock forward (before the recipe
conversion: the warm start stands in for a pretrained checkpoint).
Returns {"warmup/loss_first", "warmup/loss_last"}.

Cached: the result is a function of the initial weights, the tokenizer, the
samples, the settings and the torch version, so a SHA-256 of all of them keys
`<cache>/warmstart/<key>.safetensors` (weights + the two losses as metadata;
written atomically, safetensors only, nothing pickled). The same config and
seed find it and load it instead of training (`warmup/cached` = 1 and
`warmup/cache` = its path in the result). `<cache>` is `$RL4BIT_CACHE_DIR`,
else `$XDG_CACHE_HOME/rl4bit`, else `~/.cache/rl4bit`; `RL4BIT_CACHE_DIR=off`
turns caching off. An unreadable cache file is ignored and rewritten.

Leaves out: learning-rate schedules, packing, evaluation (the driver's first
`eval/accuracy` measures the warm-started model), cache eviction (one file per
distinct warm start, the size of the model).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from rl4bit.common.atomic import atomic_write_bytes
from rl4bit.trainer.tokenizer import prompt_ids


def supervised_warm_start(model, tokenizer, samples: list[dict], *, steps: int, lr: float, batch_size: int,
                          seed: int, chat: bool = False) -> dict:
    if steps == 0:
        return {}
    if any(s.get("answer") is None for s in samples[:batch_size]):
        raise ValueError("the supervised warm start needs an 'answer' for every prompt; set run.warmup_sft_steps=0")
    path = cache_path(model, tokenizer, samples, steps=steps, lr=lr, batch_size=batch_size, seed=seed, chat=chat)
    if path is not None and (hit := _load_cached(model, path)) is not None:
        return hit
    result = _train(model, tokenizer, samples, steps=steps, lr=lr, batch_size=batch_size, seed=seed, chat=chat)
    if path is not None:
        _store(model, path, result)
        result["warmup/cache"] = str(path)
    return result


def cache_dir() -> Path | None:
    """Where warm starts are cached (see the module docstring); None when RL4BIT_CACHE_DIR=off."""
    env = os.environ.get("RL4BIT_CACHE_DIR")
    if env == "off":
        return None
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rl4bit"


def cache_path(model, tokenizer, samples: list[dict], **settings) -> Path | None:
    """`<cache>/warmstart/<sha256>.safetensors` of everything the warm start's result depends on."""
    root = cache_dir()
    if root is None:
        return None
    h = hashlib.sha256()
    dev = next(model.parameters()).device
    h.update(json.dumps({"torch": torch.__version__, "model": type(model).__name__, "device": dev.type,
                         "settings": settings, "vocab": sorted(tokenizer.get_vocab().items()),
                         "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}, default=str).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(json.dumps([(s["prompt"], s.get("answer")) for s in samples]).encode())
    return root / "warmstart" / f"{h.hexdigest()}.safetensors"


def _load_cached(model, path: Path) -> dict | None:
    from safetensors import SafetensorError
    from safetensors.torch import load

    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
        tensors = load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        model.load_state_dict(tensors, strict=True)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError):  # damaged or foreign: train again
        return None
    model.eval()
    return {"warmup/loss_first": float(meta["loss_first"]), "warmup/loss_last": float(meta["loss_last"]),
            "warmup/cached": 1.0, "warmup/cache": str(path)}


def _store(model, path: Path, result: dict) -> None:
    from safetensors.torch import save

    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}  # tied: copies
    meta = {"loss_first": repr(result["warmup/loss_first"]), "loss_last": repr(result["warmup/loss_last"])}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, save(tensors, metadata=meta))
    except OSError:  # a read-only or full cache: the run goes on, untouched
        pass


def _train(model, tokenizer, samples: list[dict], *, steps: int, lr: float, batch_size: int, seed: int,
           chat: bool) -> dict:
    rng = random.Random(seed + 7919)
    dev = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98))
    model.train()
    losses = []
    for _ in range(steps):
        batch = [samples[rng.randrange(len(samples))] for _ in range(batch_size)]
        seqs, masks = [], []
        for s in batch:
            p = prompt_ids(tokenizer, s["prompt"], chat)  # as the sampler sends it
            a = tokenizer(str(s["answer"]), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        t = max(map(len, seqs))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids = torch.tensor([s + [pad] * (t - len(s)) for s in seqs], device=dev)  # masked out below
        mask = torch.tensor([m + [0] * (t - len(m)) for m in masks], device=dev, dtype=torch.float32)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        m = mask[:, 1:].reshape(-1)
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.eval()
    return {"warmup/loss_first": losses[0], "warmup/loss_last": sum(losses[-10:]) / len(losses[-10:])}
