"""The bf16 recipe's grouped expert product (`qgemm.bf16_grouped`, `bf16_grouped_backward`).

CPU: bitwise equal to a plain per-expert matmul loop (backward), row results
independent of the row counts (forward: what keeps the engine batch-invariant),
empty experts give zero weight gradients, unaligned shapes and stride-0
gradients take the loop. CUDA (gpu): the
grouped kernels (`torch._grouped_mm`) against the loop in FP32 to BF16
tolerance, the same row-independence, zeros for empty experts.
"""

from __future__ import annotations

import pytest
import torch

from rl4bit.trainer.qgemm import GemmSpec, bf16_grouped, bf16_grouped_backward, grouped_gemm

COUNTS = [5, 0, 37, 1, 19, 0, 2, 64]


def _operands(dtype, device, counts=COUNTS, k=64, n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), k, generator=g).to(dtype).to(device)
    w = torch.randn(len(counts), n, k, generator=g).to(dtype).to(device)
    dy = torch.randn(sum(counts), n, generator=g).to(dtype).to(device)
    return x, w, dy


def _loop(x, w, dy, counts):
    y, dx, dw, start = [], [], torch.zeros_like(w), 0
    for e, m in enumerate(counts):
        seg = slice(start, start + m)
        y.append(x[seg] @ w[e].t())
        dx.append(dy[seg] @ w[e])
        if m:
            dw[e] = dy[seg].t() @ x[seg]
        start += m
    return torch.cat(y), torch.cat(dx), dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backward_is_the_loop_bitwise(dtype):
    x, w, dy = _operands(dtype, "cpu")
    _, dx_ref, dw_ref = _loop(x, w, dy, COUNTS)
    dx, dw = bf16_grouped_backward(dy, x, w, COUNTS)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)
    assert not dw[1].any() and not dw[5].any()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rows_do_not_depend_on_the_row_counts(device):
    """What batch invariance needs: a row's result is the same whether its expert got 3 rows or 37, and
    whatever the other experts got (a plain FP32 matmul on the CPU fails the first: small-M kernels)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w, _ = _operands(dtype, device)
    full = bf16_grouped(x, w, COUNTS)
    first = sum(COUNTS[:2])  # expert 2's rows start here
    for m in (1, 3, 20):
        few = bf16_grouped(x[first : first + m], w, [0, 0, m, 0, 0, 0, 0, 0])
        assert torch.equal(few, full[first : first + m]), f"expert 2's first rows changed when it got {m} rows"
    y_dev = bf16_grouped(x, w, torch.tensor(COUNTS, dtype=torch.int32, device=device))
    assert torch.equal(y_dev, full)


def test_unaligned_or_strided_operands_take_the_loop():
    """torch._grouped_mm needs 16-byte rows and dense strides; other shapes still work (the per-expert loop)."""
    x, w, _ = _operands(torch.float32, "cpu", k=13, n=6)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_gemm(xg, wg, COUNTS, GemmSpec(fmt="bf16")).sum().backward()  # stride-0 output gradient
    _, dx_ref, dw_ref = _loop(x, w, torch.ones(sum(COUNTS), 6), COUNTS)
    assert torch.equal(xg.grad, dx_ref) and torch.equal(wg.grad, dw_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_kernels_match_the_loop():
    x, w, dy = _operands(torch.bfloat16, "cuda", k=256, n=128)
    y_ref, dx_ref, dw_ref = _loop(x.float(), w.float(), dy.float(), COUNTS)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_gemm(xg, wg, COUNTS, GemmSpec(fmt="bf16"))
    y.backward(dy)
    for name, got, ref in (("y", y, y_ref), ("dx", xg.grad, dx_ref), ("dw", wg.grad, dw_ref)):
        err = float((got.float() - ref).norm() / ref.norm())
        assert err < 1e-2, f"{name}: relative error {err:.2e} against the FP32 loop"
    assert not wg.grad[1].any() and not wg.grad[5].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offsets_from_the_routing_kernel_are_the_cumsum_bitwise():
    """bf16_grouped with the routing kernel's group offsets (`expert_grouping(maps=)`, the engine's BF16 experts)
    = with the cumsum it computes itself, bitwise."""
    from rl4bit.kernels import fused
    from rl4bit.trainer.qgemm import expert_grouping

    g = torch.Generator().manual_seed(5)
    flat = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(64)]).reshape(-1).cuda()
    fused.set_enabled(True, "cuda")
    maps: dict = {}
    _, _, counts, _ = expert_grouping(flat, 8, 2, maps, tile_map=False)
    x, w, _ = _operands(torch.bfloat16, "cuda", counts=counts.tolist(), k=256, n=128)
    assert torch.equal(bf16_grouped(x, w, counts, maps["offs"]), bf16_grouped(x, w, counts))
