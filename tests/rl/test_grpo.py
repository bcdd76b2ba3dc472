"""GRPO math against hand-computed values (trainer/grpo.py)."""

import math

import pytest
import torch

from rl4bit.trainer import grpo


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo.group_advantages(r, 4, eps=0.0 + 1e-6)
    # group 1: mean 0.5, unbiased std sqrt(1/3); group 2: zero spread -> 0
    s = math.sqrt(1 / 3)
    expect = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expect, rel=1e-5)
    centred = grpo.group_advantages(r, 4, normalize_std=False)
    assert centred.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.group_advantages(r, 3)


def test_group_advantages_over_the_valid_samples_only():
    """Failed samples (valid False) take no part in their group's mean and std and get advantage 0: the valid
    samples' advantages are those of the group without them."""
    r = torch.tensor([1.0, 0.0, 123.0, -7.0, 1.0, 0.0, 5.0, 2.0, 3.0])
    valid = torch.tensor([True, True, False, False, True, False, False, False, True])
    adv = grpo.group_advantages(r, 3, valid=valid)
    alone = grpo.group_advantages(torch.tensor([1.0, 0.0]), 2)
    assert adv[:2].tolist() == alone.tolist() and adv[2].item() == 0.0
    assert adv[3:6].tolist() == [0.0, 0.0, 0.0]  # one valid sample: no spread
    assert adv[6:].tolist() == [0.0, 0.0, 0.0]
    assert grpo.group_advantages(r, 3, valid=valid, normalize_std=False)[:3].tolist() == [0.5, -0.5, 0.0]
    assert grpo.group_advantages(torch.tensor([1.0, 2.0]), 1).tolist() == [0.0, 0.0]  # groups of one: no NaN


def test_ppo_clip_loss_token_and_seq_mean_by_hand():
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 1.0, 0.5], [0.9, 1.1, 1.0]]))  # ratios
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, st = grpo.ppo_clip_loss(logp, old, adv, mask, clip_eps=0.2, agg="token_mean")
    # A=+1: max(-r, -clip(r)) -> -min(r, clip(r)): r=1.5 -> -1.2 (clipped), 1.0 -> -1.0, 0.5 -> -0.5
    # A=-2: max(2r, 2clip(r)): r=0.9 -> 1.8, r=1.1 -> 2.2 (third token masked)
    per = [-1.2, -1.0, -0.5, 1.8, 2.2]
    assert loss.item() == pytest.approx(sum(per) / 5, rel=1e-6)
    assert st["clipped"] == 1 and st["tokens"] == 5
    loss_seq, _ = grpo.ppo_clip_loss(logp, old, adv, mask, clip_eps=0.2, agg="seq_mean")
    assert loss_seq.item() == pytest.approx(((-1.2 - 1.0 - 0.5) / 3 + (1.8 + 2.2) / 2) / 2, rel=1e-6)


def test_loss_gradient_is_zero_for_clipped_tokens():
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_(True)
    loss, _ = grpo.ppo_clip_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0  # ratio 1.5 > 1.2 with A > 0: clipped, no gradient
    assert logp.grad[0, 1].item() == pytest.approx(-0.5)  # d(-r)/dlogp / 2 tokens at r = 1


def test_microbatch_totals_add_up_to_full_batch():
    torch.manual_seed(0)
    logp, old = torch.randn(4, 5) * 0.1, torch.randn(4, 5) * 0.1
    mask = (torch.rand(4, 5) > 0.3).float()
    mask[:, 0] = 1
    adv = torch.randn(4)
    for agg in ("token_mean", "seq_mean"):
        full, _ = grpo.ppo_clip_loss(logp, old, adv, mask, agg=agg)
        parts = sum(grpo.ppo_clip_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], agg=agg,
                                       total_tokens=mask.sum(), total_seqs=4)[0] for i in (0, 2))
        assert parts.item() == pytest.approx(full.item(), rel=1e-6, abs=1e-7)


def test_truncated_importance_sampling_and_k3():
    old = torch.zeros(1, 2)
    sampler = torch.log(torch.tensor([[0.25, 1.0]]))  # w = exp(old - sampler) = [4, 1] -> capped at 2
    loss, st = grpo.ppo_clip_loss(old.clone(), old, torch.tensor([1.0]), torch.ones(1, 2), sampler_logp=sampler,
                                  tis_cap=2.0)
    assert loss.item() == pytest.approx((-1 * 2 + -1 * 1) / 2)
    assert st["tis_truncated"] == 1
    # k3(p, q) = exp(q - p) - (q - p) - 1
    p, q = torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0])
    assert grpo.k3(p, q).tolist() == pytest.approx([0.0, math.e - 1 - 1])
    # small gaps: exp(d) - d - 1 in FP32 is rounding noise there (and can go negative); expm1(d) - d is not
    d = torch.tensor([1e-4, -1e-4, 3e-6, -2e-7], dtype=torch.float64)
    exact = [math.expm1(x) - x for x in d.tolist()]
    assert grpo.k3(torch.zeros(4, dtype=torch.float64), d).tolist() == pytest.approx(exact, rel=1e-12)
    small = grpo.k3(torch.zeros(4), d.float())
    assert (small >= 0).all() and small.tolist() == pytest.approx(exact, rel=1e-3)
    ref = torch.log(torch.tensor([[0.5, 1.0]]))
    loss_kl, st = grpo.ppo_clip_loss(old.clone(), old, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=ref, kl_coef=0.1)
    assert loss_kl.item() == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1) / 2, rel=1e-6)
