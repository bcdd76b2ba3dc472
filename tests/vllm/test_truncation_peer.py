"""The embedded engine's truncation (`sampling.truncation_mask`) against vLLM's own sampler pieces, run in the
order vLLM's V1 sampler runs them: temperature, min-p (`MinPLogitsProcessor`, an argmax-invariant logits
processor), then top-k and top-p (`apply_top_k_top_p_pytorch`). Both backends must sample from the same set
of tokens for the same SamplingParams.

Run: bash scripts/test_vllm.sh
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from rl4bit.sampler.sampling import truncation_mask
from rl4bit.sampler.types import SamplingParams


def _vllm_kept(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Tokens vLLM's sampler keeps for one row: the finite entries of its processed logits."""
    import vllm
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    row = (logits.float() / p.temperature)[None].clone()
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=1))
    min_p = MinPLogitsProcessor(config, torch.device("cpu"), is_pin_memory=False)
    params = vllm.SamplingParams(temperature=p.temperature, min_p=p.min_p)
    min_p.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params, [], [])], moved=[]))
    row = min_p.apply(row)
    k = torch.tensor([min(p.top_k, row.shape[1])]) if p.top_k > 0 else None  # the input batch's clamp to V
    top_p = torch.tensor([p.top_p]) if p.top_p < 1 else None
    row = apply_top_k_top_p_pytorch(row, k, top_p)
    return torch.isfinite(row[0])


def test_truncation_keeps_what_vllm_keeps():
    torch.manual_seed(0)
    rows = [torch.randn(64) * s for s in (0.5, 2.0, 5.0)] + [torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]).log()]
    grid = itertools.product((1.0, 0.7), (0, 3, 10), (1.0, 0.9, 0.5, 0.8), (0.0, 0.05, 0.2))
    checked = differ_from_hf = 0
    for (t, k, top_p, min_p), logits in itertools.product(grid, rows):
        p = SamplingParams(temperature=t, top_k=k, top_p=top_p, min_p=min_p)
        ours = truncation_mask(torch.log_softmax(logits / t, -1), p)
        want = _vllm_kept(logits, p)
        assert torch.equal(ours, want), (p, ours.nonzero().flatten().tolist(), want.nonzero().flatten().tolist())
        checked += 1
        # HF's order (top-p before min-p) would keep more here: the case the order decides
        differ_from_hf += bool(top_p < 1 and min_p > 0 and int(want.sum()) < _hf_kept(logits, p))
    assert checked == 2 * 3 * 4 * 3 * 4 and differ_from_hf > 0


def _hf_kept(logits: torch.Tensor, p: SamplingParams) -> int:
    """How many tokens top-k, then top-p, then min-p keep (HF's order), for the check that the grid has cases
    where the order matters."""
    logp = torch.log_softmax(logits / p.temperature, -1)
    keep = torch.ones_like(logp, dtype=torch.bool)
    if 0 < p.top_k < logp.numel():
        keep &= logp >= torch.topk(logp, p.top_k).values[-1]
    probs = torch.softmax(logp.masked_fill(~keep, float("-inf")), -1)
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    kept_sorted = (torch.cumsum(sorted_p, -1) - sorted_p) < p.top_p
    keep_p = torch.zeros_like(keep)
    keep_p[order] = kept_sorted
    keep &= keep_p
    probs = torch.softmax(logp.masked_fill(~keep, float("-inf")), -1)
    return int((keep & (probs >= p.min_p * probs.max())).sum())
