"""The fused MoE router (`kernels/router_triton.py`, `trainer/fused_router.py`).

Against the torch formula (`fused_router.reference`, which the install probe checks against HF's own
`Qwen3MoeTopKRouter`) to rounding, with the same experts chosen; bitwise against itself where its docstring
promises: a row's outputs are the same alone and among other rows; the training forward (autograd) gives the
same bits, and gradients are the formula's. CPU: the Triton interpreter (triton_setup); CUDA: the compiled kernel.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch

from rl4bit.kernels import fused
from rl4bit.kernels.router_triton import route_topk
from rl4bit.trainer.fused_router import fuse_router, fuse_routers, reference


def _inputs(t, h, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, h, generator=g).to(dtype).to(DEVICE),
            (torch.randn(e, h, generator=g) / h ** 0.5).to(dtype).to(DEVICE))


@pytest.mark.parametrize("dtype,compute,e,k,normalize", [
    (torch.float32, torch.float32, 32, 4, True),    # rl4bit's FP32 router (Qwen3-MoE shape)
    (torch.bfloat16, torch.float32, 8, 2, False),   # BF16 hidden states into the FP32 router
    (torch.float32, torch.float32, 16, 3, True),    # 16 experts: the widest column step
    (torch.bfloat16, torch.bfloat16, 96, 8, True),  # a plain BF16 model's router; E not a power of 2
])
def test_matches_the_torch_formula(dtype, compute, e, k, normalize):
    x, w = _inputs(37, 300, e, dtype)  # 37 rows; three column chunks, the last one partial
    logits, weights, index = route_topk(x, w, k, normalize, compute)
    want_l, want_w, want_i = reference(x, w, k, normalize, compute)
    assert logits.dtype == weights.dtype == compute and index.dtype == torch.int64
    tol = 1e-5 if compute == torch.float32 else 2e-2
    torch.testing.assert_close(logits.float(), want_l.float(), atol=tol, rtol=tol)
    # the top-k of its own logits: descending, ties to the lower expert, nothing left out larger
    p = torch.softmax(logits.float(), dim=-1)
    chosen = p.gather(1, index)
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()
    assert ((chosen[:, :-1] > chosen[:, 1:]) | (index[:, :-1] < index[:, 1:])).all()
    rest = p.scatter(1, index, -1.0)
    last, last_i = chosen[:, -1:], index[:, -1:]
    assert ((rest < last) | ((rest == last) & (torch.arange(e, device=DEVICE) > last_i))).all()
    if compute == torch.float32:
        assert torch.equal(index, want_i)  # FP32 random logits: no ties, torch's choice
    _, at_index, _ = reference(x, w, k, normalize, compute, index=index)  # BF16: ties are common
    torch.testing.assert_close(weights.float(), at_index.float(), atol=tol, rtol=tol)


def test_a_row_is_the_same_bits_alone_and_among_others():
    x, w = _inputs(40, 300, 16, torch.float32, seed=1)  # three column chunks: partials of 40 rows vs of 1
    together = route_topk(x, w, 4, True, torch.float32)
    for r in (0, 17, 39):
        alone = route_topk(x[r:r + 1].clone(), w, 4, True, torch.float32)
        for a, b in zip(alone, together):
            assert torch.equal(a[0], b[r])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on the NaN row
def test_ties_pick_the_lower_expert_and_nan_is_largest():
    x = torch.zeros(2, 16, device=DEVICE)
    w = torch.zeros(8, 16, device=DEVICE)
    w[5, 0] = 1.0
    x[0, 0] = 1.0    # expert 5 largest, the other seven tied: 0 then 1
    x[1, 0] = float("nan")
    _, weights, index = route_topk(x, w, 3, False, torch.float32)
    assert index[0].tolist() == [5, 0, 1]
    assert weights[1].isnan().all() and index[1].tolist() == [0, 1, 2]  # a NaN row: NaN weights, the first experts


def test_bad_shapes_raise():
    x, w = _inputs(4, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="need x"):
        route_topk(x, w[:, :8], 2, True, torch.float32)
    with pytest.raises(ValueError, match="top_k 9 of 8"):
        route_topk(x, w, 9, True, torch.float32)


def _qwen3_moe(**extra):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=32, **extra)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).to(DEVICE)


@pytest.mark.parametrize("norm", [True, False])
def test_installed_on_qwen3_moe_routers_with_their_own_setting(norm):
    """The probe finds the module's renormalization setting; the fused forward chooses HF's experts."""
    model = _qwen3_moe(norm_topk_prob=norm)
    gate = model.model.layers[0].mlp.gate
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    with torch.no_grad():
        want = gate(x)
    assert fuse_routers(model) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert gate.forward.args[2] is norm
    saved = fused.state()
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        with torch.no_grad():
            got = gate(x)
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


class _TopKThenSoftmax(torch.nn.Module):
    """A router that takes the softmax over its top-k logits (Mixtral-style): not this kernel's formula."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        self.top_k, self.hidden_dim = 2, weight.shape[1]

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        top, index = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=-1), index


def test_another_formula_keeps_its_forward():
    assert not fuse_router(_TopKThenSoftmax(torch.randn(8, 16)).to(DEVICE))


def test_the_probe_sees_past_zero_weights_and_extra_tensors():
    """A freshly initialized (zero) router of another formula still fails the probe (zero weights: every
    formula gives the same uniform routing), a bias makes it another formula, and a router already under
    rl4bit's FP32 wrap is left to be fused before wrapping."""
    from rl4bit.trainer.surgery import _make_router_fp32

    model = _qwen3_moe(norm_topk_prob=True)
    gates = [model.model.layers[i].mlp.gate for i in (0, 1)]
    assert not fuse_router(_TopKThenSoftmax(torch.zeros(8, 16)).to(DEVICE))
    gates[0].register_buffer("bias", torch.zeros(8, device=DEVICE))
    assert not fuse_router(gates[0])
    _make_router_fp32(gates[1])
    assert not fuse_router(gates[1])


def test_training_forward_is_the_kernel_and_gradients_are_the_formulas():
    x, w = _inputs(21, 48, 8, torch.float32, seed=4)
    x.requires_grad_()
    w.requires_grad_()
    model = _qwen3_moe(norm_topk_prob=True)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.copy_(w)
    fuse_router(gate)
    saved = fused.state()
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        logits, weights, index = gate(x)  # grad on: the autograd Function
        plain = route_topk(x.detach(), w.detach(), 2, True, torch.float32)
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")
    for a, b in zip((logits, weights, index), plain):
        assert torch.equal(a.detach(), b)
    up = torch.randn(21, 2, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    dx, dw = torch.autograd.grad((weights * up).sum() + logits.square().sum(), (x, gate.weight))
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    rl, rw, _ = reference(xr, wr, 2, True, torch.float32, index=index)
    want = torch.autograd.grad((rw * up).sum() + rl.square().sum(), (xr, wr))
    torch.testing.assert_close(dx, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, want[1], atol=1e-5, rtol=1e-5)


def test_the_fp32_wrap_hands_a_bf16_stream_to_the_kernel_uncast():
    """rl4bit's FP32 router wrap over a fused router, BF16 hidden states: the kernel takes the BF16 rows and
    rounds them to FP32 itself (no cast launch), with the bits of the FP32-cast input, forward and backward;
    with the kernels off, the wrap casts and runs the module's own forward."""
    from unittest import mock

    import rl4bit.kernels.router_triton as rt
    from rl4bit.trainer.surgery import _make_router_fp32

    x, w = _inputs(21, 48, 8, torch.bfloat16, seed=6)
    model = _qwen3_moe(norm_topk_prob=True)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.copy_(w.float())
    assert fuse_router(gate)
    _make_router_fp32(gate)
    saved = fused.state()
    fused.set_enabled(True, torch.device(DEVICE).type)
    try:
        with mock.patch.object(rt, "route_topk", wraps=rt.route_topk) as calls:
            xb = x.clone().requires_grad_()
            got = gate(xb)
        xf = x.float().requires_grad_()
        want = route_topk(xf.detach(), gate.weight.detach(), 2, True, torch.float32)
        assert [c.args[0].dtype for c in calls.call_args_list] == [torch.bfloat16]
        for a, b in zip(got, want):
            assert torch.equal(a.detach(), b)
        up = torch.randn(21, 2, generator=torch.Generator().manual_seed(7)).to(DEVICE)
        dxb = torch.autograd.grad((got[1] * up).sum() + got[0].square().sum(), xb)[0]
        cast = gate(xf.to(torch.bfloat16).float())  # the old path: an FP32 input
        rl, rw, _ = reference(xf, gate.weight.detach(), 2, True, torch.float32, index=got[2])
        dxf = torch.autograd.grad((rw * up).sum() + rl.square().sum(), xf)[0]
        assert dxb.dtype == torch.bfloat16 and torch.equal(dxb, dxf.to(torch.bfloat16))
        assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(cast, got))
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")
    with fused.disabled():
        off = gate(x)
    assert off[0].dtype == torch.float32  # HF's router on the cast input, autocast off
    torch.testing.assert_close(off[0], got[0].detach(), atol=1e-5, rtol=1e-5)


def test_padding_rows_take_row_0s_routing_and_live_rows_keep_their_bits():
    """With a live mask (the engine's padding rows, `trainer.padding`), a row marked 0 gets row 0's logits, weights
    and experts; every live row gets exactly what the call without a mask gives it (int32 and int64 masks)."""
    x, w = _inputs(37, 300, 16, torch.float32, seed=3)  # three top-k programs, padding in the last two
    plain = route_topk(x, w, 4, True, torch.float32)
    for dtype in (torch.int32, torch.int64):
        live = torch.ones(37, dtype=dtype, device=DEVICE)
        live[20:] = 0
        live[5] = 0  # any row may be marked, not only trailing ones
        got = route_topk(x, w, 4, True, torch.float32, live=live)
        pad = live == 0
        for a, b in zip(got, plain):
            assert torch.equal(a[~pad], b[~pad])
            assert torch.equal(a[pad], b[0].expand_as(a[pad]))
    assert not torch.equal(plain[2][20:], plain[2][0].expand(17, 4))  # unmasked, they route elsewhere
    with pytest.raises(ValueError, match="live must be"):
        route_topk(x, w, 4, True, torch.float32, live=torch.ones(36, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="live must be"):
        route_topk(x, w, 4, True, torch.float32, live=torch.ones(37, dtype=torch.bool, device=DEVICE))
