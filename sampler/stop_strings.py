"""Stop strings checked on the tail of a completion, not on its whole text every step.

    stops = StopStrings(tokenizer, params.stop)
    cut = stops.check(completion_ids)     # None, or the text up to and including the first stop string

`check` gives exactly what decoding the whole completion and searching it gives (the first occurrence of
any stop string, ties to the earliest-starting one, the shorter string on equal starts, `min` over
(index, string)), but decodes the whole completion only on a step where a stop string shows up in the
decoded text of its last `window` tokens. Decoding everything every step costs O(length) a step per row,
O(length^2) a rollout: one decode of 512 tokens took ~90 µs on the development CPU (a byte-level BPE
tokenizer trained in memory as in the tests, timed by hand), so at batch 64 a few ms of host time a step,
more than a GPU decode step: the engine's host loop, not the GPU, would set the throughput.

Why the tail sees every new occurrence: the engine checks after every token, so an occurrence is new in the
step whose token completes it, and it ends within the last few characters of the text (clean-up rules that
drop a space before punctuation look one token back). The tail is decoded from the last `window` tokens
(the longest stop string's UTF-8 bytes plus WINDOW_MARGIN: enough for byte-level and byte-fallback
tokenizers, whose tokens are at least one byte) and doubled until it decodes to at least CHAR_MARGIN
characters more than the longest stop string before the newest token's own text (which may be long), or
is the whole completion: tokens that decode to nothing
(special and added tokens `skip_special_tokens` drops, a lone space a clean-up rule removes) only make it
reach further back. The tail's first characters may differ from the whole decode's (a leading space a
SentencePiece decoder drops, a character cut in two): the margins cover them.
tests/sampler/test_stop_strings.py checks the claim step by step on byte-level BPE, SentencePiece-style,
WordPiece and character tokenizers, and on runs of tokens that decode to nothing: no step where the
whole-text search finds a stop and the tail does not.

Leaves out: incremental detokenization (vLLM's).
"""

from __future__ import annotations

WINDOW_MARGIN = 8
"""Tokens added to the longest stop string's byte length for the first tail decoded."""
CHAR_MARGIN = 8
"""Characters a decoded tail must hold beyond the longest stop string (else it takes twice the tokens)."""


class StopStrings:
    """The stop strings of one request, checked against its completion token ids."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + WINDOW_MARGIN if self.stops else 0
        self.chars = max(len(s) for s in self.stops) + CHAR_MARGIN if self.stops else 0

    def _tail_text(self, ids: list[int]) -> str:
        """The decoded text of the last tokens: `window` of them, doubled until it holds `chars` characters
        before the newest token's own text (a new occurrence ends in that text, which may be long) or is the
        whole completion."""
        newest = len(self.tokenizer.decode(ids[-1:], skip_special_tokens=True))
        n = self.window
        while True:
            text = self.tokenizer.decode(ids[-n:], skip_special_tokens=True)
            if len(text) - newest >= self.chars or n >= len(ids):
                return text
            n *= 2

    def check(self, ids: list[int]) -> str | None:
        """The decoded completion cut after the first stop string it holds, or None when it holds none."""
        if not self.stops or not ids:
            return None
        tail = self._tail_text(ids)
        if not any(stop in tail for stop in self.stops):
            return None
        return first_stop(self.tokenizer.decode(ids, skip_special_tokens=True), self.stops)


def first_stop(text: str, stops: list[str]) -> str | None:
    """`text` cut after its first stop string (earliest start; on equal starts the string `min` orders
    first), or None when it holds none."""
    hits = [(text.find(stop), stop) for stop in stops if stop in text]
    if not hits:
        return None
    idx, stop = min(hits)
    return text[: idx + len(stop)]
