"""The embedded engine's detokenizer (`rl4bit.sampler.detokenizer`) against vLLM's own incremental detokenizer
(vllm.v1.engine.detokenizer, what fills CompletionOutput.text), token by token: the same text and the same stop,
with the options our vLLM backend sets (skip_special_tokens, include_stop_str_in_output).

Random completions of four in-memory tokenizers (byte-level BPE, SentencePiece BPE with byte fallback,
WordPiece with clean-up rules, rl4bit's characters; tests/sampler/tokenizer_zoo.py) after random prompts, with
special tokens mixed in and stop strings cut from their text; every fifth prompt is special tokens only.
Decoded alone, as the engine did before, the SentencePiece and WordPiece texts differed from vLLM's in most
cases (a leading space, clean-up rules).
"""

from __future__ import annotations

import random
import types

import pytest

from rl4bit.sampler.detokenizer import IncrementalDetokenizer

from ..sampler.tokenizer_zoo import TOKENIZERS, completion_ids


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_text_and_stops_equal_vllms_at_every_token(name):
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer as VLLMDetokenizer

    tok = TOKENIZERS[name]()
    rng = random.Random(name)
    stopped = differs_alone = 0
    for trial in range(40):
        ids = completion_ids(tok, rng, 80)
        prompt, comp = ids[:rng.randrange(1, 20)], ids[20:]
        if trial % 5 == 0:  # a prompt of special tokens only: it decodes to "", nothing to prime the stream with
            prompt = [rng.choice(tok.all_special_ids) for _ in range(rng.randint(1, 3))]
        full = tok.decode(comp, skip_special_tokens=True)
        stops = [full[a:a + rng.randint(1, 6)] for a in (rng.randrange(max(1, len(full) - 1))
                                                         for _ in range(rng.choice((0, 1, 2, 3))))]
        stops = [s for s in stops if s]
        params = SamplingParams(skip_special_tokens=True, include_stop_str_in_output=True, stop=stops or None)
        theirs = VLLMDetokenizer.from_new_request(tok, types.SimpleNamespace(
            request_id="r", prompt_token_ids=prompt, prompt_embeds=None, sampling_params=params))
        ours = IncrementalDetokenizer(tok, prompt, stops)
        for k, t in enumerate(comp):
            stop = theirs.update([t], False)
            hit = ours.step(t)
            assert (stop is not None, theirs.output_text) == (hit, ours.text), (name, trial, k, stops)
            if hit:
                stopped += 1
                break
        differs_alone += ours.text != tok.decode(comp[:k + 1], skip_special_tokens=True)
    assert stopped >= 8, f"{name}: only {stopped} of 40 completions hit a stop string; the test would not bite"
    if name in ("sentencepiece BPE", "wordpiece"):
        assert differs_alone >= 20, "decoding the completion alone no longer differs: the comparison lost its edge"
