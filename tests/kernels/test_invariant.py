"""Invariant-kernel mode: the Triton products and means are right, their rows do not depend on the row count,
and the mode routes torch's own calls (mm, addmm via F.linear, bmm via matmul, mean) through them and back out.

CPU: TRITON_INTERPRET=1 (triton_setup) and the mode registered for the CPU dispatch key; CUDA (marked gpu):
the same on the H200, where the point is that cuBLAS's own rows do depend on the row count.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch
import torch.nn.functional as F
from bitwise import assert_bitwise_equal

from rl4bit.kernels import invariant
from rl4bit.kernels.invariant_triton import bmm, mean

KEY = "CUDA" if HAS_CUDA else "CPU"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def mode():
    invariant.set_mode(True, KEY)
    yield
    invariant.set_mode(False)


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_matches_float64_product(dtype):
    a, b = _rand(3, 37, 80, dtype=dtype, seed=1), _rand(3, 80, 70, dtype=dtype, seed=2)  # partial M, N, K tiles
    ref = (a.double() @ b.double()).to(dtype)
    got = bmm(a, b)
    assert got.dtype == dtype and got.shape == (3, 37, 70)
    torch.testing.assert_close(got.float(), ref.float(), **_tol(dtype))
    bias = _rand(70, dtype=dtype, seed=3)
    got = bmm(a[:1], b[:1], bias=bias, alpha=0.5, beta=2.0)
    torch.testing.assert_close(got.float(), (0.5 * (a[:1].double() @ b[:1].double()) + 2 * bias.double()).float(),
                               **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_row_count(dtype):
    """Rows 0..M of a product computed alone equal the same rows of a 300-row product, for every M, transposed
    weights (F.linear's layout) included."""
    x, w = _rand(300, 96, dtype=dtype, seed=4), _rand(48, 96, dtype=dtype, seed=5)
    full = bmm(x[None], w.t()[None])[0]
    for lo, hi in ((0, 1), (0, 16), (17, 18), (5, 70), (64, 200)):
        assert_bitwise_equal(bmm(x[None, lo:hi], w.t()[None])[0], full[lo:hi], f"{dtype} rows {lo}:{hi}")


def test_mean_matches_torch_and_rows_are_independent():
    x = _rand(50, 2100, seed=6)  # longer than one 1024-wide chunk, with a partial one
    torch.testing.assert_close(mean(x, [-1]), x.double().mean(-1).float(), rtol=1e-6, atol=1e-7)
    full = mean(x, [-1])
    for lo, hi in ((0, 1), (7, 9), (3, 20), (0, 50)):
        assert_bitwise_equal(mean(x[lo:hi], [-1]), full[lo:hi], f"rows {lo}:{hi} alone")
    y = _rand(4, 6, 5, seed=7).to(torch.bfloat16)
    got = mean(y, [0, 2], keepdim=True, dtype=torch.float32)
    assert got.shape == (1, 6, 1) and got.dtype == torch.float32
    torch.testing.assert_close(got, y.double().mean((0, 2), keepdim=True).float(), rtol=1e-6, atol=1e-7)


def test_edge_cases_keep_atens_contract():
    a, b = _rand(1, 5, 0, seed=17), _rand(1, 0, 3, seed=18)
    assert torch.equal(bmm(a, b), torch.zeros(1, 5, 3, device=DEVICE))  # K = 0: the empty sum
    nan_bias = torch.full((3,), float("nan"), device=DEVICE)
    x, w = _rand(1, 4, 32, seed=19), _rand(1, 32, 3, seed=20)
    assert torch.equal(bmm(x, w, bias=nan_bias, beta=0.0), bmm(x, w))  # beta = 0 ignores the input, NaN too
    assert torch.isnan(mean(_rand(3, 0, seed=21), [-1])).all()  # mean of nothing
    y = _rand(4, 1, 6, seed=22)
    torch.testing.assert_close(mean(y, [1]), y[:, 0])  # a reduced extent of 1
    with pytest.raises(IndexError, match="out of range"):
        mean(y, [3])
    with pytest.raises(RuntimeError, match="twice"):
        mean(y, [1, -2])


def test_bad_operands_are_named():
    with pytest.raises(ValueError, match="do not multiply"):
        bmm(_rand(1, 3, 4), _rand(1, 5, 2))
    with pytest.raises(ValueError, match="dtypes"):
        bmm(_rand(1, 3, 4), _rand(1, 4, 2, dtype=torch.bfloat16))


def test_mode_routes_torch_calls_and_restores_them():
    x, w, bias = _rand(33, 64, seed=8), _rand(40, 64, seed=9), _rand(40, seed=10)
    q, k = _rand(2, 3, 5, 32, seed=11), _rand(2, 3, 32, 48, seed=12)
    before = (torch.mm(x, w.t()), F.linear(x, w, bias), torch.matmul(q, k), x.pow(2).mean(-1, keepdim=True))
    invariant.set_mode(True, KEY)
    try:
        assert invariant.enabled()
        assert_bitwise_equal(torch.mm(x, w.t()), bmm(x[None], w.t()[None])[0], "mm")
        assert_bitwise_equal(F.linear(x, w, bias), bmm(x[None], w.t()[None], bias=bias)[0], "linear -> addmm")
        assert_bitwise_equal(torch.matmul(q, k), bmm(q.reshape(6, 5, 32), k.reshape(6, 32, 48)).reshape(2, 3, 5, 48),
                             "matmul -> bmm")
        assert_bitwise_equal(x.pow(2).mean(-1, keepdim=True), mean(x.pow(2), [-1], keepdim=True), "mean.dim")
        out = torch.empty(0, device=DEVICE)
        assert_bitwise_equal(torch.mm(x, w.t(), out=out), bmm(x[None], w.t()[None])[0], "mm.out")
        with pytest.raises(RuntimeError, match="one dtype"):
            torch.mm(x, w.t().to(torch.bfloat16))
        invariant.set_mode(True, KEY)  # idempotent
    finally:
        invariant.set_mode(False)
    assert not invariant.enabled()
    after = (torch.mm(x, w.t()), F.linear(x, w, bias), torch.matmul(q, k), x.pow(2).mean(-1, keepdim=True))
    for name, b, a in zip(("mm", "linear", "matmul", "mean"), before, after):
        assert_bitwise_equal(a, b, f"{name} after the mode is off")


def test_autograd_through_the_mode(mode):
    x = _rand(9, 32, seed=13).requires_grad_()
    w = _rand(16, 32, seed=14).requires_grad_()
    F.linear(x, w).pow(2).mean(-1).sum().backward()
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F.linear(x2, w2).pow(2).mean(-1).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad.float(), rtol=1e-5, atol=1e-5)


def _engine_runs(min_rows: int, dtype):
    """Each request alone, then all together, in an engine that pads GEMMs to `min_rows` rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sampler"))
    from conftest import make_model, make_tokenizer, prompts  # the sampler tests' tiny Qwen3-MoE

    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams

    engine = EmbeddedEngine(make_model(dtype), make_tokenizer(), max_batch_size=8, min_rows=min_rows,
                            decode_graphs="off")
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, seed=50 + i, max_new_tokens=4))
            for i, p in enumerate(prompts(5, seed=21))]
    alone = [engine.generate([r])[0] for r in reqs]
    together = engine.generate(reqs)
    return [(r.completion_ids, r.logprobs) for r in alone], [(r.completion_ids, r.logprobs) for r in together]


@pytest.mark.skipif(HAS_CUDA, reason="drives the CPU dispatch key through the interpreter; the GPU test is below")
def test_engine_needs_no_row_padding_in_the_mode():
    """Without padding GEMMs to MIN_ROWS the CPU engine's FP32 rows depend on the batch (kv_cache.py; this
    test's engine, outside the mode, gives other rollouts alone than together); in the mode they do not,
    because no product's reduction depends on its row count any more."""
    invariant.set_mode(True, "CPU")
    try:
        alone, together = _engine_runs(1, torch.float32)
    finally:
        invariant.set_mode(False)
    assert alone == together, "the batch changed the rollouts in the invariant mode"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="cuBLAS's row-count dependence exists on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_do_not_depend_on_the_row_count_in_the_mode(dtype):
    """F.linear and mean on CUDA in the mode: rows equal across row counts 1..300 (cuBLAS's need not)."""
    x, w = _rand(300, 2048, dtype=dtype, seed=15), _rand(2048, 2048, dtype=dtype, seed=16)
    invariant.set_mode(True, "CUDA")
    try:
        full, norm = F.linear(x, w), x.float().pow(2).mean(-1, keepdim=True)
        for m in (1, 2, 7, 16, 64, 65, 129):
            assert_bitwise_equal(F.linear(x[:m], w), full[:m], f"{dtype} linear M={m}")
            assert_bitwise_equal(x[:m].float().pow(2).mean(-1, keepdim=True), norm[:m], f"{dtype} mean M={m}")
    finally:
        invariant.set_mode(False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_rows_equal_each_experts_own_product(dtype):
    """The bf16 recipe's grouped product in the mode: every expert's rows equal `bmm` on those rows alone,
    bitwise, whatever the other experts' counts (list or device counts, an empty expert, partial tiles)."""
    from rl4bit.kernels.invariant_triton import grouped_mm

    w = _rand(4, 40, 80, dtype=dtype, seed=23)  # [E, N, K]
    for counts in ([5, 0, 70, 3], [1, 1, 1, 1], [0, 0, 0, 9]):
        x = _rand(sum(counts), 80, dtype=dtype, seed=24 + sum(counts))
        y = grouped_mm(x, w, counts)
        assert_bitwise_equal(grouped_mm(x, w, torch.tensor(counts, device=DEVICE)), y, f"{counts} device counts")
        start = 0
        for e, m in enumerate(counts):
            if m:
                alone = bmm(x[None, start:start + m], w[e].t()[None])[0]
                assert_bitwise_equal(y[start:start + m], alone, f"{dtype} counts {counts} expert {e}")
            start += m
        starts = [0, *torch.tensor(counts).cumsum(0).tolist()[:-1]]
        want = torch.cat([x[s:s + m].double() @ w[e].double().t() for e, (s, m) in enumerate(zip(starts, counts))])
        torch.testing.assert_close(y.float(), want.float(), **_tol(dtype))
