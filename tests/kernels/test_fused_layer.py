"""Decoder layers with the attention's residual add in the post-attention norm's kernel and the MLP's in the MoE
combine (`trainer.fused_layer`).

`convert_model` fuses the pre-norm layers of every family it supports (the MoE combine's add where the block is a
gate and `QuantExperts` alone); the fused layer changes no bits of the
model's logits (interpreter; on a GPU the trainer's mixed FP32/BF16 stream is another compilation of the norm:
to rounding); its training gradients follow HF's; layers of another shape keep their forward, and the probe leaves
the layer it looks at untouched.

CPU: TRITON_INTERPRET=1 (triton_setup) with the fused kernels enabled for CPU tensors; CUDA: the compiled kernels.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

from unittest import mock

import pytest
import torch
from bitwise import assert_bitwise_equal
from torch import nn

from rl4bit.kernels import combine_triton, fused, rmsnorm, rmsnorm_triton
from rl4bit.trainer import fused_layer
from rl4bit.trainer.recipe import RecipeConfig
from rl4bit.trainer.surgery import convert_model

DEV = torch.device(DEVICE).type
FAMILIES = {  # tiny configs, every dimension a multiple of 32 so the recipes apply
    "qwen3_moe": dict(num_hidden_layers=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    "olmoe": dict(num_hidden_layers=2, intermediate_size=32, num_experts=4, num_experts_per_tok=2, eos_token_id=0,
                  pad_token_id=1, bos_token_id=None),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_hidden_layers=2, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2, shared_expert_intermediate_size=32),
    "llama": dict(num_hidden_layers=2, intermediate_size=128),
}
RESIDUAL_BLOCKS = {"qwen3_moe", "olmoe", "mixtral"}  # gate + QuantExperts only (Qwen2-MoE adds a shared expert)


@pytest.fixture
def kernels_on():
    saved = fused.state()
    fused.set_enabled(True, DEV)
    yield
    fused.set_enabled(saved is not None, saved or "cuda")


def _converted(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # norm weights off HF's all-ones init, so the weight product's rounding shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.5)
    convert_model(model, RecipeConfig(name="bf16"))
    return model.to(DEVICE).eval()  # as the trainer and the samplers hold it (no dropout)


def _layers(model):
    return [m for n, m in model.named_modules() if type(m).__name__.endswith("DecoderLayer")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convert_model_fuses_pre_norm_layers(family):
    layers = _layers(_converted(family))
    assert layers and all(getattr(m, "_rl4bit_fused_layer", False) for m in layers)
    blocks = [getattr(m.mlp, "_rl4bit_residual_block", False) for m in layers]
    assert blocks == [family in RESIDUAL_BLOCKS] * len(layers), blocks


def _unfuse(model):
    for m in _layers(model):
        del m.forward  # the class's (HF's) forward again
        m._rl4bit_fused_layer = False


def test_fused_layers_change_no_bits_and_run_the_kernel(kernels_on):
    """The converted model (FP32 masters under BF16 autocast, as the trainer holds it) with fused layers gives the
    logits of the same model with HF's layer forward (the fused norms, attention and router in both)."""
    import copy

    model = _converted("qwen3_moe")
    plain = copy.deepcopy(model)
    _unfuse(plain)
    ids = torch.randint(0, 128, (3, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad(), torch.autocast(DEV, torch.bfloat16):
        with mock.patch.object(rmsnorm_triton, "add_rms_norm", wraps=rmsnorm_triton.add_rms_norm) as spy, \
                mock.patch.object(combine_triton, "combine", wraps=combine_triton.combine) as combines:
            got = model(input_ids=ids).logits
        want = plain(input_ids=ids).logits
    assert spy.call_count == len(_layers(model))
    assert [c.args[6] is not None for c in combines.call_args_list] == [True] * len(_layers(model))  # residual
    if HAS_CUDA:  # FP32 residual + BF16 attention output: another compilation of the norm's kernel
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bitwise_equal(got, want, "logits")


def test_bf16_stream_on_the_device_is_bitwise(kernels_on):
    """A BF16 model (the bench's serving stream): sum and sublayer output share a dtype, so the fused layer is the
    same compiled kernel as the add and the norm apart, on the GPU too."""
    model = _converted("llama").to(torch.bfloat16)
    layer = _layers(model)[0]
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    pos = torch.arange(7, device=DEVICE)[None].expand(2, -1)
    emb = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        got = layer(x, position_embeddings=emb, position_ids=pos, attention_mask=None)
        want = type(layer).forward(layer, x, position_embeddings=emb, position_ids=pos, attention_mask=None)
    assert_bitwise_equal(got, want, "layer output")


def test_training_gradients_follow_hf(kernels_on):
    import copy

    model = _converted("qwen3_moe")
    plain = copy.deepcopy(model)
    _unfuse(plain)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    losses, grads = [], []
    for m in (model, plain):
        with torch.autocast(DEV, torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    tol = 1e-5 if HAS_CUDA else 0  # the mixed-dtype norm is another compilation on a GPU: to rounding there
    torch.testing.assert_close(losses[0], losses[1], rtol=tol, atol=tol)
    assert grads[0].keys() == grads[1].keys() and any("post_attention_layernorm" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6, msg=n)


def test_kernels_off_runs_hf_forward():
    model = _converted("qwen3_moe")
    layer = _layers(model)[0]
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    pos = torch.arange(5, device=DEVICE)[None]
    emb = model.model.rotary_emb(x, pos)
    saved = fused.state()
    fused.set_enabled(False)
    try:
        with torch.no_grad(), mock.patch.object(rmsnorm, "add_rms_norm") as never:
            got = layer(x, position_embeddings=emb, position_ids=pos, attention_mask=None)
        want = type(layer).forward(layer, x, position_embeddings=emb, position_ids=pos, attention_mask=None)
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")
    assert not never.called
    assert_bitwise_equal(got, want, "kernels off")


# ---------------------------------------------------------------- layers of other shapes keep their forward


def _norm(c=64):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    n = Qwen3MoeRMSNorm(c)
    rmsnorm.fuse_norm(n)
    return n


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, hidden_states, position_ids=None, **kwargs):
        return self.proj(hidden_states), None


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = _norm(), _norm()
        self.self_attn, self.mlp = _Attn(), nn.Linear(64, 64)


class PreNormDecoderLayer(_Base):
    def forward(self, hidden_states, position_ids=None, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids=position_ids, **kwargs)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class ParallelDecoderLayer(_Base):  # GPT-J / Cohere: attention and MLP on the same normed input
    def forward(self, hidden_states, position_ids=None, **kwargs):
        n = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attn(n, position_ids=position_ids, **kwargs)[0] + self.mlp(n)


class PostNormDecoderLayer(_Base):  # OLMo2 / Gemma2: the norm on the sublayer's output, before the add
    def forward(self, hidden_states, position_ids=None, **kwargs):
        h = hidden_states + self.post_attention_layernorm(self.self_attn(hidden_states, position_ids=position_ids,
                                                                         **kwargs)[0])
        return h + self.mlp(self.input_layernorm(h))


class RenamingDecoderLayer(_Base):  # hands the attention another argument than it was given
    def forward(self, hidden_states, position_ids=None, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids=None, **kwargs)[0]
        return h + self.mlp(self.post_attention_layernorm(h))


class SharedNormDecoderLayer(_Base):  # the input norm before the MLP too: equal to the pre-norm form at HF's init
    def forward(self, hidden_states, position_ids=None, **kwargs):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_ids=position_ids, **kwargs)[0]
        return h + self.mlp(self.input_layernorm(h))


class TupleDecoderLayer(PreNormDecoderLayer):  # returns (hidden, extras) as older HF layers did
    def forward(self, hidden_states, **kwargs):
        return super().forward(hidden_states, **kwargs), None


def test_only_pre_norm_layers_are_fused():
    assert fused_layer.fuse_layer(PreNormDecoderLayer())
    for cls in (ParallelDecoderLayer, PostNormDecoderLayer, RenamingDecoderLayer, TupleDecoderLayer,
                SharedNormDecoderLayer):
        layer = cls()
        assert not fused_layer.fuse_layer(layer) and "forward" not in vars(layer), cls.__name__
    unfused_norm = PreNormDecoderLayer()
    unfused_norm.post_attention_layernorm._rl4bit_fused_norm = False  # formula unchecked
    assert not fused_layer.fuse_layer(unfused_norm)


def test_probe_leaves_the_layer_untouched():
    layer = PreNormDecoderLayer()
    layer.resid_dropout = nn.Dropout(0.0)  # a child the probe shares with the layer: its mode must not change
    parts = dict(layer._modules)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    assert fused_layer.reproduces(layer)
    assert dict(layer._modules) == parts and all(torch.equal(state[k], v) for k, v in layer.state_dict().items())
    assert layer.training and layer.resid_dropout.training


class _NoResidualExperts(nn.Module):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class _Block(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4), experts

    def forward(self, hidden_states):
        flat = hidden_states.view(-1, hidden_states.shape[-1])
        _, weights, index = self.gate(flat)
        return self.experts(flat, index, weights).reshape(hidden_states.shape)


class _ScaledBlock(_Block):  # another formula around the experts
    def forward(self, hidden_states):
        return super().forward(hidden_states) * 0.5


def test_residual_block_needs_experts_taking_the_residual_and_the_plain_formula():
    assert fused_layer.residual_block(_Block(fused_layer._ProbeExperts()))
    assert not fused_layer.residual_block(_Block(_NoResidualExperts()))  # e.g. the expert-parallel layer
    assert not fused_layer.residual_block(_ScaledBlock(fused_layer._ProbeExperts()))
    assert not fused_layer.residual_block(nn.Linear(8, 8))


def test_recomputed_layers_run_the_fused_forward(kernels_on):
    """`trainer.recompute` checkpoints the fused forward (not the class's): the kernel runs in the forward and in
    the backward's re-run, and the gradients are the plain backward's, bit for bit."""
    import copy

    from rl4bit.trainer.recompute import enable_recompute

    model = _converted("qwen3_moe")
    plain = copy.deepcopy(model)
    assert enable_recompute(model) == len(_layers(model))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    grads = []
    for m in (model, plain):
        with mock.patch.object(rmsnorm_triton, "add_rms_norm", wraps=rmsnorm_triton.add_rms_norm) as spy:
            with torch.autocast(DEV, torch.bfloat16):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        assert spy.call_count == len(_layers(m)) * (2 if m is model else 1)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert_bitwise_equal(grads[0][n], grads[1][n], n)


def test_training_mode_and_missing_arguments(kernels_on):
    """A layer in training mode runs HF's forward (dropout, router jitter and transformers' checkpointing live
    there); arguments the caller leaves out reach the attention with HF's defaults, as HF passes them."""
    model = _converted("qwen3_moe")
    layer = _layers(model)[0]
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    emb = model.model.rotary_emb(x, torch.arange(4, device=DEVICE)[None])
    with torch.no_grad(), mock.patch.object(rmsnorm_triton, "add_rms_norm", wraps=rmsnorm_triton.add_rms_norm) as spy:
        got = layer(x, position_embeddings=emb)  # no attention_mask, position_ids, cache: HF's defaults
        assert spy.call_count == 1
        want = type(layer).forward(layer, x, position_embeddings=emb)
        layer.train()
        layer(x, position_embeddings=emb)
        assert spy.call_count == 1  # HF's forward in training mode
    if HAS_CUDA:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bitwise_equal(got, want, "defaults")
