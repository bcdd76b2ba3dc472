"""Fused MoE combine: bitwise the CPU's torch expression (weights cast to o's dtype, index_add_ in grouped order;
with a residual, torch's add of the two),
expert-parallel sentinels add nothing, and `QuantExperts` gives the same output and gradients with it on or off.

CPU: TRITON_INTERPRET=1 (triton_setup) with the fused kernels enabled for CPU tensors; CUDA: the compiled kernel
against the same expression run on the CPU.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch
from bitwise import assert_bitwise_equal

from rl4bit.kernels import fused
from rl4bit.kernels.combine_triton import combine as kernel
from rl4bit.trainer.combine import reference
from rl4bit.trainer.qgemm import inverse_order

DEV_TYPE = torch.device(DEVICE).type
# (o dtype, router weight dtype, hidden dtype): trainer / sampler (BF16 expert outputs, FP32 router and residual),
# a BF16 residual, FP32 throughout
CASES = [(torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.float32, torch.bfloat16),
         (torch.float32, torch.float32, torch.float32)]


def _routing(tokens, e, k, seed, sentinel=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    if sentinel:  # expert parallelism's "not on this rank": index == e
        idx[::3, 0] = e
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    return idx, w


@pytest.mark.parametrize("dtypes", CASES, ids=lambda c: "-".join(str(t).replace("torch.", "") for t in c))
@pytest.mark.parametrize("sentinel", [False, True])
def test_kernel_is_the_cpu_expression_bitwise(dtypes, sentinel):
    od, wd, hd = dtypes
    tokens, e, k, h = 37, 8, 4, 200
    idx, w = _routing(tokens, e, k, 1, sentinel)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[: int((flat < e).sum())]  # the sentinels sort last and are dropped, as QuantExperts does
    tok = order // k
    g = torch.Generator().manual_seed(2)
    o = (torch.randn(order.numel(), h, generator=g) * 4).to(od)
    hidden = torch.zeros(tokens, h, dtype=hd)
    want = reference(o, w.to(wd), order, tok, hidden)  # on the CPU: index_add_ in order
    inv = inverse_order(order, flat.numel())
    got = kernel(o.to(DEVICE), w.to(wd).to(DEVICE), idx.to(DEVICE), inv.to(DEVICE), hd, e)
    assert_bitwise_equal(got.cpu(), want, f"{dtypes} sentinel={sentinel}")
    residual = (torch.randn(tokens, h, generator=g) * 4).to(hd)  # the decoder layer's add, in the same launch
    got = kernel(o.to(DEVICE), w.to(wd).to(DEVICE), idx.to(DEVICE), inv.to(DEVICE), hd, e, residual.to(DEVICE))
    assert_bitwise_equal(got.cpu(), residual + want, f"{dtypes} sentinel={sentinel} + residual")


def test_residual_of_another_dtype_or_shape_is_refused_by_the_kernel_and_added_apart():
    idx, w = _routing(5, 4, 2, 6)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = inverse_order(order, flat.numel())
    o = torch.randn(order.numel(), 32, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    args = (o.to(DEVICE), w.to(DEVICE), idx.to(DEVICE), inv.to(DEVICE), torch.bfloat16, 4)
    with pytest.raises(ValueError, match="residual"):
        kernel(*args, torch.zeros(5, 32, device=DEVICE))  # FP32 residual, BF16 output
    with pytest.raises(ValueError, match="residual"):
        kernel(*args, torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE))
    from rl4bit.trainer.combine import combine

    hidden = torch.zeros(5, 32, dtype=torch.bfloat16, device=DEVICE)
    r32 = torch.randn(5, 32, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    fused.set_enabled(True, DEV_TYPE)
    try:  # the module-level combine adds a mixed-dtype residual with torch, as the layer would
        got = combine(o.to(DEVICE), w.to(DEVICE), idx.to(DEVICE), order.to(DEVICE), (order // 2).to(DEVICE), None,
                      hidden, 4, r32)
        want = r32 + combine(o.to(DEVICE), w.to(DEVICE), idx.to(DEVICE), order.to(DEVICE), (order // 2).to(DEVICE),
                             None, hidden, 4)
    finally:
        fused.set_enabled(True, "cuda")
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_quant_experts_output_and_gradients_do_not_change():
    """A converted tiny Qwen3-MoE's experts (bf16 recipe, FP32 masters under BF16 autocast): fused combine on vs off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                               num_experts=8, num_experts_per_tok=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    convert_model(model, RecipeConfig(name="bf16"))
    experts = model.model.layers[0].mlp.experts.to(DEVICE)
    idx, w = _routing(23, 8, 4, 3)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    results = []
    for on in (True, False):
        fused.set_enabled(on, DEV_TYPE)
        try:
            xs, ws = x.clone().requires_grad_(), w.to(DEVICE).clone().requires_grad_()
            rs = (x * 0.5 + 1).requires_grad_()  # the layer's residual, added by the combine
            with torch.autocast(DEV_TYPE, torch.bfloat16):
                out = experts(xs, idx.to(DEVICE), ws, residual=rs)
            out.square().sum().backward()
            results.append((out.detach(), xs.grad, ws.grad, experts.down_proj.grad.clone(), rs.grad))
            experts.zero_grad()
        finally:
            fused.set_enabled(True, "cuda")
    for a, b, name in zip(results[0], results[1], ("out", "d hidden", "d router weights", "d down_proj", "d residual")):
        assert_bitwise_equal(a, b, name)


def test_a_non_finite_expert_output_reaches_its_token_only():
    """NaN / Inf terms propagate as in the CPU expression (Inf * 0 weight -> NaN), never dropped to a finite sum."""
    idx, w = _routing(6, 4, 2, 5)
    w[0, 1] = 0.0
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // 2
    o = torch.randn(order.numel(), 32, generator=torch.Generator().manual_seed(6))
    inv = inverse_order(order, flat.numel())
    o[inv[1], 3] = float("inf")  # token 0, slot 1, weight 0: Inf * 0 = NaN
    o[inv[4], 7] = float("nan")  # token 2
    for hd in (torch.float32, torch.bfloat16):
        want = reference(o, w, order, tok, torch.zeros(6, 32, dtype=hd))
        got = kernel(o.to(DEVICE), w.to(DEVICE), idx.to(DEVICE), inv.to(DEVICE), hd, 4).cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).sum() == 2, hd
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), hd


def test_gradient_reaches_a_residual_alone():
    """Only the residual needs a gradient (expert outputs and router weights frozen): it gets the output's."""
    from rl4bit.trainer.combine import combine

    idx, w = _routing(5, 4, 2, 9)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    o = torch.randn(order.numel(), 32, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    hidden = torch.zeros(5, 32, device=DEVICE)
    r = torch.randn(5, 32, generator=torch.Generator().manual_seed(11)).to(DEVICE).requires_grad_()
    fused.set_enabled(True, DEV_TYPE)
    try:
        out = combine(o, w.to(DEVICE), idx.to(DEVICE), order.to(DEVICE), (order // 2).to(DEVICE), None, hidden, 4, r)
        dout = torch.randn_like(out)
        (d_r,) = torch.autograd.grad(out, [r], dout)
    finally:
        fused.set_enabled(True, "cuda")
    assert torch.equal(d_r, dout)
