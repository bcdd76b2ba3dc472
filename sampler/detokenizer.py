"""A completion's text as vLLM writes it: decoded token by token after its prompt, stop strings checked as each
token's text arrives.

    d = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
    stopped = d.step(token)     # after every sampled token; d.text is the completion's text so far

Mirrors vLLM 0.32's FastIncrementalDetokenizer and check_stop_strings (vllm/v1/engine/detokenizer.py) with the
options our vLLM backend sets (sampler/vllm_engine.py): skip_special_tokens=True, include_stop_str_in_output=True.
So both backends' Rollout.text agree (tests/vllm/test_detokenizer_peer.py compares them token by token):
- the text is what `tokenizers.decoders.DecodeStream`, primed with the whole prompt, yields. A SentencePiece
  decoder (Metaspace, or Llama 2's Strip) keeps the first piece's leading space, which
  `tokenizer.decode(completion)` drops; no `clean_up_tokenization_spaces`; a character whose UTF-8 bytes are not
  all generated yet is held back (never written as U+FFFD, also at the end);
- a stop string is looked for only where this token's text could complete it; of several completed by one token,
  the one ending first wins (ties: list order); the text is cut right after it.
Each step decodes only the tokens since the last emitted chunk (a few), so a step costs the same at any length;
the first decodes the prompt once. Without stop strings nothing is decoded until `text` is read (the same
stream, run then: when the engine builds the finished sample's Rollout). Cost: a few µs a token on a CPU, several
times one `tokenizer.decode` of the whole completion; with stop strings it is paid token by token instead.

A tokenizer without a `tokenizers` backend (a slow one, a test's stand-in) runs the same algorithm in Python
over `tokenizer.decode` (`_PyDecodeStream`).

Leaves out: vLLM's own slow path for such tokenizers (convert_tokens_to_string over a 5-token prefix window).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

INVALID_PREFIX = "Invalid prefix encountered"
"""Start of the error DecodeStream raises on non-monotonic output; vLLM restarts the stream on it."""


class IncrementalDetokenizer:
    """One sample's text, extended token by token, cut after its first stop string."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str]):
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = (DecodeStream(ids=list(prompt_ids), skip_special_tokens=True) if self.backend is not None
                       else _PyDecodeStream(tokenizer, prompt_ids))
        self.stops = list(stops)
        self._text = ""
        self._unread: list[int] = []

    @property
    def text(self) -> str:
        """The completion's text so far (cut after its stop string if one completed)."""
        for token in self._unread:
            self._feed(token)
        self._unread.clear()
        return self._text

    def step(self, token: int) -> bool:
        """Add `token`'s text; True when it completed a stop string (the text is then cut after it)."""
        if not self.stops:
            self._unread.append(token)
            return False
        new = self._feed(token)
        if not new:
            return False
        end = None
        for stop in self.stops:  # only where the new text could complete it
            i = self._text.find(stop, 1 - len(new) - len(stop))
            if i != -1 and (end is None or i + len(stop) < end):
                end = i + len(stop)
        if end is None:
            return False
        self._text = self._text[:end]
        return True

    def _feed(self, token: int) -> str:
        try:
            new = self.stream.step(self.backend, token) or ""
        except Exception as e:  # vLLM's recovery, on the same condition
            if not str(e).startswith(INVALID_PREFIX):
                raise
            self.stream = (DecodeStream(skip_special_tokens=True) if self.backend is not None
                           else _PyDecodeStream(self.stream.tokenizer, []))
            new = self.stream.step(self.backend, token) or ""
        self._text += new
        return new


class _PyDecodeStream:
    """tokenizers' DecodeStream (step_decode_stream, tokenizers 0.23) over `tokenizer.decode`, its "Invalid prefix"
    error included (the decoded window no longer starting with the prefix text)."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.ids, self.prefix, self.prefix_index = list(prompt_ids), "", 0

    def step(self, _backend, token: int) -> str | None:
        if not self.prefix and self.ids:
            prefix = self.decode(self.ids)
            if not prefix.endswith("\ufffd"):
                self.prefix, self.prefix_index = prefix, len(self.ids)
        self.ids.append(token)
        text = self.decode(self.ids)
        if len(text) <= len(self.prefix) or text.endswith("\ufffd"):
            return None
        if not text.startswith(self.prefix):
            raise ValueError(f"{INVALID_PREFIX}: {self.prefix!r} is not a prefix of {text!r}")
        new = text[len(self.prefix):]
        self.ids = self.ids[self.prefix_index:]
        self.prefix, self.prefix_index = self.decode(self.ids), len(self.ids)
        return new
