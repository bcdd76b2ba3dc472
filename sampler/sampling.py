"""Token sampling as pure tensor functions over logits rows.

Every operation is row-local: a row-wise log_softmax/argmax over [B, V], a
per-row function for truncation, and noise keyed by each sequence's own key and
token index (noise.py), so a sequence's sampled token and logprobs do not depend
on its batch neighbours: half of the engine's batch invariance (the other half
is the forward, see kv_cache.py).

Logprob semantics (rl4bit.sampler.types): `policy_logprobs` is
log_softmax(logits / T) (T = 1 when T = 0, greedy), before any truncation; it
is what the trainer recomputes. `processed_logprobs` is the log-distribution
actually sampled from: min-p, then top-k, then top-p on the temperature-scaled
distribution, renormalised (-inf outside the kept set). Greedy rows (T = 0) ignore
truncation, as vLLM does: the argmax is kept by any of them, and their processed
logprobs are the policy's.

Sampling uses the Gumbel-max form of the categorical draw: token =
argmax(log p + G) with G standard Gumbel noise (the exponential race
argmax(p / E) in log form), exactly a draw from p. The noise of row i is keyed
by the sequence's 64-bit key and its token index (`noise.py`: counter-based
Philox), so it depends on nothing else in the batch, and one kernel draws it
for every row.

Truncation order is vLLM's (V1 sampler: temperature, then min-p as an argmax-invariant logits processor, then
top-k and top-p), so both backends sample from the same set. Min-p and top-k keep a set that renormalisation
does not move (a ratio to the top probability, a rank) and commute; top-p's cut depends on what it sees, so
taking it after min-p keeps fewer tokens than HF's order (top-k, top-p, min-p) when both are on.

Leaves out: repetition/frequency penalties, logit bias, beam search.
"""

from __future__ import annotations

import torch

from rl4bit.kernels.transfer import to_device
from rl4bit.sampler.noise import gumbel_noise
from rl4bit.sampler.types import SamplingParams
from rl4bit.trainer.temperature import temperature_scaled


def effective_temperature(temperature: float) -> float:
    """The temperature the policy logprobs are reported at: T, or 1 for greedy (T = 0)."""
    return 1.0 if temperature == 0 else float(temperature)


def policy_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) in fp32 over the full vocabulary (no truncation)."""
    return torch.log_softmax(temperature_scaled(logits, effective_temperature(temperature)), dim=-1)


def truncates(params: SamplingParams) -> bool:
    """Whether the params ask for top-k, top-p or min-p truncation (then the processed distribution is computed
    row by row, `processed_logprobs`; without, it is the policy's). top_k 0 and -1 are off."""
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def truncation_mask(logp: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Bool mask [V] of the tokens min-p, top-k and top-p keep (applied in that order: vLLM's, module docstring).

    min-p keeps p >= min_p * max p (the top token always, and its ties); top-k the tokens at least the k-th
    largest (ties kept); top-p, over the kept tokens renormalised and sorted down (stable), each token whose mass
    before it is below top_p (the top token always)."""
    keep = torch.ones_like(logp, dtype=torch.bool)
    if params.min_p > 0.0:
        probs = torch.softmax(logp, dim=-1)
        keep &= probs >= params.min_p * probs.max()
    if params.top_k > 0 and params.top_k < logp.numel():
        kth = torch.topk(logp, params.top_k).values[-1]
        keep &= logp >= kth
    if params.top_p < 1.0:
        masked = logp.masked_fill(~keep, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < params.top_p  # keeps the top token always
        keep_p = torch.zeros_like(keep)
        keep_p[order] = keep_sorted
        keep &= keep_p
    return keep


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the truncated, renormalised distribution sampled from (-inf outside it)."""
    logp = policy_logprobs(logits, params.temperature)
    keep = truncation_mask(logp, params)
    return torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)


def sample_token(logits: torch.Tensor, params: SamplingParams, key: int | None, step: int = 0):
    """Draw one token from one logits row [V]: (token id, policy logprob, processed logprob or None).

    key: the sequence's noise key (None for greedy), step: its token index.
    Temperature 0 is greedy: the argmax of the raw logits (first index on ties),
    no randomness consumed.
    """
    tokens, lps, plps = sample_rows(logits[None], [params], [key], [step])
    return tokens[0], lps[0], plps[0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], keys: list, steps: list[int]):
    """Draw one token per row of logits [B, V] (row i under params[i], noise key keys[i] at token index steps[i]).

    Same result per row as `sample_token`, with the row-wise parts batched (the
    noise of all sampled rows is one draw, `noise.gumbel_noise`) and one host
    sync. Returns (tokens, policy logprobs, processed logprobs or None) lists.
    """
    tokens, lps, plps = sample_rows_tensors(logits, params, keys, steps)
    return rows_to_lists(params, tokens.tolist(), lps.tolist(), plps.tolist())


def rows_to_lists(params: list[SamplingParams], tokens: list[int], lps: list[float], plps: list[float]):
    """`sample_rows`' lists from `sample_rows_tensors`' values read on the host: a processed logprob only for
    the rows that asked for one (`params[i].processed_logprobs`), None for the others."""
    return tokens, lps, [float(v) if p.processed_logprobs else None for p, v in zip(params, plps)]


def sample_rows_tensors(logits: torch.Tensor, params: list[SamplingParams], keys: list, steps: list[int]):
    """`sample_rows` left on the device, no host sync: (tokens int64 [B], policy logprobs fp32 [B], processed
    logprobs fp32 [B], NaN in the rows whose params do not ask for them). The engine's decode steps read these
    on the host one step later, while the next step already runs."""
    logits = logits.float()
    temps = to_device(torch.tensor([effective_temperature(p.temperature) for p in params]), logits.device)
    logp = torch.log_softmax(temperature_scaled(logits, temps[:, None]), dim=-1)
    # what argmax draws from: the raw logits (greedy rows), else processed logp plus Gumbel noise; the
    # per-row ops are only for rows that truncate (a batch-wide op otherwise: no launches per row)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if len(greedy) == len(params):
        scores = logits  # only read below: no row draws noise or truncates
    else:
        scores = logp.clone()
        if greedy:
            g = to_device(torch.tensor(greedy), logits.device)
            scores[g] = logits[g]
    proc_rows = {}  # rows whose processed logprobs differ from the policy's: they truncate
    for i, p in enumerate(params):
        if truncates(p) and p.temperature > 0:  # greedy rows ignore truncation (module docstring)
            proc_rows[i] = scores[i] = processed_logprobs(logits[i], p)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0]
    if drawn:
        if any(keys[i] is None for i in drawn):
            raise ValueError("sample_rows: a row with temperature > 0 needs a noise key")
        noise = gumbel_noise([keys[i] for i in drawn], [steps[i] for i in drawn], logits.shape[1], logits.device)
        if len(drawn) == len(params):
            scores += noise
        else:
            idx = to_device(torch.tensor(drawn), logits.device)
            scores[idx] += noise
    tokens = torch.argmax(scores, dim=-1)
    lps = logp.gather(1, tokens[:, None])[:, 0]
    ask = [p.processed_logprobs for p in params]  # without truncation the processed logprob is the policy's
    if all(ask):
        plps = lps.clone()
    elif any(ask):
        plps = torch.where(to_device(torch.tensor(ask), lps.device), lps, float("nan"))
    else:
        plps = torch.full_like(lps, float("nan"))
    for i, row in proc_rows.items():
        if params[i].processed_logprobs:
            plps[i] = row.gather(0, tokens[i:i + 1])[0]
    return tokens, lps, plps
