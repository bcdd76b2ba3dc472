"""Fused q/k norm + rotary embedding: the kernel is bitwise the fused norms followed by HF's rotary ops, rows do not
depend on the row count, `fuse_attention` takes Qwen3-style attention only, and a converted model's no-grad forward
(the kernel) equals its training forward (HF's ops through the fused norms) bitwise.

CPU: TRITON_INTERPRET=1 (triton_setup) with the fused kernels enabled for CPU tensors; CUDA: the compiled kernels.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

from unittest import mock

import pytest
import torch
from bitwise import assert_bitwise_equal

from rl4bit.kernels import fused, qk_rope_triton, rmsnorm
from rl4bit.kernels.qk_rope_triton import qk_norm_rope
from rl4bit.kernels.rmsnorm_triton import rms_norm
from rl4bit.trainer.fused_attention import _rotate_half, fuse_attention, fuse_attentions

DEV_TYPE = torch.device(DEVICE).type
# (q/k dtype, norm weight dtype, cos dtype): trainer (BF16 projections, FP32 norm weights and cos), BF16 all, FP32 all
CASES = [(torch.bfloat16, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
         (torch.float32, torch.float32, torch.float32)]


@pytest.fixture
def on():
    fused.set_enabled(True, DEV_TYPE)
    yield
    fused.set_enabled(True, "cuda")


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _rope_inputs(b, t, d, dtype, seed):
    angle = (torch.arange(t, dtype=torch.float32)[:, None] + 3) * torch.logspace(0, -3, d // 2).repeat(2)[None]
    cos, sin = angle.cos().expand(b, t, d), angle.sin().expand(b, t, d)
    return cos.to(dtype).to(DEVICE), sin.to(dtype).to(DEVICE)


def _separate(q, k, wq, wk, cos, sin):
    """The fused norm kernel, then HF's `apply_rotary_pos_emb` ops ([B, T, H, D] layout)."""
    q, k = rms_norm(q, wq, 1e-6), rms_norm(k, wk, 1e-6)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtypes", CASES, ids=lambda c: "-".join(str(t).replace("torch.", "") for t in c))
def test_kernel_is_fused_norm_then_hf_rotary_bitwise(d, dtypes):
    xd, wd, cd = dtypes
    q, k = _rand(2, 7, 4, d, dtype=xd, seed=1, scale=3.0), _rand(2, 7, 2, d, dtype=xd, seed=2, scale=3.0)
    wq, wk = _rand(d, dtype=wd, seed=3), _rand(d, dtype=wd, seed=4)
    cos, sin = _rope_inputs(2, 7, d, cd, 5)
    got = qk_norm_rope(q, k, wq, wk, 1e-6, 1e-6, cos, sin)
    for g, w, name in zip(got, _separate(q, k, wq, wk, cos, sin), "qk"):
        assert_bitwise_equal(g, w, f"{name} {dtypes}")


def test_zero_heads_keep_hf_signed_zeros():
    """All-zero heads normalize to signed zeros and rotate to -0 where HF's rotate_half negates a +0 and cos < 0
    (positions 3..9 rad): the kernel negates by the sign bit, as torch does (Triton 3.6's unary minus, 0 - x,
    gives +0 there)."""
    q, k = _rand(2, 7, 4, 64, dtype=torch.bfloat16, seed=1), _rand(2, 7, 2, 64, dtype=torch.bfloat16, seed=2)
    q[:, :, 1], k[:, :, 0] = 0, 0
    wq, wk = _rand(64, seed=3).abs(), _rand(64, seed=4).abs()
    cos, sin = _rope_inputs(2, 7, 64, torch.float32, 5)
    got, want = qk_norm_rope(q, k, wq, wk, 1e-6, 1e-6, cos, sin), _separate(q, k, wq, wk, cos, sin)
    assert torch.signbit(want[0][:, :, 1]).any(), "the case needs HF outputs of -0"
    for g, w, name in zip(got, want, "qk"):
        assert_bitwise_equal(g, w, name)


def test_rows_do_not_depend_on_the_row_count():
    q, k = _rand(1, 40, 4, 64, dtype=torch.bfloat16, seed=6), _rand(1, 40, 2, 64, dtype=torch.bfloat16, seed=7)
    w = _rand(64, seed=8)
    cos, sin = _rope_inputs(1, 40, 64, torch.float32, 9)
    full = qk_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin)
    for lo, hi in ((0, 1), (3, 4), (10, 40)):
        part = qk_norm_rope(q[:, lo:hi], k[:, lo:hi], w, w, 1e-6, 1e-6, cos[:, lo:hi], sin[:, lo:hi])
        assert_bitwise_equal(part[0], full[0][:, lo:hi], f"q rows {lo}:{hi}")
        assert_bitwise_equal(part[1], full[1][:, lo:hi], f"k rows {lo}:{hi}")


def test_strided_token_rows_are_read_in_place():
    """q/k as views of one stacked q/k/v output (tokens 3 * H * D apart): the same bits as contiguous copies."""
    d, hq, hk = 32, 4, 2
    qkv = _rand(2, 5, (hq + 2 * hk) * d, dtype=torch.bfloat16, seed=31, scale=3.0)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(2, 5, hq, d), k.view(2, 5, hk, d)
    assert not q.is_contiguous()
    w = _rand(d, seed=32)
    cos, sin = _rope_inputs(2, 5, d, torch.float32, 33)
    got = qk_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin)
    want = qk_norm_rope(q.contiguous(), k.contiguous(), w, w, 1e-6, 1e-6, cos, sin)
    for g, x, name in zip(got, want, "qk"):
        assert_bitwise_equal(g, x, f"{name} strided")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_cache_rows_in_the_same_launch_equal_cache_write(cache_dtype):
    """cache=: keys and values of the first n tokens land in their (slot, position) as `cache_write` puts them
    (rounded to the cache's dtype), from q/k/v views of one stacked GEMM output; other cache rows and the
    returned q/k are untouched by it; slot/pos of fewer tokens than T (padding rows) write nothing else."""
    from rl4bit.kernels.attention_triton import cache_write

    d, hq, hk, t, n = 32, 4, 2, 6, 5
    qkv = _rand(1, t, (hq + 2 * hk) * d, dtype=torch.bfloat16, seed=41, scale=3.0)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(1, t, hq, d), k.view(1, t, hk, d), v.view(1, t, hk, d)
    w = _rand(d, seed=42)
    cos, sin = _rope_inputs(1, t, d, torch.float32, 43)
    slot = torch.tensor([2, 0, 2, 1, 2], device=DEVICE)
    pos = torch.tensor([7, 3, 8, 0, 9], device=DEVICE)
    noise = _rand(3, hk, 12, d, dtype=cache_dtype, seed=44)
    kc, vc = noise.clone(), noise.clone() + 1
    want_q, want_k = qk_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin)
    want_kc, want_vc = kc.clone(), vc.clone()
    cache_write(want_k[0, :n], v[0, :n], want_kc, want_vc, slot, pos)
    got_q, got_k = qk_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin, cache=(v, kc, vc, slot, pos))
    assert_bitwise_equal(got_q, want_q, "q")
    assert_bitwise_equal(got_k, want_k, "k")
    assert_bitwise_equal(kc, want_kc, "key cache")
    assert_bitwise_equal(vc, want_vc, "value cache")
    assert not torch.equal(kc, noise), "the test must write something"
    with pytest.raises(ValueError, match="qk_norm_rope cache"):
        qk_norm_rope(q, k, w, w, 1e-6, 1e-6, cos, sin, cache=(v, kc, vc[:, :1], slot, pos))


def _tiny(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2) \
        if family == "qwen3_moe" else dict(num_experts=4, num_experts_per_tok=2)
    cfg = AutoConfig.for_model(family, vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=2, intermediate_size=128, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def test_fuse_attention_takes_qwen3_style_attention_only():
    from rl4bit.kernels.rmsnorm import fuse_norms

    qwen, olmoe = _tiny("qwen3_moe"), _tiny("olmoe")  # OLMoE normalizes q/k over all heads: another layout
    assert fuse_attentions(qwen) == []  # q/k norms not fused (yet): their formula is unchecked
    fuse_norms(qwen)
    fuse_norms(olmoe)
    assert fuse_attentions(qwen) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert fuse_attentions(olmoe) == []
    assert fuse_attention(qwen.model.layers[0].self_attn)  # idempotent


def test_converted_model_no_grad_forward_equals_training_forward_bitwise(on):
    """The no-grad forward (samplers, logprob recompute) and the training forward (the same kernel under autograd)
    give the same logits, under BF16 autocast with FP32 masters as the trainer runs; the gradients are HF's."""
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    model = _tiny("qwen3_moe")
    convert_model(model, RecipeConfig(name="bf16"))
    assert all(getattr(m.self_attn, "_rl4bit_fused_attention", False) for m in model.model.layers)
    model.to(DEVICE)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = []
    spy = mock.patch.object(qk_rope_triton, "qk_norm_rope", wraps=qk_rope_triton.qk_norm_rope)
    with torch.autocast(DEV_TYPE, torch.bfloat16), spy as calls:
        with torch.no_grad():
            kernel = model(input_ids=ids, use_cache=False).logits  # as trainer and engine call it
        assert calls.call_count == 2  # one launch a layer
        for off in (False, True):
            with fused.disabled() if off else torch.enable_grad():
                logits = model(input_ids=ids, use_cache=False).logits
            assert calls.call_count == 4  # the training forward runs the kernel too; off: HF's forward
            logits.float().square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n})
            model.zero_grad()
            if not off:
                trained = logits.detach()
        with fused.disabled(), torch.no_grad():
            plain = model(input_ids=ids, use_cache=False).logits
    assert_bitwise_equal(kernel, trained, "no-grad (kernel) vs training forward")
    torch.testing.assert_close(kernel, plain, rtol=2e-2, atol=2e-2)  # HF's own norms: another mean order
    assert len(grads[0]) == 2 * 6  # q/k/v/o projections and the two norms of each layer
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=5e-2, atol=1e-4, msg=n)


@pytest.mark.parametrize("frozen", ["k side", "q side", "norm weights"])
def test_backward_with_part_of_the_inputs_frozen(on, frozen):
    """Gradients through the fused q/k path when one side (or the norm weights) needs none, as HF's ops give them."""
    from rl4bit.trainer.fused_attention import _QKNormRope

    q, k = _rand(1, 5, 4, 16, seed=20), _rand(1, 5, 2, 16, seed=21)
    wq, wk = _rand(16, seed=22), _rand(16, seed=23)
    cos, sin = _rope_inputs(1, 5, 16, torch.float32, 24)
    need = {"k side": (True, False, True, False), "q side": (False, True, False, True),
            "norm weights": (True, True, False, False)}[frozen]
    results = []
    for fused_path in (True, False):
        ins = [t.clone().requires_grad_(n) for t, n in zip((q, k, wq, wk), need)]
        if fused_path:
            qo, ko = _QKNormRope.apply(*ins, cos, sin, 1e-6, 1e-6)
        else:  # HF's ops as torch autograd sees them
            qn, kn = rmsnorm.reference(ins[0], ins[2], 1e-6), rmsnorm.reference(ins[1], ins[3], 1e-6)
            c, s = cos.unsqueeze(2), sin.unsqueeze(2)
            qo, ko = qn * c + _rotate_half(qn) * s, kn * c + _rotate_half(kn) * s
        loss = sum(o.square().sum() for o in (qo, ko) if o.requires_grad)
        loss.backward()
        results.append([t.grad for t, n in zip(ins, need) if n])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_stacked_projections_packed_equal_concatenated_and_follow_updates(on):
    """`pack_qkv` makes q/k/v views of one tensor: the packed GEMM equals the concatenated one bitwise (same
    weight values, same shape), follows in-place weight updates, and a replaced weight falls back to the cat."""
    from rl4bit.kernels.rmsnorm import fuse_norms
    from rl4bit.trainer.fused_attention import _packed, pack_qkv, projections

    model = _tiny("qwen3_moe").to(DEVICE)
    fuse_norms(model)
    fuse_attentions(model)
    attn = model.model.layers[0].self_attn
    x = _rand(1, 5, 64, seed=30)
    with torch.no_grad():
        separate = [lin(x) for lin in (attn.q_proj, attn.k_proj, attn.v_proj)]
        cat = projections(attn, x)
        assert pack_qkv(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
        assert _packed(weights, attn._rl4bit_qkv[0])
        base = attn._rl4bit_qkv[0]
        assert pack_qkv(model) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]  # again: kept as is
        assert attn._rl4bit_qkv[0] is base
        packed = projections(attn, x)
        for got, want, sep in zip(packed, cat, separate):
            assert_bitwise_equal(got, want, "packed vs cat")
            torch.testing.assert_close(got, sep, rtol=1e-5, atol=1e-5)  # three GEMMs: another kernel's rounding
        attn.k_proj.weight.copy_(attn.k_proj.weight * 2)  # what update_weights does: through the view
        stacked = torch.nn.functional.linear(x, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                           attn.v_proj.weight]))  # one GEMM of the packed shape
        q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        assert_bitwise_equal(projections(attn, x)[1], stacked[..., q_rows:q_rows + k_rows], "after an in-place update")
        torch.testing.assert_close(projections(attn, x)[1], attn.k_proj(x), rtol=1e-5, atol=1e-5)  # another GEMM
        attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight * 3, requires_grad=False)  # no longer a view
        assert not _packed([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], attn._rl4bit_qkv[0])
        torch.testing.assert_close(projections(attn, x)[1], attn.k_proj(x), rtol=1e-5, atol=1e-5)
        assert not hasattr(attn, "_rl4bit_qkv")  # the stale stack is dropped
        calls = []
        attn.v_proj.register_forward_hook(lambda *a: calls.append(1))
        projections(attn, x)
        assert calls == [1]  # a hooked projection keeps its own forward


def test_engine_serves_packed_projections_and_takes_updates(on):
    """The engine packs q/k/v (one GEMM a layer); its greedy tokens follow a weight update into them."""
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams, WeightUpdate
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    class _Tok:
        eos_token_id = None

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    model = _tiny("qwen3_moe")
    convert_model(model, RecipeConfig(name="bf16"))
    fresh = {n: t.clone() for n, t in model.state_dict().items()}
    eng = EmbeddedEngine(model, _Tok(), max_batch_size=2, device=DEVICE, max_seq_len=32, decode_graphs="off")
    attn = eng.model.model.layers[1].self_attn
    assert hasattr(attn, "_rl4bit_qkv")
    req = [Request("a", [3, 5, 7, 9], SamplingParams(temperature=0.0, max_new_tokens=6))]
    before = eng.generate(req)[0].completion_ids
    g = torch.Generator().manual_seed(5)
    new = {n: t + torch.randn(t.shape, generator=g) * 0.5 for n, t in fresh.items() if "v_proj" in n or "q_proj" in n}
    eng.update_weights(WeightUpdate(version=1, tensors=new))
    after = eng.generate(req)[0].completion_ids
    assert_bitwise_equal(attn.v_proj.weight, new["model.layers.1.self_attn.v_proj.weight"].to(DEVICE), "view updated")
    assert attn.v_proj.weight.data_ptr() != attn._rl4bit_qkv[0].data_ptr()  # still a view, inside the stack
    reference = _tiny("qwen3_moe")
    convert_model(reference, RecipeConfig(name="bf16"))
    reference.load_state_dict({**fresh, **new})
    rebuilt = EmbeddedEngine(reference, _Tok(), max_batch_size=2, device=DEVICE, max_seq_len=32, decode_graphs="off")
    assert after == rebuilt.generate(req)[0].completion_ids
    assert after != before


def test_engine_writes_its_kv_cache_in_the_rope_kernel(on):
    """With the fused kernels on, the engine's steps put keys and values into the cache from the q/k-norm +
    RoPE kernel (`cache_write` never runs); tokens, logprobs and the cache (n = 2 samples: forked prefixes
    too) equal those of the separate write."""
    import contextlib

    from rl4bit.kernels import attention_triton
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams
    from rl4bit.trainer import fused_attention
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    class _Tok:
        eos_token_id = None

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    reqs = [Request("a", [3, 5, 7, 9], SamplingParams(temperature=0.0, max_new_tokens=5)),
            Request("b", [4, 6], SamplingParams(temperature=1.0, seed=3, max_new_tokens=4, n=2))]
    runs = []
    for fused_write in (True, False):
        model = _tiny("qwen3_moe")
        convert_model(model, RecipeConfig(name="bf16"))
        eng = EmbeddedEngine(model, _Tok(), max_batch_size=4, device=DEVICE, max_seq_len=32, decode_graphs="off")
        writes = mock.patch.object(attention_triton, "cache_write", wraps=attention_triton.cache_write)
        separate = mock.patch.object(fused_attention, "_engine_cache", return_value=None)
        with writes as w, (contextlib.nullcontext() if fused_write else separate):
            out = eng.generate(reqs)
        assert (w.call_count == 0) == fused_write, w.call_count
        runs.append(([(r.completion_ids, r.logprobs) for r in out], [c.clone() for c in eng.cache.k + eng.cache.v]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert_bitwise_equal(a, b, "KV cache")
