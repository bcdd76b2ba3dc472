"""EmbeddedEngine: greedy/seeded sampling, stop conditions, n samples, per-request errors, logprob semantics."""

from __future__ import annotations

import pytest
import torch

from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams

from .conftest import make_model, prompts

LOGPROB_ATOL_FP32 = 1e-4
"""Engine decode logprobs vs the stock HF full-sequence forward (SDPA, unpadded GEMMs), fp32 model."""


@pytest.fixture(scope="module")
def engine(tokenizer):
    return EmbeddedEngine(make_model(torch.float32), tokenizer, max_batch_size=8)


def greedy(max_new=10, **kw):
    return SamplingParams(temperature=0.0, max_new_tokens=max_new, **kw)


def test_greedy_is_deterministic_and_is_the_argmax_chain(engine):
    p = prompts(1)[0]
    a, b = engine.generate([Request("a", p, greedy())])[0], engine.generate([Request("a", p, greedy())])[0]
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    ids = list(p)
    with torch.no_grad():
        for _ in range(len(a.completion_ids)):
            ids.append(int(engine.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert a.completion_ids == ids[len(p):]


def test_seed_reproduces_and_different_seeds_differ(engine):
    p = prompts(1, seed=1)[0]

    def run(seed):
        return engine.generate([Request("r", p, SamplingParams(seed=seed, max_new_tokens=12))])[0]

    a, b = run(7), run(7)
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert len({tuple(run(s).completion_ids) for s in range(5)}) > 1


def test_n_samples_in_order_and_distinct(engine):
    ps = prompts(2, seed=2)
    out = engine.generate([Request("x", ps[0], SamplingParams(n=4, seed=3)), Request("y", ps[1], SamplingParams(n=2))])
    assert [(r.request_id, r.sample_index) for r in out] == [("x", 0), ("x", 1), ("x", 2), ("x", 3), ("y", 0), ("y", 1)]
    assert len({tuple(r.completion_ids) for r in out[:4]}) > 1
    again = engine.generate([Request("x", ps[0], SamplingParams(n=4, seed=3))])
    assert [r.completion_ids for r in again] == [r.completion_ids for r in out[:4]]


def test_stop_string_ends_completion_and_is_kept(engine):
    p = prompts(1, seed=3)[0]
    full = engine.generate([Request("a", p, greedy(16))])[0]
    stop = full.text[4:6]
    out = engine.generate([Request("a", p, greedy(16, stop=[stop]))])[0]
    assert out.finish_reason == "stop"
    assert out.text.endswith(stop) and stop not in out.text[:-1]
    assert out.text == full.text[: full.text.find(stop) + len(stop)]
    assert out.completion_ids == full.completion_ids[: len(out.completion_ids)]


def test_stop_token_id_ends_completion(engine):
    p = prompts(1, seed=3)[0]
    full = engine.generate([Request("a", p, greedy(16))])[0]
    stop_id = full.completion_ids[5]
    out = engine.generate([Request("a", p, greedy(16, stop_token_ids=[stop_id]))])[0]
    first = full.completion_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.completion_ids == full.completion_ids[: first + 1]
    assert full.finish_reason == "length" and len(full.completion_ids) == 16


def test_bad_requests_fail_alone(engine, tokenizer):
    good = [Request("ok1", prompts(1, 4)[0], greedy()), Request("ok2", prompts(1, 5)[0], SamplingParams(seed=1))]
    bad = [
        Request("empty", [], greedy()),
        Request("long", [1] * 128, greedy()),
        Request("temp", [1, 4], SamplingParams(temperature=-1.0)),
        Request("topp", [1, 4], SamplingParams(top_p=0.0)),
        Request("vocab", [1, 10_000], greedy()),
        Request("many", [1, 4], SamplingParams(n=10**9)),  # one error rollout, not a billion (nor a full host)
    ]
    out = engine.generate([bad[0], good[0], bad[1], bad[2], good[1], bad[3], bad[4], bad[5]])
    by_id = {r.request_id: r for r in out}
    assert len(out) == len(good) + len(bad)
    for r, key in zip(bad, ("empty prompt", "does not fit the context", "temperature", "top_p", "vocabulary",
                            "n: 1000000000 must be an int in [1, 4096]")):
        got = by_id[r.id]
        assert got.finish_reason == "error" and key in got.error and got.completion_ids == []
    for g in good:
        alone = engine.generate([g])[0]
        assert by_id[g.id].error is None and by_id[g.id].completion_ids == alone.completion_ids


@pytest.mark.parametrize("params", [greedy(), SamplingParams(seed=3, max_new_tokens=10, n=2)])
def test_a_sample_whose_logits_turn_nan_fails_alone(tokenizer, params):
    """A token whose embedding is NaN makes its sequence's logits NaN (nothing else reads its rows): that sample
    ends there with finish_reason "error" and a message naming the token, while the batch's other requests are
    served as they would be alone. Before, the NaN logprobs went back as a normal rollout (on the CPU, and on a
    GPU under the bf16 recipe, where no quantize kernel checks activations)."""
    model = make_model(torch.float32)
    clean = EmbeddedEngine(make_model(torch.float32), tokenizer, max_batch_size=8)
    bad_token = 9
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_token] = float("nan")
    engine = EmbeddedEngine(model, tokenizer, max_batch_size=8)
    good = [Request(f"ok{i}", [t for t in p if t != bad_token], params) for i, p in enumerate(prompts(3, seed=11))]
    bad = Request("nan", [1, 5, bad_token, 6], params)
    out = engine.generate([good[0], bad, good[1], good[2]])
    failed = [r for r in out if r.request_id == "nan"]
    assert len(failed) == params.n
    for r in failed:
        assert r.finish_reason == "error" and "completion token 0 is nan" in r.error, r.error
        assert len(r.completion_ids) == len(r.logprobs) == 1
    alone = clean.generate(good)
    assert [(r.completion_ids, r.logprobs, r.error) for r in out if r.request_id != "nan"] == \
        [(r.completion_ids, r.logprobs, None) for r in alone]


def test_malformed_requests_fail_alone(engine):
    """Requests that are not well-formed objects (no SamplingParams, a prompt that is not a list of ints, not a
    Request at all) fail in their own rollout with a message naming the field; the others run."""
    import numpy as np

    good = Request("ok", prompts(1, 4)[0], greedy())
    bad = [
        (Request("none-params", [1, 4], None), "params: NoneType is not a SamplingParams"),
        (Request("dict-params", [1, 4], {"temperature": 0.0}), "params: dict is not a SamplingParams"),
        (Request("none-prompt", None, greedy()), "prompt_ids: NoneType is not a list"),
        (Request("tensor-prompt", torch.tensor([1, 4]), greedy()), "prompt_ids: Tensor is not a list"),
        (Request("numpy-ids", [1, np.int64(4)], greedy()), "prompt_ids[1] is int64"),
        (Request("bool-n", [1, 4], greedy(n=True)), "n: True"),
        (Request("tiny-temp", [1, 4], SamplingParams(temperature=1e-38)), "temperature: 1e-38"),
        (Request("stop-oov", [1, 4], greedy(stop_token_ids=[2, 10_000])), "stop_token_ids [10000] are outside"),
    ]
    out = engine.generate([r for r, _ in bad[:3]] + [good] + [r for r, _ in bad[3:]] + ["not a request"])
    assert len(out) == len(bad) + 2
    by_id = {r.request_id: r for r in out}
    for r, key in bad:
        got = by_id[r.id]
        assert got.finish_reason == "error" and key in got.error and got.completion_ids == [], (r.id, got.error)
    assert by_id[None].error == "request: str is not a Request"
    assert by_id["ok"].error is None and by_id["ok"].completion_ids == engine.generate([good])[0].completion_ids


def test_context_end_finishes_with_length(engine):
    """A prompt of L tokens in a 128-token context gets exactly 128 - L new tokens, then finishes with length."""
    for n in (125, 126, 127):
        params = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
        out = engine.generate([Request("edge", [1] * n, params)])[0]
        assert out.error is None and out.finish_reason == "length" and len(out.completion_ids) == 128 - n, out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_full_forward(engine, temperature):
    ps = prompts(4, seed=6)
    out = engine.generate([Request(str(i), p, SamplingParams(temperature=temperature, seed=i, max_new_tokens=8))
                           for i, p in enumerate(ps)])
    t = temperature or 1.0
    for r in out:
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
        ref = torch.log_softmax(logits / t, -1).gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=LOGPROB_ATOL_FP32, rtol=0)
        # the engine's own full-sequence scoring path agrees bitwise
        assert engine.score(r.prompt_ids, r.completion_ids, temperature=t) == r.logprobs


def test_processed_logprobs_follow_truncation(engine):
    p = prompts(1, seed=8)[0]
    top1 = engine.generate([Request("k", p, SamplingParams(top_k=1, seed=0, processed_logprobs=True))])[0]
    g = engine.generate([Request("g", p, greedy(32))])[0]
    assert top1.completion_ids == g.completion_ids
    assert top1.processed_logprobs == [0.0] * len(top1.completion_ids)
    assert all(lp < 0 for lp in top1.logprobs)  # policy logprobs stay un-truncated
    plain = engine.generate([Request("n", p, SamplingParams(seed=0))])[0]
    assert plain.processed_logprobs is None


def test_an_engine_without_a_tokenizer_serves_token_ids_only(engine):
    """tokenizer None (vLLM's skip_tokenizer_init; benchmarks): the same tokens and logprobs, text "", and a
    request with stop strings fails alone with the reason."""
    bare = EmbeddedEngine(make_model(torch.float32), None, max_batch_size=8)
    reqs = [Request("a", prompts(1, 4)[0], greedy()), Request("s", prompts(1, 5)[0], SamplingParams(stop=["x"]))]
    got = bare.generate(reqs)
    want = engine.generate(reqs[:1])[0]
    assert (got[0].completion_ids, got[0].logprobs, got[0].text, got[0].error) == \
        (want.completion_ids, want.logprobs, "", None)
    assert got[1].finish_reason == "error" and "stop strings need a tokenizer" in got[1].error
