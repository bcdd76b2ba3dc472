"""The embedded engine's Rollout.text is vLLM's CompletionOutput.text (include_stop_str_in_output=True,
skip_special_tokens=True): the completion decoded after its prompt, stop strings found as vLLM finds them.

SentencePiece-style tokenizers (Metaspace decoder: the first piece's leading space dropped) show the
difference: decoded alone, a completion loses the space of its first piece; decoded after the prompt, as vLLM
does, it keeps it.
"""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl4bit.sampler.detokenizer import IncrementalDetokenizer
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams

from .conftest import CHARS, SPECIAL, make_model, prompts
from .tokenizer_zoo import TOKENIZERS, completion_ids


def _metaspace(words):
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


@pytest.fixture(scope="module")
def sp_engine():
    # the conftest model's vocabulary, every non-special piece a word with its leading '▁'
    tok = _metaspace(SPECIAL + [f"▁w{i}" for i in range(len(CHARS))])
    return EmbeddedEngine(make_model(torch.float32), tok, max_batch_size=4)


def _after_prompt(tok, prompt, completion):
    """vLLM's text for a Metaspace tokenizer without byte fallback: the completion decoded after its prompt."""
    return tok.decode(prompt + completion, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]


def test_text_is_decoded_after_the_prompt(sp_engine):
    tok = sp_engine.tokenizer
    for p in prompts(4, seed=5):
        r = sp_engine.generate([Request("a", p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))])[0]
        assert r.text == _after_prompt(tok, p, r.completion_ids)
        assert r.text.startswith(" ")  # decoded alone it would not: tokenizer.decode drops the first '▁'


def test_a_stop_string_with_a_leading_space_stops_at_the_first_token(sp_engine):
    tok = sp_engine.tokenizer
    p = prompts(1, seed=6)[0]
    full = sp_engine.generate([Request("a", p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))])[0]
    stop = _after_prompt(tok, p, full.completion_ids[:1])  # ' wN': the first token's text, space included
    out = sp_engine.generate([Request("a", p, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                                             stop=[stop]))])[0]
    assert (out.finish_reason, out.completion_ids, out.text) == ("stop", full.completion_ids[:1], stop)


def test_stop_strings_follow_vllm():
    """The stop string ending first wins (vLLM's check_stop_strings), not the one starting first; a character
    left unfinished at the end is held back (vLLM's DecodeStream), not written as U+FFFD."""
    tok = _metaspace(["<pad>", "<bos>", "<eos>", "▁x", "▁a", "bc"])
    d = IncrementalDetokenizer(tok, [1, 3], ["abc", "b"])  # prompt '<bos> x'
    assert [d.step(t) for t in (4, 5)] == [False, True] and d.text == " ab"  # ' a' + 'bc': 'b' ends first

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    bl = Tokenizer(models.BPE(vocab={"<eos>": 0, **{c: i + 1 for i, c in enumerate(alphabet)}}, merges=[]))
    bl.pre_tokenizer, bl.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bl = PreTrainedTokenizerFast(tokenizer_object=bl, eos_token="<eos>")
    ids = bl("ok é", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(bl, [0], [])
    for t in ids[:-1]:  # cut after the first byte of 'é'
        d.step(t)
    assert d.text == "ok " and bl.decode(ids[:-1]) == "ok \ufffd"


class _DecodeOnly:
    """A tokenizer seen only through `decode` (no `tokenizers` backend: a slow tokenizer, a benchmark's stub),
    its calls counted."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_the_python_stream_equals_tokenizers_decode_stream(name):
    """`_PyDecodeStream` (over `tokenizer.decode`) against tokenizers' own DecodeStream (Rust), token by token:
    the same text and the same stop, on random completions with specials mixed in and stop strings cut from their
    text (multi-byte characters, leading spaces)."""
    tok = TOKENIZERS[name]()
    rng = random.Random(name)
    stopped = 0
    for trial in range(30):
        ids = completion_ids(tok, rng, 80)
        prompt, comp = ids[:rng.randrange(1, 20)], ids[20:]
        if trial % 5 == 0:  # a prompt of special tokens only (it decodes to "")
            prompt = [rng.choice(tok.all_special_ids) for _ in range(rng.randint(1, 3))]
        full = tok.decode(comp, skip_special_tokens=True)
        stops = [full[a:a + rng.randint(1, 6)] for a in (rng.randrange(max(1, len(full) - 1))
                                                         for _ in range(rng.choice((0, 1, 2))))]
        stops = [s for s in stops if s]
        rust, py = IncrementalDetokenizer(tok, prompt, stops), IncrementalDetokenizer(_DecodeOnly(tok), prompt, stops)
        assert rust.backend is not None and py.backend is None
        for k, t in enumerate(comp):
            a, b = rust.step(t), py.step(t)
            assert (a, rust.text) == (b, py.text), (name, trial, k, stops)
            if a:
                stopped += 1
                break
    assert stopped >= 5, f"{name}: only {stopped} of 30 completions hit a stop string; the test would not bite"


def test_without_stop_strings_nothing_is_decoded_until_the_text_is_read():
    """The engine's decode loop pays nothing for the text of a request without stop strings."""
    tok = _DecodeOnly(TOKENIZERS["byte-level BPE"]())
    ids = tok.tok("the naïve café", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tok, ids[:2], [])
    assert not any(d.step(t) for t in ids[2:]) and tok.calls == 0
    assert d.text == tok.tok.decode(ids, skip_special_tokens=True)[len(tok.tok.decode(ids[:2])):] and tok.calls > 0


def test_a_decode_that_rewrites_earlier_text_restarts_the_stream():
    """DecodeStream's "Invalid prefix" case: a decode that changes text already emitted (token 9 upper-cases its
    window). When a step's text no longer starts with the emitted prefix (at the 0 after the 9), the stream starts
    again from that token with no context, as vLLM restarts its stream; nothing raises."""
    class Rewriting:
        def decode(self, ids, skip_special_tokens=True):
            text = "".join("ab"[i % 2] for i in ids if i != 9)
            return text.upper() if 9 in ids else text

    d = IncrementalDetokenizer(Rewriting(), [0, 1], ["zz"])
    assert [d.step(t) for t in (0, 1, 9, 0, 1)] == [False] * 5
    assert d.text == "ab" + "ab"  # 9 emits nothing (its text is no longer than the prefix); the 0 after it
    # decodes 'BA' against the prefix 'b': the restart, from the 0 alone ('a'), then the 1 ('b')
