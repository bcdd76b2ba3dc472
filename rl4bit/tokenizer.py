"""A character-level tokenizer as a transformers `PreTrainedTokenizerFast`.

One token per character of a fixed alphabet (digits, `+ - * =`, space, newline,
ASCII letters and a little punctuation), plus `<pad>`, `<bos>`, `<eos>` and
`<unk>`. Built in memory from a `tokenizers` WordLevel model whose
pre-tokenizer splits every character, so no file or download is needed;
decoding concatenates the characters back (`Fuse` decoder).

Leaves out: byte fallback (a character outside the alphabet becomes `<unk>`)
and any merges; this tokenizer is for the quickstart's tiny models and tests.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = string.digits + "+-*=/ \n" + string.ascii_letters + ".,:;?!()'\"_#"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer (ids: specials first, then ALPHABET in order)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
