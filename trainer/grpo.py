"""GRPO as pure tensor functions: advantages, the PPO-clip loss, and its diagnostics.

- `group_advantages(rewards, group_size, valid=)`: A_i = (r_i - mean_g) / (std_g + eps)
  per group of `group_size` consecutive samples (std is the unbiased sample std,
  as TRL's GRPOTrainer; `normalize_std=False` keeps only the centring, Dr. GRPO),
  mean and std over the group's valid samples (the others get 0).
- `ppo_clip_loss(...)`: per token
  `max(-A * ratio, -A * clip(ratio, 1-eps, 1+eps))` with `ratio = exp(logp - old_logp)`,
  times a truncated importance weight `min(exp(old_logp - sampler_logp), cap)`
  when `tis_cap` is set (the sampler's tokens came from a slightly different
  policy, e.g. vLLM), plus `kl_coef * k3(ref || policy)` when a reference is
  given; aggregated by `aggregate`.
- `aggregate(values, mask, how, ...)`: "token_mean" (sum over every
  completion token / token count) or "seq_mean" (mean of per-sequence token
  means). `total_tokens` / `total_seqs` let micro-batches add up to exactly the
  full-batch value.
- `k3(logp, ref_logp)`: the k3 estimator of KL(pi || ref) from samples of pi,
  `exp(ref - logp) - (ref - logp) - 1` per token (computed as expm1(d) - d); >= 0 and 0 iff equal.

Tensors are [B, T] (B sequences, T completion positions, `mask` 1 on real
tokens). Leaves out: value functions, entropy bonus, sequence-level ratios (GSPO).
References: DeepSeekMath (GRPO), Schulman's k3, Yao et al. "Your efficient RL
framework secretly brings you off-policy RL training" (truncated IS).
"""

from __future__ import annotations

import math

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, valid: torch.Tensor | None = None,
                     normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized advantages for [P * G] rewards laid out group after group.

    valid: bool [P * G], False for samples without a reward (a failed rollout): the group's mean and std are taken
    over its valid samples alone and the others get advantage 0 (their values are never read). A group with
    fewer than two valid samples has no spread: advantage 0 throughout."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}; "
                         "pass prompts x samples_per_prompt rewards")
    r = rewards.float().view(-1, group_size)
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.view(-1, group_size).bool()
    r = torch.where(ok, r, 0.0)
    n = ok.sum(dim=1, keepdim=True).float()
    mean = r.sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = torch.where(ok, r - mean, 0.0)
    if normalize_std:
        std = (adv.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased over the valid
        adv = adv / (std + eps)
    return torch.where(n >= 2, adv, 0.0).view(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, *, total_tokens: float | None = None,
              total_seqs: float | None = None) -> torch.Tensor:
    """Reduce [B, T] per-token values to a scalar; totals default to this batch's counts."""
    mask = mask.to(values.dtype)
    if how == "token_mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1)
        return (values * mask).sum() / denom
    if how == "seq_mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        denom = total_seqs if total_seqs is not None else values.shape[0]
        return per_seq.sum() / denom
    raise ValueError(f"loss aggregation {how!r} is not one of token_mean, seq_mean")


def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) from tokens sampled by pi, as expm1(d) - d (d = ref - logp): the
    same value as exp(d) - d - 1 without its cancellation at small d (exp(d) - 1 loses everything below one
    ulp of 1.0, ~6e-8 in FP32, and could go negative); in the inputs' dtype (pass float64 for a metric)."""
    d = ref_logp - logp
    return torch.expm1(d) - d


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                  clip_eps: float = 0.2, agg: str = "token_mean", sampler_logp: torch.Tensor | None = None,
                  tis_cap: float | None = None, ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                  total_tokens: float | None = None, total_seqs: float | None = None) -> tuple[torch.Tensor, dict]:
    """The PPO-clip policy loss (scalar) and detached per-token statistics.

    `advantages` is [B] (one per sequence) or [B, T]. Statistics are sums over
    real tokens (so micro-batches add up): clipped tokens, ratio sum/min/max,
    TIS-truncated tokens, k3 to the reference.
    """
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = torch.maximum(-adv * ratio, -adv * clipped_ratio)
    m = mask.bool()
    sums = {}  # 0-dim statistics, read together below: one host read a call, no boolean-mask select (each a sync)
    if tis_cap is not None:
        if sampler_logp is None:
            raise ValueError("tis_cap is set but sampler_logp is missing; pass the sampler's per-token logprobs")
        raw = torch.exp(old_logp - sampler_logp).detach()
        weight = raw.clamp(max=tis_cap)
        per_token = per_token * weight
        sums["tis_truncated"] = ((raw > tis_cap) & m).sum()
    if ref_logp is not None and kl_coef > 0:
        kl = k3(logp, ref_logp)
        per_token = per_token + kl_coef * kl
        sums["kl_ref_sum"] = torch.where(m, kl.detach(), 0.0).sum()
    loss = aggregate(per_token, mask, agg, total_tokens=total_tokens, total_seqs=total_seqs)
    r = ratio.detach()
    sums.update(clipped=(((-adv * clipped_ratio) > (-adv * ratio)).detach() & m).sum(),
                ratio_sum=torch.where(m, r, 0.0).sum(), tokens=m.sum(),
                ratio_min=torch.where(m, r, math.inf).amin() if r.numel() else r.new_tensor(1.0),
                ratio_max=torch.where(m, r, -math.inf).amax() if r.numel() else r.new_tensor(1.0))
    stats = dict(zip(sums, torch.stack([v.double() for v in sums.values()]).tolist()))
    if not stats["tokens"]:  # no real token: the ratio's range is undefined, reported as 1
        stats["ratio_min"] = stats["ratio_max"] = 1.0
    return loss, stats
