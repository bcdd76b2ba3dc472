"""Fixtures for the sampler tests: a tiny Qwen3-MoE (~100k params) and a character-level tokenizer.

Built here (not from rl4bit.trainer.models) so the sampler tests stand alone.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

CHARS = list("0123456789+-*= \nabcdefghijklmnopqrstuvwxyz")
SPECIAL = ["<pad>", "<bos>", "<eos>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def make_model(dtype=torch.float32, seed=0, vocab=len(SPECIAL) + len(CHARS)) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # HF init leaves the router at zero; random routers exercise the experts
        for p in model.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (2..20 tokens), BOS first."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(1, 20, (1,), generator=g))
        out.append([1] + torch.randint(3, 3 + len(CHARS), (length,), generator=g).tolist())
    return out


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: one torch thread is fastest, and OpenMP spin-waits make 2 threads on a busy
    2-core machine 10x slower. Restored after each module so other test folders keep their setting."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
