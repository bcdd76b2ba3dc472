"""The engine's rotary tables (`sampler.rope_table`): the same cos/sin as HF's rotary module for any positions, the
engine's rollouts unchanged by them, and the modules that must keep their forward (length-dependent rope types,
other dtypes) keep it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rl4bit.sampler import rope_table
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _model(**rope):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=48, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None, tie_word_embeddings=False, **rope)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    return model


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_give_the_modules_cos_and_sin(dtype, device):
    """On each device the tables hold the module's own bits there (the install probe checks the same)."""
    model = _model().to(dtype).to(device)
    plain = copy.deepcopy(model.model.rotary_emb)
    assert rope_table.rope_tables(model, 40) and rope_table.rope_tables(model, 40)  # idempotent
    x = torch.zeros(2, 7, 64, dtype=dtype, device=device)
    pos = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)
    for got, want in zip(model.model.rotary_emb(x, pos), plain(x, pos)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    other = torch.zeros(1, 1, 64, dtype=torch.float16, device=device)  # no table: the module's own forward
    for got, want in zip(model.model.rotary_emb(other, pos[:1]), plain(other, pos[:1])):
        assert got.dtype == torch.float16 and torch.equal(got, want)


def test_engine_rollouts_do_not_change():
    model = _model()
    reqs = [Request(str(i), list(range(1, 4 + 3 * i)), SamplingParams(temperature=1.0, seed=i, max_new_tokens=5))
            for i in range(3)]
    runs = []
    for tables in (True, False):
        m = copy.deepcopy(model)
        if not tables:  # the engine installs them; keep the module's forward for the baseline
            m.model.rotary_emb._rl4bit_rope_table = True
        engine = EmbeddedEngine(m, _Tok(), max_batch_size=3, max_seq_len=32, decode_graphs="static")
        assert ("forward" in vars(m.model.rotary_emb)) == tables
        runs.append([(r.completion_ids, r.logprobs) for r in engine.generate(reqs)])
    assert runs[0] == runs[1]


def test_length_dependent_rope_types_keep_their_forward():
    model = _model(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    if "dynamic" not in getattr(model.model.rotary_emb, "rope_type", ""):
        pytest.skip("this transformers version names the rope type elsewhere")
    assert not rope_table.rope_tables(model, 40) and "forward" not in vars(model.model.rotary_emb)


def test_tables_over_the_size_limit_are_not_built(monkeypatch):
    monkeypatch.setattr(rope_table, "MAX_BYTES", 1024)
    model = _model()
    assert not rope_table.rope_tables(model, 40) and "forward" not in vars(model.model.rotary_emb)


def test_a_later_engine_with_a_longer_context_gets_a_longer_table():
    """Two engines on one model: the second's positions past the first's table are served (it raised IndexError),
    with the module's bits, and the first table stays alive (its engine's graphs read it)."""
    model = _model()
    plain = copy.deepcopy(model.model.rotary_emb)
    assert rope_table.rope_tables(model, 16)
    first = model.model.rotary_emb._rl4bit_rope_state["tables"][(torch.device("cpu"), torch.float32)]
    assert rope_table.rope_tables(model, 48) and rope_table.rope_tables(model, 20)  # a shorter one keeps 48
    state = model.model.rotary_emb._rl4bit_rope_state
    assert state["tables"][(torch.device("cpu"), torch.float32)][0].shape[0] == 48
    assert any(t[0] is first[0] for t in state["kept"])
    x = torch.zeros(1, 3, 64)
    pos = torch.tensor([[0, 30, 47]])
    for got, want in zip(model.model.rotary_emb(x, pos), plain(x, pos)):
        assert torch.equal(got, want)
    reqs = [Request("a", list(range(1, 30)), SamplingParams(temperature=0.0, max_new_tokens=8))]
    for n in (16, 40):  # the engines' own calls
        engine = EmbeddedEngine(model, _Tok(), max_batch_size=1, max_seq_len=n, decode_graphs="static")
        assert engine.generate([Request("b", [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=4))])
    assert engine.generate(reqs)[0].finish_reason == "length"


def test_a_longer_table_that_does_not_qualify_hands_back_to_the_module(monkeypatch):
    model = _model()
    plain = copy.deepcopy(model.model.rotary_emb)
    assert rope_table.rope_tables(model, 8)
    monkeypatch.setattr(rope_table, "MAX_BYTES", 1024)  # 8 positions fit, 40 do not
    assert not rope_table.rope_tables(model, 40)
    assert not model.model.rotary_emb._rl4bit_rope_state["tables"]
    x, pos = torch.zeros(1, 2, 64), torch.tensor([[3, 39]])
    for got, want in zip(model.model.rotary_emb(x, pos), plain(x, pos)):
        assert torch.equal(got, want)
