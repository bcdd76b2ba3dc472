"""Rollouts: a step's requests (`rollout_requests`), spread over the samplers (`generate`), the eval split's
greedy ones (`evaluate`), and a step's rollout and reward metrics (`rollout_metrics`).

Seeds are keyed by (run.seed, step, prompt index), so a redone step samples the same rollouts and no sampler RNG
state needs saving. A Sampler actor that dies mid-rollout or mid-sync is restarted by Ray (`ray.sampler_restarts`
a job); `SamplerRecovery` waits for it and re-sends the current weights, and the rollouts (or the cut-off update)
are redone.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

from rl4bit.actors import ActorDiedError, get, wait_alive
from rl4bit.config import JobConfig
from rl4bit.kernels.philox import derive_seed
from rl4bit.reward_log import RewardLog, failure_metrics
from rl4bit.rewards import exact_match
from rl4bit.sampler.types import MAX_SEED, Request, SamplingParams
from rl4bit.sampler_sync import sync_weights
from rl4bit.trainer.tokenizer import prompt_ids


class SamplerRecovery:
    """What `generate` does when a Sampler actor died: wait for Ray's restart, re-send the current weights.

    Called with the ActorDiedError; returns True when the rollouts may be redone,
    False (the caller re-raises) for another actor or past `budget` restarts.
    """

    def __init__(self, trainer, samplers, budget: int):
        self.trainer, self.samplers, self.budget, self.used = trainer, samplers, budget, 0
        self.last_sync = (0, 0.0)  # (bytes, seconds) of the re-send

    def __call__(self, err: ActorDiedError) -> bool:
        if err.actor != "Sampler" or self.used >= self.budget:
            return False
        self.used += 1
        print(f"rl4bit: {err}; Ray restarts it ({self.used}/{self.budget} restarts this job); "
              "re-sending the current weights and redoing the rollouts or the update it cut off", file=sys.stderr)
        health = [wait_alive(s) for s in self.samplers]
        version = get(self.trainer.weight_header())[0]
        stale = [s for s, h in zip(self.samplers, health) if h["version"] < version]
        self.last_sync = sync_weights(self.trainer, stale) if stale else (0, 0.0)
        return True


def _request(cfg: JobConfig, tokenizer, sample: dict, *, n: int, seed: int, rid: str, greedy: bool = False) -> Request:
    s = cfg.sampler
    params = SamplingParams(
        temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        max_new_tokens=s.max_new_tokens, stop=list(s.stop), n=n, seed=seed,
        ignore_eos=s.ignore_eos and not greedy,
    )
    ids = prompt_ids(tokenizer, sample["prompt"], cfg.data.chat_template)
    return Request(id=rid, prompt_ids=ids, params=params, prompt=sample["prompt"])


def generate(samplers, requests: list[Request], recover: Callable[[ActorDiedError], bool] | None = None):
    """Split requests into contiguous shards, one per sampler; rollouts come back in request order.

    A dead sampler: `recover(err)` (SamplerRecovery) readies the restarted one and
    every shard is generated again (seeded requests: the same rollouts).
    """
    k = len(samplers)
    bounds = [round(i * len(requests) / k) for i in range(k + 1)]
    shards = [requests[bounds[i]: bounds[i + 1]] for i in range(k)]
    while True:
        try:
            results = get([s.generate(shard) for s, shard in zip(samplers, shards) if shard])
            return [r for part in results for r in part]
        except ActorDiedError as e:
            if recover is None or not recover(e):
                raise


def rollout_requests(cfg: JobConfig, tokenizer, prompts: list[dict], step: int) -> list[Request]:
    """A request of rl.samples_per_prompt completions per prompt, seeded by (run.seed, step, prompt index) so
    a redone step samples the same rollouts."""
    # seeds folded to 63 bits, as the engines fold them into their noise keys anyway (the same noise)
    return [_request(cfg, tokenizer, p, n=cfg.rl.samples_per_prompt,
                     seed=derive_seed(cfg.run.seed, step, i) & MAX_SEED, rid=f"{step}-{i}")
            for i, p in enumerate(prompts)]


def rollout_metrics(rollouts, totals, scores, group: int, sample_s: float) -> dict:
    ok = [v for v in totals if v is not None]
    groups = [[v for v in totals[g: g + group] if v is not None] for g in range(0, len(totals), group)]
    comp = [len(r.completion_ids) for r in rollouts]
    m = {
        "reward/mean": sum(ok) / len(ok) if ok else 0.0,
        "reward/std": statistics.pstdev(ok) if len(ok) > 1 else 0.0,
        "reward/errors": float(scores.errors),
        "reward/zero_spread_frac": sum(1 for g in groups if len(g) < 2 or max(g) == min(g)) / len(groups),
        "rollout/clipped_frac": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        "rollout/errors": float(sum(r.finish_reason == "error" for r in rollouts)),
        "rollout/completion_len_mean": sum(comp) / len(comp),
        "rollout/completion_len_max": float(max(comp)),
        "rollout/prompt_len_mean": sum(len(r.prompt_ids) for r in rollouts) / len(rollouts),
        "rollout/tokens_per_s": sum(comp) / max(sample_s, 1e-9),
        "rollout/policy_version": float(min(r.policy_version for r in rollouts)),
    }
    for name, vals in scores.per_reward.items():
        good = [v for v in vals if v is not None]
        m[f"reward/{name}"] = sum(good) / len(good) if good else 0.0
    m.update(failure_metrics(scores, "reward_errors"))
    return m


def evaluate(cfg: JobConfig, tokenizer, samplers, pool, eval_set: list[dict], recover=None, *,
             log: RewardLog | None = None, step: int = 0) -> dict:
    """Greedy completions of the eval split: exact-match accuracy (when answers exist) and mean reward.

    What was left out and why is reported: `eval/rollout_errors` (failed rollouts, scored as empty completions),
    `eval/reward_dropped` (samples whose reward failed: not in eval/reward_mean), `eval/reward_errors/<kind>`,
    and the failures themselves in `log` (logs/rewards.log)."""
    if not eval_set:
        return {}
    t0 = time.perf_counter()
    requests = [_request(cfg, tokenizer, s, n=1, seed=0, rid=f"eval-{i}", greedy=True) for i, s in enumerate(eval_set)]
    rollouts = generate(samplers, requests, recover)
    # a failed sample (finish_reason "error": a bad request, NaN logits) scores as an empty completion, whatever
    # partial text it carries
    texts = ["" if r.finish_reason == "error" else r.text for r in rollouts]
    m = {"eval/n": float(len(eval_set))}  # the items evaluated (a prompt file may hold fewer than data.eval_size)
    if all(s.get("answer") is not None for s in eval_set):
        hits = sum(exact_match(s["prompt"], t, s["answer"]) for s, t in zip(eval_set, texts))
        m["eval/accuracy"] = hits / len(eval_set)
    scores = get(pool.score([(s["prompt"], t, s) for s, t in zip(eval_set, texts)]))
    ok = [v for v in scores.totals if v is not None]
    m["eval/reward_mean"] = sum(ok) / len(ok) if ok else 0.0
    m["eval/rollout_errors"] = float(sum(r.finish_reason == "error" for r in rollouts))
    m["eval/reward_dropped"] = float(len(eval_set) - len(ok))
    m.update(failure_metrics(scores, "eval/reward_errors"))
    if log is not None and (line := log.write(step, "eval", scores)):
        print(f"rl4bit: eval/reward_mean leaves out {len(eval_set) - len(ok)} samples: {line}", file=sys.stderr)
    m["time/eval_s"] = time.perf_counter() - t0
    return m
