"""Stop strings on the completion's tail (sampler/stop_strings.py) give the whole-text search's answer at every step.

Tokenizers built in memory (no downloads): byte-level BPE (GPT-2 / Qwen kind) and SentencePiece-style BPE
(Metaspace, leading space dropped on decode), both trained on text with multi-byte characters; a WordPiece
tokenizer (decode joins with spaces, clean-up rules); rl4bit's character tokenizer. Random completions with
special tokens among them; stop strings cut from their decoded text (so they hit), with spaces and
multi-byte characters.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rl4bit.sampler.stop_strings import StopStrings, first_stop
from rl4bit.tokenizer import build_tokenizer

CORPUS = [f"Émile said {i} times: the naïve café ☕ serves 中文 text, then 🙂 again; x{i % 7} = y." for i in range(400)]
SPECIALS = ["<|eos|>", "<|pad|>"]


def _byte_bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1])


def _sentencepiece_bpe():
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS + ["<unk>"] + bytes_))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1], unk_token="<unk>")


def _wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]"] + SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1], unk_token="[UNK]",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level BPE": _byte_bpe, "sentencepiece BPE": _sentencepiece_bpe, "wordpiece": _wordpiece,
              "characters": build_tokenizer}


def _completion(tok, rng: random.Random, n: int) -> list[int]:
    """Mostly real text's ids (cut at a random place), with random ids and special tokens mixed in."""
    text = " ".join(rng.sample(CORPUS, 6))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = rng.randrange(0, max(1, len(ids) - n))
    ids = ids[start:start + n]
    specials = list(tok.all_special_ids)
    for _ in range(n // 20):
        ids[rng.randrange(len(ids))] = rng.choice(specials) if rng.random() < 0.5 else rng.randrange(len(tok))
    return ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_tail_check_equals_the_whole_text_search_at_every_step(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(name)
    hits = 0
    for trial in range(12):
        ids = _completion(tok, rng, 120)
        full = tok.decode(ids, skip_special_tokens=True)
        stops = []
        for _ in range(rng.choice((1, 2, 3))):  # substrings of the final text: they hit somewhere
            a = rng.randrange(len(full) - 1)
            stops.append(full[a:a + rng.randint(1, 12)])
        if trial % 4 == 0:
            stops.append("never there \u2603")
        checker = StopStrings(tok, stops)
        for t in range(1, len(ids) + 1):
            want = first_stop(tok.decode(ids[:t], skip_special_tokens=True), stops)
            got = checker.check(ids[:t])
            assert got == want, (name, trial, t, stops)
            if want is not None:  # the engine stops here: later steps never run
                hits += 1
                break
    assert hits >= 8, f"{name}: only {hits} of 12 completions hit a stop string; the test would not bite"


class _CountingTokenizer:
    """A tokenizer whose decode calls are counted by length."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_no_whole_decode_until_the_tail_holds_a_stop():
    """A 400-token completion: until a stop string appears every step decodes only its tail (window ids, plus
    the special tokens among them, which the window does not count), so the cost a step does not grow with the
    completion; the step the stop appears decodes the whole once."""
    tok = _CountingTokenizer(_byte_bpe())
    ids = tok.tok(" ".join(CORPUS[:12]) + " </answer> tail", add_special_tokens=False)["input_ids"]
    ids[50:50] = [tok.tok.eos_token_id] * 3  # specials inside: skipped by decode, not counted in the window
    stops = ["never there \u2603", "</answer>"]
    checker = StopStrings(tok, stops)
    hit = next(t for t in range(1, len(ids) + 1)
               if "</answer>" in tok.tok.decode(ids[:t], skip_special_tokens=True))
    assert hit > 2 * checker.window, "the stop string must come late for the test to bite"
    for t in range(1, hit):
        assert checker.check(ids[:t]) is None
    assert len(tok.lengths) == 2 * (hit - 1)  # a step: the newest token, then the tail
    assert max(tok.lengths) <= checker.window  # the tails held enough characters: none had to grow
    cut = checker.check(ids[:hit])
    assert cut == first_stop(tok.tok.decode(ids[:hit], skip_special_tokens=True), stops) and cut.endswith("</answer>")
    assert tok.lengths[-3:] == [1, checker.window, hit]  # the newest token, the tail, then the whole completion


def test_no_stop_strings_decode_nothing():
    tok = _CountingTokenizer(build_tokenizer())
    assert StopStrings(tok, []).check([5, 6, 7]) is None and tok.lengths == []


def test_a_leading_space_the_tail_decode_drops_is_covered_by_the_margin():
    """SentencePiece decoding drops the space of its first piece: with a window of exactly the stop string's
    bytes, the tail ["▁", "x"] decodes to "x" and misses " x", which the whole text "a x" holds."""
    tok = _sentencepiece_bpe()
    vocab = tok.get_vocab()
    ids = [vocab["a"], vocab["\u2581"], vocab["x"]]
    assert tok.decode(ids) == "a x" and tok.decode(ids[1:]) == "x"
    assert StopStrings(tok, [" x"]).check(ids) == "a x"


def test_runs_of_tokens_that_decode_to_nothing_widen_the_tail():
    """Tokens the window counts but the text does not show: an added special token that `all_special_ids`
    does not list (Llama-3's reserved tokens are such), and lone spaces a clean-up rule removes before '.'.
    A stop string spread over more of them than the first window still ends the completion when the whole
    text shows it."""
    from tokenizers import AddedToken

    tok = _byte_bpe()
    tok.add_tokens([AddedToken("<|reserved|>", special=True)])
    reserved = tok.convert_tokens_to_ids("<|reserved|>")
    assert reserved not in tok.all_special_ids and tok.decode([reserved], skip_special_tokens=True) == ""
    a, b = (tok(c, add_special_tokens=False)["input_ids"] for c in ("a", "b"))
    ids = a + [reserved] * 40 + b
    checker = StopStrings(tok, ["ab"])
    assert 40 > checker.window
    assert [checker.check(ids[:t]) for t in range(1, len(ids) + 1)] == [None] * (len(ids) - 1) + ["ab"]
    tok.add_tokens([AddedToken("b" + "x" * 19)])  # the completing token alone holds more than the margin
    long_b = tok.convert_tokens_to_ids("b" + "x" * 19)
    ids = a + [tok.pad_token_id] * 20 + [long_b]
    assert tok.decode(ids, skip_special_tokens=True) == "ab" + "x" * 19
    assert StopStrings(tok, ["ab"]).check(ids) == "ab"

    uni = Tokenizer(models.Unigram([("<unk>", 0.0), ("<eos>", 0.0), ("\u2581", -1.0), (".", -1.0), ("a", -1.0)],
                                   unk_id=0))  # a Unigram SentencePiece: transformers keeps its clean-up rules
    uni.pre_tokenizer, uni.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp = PreTrainedTokenizerFast(tokenizer_object=uni, eos_token="<eos>", unk_token="<unk>",
                                 clean_up_tokenization_spaces=True)
    ids = [4] + [2, 3] * 12  # a, then (lone space, '.') pairs
    assert sp.decode(ids) == "a" + "." * 12  # each " ." cleaned to "."
    checker = StopStrings(sp, ["." * 12])
    for t in range(1, len(ids) + 1):
        assert checker.check(ids[:t]) == first_stop(sp.decode(ids[:t], skip_special_tokens=True), ["." * 12]), t
    assert checker.check(ids) == "a" + "." * 12
