"""A character-level tokenizer as a transformers `PreTrainedTokenizerFast`.

One token per character of a fixed alphabet (digits, `+ - * =`, space, newline,
ASCII letters and a little punctuation), plus `<pad>`, `<bos>`, `<eos>` and
`<unk>`. Built in memory from a `tokenizers` WordLevel model whose
pre-tokenizer splits every character, so no file or download is needed;
decoding concatenates the characters back (`Fuse` decoder).

`build_tokenizer(model_cfg)` gives the tokenizer of a job's model: the
checkpoint's own (`AutoTokenizer`, local files only) when `model.path` is
set, this character-level one for the built `tiny` models.

`prompt_ids(tokenizer, text, chat)` is how every prompt becomes ids (rollouts,
evaluation, the warm start, the length check): raw text, or with
`data.chat_template` one user turn of the tokenizer's chat template.

Leaves out: byte fallback (a character outside the alphabet becomes `<unk>`)
and any merges; this tokenizer is for the quickstart's tiny models and tests.
Multi-turn conversations and system prompts.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl4bit.common.config import ConfigError

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
ALPHABET = string.digits + "+-*=/ \n" + string.ascii_letters + ".,:;?!()'\"_#"


def build_tokenizer(model_cfg=None):
    """The tokenizer of `model_cfg`'s model: the checkpoint's own when `model_cfg.path` is set (as saved: it is
    exported with the weights), else the character-level one (ids: specials first, then ALPHABET)."""
    path = getattr(model_cfg, "path", None)
    if path is None:
        return char_tokenizer()
    from pathlib import Path

    from transformers import AutoTokenizer

    root = Path(path).expanduser()
    if not root.is_dir():  # checked first: every later message ("holds no tokenizer") would misname the problem
        what = "is a file, not a directory" if root.exists() else "does not exist"
        raise FileNotFoundError(f"model.path: {path!r} {what} (resolved from {Path.cwd()}: {root.resolve()}); point "
                                f"it at a local Hugging Face checkpoint directory (config.json, safetensors, "
                                f"tokenizer files) or set model.path to null to build the tiny model")
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        # transformers would build an empty tokenizer of the config's model type instead of failing
        raise FileNotFoundError(f"model.path: {path!r} holds no tokenizer (tokenizer.json or tokenizer_config.json); "
                                f"save the model's tokenizer there (tokenizer.save_pretrained)")
    try:
        tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a missing dependency or an unknown class: the same clear message
        raise FileNotFoundError(f"model.path: no tokenizer could be loaded from {path!r} ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); save the model's tokenizer there "
                                f"(tokenizer.save_pretrained)") from e
    if tok.eos_token_id is None:
        raise FileNotFoundError(f"model.path: the tokenizer in {path!r} has no eos token; completions could not "
                                f"end: set one in its tokenizer_config.json")
    return tok


def prompt_ids(tokenizer, text: str, chat: bool = False) -> list[int]:
    """A prompt's token ids: the raw text behind the BOS the tokenizer adds itself (Llama, Gemma; Qwen and the
    character tokenizer add none; an EOS it would append is left out), or with `chat` the text as one user
    turn of the tokenizer's chat template with the generation prompt (the template writes its special tokens)."""
    if not chat:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        bos = tokenizer.bos_token_id
        if bos is not None and ids[:1] != [bos] and tokenizer(text).input_ids[:1] == [bos]:
            ids = [bos] + ids  # the BOS alone: a post-processor's appended EOS would end the prompt
        return ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def check_chat_template(tokenizer, chat: bool) -> None:
    """ConfigError when `data.chat_template` is on and the tokenizer has no template to apply."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("data.chat_template: the tokenizer has no chat template (the built-in character "
                         "tokenizer has none; a model.path checkpoint needs chat_template in its "
                         "tokenizer_config.json or chat_template.jinja); set data.chat_template=false")


def char_tokenizer() -> PreTrainedTokenizerFast:
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
