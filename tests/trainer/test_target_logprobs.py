"""`trainer.logprobs.TargetLogprobs`: the sampled tokens' logprobs and the entropy a chunk of rows at a time.

Checked against the whole-tensor expression it replaced (forward bitwise, gradient to FP32 rounding) and
against itself at other chunk sizes (bitwise, forward and backward): the chunk size is a memory knob only.
"""

import pytest
import torch

from rl4bit.trainer.logprobs import TargetLogprobs, chunk_rows


def _case(dtype, rows=37, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    weights = torch.randn(rows, generator=g)
    return logits, targets, weights


def _run(logits, targets, weights, t, chunk):
    x = logits.clone().requires_grad_(True)
    logp, ent = TargetLogprobs.apply(x, targets, t, chunk)
    (logp * weights).sum().backward()
    return logp.detach(), ent, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_equal_to_the_whole_tensor_expression(dtype, t):
    logits, targets, weights = _case(dtype)
    logp, ent, grad = _run(logits, targets, weights, t, chunk=5)
    x = logits.clone().requires_grad_(True)
    out = torch.log_softmax(x.float() / t, dim=-1)
    want = out.gather(1, targets[:, None])[:, 0]
    (want * weights).sum().backward()
    assert torch.equal(logp, want.detach())
    assert torch.equal(ent, -(out.exp() * out).sum(-1).detach().sum()) and not ent.requires_grad
    torch.testing.assert_close(grad, x.grad, rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunk_size_changes_no_bit(dtype):
    logits, targets, weights = _case(dtype, rows=41)
    ref = _run(logits, targets, weights, 1.0, chunk=1000)
    for chunk in (1, 7, 16, 40):
        got = _run(logits, targets, weights, 1.0, chunk=chunk)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), chunk


def test_chunk_rows_bounds_the_fp32_chunk():
    assert chunk_rows(151_936) == 441 and chunk_rows(80) > 100_000 and chunk_rows(2**40) == 1
