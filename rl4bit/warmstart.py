"""Supervised warm start: teach the freshly built model the task's format before RL.

`supervised_warm_start(model, tokenizer, samples, steps, lr, batch_size, seed, chat)`
runs `steps` AdamW steps of teacher-forced cross-entropy on `prompt + answer +
<eos>` (loss on the answer and eos tokens only; the prompt's ids as the sampler
sends them, `rl4bit.tokenizer.prompt_ids`), `batch_size` samples drawn with a
seeded `random.Random`, through the model's stock forward (before the recipe
conversion: the warm start stands in for a pretrained checkpoint).
Returns {"warmup/loss_first", "warmup/loss_last"}.

Leaves out: learning-rate schedules, packing, evaluation (the driver's first
`eval/accuracy` measures the warm-started model).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from rl4bit.tokenizer import prompt_ids


def supervised_warm_start(model, tokenizer, samples: list[dict], *, steps: int, lr: float, batch_size: int,
                          seed: int, chat: bool = False) -> dict:
    if steps == 0:
        return {}
    if any(s.get("answer") is None for s in samples[:batch_size]):
        raise ValueError("the supervised warm start needs an 'answer' for every prompt; set run.warmup_sft_steps=0")
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
