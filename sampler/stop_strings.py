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
step whose token completes it, and it lies in the text of the last tokens: a stop string of b UTF-8 bytes
spans at most b tokens of byte-level and byte-fallback tokenizers (every token is at least one byte), and
the text of the tail's first tokens may differ from the whole decode's (a leading space a SentencePiece
decoder drops, a character cut in two, clean-up rules that look one token back): WINDOW_MARGIN tokens cover
that. Special tokens (removed by `skip_special_tokens`) are not counted in the window.
tests/sampler/test_stop_strings.py checks the claim step by step on byte-level BPE, SentencePiece-style and
character tokenizers: no step where the whole-text search finds a stop and the tail does not.

Leaves out: incremental detokenization (vLLM's); tokenizers with tokens of no bytes other than specials.
"""

from __future__ import annotations

WINDOW_MARGIN = 8
"""Tokens added to the longest stop string's byte length: the tail's first tokens may decode otherwise than
within the whole text."""


class StopStrings:
    """The stop strings of one request, checked against its completion token ids."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + WINDOW_MARGIN if self.stops else 0
        self.specials = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def _tail(self, ids: list[int]) -> list[int]:
        """The last `window` ids that are not special tokens, and the special ones among them."""
        i, kept = len(ids), 0
        while i > 0 and kept < self.window:
            i -= 1
            kept += ids[i] not in self.specials
        return ids[i:]

    def check(self, ids: list[int]) -> str | None:
        """The decoded completion cut after the first stop string it holds, or None when it holds none."""
        if not self.stops:
            return None
        tail = self.tokenizer.decode(self._tail(ids), skip_special_tokens=True)
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
