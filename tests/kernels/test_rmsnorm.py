"""Fused RMSNorm: the kernel is HF's RMSNorm to rounding, with the residual add it is the add followed by the norm, and
(interpreter) bitwise HF's forward in the invariant mode,
its rows do not depend on the row count, `fuse_norm` fuses HF's norms and only them, and the fused
forward and backward follow HF's.

CPU: TRITON_INTERPRET=1 (triton_setup), the kernel enabled for CPU tensors; CUDA (marked gpu): the compiled kernel
on the H200.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch
import triton
import triton.language as tl
from bitwise import assert_bitwise_equal
from torch import nn

from rl4bit.kernels import fused as fused_switch
from rl4bit.kernels import invariant, rmsnorm
from rl4bit.kernels.rmsnorm_triton import add_rms_norm, rms_norm, round_to

DEV_TYPE = torch.device(DEVICE).type
KEY = "CUDA" if HAS_CUDA else "CPU"
# (input dtype, weight dtype): the trainer's FP32 masters under BF16 autocast, BF16 serving copies, an FP32 model
CASES = [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


@pytest.fixture
def fused():
    fused_switch.set_enabled(True, DEV_TYPE)
    yield
    fused_switch.set_enabled(True, "cuda")


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _hf_norm(c: int, w: torch.Tensor, eps: float = 1e-6) -> nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    m = Qwen3MoeRMSNorm(c, eps=eps).to(DEVICE)
    with torch.no_grad():
        m.weight = nn.Parameter(w.clone())
    return m


@pytest.mark.parametrize("c", [16, 128, 1100])  # one partial chunk, one full chunk, two chunks + a masked tail
@pytest.mark.parametrize("dtypes", CASES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_kernel_is_hf_rmsnorm_to_rounding(c, dtypes):
    xd, wd = dtypes
    x, w = _rand(5, 3, c, dtype=xd, seed=1, scale=4.0), _rand(c, dtype=wd, seed=2)
    got = rms_norm(x, w, 1e-6)
    want = rmsnorm.reference(x.double(), w.double(), 1e-6)
    assert got.dtype == torch.promote_types(wd, xd) and got.shape == x.shape
    tol = dict(rtol=1e-5, atol=1e-5) if xd == torch.float32 else dict(rtol=8e-3, atol=1e-2)  # two BF16 roundings
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtypes", CASES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_kernel_is_hf_forward_in_invariant_mode(dtypes):
    """HF's own module forward with the invariant mode's mean. CPU (interpreter, numpy sums): the same bits, which
    checks every rounding of the formula. GPU: to rounding (another kernel's reduction tree; see rmsnorm_triton)."""
    xd, wd = dtypes
    x, w = _rand(40, 1100, dtype=xd, seed=3, scale=2.0), _rand(1100, dtype=wd, seed=4)
    module = _hf_norm(1100, w)
    invariant.set_mode(True, KEY)
    try:
        want = module(x)
    finally:
        invariant.set_mode(False)
    got = rms_norm(x, w, module.variance_epsilon)
    if HAS_CUDA:
        torch.testing.assert_close(got, want, rtol=1e-6 if xd == torch.float32 else 8e-3, atol=1e-6)
    else:
        assert_bitwise_equal(got, want, f"{xd} x {wd}")


def test_rows_do_not_depend_on_the_row_count():
    x, w = _rand(300, 256, dtype=torch.bfloat16, seed=5), _rand(256, seed=6)
    full = rms_norm(x, w, 1e-6)
    for lo, hi in ((0, 1), (17, 18), (5, 70), (64, 300)):
        assert_bitwise_equal(rms_norm(x[lo:hi], w, 1e-6), full[lo:hi], f"rows {lo}:{hi}")


def test_strided_input_and_empty_rows():
    x, w = _rand(8, 64, seed=7), _rand(32, seed=8)
    view = x[:, ::2]  # rows not contiguous: copied first
    assert_bitwise_equal(rms_norm(view, w, 1e-5), rms_norm(view.contiguous(), w, 1e-5), "strided")
    assert rms_norm(x[:0, :32], w, 1e-5).shape == (0, 32)


class GemmaStyleRMSNorm(nn.Module):
    """Another RMSNorm formula (scale by 1 + weight): must keep its own forward."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(c))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def test_fuse_norm_takes_hf_norms_and_leaves_other_formulas(fused):
    hf = _hf_norm(64, _rand(64, seed=9))
    other = GemmaStyleRMSNorm(64).to(DEVICE)
    assert rmsnorm.fuse_norm(hf) and rmsnorm.fuse_norm(hf)  # idempotent
    assert not rmsnorm.fuse_norm(other) and not getattr(other, "_rl4bit_fused_norm", False)
    x = _rand(4, 64, dtype=torch.bfloat16, seed=10)
    assert_bitwise_equal(hf(x), rms_norm(x, hf.weight, hf.variance_epsilon), "fused forward runs the kernel")
    fused_switch.set_enabled(False)
    assert_bitwise_equal(hf(x), rmsnorm.reference(x, hf.weight, hf.variance_epsilon), "disabled: HF's forward")


def test_convert_model_fuses_every_norm_and_backward_follows_hf(fused):
    """A converted tiny Qwen3-MoE: every RMSNorm fused; loss and gradients close to the unfused model's."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=128, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, num_hidden_layers=2, head_dim=16, intermediate_size=128,
                               moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    convert_model(model, RecipeConfig(name="bf16"))
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 4 + 1 and all(getattr(m, "_rl4bit_fused_norm", False) for m in norms)
    model.to(DEVICE)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    losses, grads = [], []
    for on in (True, False):
        fused_switch.set_enabled(on, DEV_TYPE)
        m = model if on else plain
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if "norm" in n})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 9
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-5, msg=n)


def test_bad_input_names_the_problem(fused):
    with pytest.raises(ValueError, match="last dim"):
        rmsnorm.rms_norm(_rand(4, 64, seed=11), _rand(32, seed=12), 1e-6)


def test_round_to_bf16_keeps_nan_and_rounds_ties_to_even():
    """The integer BF16 rounding: GPU NaN patterns (0x7FFFFFFF, 0xFFFFFFFF, signalling) stay NaN, overflow goes to
    Inf, ties go to even; every other value rounds like torch's FP32 -> BF16 cast."""
    @triton.jit
    def k(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < N, other=0.0)
        tl.store(y_ptr + offs, round_to(v, tl.bfloat16), mask=offs < N)

    bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, 0x7F7FFFFF, 0x7F800000, 0x3F808000, 0x3F818000,
                         0x3F808001, 0x80000000, 0x00000001], dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(500, generator=torch.Generator().manual_seed(13)) * 1e3])
    y = torch.empty_like(x).to(DEVICE)
    k[(1,)](x.to(DEVICE), y, x.numel(), BLOCK=1024)
    y, want = y.cpu(), x.to(torch.bfloat16).float()
    assert torch.isnan(y[:4]).all()
    assert torch.equal(y[4:], want[4:])


def test_non_finite_rows_stay_non_finite():
    """A NaN or Inf in a row makes that row NaN, as HF's forward does (never a row of zeros), and no other row."""
    x, w = _rand(4, 96, dtype=torch.bfloat16, seed=14), _rand(96, seed=15)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    got = rms_norm(x, w, 1e-6)
    want = rmsnorm.reference(x, w, 1e-6)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[1]).all()
    assert torch.isfinite(got[[0, 3]]).all()


class Olmo2StyleRMSNorm(nn.Module):
    """OLMo2's order: the weight product in FP32, then one cast. Equal to HF's Qwen3 order when the weight is all
    ones (HF's init), not otherwise: the probe's random weight must tell them apart."""

    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight * h).to(x.dtype)


def test_probe_uses_a_random_weight():
    norm = Olmo2StyleRMSNorm(64).to(torch.bfloat16).to(DEVICE)
    x = _rand(4, 64, dtype=torch.bfloat16, seed=16)
    assert torch.equal(norm(x), rmsnorm.reference(x, norm.weight, 1e-6))  # at init the two formulas agree
    assert not rmsnorm.reproduces(norm) and not rmsnorm.fuse_norm(norm)


# (x = sublayer output, residual, weight): the bench model's BF16 stream, an FP32 model, the trainer's FP32 residual
# stream with BF16 sublayer outputs under autocast (mixed: another compilation, see rmsnorm_triton.add_rms_norm)
ADD_CASES = [(torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32, torch.float32),
             (torch.bfloat16, torch.float32, torch.float32)]


def _equal_but_nan_payloads(a, b, what):
    """Bitwise equal, NaN where the other is NaN (a NaN's payload is the conversion's: torch's CPU BF16 add gives
    0xFFFF, the kernel's rounding keeps the operand's)."""
    nan = torch.isnan(b)
    assert torch.equal(torch.isnan(a), nan), what
    assert_bitwise_equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0), what)


@pytest.mark.parametrize("c", [16, 1100])
@pytest.mark.parametrize("dtypes", ADD_CASES, ids=lambda d: "-".join(str(t)[6:] for t in d))
def test_add_rms_norm_is_the_add_then_the_norm(c, dtypes):
    """(residual + x, rms_norm of it) from one launch: the sum is torch's add (one rounding to the promoted dtype)
    and the norm the plain kernel's, bitwise when the dtypes agree (one compiled kernel, on the GPU too); mixed
    dtypes bitwise under the interpreter, to rounding on the GPU. A NaN stays in its row."""
    xd, rd, wd = dtypes
    x, res = _rand(3, 5, c, dtype=xd, seed=21, scale=3.0), _rand(3, 5, c, dtype=rd, seed=22, scale=3.0)
    x[1, 2, 3] = float("nan")
    w = _rand(c, dtype=wd, seed=23)
    s, y = add_rms_norm(x, res, w, 1e-6)
    want_s = res + x
    assert s.dtype == want_s.dtype and s.shape == x.shape and y.dtype == torch.promote_types(wd, want_s.dtype)
    _equal_but_nan_payloads(s, want_s, "sum")
    want_y = rms_norm(want_s, w, 1e-6)
    if HAS_CUDA and xd != rd:
        torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6, equal_nan=True)
    else:
        _equal_but_nan_payloads(y, want_y, "norm")
    assert torch.isnan(y[1, 2]).all() and torch.isfinite(y[[0, 2]]).all()


def test_add_rms_norm_rows_strided_and_empty():
    x, res, w = _rand(6, 64, seed=24), _rand(6, 128, seed=25)[:, ::2], _rand(64, seed=26)
    s, y = add_rms_norm(x, res, w, 1e-5)
    s2, y2 = add_rms_norm(x, res.contiguous(), w, 1e-5)
    assert_bitwise_equal(s, s2, "strided sum") and assert_bitwise_equal(y, y2, "strided norm")
    for lo, hi in ((0, 1), (2, 5)):
        sp, yp = add_rms_norm(x[lo:hi], res[lo:hi], w, 1e-5)
        assert_bitwise_equal(yp, y[lo:hi], f"rows {lo}:{hi}")
    assert add_rms_norm(x[:0], res[:0], w, 1e-5)[1].shape == (0, 64)
    with pytest.raises(ValueError, match="must be one shape"):
        add_rms_norm(x, res[:3], w, 1e-5)


def test_fused_add_norm_backward_follows_the_torch_ops(fused):
    """`rmsnorm.add_rms_norm` under autograd (the training forward): kernel forward, the torch ops' gradients for x,
    the residual and the weight, through both outputs."""
    x = _rand(4, 96, dtype=torch.bfloat16, seed=27).requires_grad_()
    res = _rand(4, 96, seed=28).requires_grad_()
    w = _rand(96, seed=29).requires_grad_()
    gs, gy = _rand(4, 96, seed=30), _rand(4, 96, seed=31)
    grads = []
    for fn in (rmsnorm.add_rms_norm, rmsnorm.add_reference):
        s, y = fn(x, res, w, 1e-6)
        grads.append(torch.autograd.grad([s, y], [x, res, w], [gs, gy]))
        if fn is rmsnorm.add_rms_norm:
            kernel = add_rms_norm(x.detach(), res.detach(), w.detach(), 1e-6)
            assert_bitwise_equal(s, kernel[0], "sum") and assert_bitwise_equal(y, kernel[1], "norm")
    for a, b, name in zip(*grads, ("x", "residual", "weight")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
