"""The sampler's data types: what goes in (`Request`, `SamplingParams`), what comes
out (`Rollout`), and what syncs the policy (`WeightUpdate`).

Every backend (the embedded engine, vLLM) speaks these types, so the RL loop
never sees which one runs. Logprob semantics, fixed here for all backends:
`Rollout.logprobs[i]` is log p(completion_ids[i]) under the policy's logits
divided by the sampling temperature, BEFORE top-p/top-k/min-p truncation: the
number the trainer recomputes from the same tokens. At temperature 0 (greedy)
the temperature is taken as 1, i.e. plain log_softmax(logits).
`Rollout.processed_logprobs` (only on request) is the log-prob under the
distribution actually sampled from (after truncation and renormalisation);
greedy requests ignore truncation (the argmax survives any), so theirs equal
`logprobs`, in every backend.

Leaves out: per-token top-k alternatives, prompt logprobs, beam search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# The dense update message lives below the trainer and the samplers (both build or apply it); every engine takes it.
from rl4bit.common.weight_update import WeightUpdate as WeightUpdate

FINISH_REASONS = ("stop", "length", "error")
MIN_TEMPERATURE = 0.01
"""Smallest temperature above 0: logits / T overflows FP32 for tiny T (NaN logprobs), and vLLM raises any T
below this to it (sampling at another temperature than asked). 0 means greedy."""
MAX_N = 4096
"""Most samples a request: each takes a batch slot, a KV-cache row and a Rollout, so an n of millions (a token
count passed as n) would exhaust the host before failing; split larger requests."""
MAX_SEED = 2**63 - 1
"""Largest seed: Philox keys are folded to 63 bits (`kernels.philox.derive_seed`), so larger seeds would collide."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to sample the completions of one request."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy (argmax, no randomness)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens with mass >= top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens, ties with the k-th kept (0 or -1 = off)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p x the top probability (0 = off)."""
    max_new_tokens: int = 32
    """Most completion tokens; hitting it ends the completion with finish_reason "length"."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends as soon as its text, decoded after the prompt as vLLM does, contains one (kept
    in the text, cut right after it; of several completed by one token, the one ending first; finish_reason "stop")."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end a completion (kept in completion_ids, finish_reason "stop"); the engine adds the tokenizer's
    eos."""
    n: int = 1
    """Completions sampled per prompt (sample_index 0..n-1)."""
    seed: Optional[int] = None
    """Seed of this request's randomness (embedded engine: sample i draws its noise from a Philox key derived from
    (seed, i), at its token index, `rl4bit.sampler.noise`; vLLM: its per-request seed); None: drawn by the engine."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's eos (stop_token_ids still stop): fixed-length rollouts for throughput benchmarks
    (vLLM's `ignore_eos`)."""
    processed_logprobs: bool = False
    """Also return logprobs under the truncated distribution actually sampled from (Rollout.processed_logprobs)."""

    def validate(self) -> None:
        """Raise ValueError naming the bad field, its value and the valid range."""
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0 or 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature: {t!r} must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        p = self.top_p
        if not _is_number(p) or not (0 < p <= 1):
            raise ValueError(f"top_p: {p!r} must be in (0, 1] (1 = off)")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k: {self.top_k!r} must be an int >= 1, or 0 or -1 (off)")
        m = self.min_p
        if not _is_number(m) or not (0 <= m <= 1):
            raise ValueError(f"min_p: {m!r} must be in [0, 1] (0 = off; 1 keeps the top token and its ties)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {self.max_new_tokens!r} must be an int >= 1")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: {self.n!r} must be an int in [1, {MAX_N}]; split larger requests")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop: {self.stop!r} must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(i) and i >= 0 for i in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids!r} must be a list of token ids (ints >= 0)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed: {self.seed!r} must be None or an int in [0, 2**63 - 1]")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: {self.ignore_eos!r} must be a bool")
        if not isinstance(self.processed_logprobs, bool):
            raise ValueError(f"processed_logprobs: {self.processed_logprobs!r} must be a bool")


@dataclass
class Request:
    """One prompt to complete."""

    id: str
    """Caller's id, echoed in every Rollout of this request."""
    prompt_ids: list[int]
    """Prompt token ids (already tokenized, BOS included if the model wants one)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """How to sample its completions."""
    prompt: Optional[str] = None
    """The prompt text, informational only (the engine reads prompt_ids)."""


@dataclass
class Rollout:
    """One sampled completion of one request."""

    request_id: Optional[str]
    """Request.id this completion answers (None for an element of the batch that was not a Request)."""
    sample_index: int
    """Which of the request's n samples (0..n-1)."""
    prompt_ids: list[int]
    """The prompt token ids, as given."""
    completion_ids: list[int]
    """Sampled token ids, including the stop token if one ended it."""
    text: str
    """Decoded completion (special tokens skipped), decoded after the prompt as vLLM does (`sampler.detokenizer`: a
    SentencePiece tokenizer's leading space kept, an unfinished UTF-8 character held back); includes the stop
    string if one ended it."""
    logprobs: list[float]
    """Per completion token: log-prob at the sampling temperature BEFORE top-p/top-k/min-p truncation (what the trainer
    recomputes)."""
    finish_reason: str
    """"stop" (stop string or stop token), "length" (max_new_tokens or the context end) or "error" (see `error`)."""
    policy_version: int
    """WeightUpdate.version of the weights that produced every token of this completion."""
    error: Optional[str] = None
    """Why the request failed (finish_reason "error"); None otherwise."""
    processed_logprobs: Optional[list[float]] = None
    """Per token log-prob under the truncated distribution sampled from; only when params.processed_logprobs."""


def nonfinite_logprob_error(logprobs: list[float]) -> str | None:
    """Why a sample's logprobs cannot be trusted (a message naming the token), or None: a NaN or infinite logprob
    means the policy's logits for that token were not finite (activations overflowing or NaN; weights are checked
    finite when loaded). Every backend fails such a sample alone (finish_reason "error", nothing of it trained on)
    instead of handing NaN logprobs to the trainer."""
    bad = next((i for i, lp in enumerate(logprobs) if not math.isfinite(lp)), None)
    if bad is None:
        return None
    return (f"the policy's logprob of completion token {bad} is {logprobs[bad]}: its logits were NaN/Inf "
            f"(non-finite activations); the sample is dropped. If every sample fails, check the model's weights "
            f"and inputs (a bf16 overflow, a corrupt checkpoint)")


def request_error(req: Request, vocab_size: int, max_seq_len: int) -> str | None:
    """Why `req` cannot run on a model of `vocab_size` tokens and `max_seq_len` context (a message
    naming the fix), or None. Every backend checks these; a backend's own limits come on top."""
    if not isinstance(req, Request):
        return f"request: {type(req).__name__} is not a Request"
    try:
        if not isinstance(req.params, SamplingParams):
            raise ValueError(f"params: {type(req.params).__name__} is not a SamplingParams")
        req.params.validate()
    except ValueError as e:
        return f"invalid sampling params: {e}"
    ids = req.prompt_ids
    if not isinstance(ids, (list, tuple)):
        return (f"prompt_ids: {type(ids).__name__} is not a list of token ids; pass a list of ints "
                f"(e.g. tensor.tolist())")
    if len(ids) == 0:
        return "empty prompt: prompt_ids has no tokens; give at least one (e.g. the BOS token)"
    bad = next((i for i, t in enumerate(ids) if not _is_int(t)), None)
    if bad is not None:
        return (f"prompt_ids[{bad}] is {type(ids[bad]).__name__} {ids[bad]!r}, not an int; pass Python ints "
                f"(e.g. tensor.tolist())")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        return f"prompt_ids[{bad}] = {ids[bad]} is outside [0, {vocab_size}) (the model's vocabulary)"
    bad = [t for t in req.params.stop_token_ids if t >= vocab_size]
    if bad:
        return f"stop_token_ids {bad} are outside [0, {vocab_size}) (the model's vocabulary)"
    if len(ids) >= max_seq_len:
        return (f"prompt of {len(ids)} tokens does not fit the context of {max_seq_len} tokens "
                f"(it must leave room for one new token); shorten the prompt or raise max_seq_len")
    return None


def failed_rollouts(req, error: str, version: int) -> list[Rollout]:
    """The rollouts of a request that cannot run (`request_error`): one a requested sample (one when n itself
    is bad, above MAX_N included), finish_reason "error" with `error`; the prompt echoed when it is a list, else []."""
    n = getattr(getattr(req, "params", None), "n", None)
    ids = getattr(req, "prompt_ids", None)
    ids = list(ids) if isinstance(ids, (list, tuple)) else []
    return [Rollout(getattr(req, "id", None), i, ids, [], "", [], "error", version, error=error)
            for i in range(n if _is_int(n) and 1 <= n <= MAX_N else 1)]
