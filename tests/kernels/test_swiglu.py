"""Fused SwiGLU: the kernel against the exact formula and HF's ops, the NVFP4 quantize of h with `swiglu=True`
bitwise equal to the kernel's output quantized, `fused_swiglu` routing (SiLU only) and its gradients, and (GPU)
a served NVFP4 experts layer equal to its training forward.

CPU: TRITON_INTERPRET=1 (triton_setup) with the fused kernels enabled for CPU tensors; CUDA: compiled kernels.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import pytest
import torch
import torch.nn.functional as F
from bitwise import assert_bitwise_equal

from rl4bit.kernels import fused, nvfp4_triton, quantize
from rl4bit.kernels import qgemm_triton as qg
from rl4bit.kernels.swiglu_triton import swiglu as kernel
from rl4bit.trainer import fused_swiglu

DEV_TYPE = torch.device(DEVICE).type


@pytest.fixture
def on():
    fused.set_enabled(True, DEV_TYPE)
    yield
    fused.set_enabled(True, "cuda")


def _h(rows, inner, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 2 * inner, generator=g) * scale
    h[0, :4] = torch.tensor([0.0, -200.0, 200.0, -1e-30])  # silu(0) = 0, exp overflow -> -0, exp -> 0, tiny
    return h.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_kernel_is_the_formula_rounded_per_op(dtype):
    """y = T(T(silu(g)) * u): within one rounding of T per op of the float64 formula; HF's ops agree to that."""
    h = _h(7, 48, dtype)
    y = kernel(h)
    assert y.dtype == dtype and y.shape == (7, 48)
    g, u = h.double().chunk(2, dim=-1)
    s = (g / (1 + torch.exp(-g))).to(dtype).double()  # exact silu, rounded: the kernel's exp is off by ulps only
    exact = s * u
    eps = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}[dtype]
    if dtype == torch.float32:  # the GPU's exp is ex2.approx(g * log2 e): that product's FP32 rounding alone is a
        eps = 2.0**-21 + g.abs() * 2.0**-23  # relative error of |g| 2**-24 in exp, hence in silu for g < 0
    assert torch.all((y.double() - exact).abs() <= eps * exact.abs() + 1e-30)
    gate, up = h.chunk(2, dim=-1)
    want = (F.silu(gate) * up).double()  # torch's accurate exp: the same bound, twice
    assert torch.all((y.double() - want).abs() <= 2 * eps * want.abs() + 1e-30)
    assert torch.equal(torch.signbit(y[0, :3]), torch.signbit((F.silu(gate) * up)[0, :3]))  # 0 * u, -0 * u


def test_kernel_rows_do_not_depend_on_the_row_count():
    h = _h(33, 40, torch.bfloat16, seed=1)
    full = kernel(h)
    for lo, hi in ((0, 1), (5, 6), (3, 33)):
        assert_bitwise_equal(kernel(h[lo:hi]), full[lo:hi], f"rows {lo}:{hi}")


@pytest.mark.parametrize("four_over_six", [True, False])
def test_quantize_of_h_with_swiglu_equals_quantize_of_the_kernel_output(four_over_six):
    """`quantize_nvfp4(h, swiglu=True)` (the serving path) = `quantize(swiglu(h))` (the training path), codes,
    scales, outer scales and the pre-decoded operand; `quantize_and_multiply(h, swiglu=True)` likewise."""
    h = _h(9, 96, torch.bfloat16, seed=2)  # K = 96: the quantize tile (128) ends on a partial block of columns
    y = kernel(h)
    want = quantize(y, "nvfp4", outer="row", four_over_six=four_over_six)
    xh = torch.empty((9, 96), dtype=torch.float16, device=DEVICE)
    data, scale, outer, _ = nvfp4_triton.quantize_nvfp4(h, outer="row", four_over_six=four_over_six, decoded=xh,
                                                        decode="bits", swiglu=True)
    assert_bitwise_equal(data, want.data, "codes")
    assert_bitwise_equal(scale, want.scale.view(torch.uint8), "block scales")
    assert_bitwise_equal(outer, want.outer.reshape(-1), "per-row outer scales")
    xh_want = torch.empty_like(xh)
    nvfp4_triton.quantize_nvfp4(y, outer="row", four_over_six=four_over_six, decoded=xh_want, decode="bits")
    assert_bitwise_equal(xh, xh_want, "decoded operand")
    counts = [4, 0, 5]
    qw = quantize(torch.randn(3, 32, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 0.1, "nvfp4",
                  outer="group")
    for cfg in (qg.DECODE, qg.TRAIN):
        _, got = qg.quantize_and_multiply(h, qw, counts, torch.float32, four_over_six=four_over_six, config=cfg,
                                          swiglu=True)
        _, ref = qg.quantize_and_multiply(y, qw, counts, torch.float32, four_over_six=four_over_six, config=cfg)
        assert_bitwise_equal(got, ref, f"quantize_and_multiply swiglu, {cfg}")


def test_swiglu_overflow_and_non_finite_h_are_named():
    from rl4bit.kernels.checks import NonFiniteInputError
    from rl4bit.kernels.triton_dispatch import quantize_nvfp4_rows

    h = torch.ones(2, 32)
    h[1, 3], h[1, 16 + 3] = 100.0, 1e38  # finite gate and up: silu(100) * 1e38 overflows FP32
    with pytest.raises(NonFiniteInputError, match="SwiGLU of h .* overflows"):
        quantize_nvfp4_rows(h.to(DEVICE), four_over_six=True, swiglu=True)
    h[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_nvfp4_rows(h.to(DEVICE), four_over_six=True, swiglu=True)


def test_swiglu_routes_silu_only_and_differentiates_hf_formula(on):
    from transformers.activations import ACT2FN

    h = _h(5, 16, torch.float32, seed=4).requires_grad_(True)
    silu, gelu = ACT2FN["silu"], ACT2FN["gelu"]
    assert fused_swiglu.is_silu(silu) and fused_swiglu.is_silu(torch.nn.SiLU()) and not fused_swiglu.is_silu(gelu)
    assert fused_swiglu.applies(h, silu) and not fused_swiglu.applies(h, gelu)
    y = fused_swiglu.swiglu(h, silu)  # the kernel under autograd
    assert_bitwise_equal(y.detach(), kernel(h.detach()), "autograd forward = kernel")
    (dy,) = torch.autograd.grad(y.square().sum(), h)
    hr = h.detach().requires_grad_(True)
    (want,) = torch.autograd.grad(fused_swiglu.reference(hr, silu).square().sum(), hr)
    torch.testing.assert_close(dy, want, rtol=1e-4, atol=1e-5)
    gelu_out = fused_swiglu.swiglu(h.detach(), gelu)  # not SiLU: HF's two ops
    gate, up = h.detach().chunk(2, dim=-1)
    assert_bitwise_equal(gelu_out, gelu(gate) * up, "gelu: HF's ops")
    with fused.disabled():
        assert_bitwise_equal(fused_swiglu.swiglu(h.detach(), silu), F.silu(gate) * up, "fused off: HF's ops")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_served_nvfp4_experts_equal_their_training_forward():
    """A QuantExperts layer serving its NVFP4 QTensors (SwiGLU inside the down projection's quantize, decoded x
    from the quantize kernel, one tile map) = the same layer's training forward (SwiGLU kernel, then the
    autograd GEMM), bitwise, at decode and prefill row counts."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from rl4bit.trainer.modules import QuantExperts
    from rl4bit.trainer.qgemm import GemmSpec

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=8,
                               num_experts_per_tok=2)
    torch.manual_seed(0)
    src = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        src.gate_up_proj.normal_(0, 0.05)
        src.down_proj.normal_(0, 0.05)
    train = QuantExperts(src, GemmSpec("nvfp4")).to(DEVICE)
    serve = QuantExperts(src, GemmSpec("nvfp4")).to(DEVICE)
    serve.load_quantized({k: v for k, v in train.quantized_weights().items()})
    for tokens in (1, 4, 300):
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, 256, generator=g).to(DEVICE, torch.bfloat16)
        idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)]).to(DEVICE)
        w = torch.rand(tokens, 2, generator=g).to(DEVICE, torch.bfloat16)
        with torch.no_grad():
            want = train(x, idx, w)
            got = serve(x, idx, w)
        assert_bitwise_equal(got, want, f"served vs training forward, {tokens} tokens")
