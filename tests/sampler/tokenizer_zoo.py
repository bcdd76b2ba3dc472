"""Tokenizers built in memory (no downloads) for the detokenizer tests: byte-level BPE (GPT-2 / Qwen kind) and
SentencePiece-style BPE (Metaspace, byte fallback), both trained on text with multi-byte characters; a WordPiece
tokenizer (decode joins with spaces, clean-up rules); rl4bit's character tokenizer. `completion_ids` makes random
completions of real text with special tokens and random ids mixed in.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rl4bit.trainer.tokenizer import build_tokenizer

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
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1],
                                   unk_token="<unk>")


def _wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]"] + SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[1],
                                   unk_token="[UNK]", clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level BPE": _byte_bpe, "sentencepiece BPE": _sentencepiece_bpe, "wordpiece": _wordpiece,
              "characters": build_tokenizer}


def completion_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Mostly real text's ids (cut at a random place), with random ids and special tokens mixed in."""
    text = " ".join(rng.sample(CORPUS, 6))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = rng.randrange(0, max(1, len(ids) - n))
    ids = ids[start:start + n]
    specials = list(tok.all_special_ids)
    for _ in range(n // 20):
        ids[rng.randrange(len(ids))] = rng.choice(specials) if rng.random() < 0.5 else rng.randrange(len(tok))
    return ids
