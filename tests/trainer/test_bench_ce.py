"""The CE-gap arithmetic and corpus of rl4bit.bench.ce (the training runs themselves are the bench, not a test)."""

from __future__ import annotations

import torch

from rl4bit.bench.ce import ALPHABET, arithmetic_batch, ce_gap, smooth


def test_ce_gap_is_one_minus_s_over_S():
    reference = [5.0, 4.0, 3.0, 2.0, 1.0]  # MXFP8
    assert ce_gap(reference, [9.0, 3.0]) == {"gap": 1 - 3 / 5, "step": 3, "reached": True}
    assert ce_gap(reference, [1.0]) == {"gap": 0.0, "step": 5, "reached": True}
    assert ce_gap(reference, [0.5]) == {"gap": 0.0, "step": 5, "reached": False}  # variant better than MXFP8


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_arithmetic_corpus_is_seeded_and_correct():
    a = arithmetic_batch(torch.Generator().manual_seed(3), 2, 40)
    b = arithmetic_batch(torch.Generator().manual_seed(3), 2, 40)
    assert torch.equal(a, b) and a.shape == (2, 41)
    text = "".join(ALPHABET[i] for i in a[0].tolist())
    for line in text.split(";")[:-1]:
        lhs, rhs = line.split("=")
        x, y = lhs.split("+")
        assert int(x) + int(y) == int(rhs)
