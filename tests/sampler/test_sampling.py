"""sampling.py: truncation masks, the Gumbel-max draw from keyed noise, and row independence of sample_rows."""

from __future__ import annotations

import re

import pytest
import torch

from rl4bit.sampler.sampling import processed_logprobs, sample_rows, sample_token, truncation_mask
from rl4bit.sampler.types import SamplingParams

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()


def test_truncation_masks():
    def keep(**kw):
        return truncation_mask(torch.log_softmax(LOGITS, -1), SamplingParams(**kw)).tolist()

    assert keep(top_k=2) == [True, True, False, False, False]
    assert keep(top_p=0.5) == [True, False, False, False, False]   # mass before token 1 is 0.5: not < 0.5
    assert keep(top_p=0.8) == [True, True, True, False, False]
    assert keep(min_p=0.2) == [True, True, True, False, False]     # 0.07 < 0.2 * 0.5
    assert keep(top_k=3, min_p=0.35) == [True, True, False, False, False]
    assert keep(min_p=1.0) == [True, False, False, False, False]     # the top token (and its ties) only
    assert keep(top_k=-1) == keep(top_k=0) == [True] * 5              # both off (vLLM's -1, HF's 0)
    # min-p before top-p (vLLM's order): min-p keeps 0.5, 0.25, 0.15 (>= 0.1); renormalised to 0.56, 0.28, 0.17,
    # top-p 0.8 stops after two. HF's order (top-p first, over all five) would keep three.
    assert keep(top_p=0.8, min_p=0.2) == [True, True, False, False, False]
    lp = processed_logprobs(LOGITS, SamplingParams(top_k=2))
    torch.testing.assert_close(lp[:2].exp(), torch.tensor([2 / 3, 1 / 3]))
    assert torch.isinf(lp[2:]).all()


def test_draw_frequencies_match_the_distribution():
    n = 4000
    rows = LOGITS.expand(n, -1)
    params = [SamplingParams(temperature=1.0)] * n
    tokens, _, _ = sample_rows(rows, params, [7 + 1000 * i for i in range(n)], [3] * n)
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / n
    sigma = (PROBS * (1 - PROBS) / n).sqrt()
    assert ((freq - PROBS).abs() < 5 * sigma).all(), f"frequencies {freq.tolist()} vs {PROBS.tolist()}"


def test_rows_are_independent_of_their_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(7, 50) * 3
    params = [SamplingParams(temperature=t, top_p=tp, top_k=k, processed_logprobs=True)
              for t, tp, k in [(1.0, 1.0, 0), (0.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 5), (1.0, 0.5, 3),
                               (0.0, 1.0, 0), (2.0, 1.0, 0)]]
    keys = [None if p.temperature == 0 else 10 + i for i, p in enumerate(params)]
    together = sample_rows(logits, params, keys, list(range(7)))
    alone = [sample_token(logits[i], params[i], k, i) for i, k in enumerate(keys)]
    assert list(zip(*together)) == alone
    for (tok, lp, plp), p, row in zip(alone, params, logits):
        t = p.temperature or 1.0
        assert lp == float(torch.log_softmax(row / t, -1)[tok])
        assert lp - 1e-6 <= plp <= 0  # truncation renormalises: the kept tokens only gain mass
    assert alone[1][0] == int(logits[1].argmax()) and alone[5][0] == int(logits[5].argmax())


def test_processed_logprobs_only_for_the_rows_that_ask():
    """Batch-wide paths (all greedy, some rows asking for processed logprobs) give each row what it gives alone."""
    torch.manual_seed(2)
    logits = torch.randn(6, 40) * 2
    for temps in ([0.0] * 6, [0.0, 1.0, 0.0, 0.8, 1.0, 0.0]):
        params = [SamplingParams(temperature=t, top_k=4 if i == 3 else 0, processed_logprobs=i % 2 == 1)
                  for i, t in enumerate(temps)]
        keys = [None if p.temperature == 0 else 20 + i for i, p in enumerate(params)]
        tokens, lps, plps = sample_rows(logits, params, keys, [5] * 6)
        alone = [sample_token(logits[i], params[i], k, 5) for i, k in enumerate(keys)]
        assert list(zip(tokens, lps, plps)) == alone
        assert [p is None for p in plps] == [i % 2 == 0 for i in range(6)]
        assert plps[1] == lps[1]  # untruncated: the policy's
        # top-k renormalises a sampled row; a greedy row ignores truncation (vLLM's convention): the policy's
        assert (plps[3] != lps[3]) if temps[3] > 0 else (plps[3] == lps[3])


@pytest.mark.parametrize("field, value, needle", [
    ("temperature", 1e-38, ">= 0.01"), ("temperature", 0.005, ">= 0.01"), ("temperature", True, "temperature"),
    ("n", True, "n: True"), ("top_k", False, "top_k"), ("max_new_tokens", True, "max_new_tokens"),
    ("seed", True, "seed"), ("seed", 2**63, "2**63 - 1"), ("stop_token_ids", [True], "stop_token_ids"),
    ("top_p", True, "top_p"), ("top_k", -2, "0 or -1 (off)"), ("min_p", 1.01, "[0, 1]"), ("min_p", -0.1, "[0, 1]"),
])
def test_params_reject_bools_tiny_temperatures_and_wide_seeds(field, value, needle):
    """A bool is not a count, a seed or a temperature; a temperature under 0.01 overflows logits / T (vLLM would
    raise it to 0.01); seeds past 63 bits would collide in the noise keys."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        SamplingParams(**{field: value}).validate()
    SamplingParams(temperature=0.01, seed=2**63 - 1, n=2, top_k=-1, min_p=1.0).validate()  # the edges are fine
