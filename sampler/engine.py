"""The embedded rollout engine: batched prefill + decode over a Hugging Face causal LM.

`EmbeddedEngine(model, tokenizer).generate(requests) -> list[Rollout]` runs a continuous-batching loop: each step
packs every active sequence's pending tokens end to end into one [1, T] row with explicit position ids, runs the
model's own forward with the attention/experts plug-ins of kv_cache.py (a KV slot per sequence, GEMMs padded to
MIN_ROWS, padding rows marked: `trainer.padding`) and samples every row with its own noise key (sampling.py).
Every op is row-local with shapes from the sequence alone, so a request's tokens and logprobs do not depend on
the rest of the batch (tested bitwise on CPU); `score` rescores through the same path. Pure decode steps run as
CUDA graphs per batch bucket (decode_graph.py), one step ahead of the host (`_decode_ahead`); a request's n
samples prefill the prompt once (`share_prefix`). Quantized serving modules (`surgery.load_quantized`) swap their
QTensors in `update_weights`, all-or-nothing with the dense tensors. Text and stop strings: detokenizer.py. Bad
input fails only its own request (finish_reason "error").

Leaves out: prefix sharing across requests (a prompt cache), chunked prefill, graphs for prefill steps."""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

import torch

from rl4bit.kernels import deferred_checks
from rl4bit.kernels.checks import all_finite, qtensor_problems
from rl4bit.kernels.philox import derive_seed
from rl4bit.sampler.decode_graph import DecodeGraphs
from rl4bit.sampler.detokenizer import IncrementalDetokenizer
from rl4bit.sampler.kv_cache import ENGINE_IMPL, KVCache, StepLayout
from rl4bit.sampler.rope_table import rope_tables
from rl4bit.sampler.sampling import policy_logprobs, rows_to_lists, sample_rows, sample_rows_tensors
from rl4bit.sampler.serving_dtype import precast
from rl4bit.sampler.types import (
    Request,
    Rollout,
    SamplingParams,
    WeightUpdate,
    failed_rollouts,
    nonfinite_logprob_error,
    request_error,
)
from rl4bit.trainer import padding
from rl4bit.trainer.batch_invariant import MIN_ROWS, model_implementations, pad_rows
from rl4bit.trainer.fused_attention import pack_qkv


@dataclass
class _Seq:
    """One sample being generated."""

    out_index: int
    request: Request
    sample_index: int
    params: SamplingParams
    noise_key: int | None
    """Philox key of this sample's noise (from the request seed and sample index); None when greedy."""
    stop_ids: set[int]
    max_new: int
    detok: IncrementalDetokenizer | None
    """The completion's text, decoded after the prompt as vLLM does, and its stop strings (detokenizer.py); None:
    no tokenizer (token ids only) or a scoring pass."""
    slot: int = -1
    n_cached: int = 0
    pending: list[int] = field(default_factory=list)
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    proc_logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    """Why the sample failed mid-generation (finish "error": a non-finite logprob), else None."""
    followers: list["_Seq"] = field(default_factory=list)
    """The request's other samples, waiting to fork from this one's prefill (shared prompt KV)."""


@dataclass
class _Launched:
    """A decode step launched on the device whose results the host has not read yet (`_decode_ahead`)."""

    seqs: list[_Seq]
    tokens: torch.Tensor
    """The sampled tokens on the device: the next step's input."""
    host: list[torch.Tensor]
    """Tokens, policy and processed logprobs copied to the host (pinned on CUDA: valid once `event` is done)."""
    event: "torch.cuda.Event | None"


class EmbeddedEngine:
    """Batched, batch-invariant generation over `model` (a HF causal LM), in-process.

    A model holding FP32 masters that the trainer runs under BF16 autocast is served under the same autocast
    (`autocast=`), so both compute the same ops on the same values (tests/rl/test_bf16_compute.py); weights the
    forward only reads through a cast are held in the autocast dtype (serving_dtype.py: same bits, no cast
    kernels per step). Against the stock HF forward (SDPA, unpadded GEMMs) logprobs agree to fp tolerance only.
    The n samples of a request copy the first one's prompt KV and draw their first token from its logits row:
    what their own prefill would give, rows being independent (tests/sampler/test_shared_prefix.py).
    """

    def __init__(self, model, tokenizer, *, max_batch_size: int = 64, device="cpu", max_seq_len: int | None = None,
                 max_prefill_tokens: int = 4096, min_rows: int = MIN_ROWS, autocast: torch.dtype | None = None,
                 decode_graphs: str = "auto", share_prefix: bool = True):
        """autocast: run every forward under `torch.autocast(device, autocast)`, as the trainer runs its own
        (`model.dtype: bfloat16`: FP32 master weights, BF16 compute; `rl4bit.trainer.models.autocast_dtype`), so the
        two compute the same ops on the same values; the KV cache then holds that dtype. None: the model's
        own parameter dtype, no autocast.
        decode_graphs: how pure decode steps run (decode_graph.py): "cuda" (CUDA graphs, one per bucket of
        batch sizes), "static" (the graphs' static-shape forward run eagerly: the CPU check of that path),
        "off" (op by op, like prefill), "auto" ("cuda" on a CUDA device, else "off").
        share_prefix: the n samples of a request prefill their prompt once: the others copy its KV and
        draw their first token from its logits (what their own prefill gives: rows never mix; bitwise on
        the CPU, tested).
        tokenizer None: token ids only (vLLM's `skip_tokenizer_init`): Rollout.text is "", eos ids come from
        the model's configs, and a request with stop strings fails alone (benchmarks, profiles)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: {max_batch_size} must be >= 1")
        if min_rows < 1:
            raise ValueError(f"min_rows: {min_rows} must be >= 1 (GEMMs are padded to at least this many rows)")
        if decode_graphs == "auto":
            decode_graphs = "cuda" if torch.device(device).type == "cuda" else "off"
        self.autocast = autocast
        self.share_prefix = share_prefix
        self.model = model.to(device).eval()
        self.precast = precast(self.model, autocast)
        """State-dict names held in the autocast dtype (serving_dtype.py); updates to them may come in FP32."""
        pack_qkv(self.model)  # q/k/v weights as views of one stacked tensor: one GEMM, no copy (fused_attention)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        cfg = model.config
        self.max_seq_len = int(max_seq_len or cfg.max_position_embeddings)
        rope_tables(self.model, self.max_seq_len)  # rotary cos/sin gathered from tables (rope_table.py)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.min_rows = min_rows
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = autocast or next(model.parameters()).dtype
        slots = max_batch_size + (decode_graphs != "off")  # + the decode graphs' scratch slot
        self.cache = KVCache(cfg.num_hidden_layers, slots, cfg.num_key_value_heads, self.max_seq_len,
                             head_dim, dtype, self.device)
        self.graphs = DecodeGraphs(self, decode_graphs) if decode_graphs != "off" else None
        self.eos_ids = _eos_ids(model, tokenizer)
        self._version = 0
        self._rng = random.Random()
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.decode_steps = 0
        self.shared_prompt_tokens = 0
        """Prompt tokens whose prefill was skipped: a sample forked from its request's first sample."""
        self.busy_s = 0.0
        """Seconds in generate calls, failed ones included (as their sampled tokens are in tokens_generated)."""
        self.prefill_s = 0.0
        """Seconds in steps that held any prompt tokens (prefill, possibly with decode rows)."""
        self.decode_s = 0.0
        """Seconds in pure decode steps (one new token per sequence)."""
        self.steps_ahead = 0
        """Graphed decode steps launched before the host had read the step before (`_decode_ahead`)."""

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ generate
    def generate(self, requests: list[Request]) -> list[Rollout]:
        """n rollouts per request, in request order then sample_index."""
        t0 = time.perf_counter()
        version = self._version
        results: list[Rollout | None] = []
        waiting: list[_Seq] = []
        for req in requests:
            err = request_error(req, self.vocab_size, self.max_seq_len)
            if err is None and self.tokenizer is None and req.params.stop:
                err = ("stop strings need a tokenizer: this engine was built without one (token ids only); "
                       "use stop_token_ids, or build it with the model's tokenizer")
            if err is not None:
                results.extend(failed_rollouts(req, err, version))
                continue
            leader = None
            for i in range(req.params.n):
                results.append(None)
                seq = self._new_seq(len(results) - 1, req, i)
                if leader is not None and self.share_prefix:
                    leader.followers.append(seq)
                else:
                    leader = seq
                    waiting.append(seq)
        active: list[_Seq] = []
        try:
            self._run(waiting, active, results, version)
        finally:  # an exception mid-generate (e.g. NaN/Inf met by a kernel) must not leak the slots
            for s in active:
                self.cache.release(s.slot)
            self.busy_s += time.perf_counter() - t0  # a failed call's time too: its tokens were counted
        return results  # type: ignore[return-value]

    def _run(self, waiting: list[_Seq], active: list[_Seq], results: list, version: int) -> None:
        """The continuous-batching loop: admit, step, retire, until nothing waits or runs.

        deferred_checks: the quantize kernels' NaN/Inf flag is read once per generate, not once per GEMM (a
        host sync each); a non-finite activation still raises, at the end of the call.
        """
        with model_implementations(self.model, ENGINE_IMPL), torch.inference_mode(), deferred_checks():
            while waiting or active:
                budget = self.max_prefill_tokens
                room = min(self.max_batch_size - len(active), len(self.cache.free))
                while waiting and room > 0:
                    need = len(waiting[0].pending)
                    if need > budget and budget < self.max_prefill_tokens:
                        break
                    s = waiting.pop(0)
                    s.slot = self.cache.acquire()
                    budget -= need
                    room -= 1 + len(s.followers)  # keep room for the samples that will fork from its prefill
                    active.append(s)
                # steps ahead until a sequence finishes: only then could a waiting request be admitted (one just
                # admitted needs a prefill, and _decode_ahead refuses any step with one)
                if not self._decode_ahead(active):
                    waiting[:0] = self._step(active)  # followers that found no room: they prefill later
                for s in [s for s in active if s.finish is not None]:
                    self.cache.release(s.slot)
                    active.remove(s)
                    results[s.out_index] = self._rollout(s, version)

    def _new_seq(self, out_index: int, req: Request, i: int) -> _Seq:
        p = req.params
        key = None
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else self._rng.getrandbits(62)
            key = derive_seed(seed, i) & (2**63 - 1)
        max_new = min(p.max_new_tokens, self.max_seq_len - len(req.prompt_ids))
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        return _Seq(out_index, req, i, p, key, stop_ids, max_new,
                    None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.stop),
                    pending=list(req.prompt_ids))

    def _forward(self, seqs: list[_Seq], tokens_per_seq: list[list[int]], starts: list[int], rows: list[int]):
        """One packed forward; returns fp32 logits [len(rows), V] of the packed positions `rows`."""
        ids, pos, tslot, spans = [], [], [], []
        for s, toks, start in zip(seqs, tokens_per_seq, starts):
            spans.append((len(ids), len(ids) + len(toks)))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            tslot.extend([s.slot] * len(toks))
        n_real = len(ids)
        pad = max(0, self.min_rows - n_real)
        dev = self.device
        input_ids = torch.tensor([ids + [0] * pad], dtype=torch.long, device=dev)
        position_ids = torch.tensor([pos + [0] * pad], dtype=torch.long, device=dev)
        layout = StepLayout(self.cache, [s.slot for s in seqs], spans, list(starts),
                            torch.tensor(tslot, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), self.min_rows)
        base = getattr(self.model, self.model.base_model_prefix)
        live = (torch.arange(n_real + pad, device=dev) < n_real).int() if pad else None  # built on the device
        with padding.live_rows(live), torch.autocast(dev.type, self.autocast or torch.bfloat16,
                                                     enabled=self.autocast is not None):
            hidden = base(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                          rl4bit_step=layout).last_hidden_state[0]
            h = pad_rows(hidden[torch.tensor(rows, dtype=torch.long, device=dev)], self.min_rows)
            return self.model.get_output_embeddings()(h)[: len(rows)].float()

    def _step(self, active: list[_Seq]) -> list[_Seq]:
        """One forward + sampling over `active` (samples forked from a prefill this step join it); returns the
        followers that found no free slot or batch room and must prefill later."""
        t0 = time.perf_counter()
        seqs = [s for s in active if s.finish is None]
        prefill = any(s.n_cached == 0 for s in seqs)
        toks = [s.pending for s in seqs]
        starts = [s.n_cached for s in seqs]
        rows, at = [], 0
        for t in toks:
            at += len(t)
            rows.append(at - 1)
        logits = None
        if not prefill and self.graphs is not None and all(len(t) == 1 for t in toks):
            logits = self.graphs.logits([t[0] for t in toks], starts, [s.slot for s in seqs])
        if logits is None:
            logits = self._forward(seqs, toks, starts, rows)
        if not prefill:
            self.decode_steps += 1
        forked, unplaced = self._fork(seqs, active) if prefill else ([], [])
        if forked:  # a fork samples its first token from its leader's row: [(index of the leader, fork)]
            logits = torch.cat([logits, logits[torch.tensor([i for i, _ in forked], device=logits.device)]])
        rows_seqs = seqs + [f for _, f in forked]
        tokens, lps, plps = sample_rows(logits, [s.params for s in rows_seqs], [s.noise_key for s in rows_seqs],
                                        [len(s.completion) for s in rows_seqs])
        for s, token, lp, plp in zip(rows_seqs, tokens, lps, plps):
            self._append(s, token, lp, plp)
        dt = time.perf_counter() - t0
        if prefill:
            self.prefill_s += dt
        else:
            self.decode_s += dt
        return unplaced

    def _decode_ahead(self, active: list[_Seq]) -> bool:
        """Graphed decode steps, each launched before the previous one's tokens reach the host, until a
        sequence finishes; False (nothing run) when this is not a pure graphed decode step.

        Step i + 1 runs from step i's sampled tokens on the device, at positions and noise indices one past
        the host's (step i is not read yet). It is launched only when no row of step i can end by length;
        a row whose step i ends on a stop token or string is dropped from step i + 1, whose other rows are
        kept, and the loop returns so that the caller retires it and admits waiting requests. Step i + 1 still
        holds the stopped row, so it may run at a larger row bucket than a step-by-step loop would, which changes
        no bits where rows do not depend on the row count (tested bitwise on the CPU in "static" mode with stops
        mid-decode, and on CUDA for the tests' models).
        """
        seqs = [s for s in active if s.finish is None]
        if (self.graphs is None or self.graphs.error is not None or not seqs
                or any(s.n_cached == 0 or len(s.pending) != 1 or s.followers for s in seqs)):
            return False
        t0 = time.perf_counter()
        step = self._launch(seqs, None)
        if step is None:  # the first capture failed: this step runs op by op
            return False
        while True:
            ahead = all(len(s.completion) + 2 <= s.max_new for s in seqs)  # no row ends by length at step i
            nxt = self._launch(seqs, step) if ahead else None
            self.steps_ahead += nxt is not None
            self._read(step, seqs)
            alive = [s for s in seqs if s.finish is None]
            if nxt is None or len(alive) < len(seqs):
                if nxt is not None and alive:  # else every row of nxt is dropped: not read
                    self._read(nxt, alive)
                break
            step = nxt
        self.decode_s += time.perf_counter() - t0
        return True

    def _launch(self, seqs: list[_Seq], prev: _Launched | None) -> _Launched | None:
        """Launch one graphed decode step of `seqs` and its sampling; the results stay on the device (copied
        to pinned host memory behind an event). prev: the step before, not yet read by the host: its device
        tokens are this step's input, one position and one noise index past the host's view."""
        ahead = 0 if prev is None else 1
        tokens = [s.pending[0] for s in seqs] if prev is None else prev.tokens
        logits = self.graphs.logits(tokens, [s.n_cached + ahead for s in seqs], [s.slot for s in seqs])
        if logits is None:
            return None
        out = sample_rows_tensors(logits, [s.params for s in seqs], [s.noise_key for s in seqs],
                                  [len(s.completion) + ahead for s in seqs])
        cuda = self.device.type == "cuda"
        event = None
        host = [t.to("cpu", non_blocking=cuda) for t in out]  # CUDA: pinned, read after the event
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return _Launched(list(seqs), out[0], host, event)

    def _read(self, step: _Launched, seqs: list[_Seq]) -> None:
        """Wait for a launched step's results on the host and append them to those of its rows' sequences
        that are in `seqs` (the caller leaves out the ones that finished after the step was launched)."""
        if step.event is not None:
            step.event.synchronize()
        tokens, lps, plps = rows_to_lists([s.params for s in step.seqs], *(t.tolist() for t in step.host))
        self.decode_steps += 1
        keep = {id(s) for s in seqs}
        for s, token, lp, plp in zip(step.seqs, tokens, lps, plps):
            if id(s) in keep:
                self._append(s, token, lp, plp)

    def _append(self, s: _Seq, token: int, lp: float, plp: float | None) -> None:
        """Record one sampled token of `s` (its pending tokens are now cached) and check whether it finished."""
        if s.n_cached == 0:
            self.prompt_tokens += len(s.pending)
        s.n_cached += len(s.pending)
        s.completion.append(token)
        s.logprobs.append(lp)
        if plp is not None:
            s.proc_logprobs.append(plp)
        s.pending = [token]
        self.tokens_generated += 1
        if not math.isfinite(lp):  # NaN/Inf logits: this sample ends here, failed; the others go on
            s.finish, s.error = "error", nonfinite_logprob_error(s.logprobs)
            return
        self._check_finished(s, token)

    def _fork(self, seqs: list[_Seq], active: list[_Seq]) -> tuple[list[tuple[int, _Seq]], list[_Seq]]:
        """Give the followers of every sequence prefilled in this step a slot holding a copy of its prompt's KV.

        Returns ([(index of the leader in seqs, follower)], new leaders: of the followers left without a free
        slot or batch room, the first, carrying the others as its followers).
        The copy is what the follower's own prefill would write (each row's K/V depends on that row alone).
        """
        forked, unplaced = [], []
        for i, s in enumerate(seqs):
            if s.n_cached != 0 or not s.followers:
                continue
            left = []
            for f in s.followers:
                if self.cache.free and len(active) < self.max_batch_size:
                    f.slot = self.cache.acquire()
                    active.append(f)  # holds a slot from here on (generate releases active slots on errors)
                    self.cache.copy_prefix(s.slot, f.slot, len(s.pending))
                    self.shared_prompt_tokens += len(f.pending)
                    forked.append((i, f))
                else:
                    left.append(f)
            if left:  # the first one left prefills later and the rest fork from it then
                left[0].followers = left[1:]
                unplaced.append(left[0])
            s.followers = []
        return forked, unplaced

    def _check_finished(self, s: _Seq, token: int) -> None:
        stopped = s.detok is not None and s.detok.step(token)  # every token, a stop token too (vLLM does)
        if stopped or token in s.stop_ids:
            s.finish = "stop"
        elif len(s.completion) >= s.max_new:
            s.finish = "length"

    def _rollout(self, s: _Seq, version: int) -> Rollout:
        text = "" if s.detok is None else s.detok.text
        return Rollout(s.request.id, s.sample_index, list(s.request.prompt_ids), s.completion, text,
                       s.logprobs, s.finish, version, error=s.error,
                       processed_logprobs=s.proc_logprobs if s.params.processed_logprobs else None)

    # ------------------------------------------------------------------ scoring
    def score(self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Policy logprobs of `completion_ids` after `prompt_ids` from ONE full-sequence forward through the
        engine's numerics (what a trainer-side recompute through the same path gets)."""
        ids = list(prompt_ids) + list(completion_ids)
        if not prompt_ids or not completion_ids or len(ids) > self.max_seq_len:
            raise ValueError(f"score needs a non-empty prompt and completion of <= {self.max_seq_len} tokens in all")
        s = _Seq(-1, Request("score", list(prompt_ids)), 0, SamplingParams(), None, set(), 0, None)
        s.slot = self.cache.acquire()
        try:
            with model_implementations(self.model, ENGINE_IMPL), torch.inference_mode():
                rows = list(range(len(prompt_ids) - 1, len(ids) - 1))
                logits = self._forward([s], [ids[:-1]], [0], rows)
        finally:
            self.cache.release(s.slot)
        return [float(policy_logprobs(row, temperature)[t]) for row, t in zip(logits, completion_ids)]

    # ------------------------------------------------------------------ weights
    def update_weights(self, update: WeightUpdate, quantized: dict | None = None) -> None:
        """Copy `update.tensors` (dense) and `quantized` (served QTensors) into the model; all-or-nothing.

        `quantized` is {module name: {param: QTensor}} for the model's quantized
        modules (`rl4bit.trainer.surgery`): a module already serving gets its
        QTensors' storage overwritten in place; one not yet serving is put into
        serving mode from them (`load_quantized`, master weights dropped).
        Everything is checked first (known name, same shape, same dtype or FP32 for a
        pre-cast weight (`self.precast`), finite
        values, same format; version newer than the serving one); any
        problem raises ValueError and leaves the old weights and version serving.
        """
        if not isinstance(update, WeightUpdate):
            raise ValueError(f"update_weights needs a WeightUpdate, got {type(update).__name__}")
        if not isinstance(update.version, int) or isinstance(update.version, bool) or update.version <= self._version:
            raise ValueError(f"version {update.version!r} must be an int newer than the serving version "
                             f"{self._version} (one version, one set of weights)")
        live = self.model.state_dict(keep_vars=True)
        problems = []
        for name, t in update.tensors.items():
            if name not in live:
                close = [k for k in live if k.split(".")[-1] == name.split(".")[-1]][:3]
                problems.append(f"unknown tensor {name!r} (not in model.state_dict(); similar: {close})")
                continue
            problems += _tensor_problems(name, t, live[name], cast_ok=name in self.precast)
        copies, loads = self._plan_quantized(quantized or {}, problems)
        if problems:
            raise ValueError(f"weight update v{update.version} rejected, v{self._version} keeps serving: "
                             + "; ".join(problems))
        # the new QTensors moved before anything is overwritten: running out of memory there leaves v`version` whole
        loads = [(module, {p: _to_device(q, self.device) for p, q in qweights.items()}) for module, qweights in loads]
        with torch.no_grad():
            for name, t in update.tensors.items():
                live[name].copy_(t)
            for dst, src in copies:
                dst.copy_(src)
            if loads and self.graphs is not None:
                self.graphs.reset()  # new QTensor storage: graphs captured before would read the old one
            for module, qweights in loads:
                module.load_quantized(qweights, check=False)
        self._version = update.version

    def _plan_quantized(self, quantized: dict, problems: list[str]):
        """(in-place copies, modules to load) for `quantized`; what does not fit goes to `problems`."""
        modules = dict(self.model.named_modules())
        copies, loads = [], []
        for mname, qweights in quantized.items():
            module = modules.get(mname)
            if module is None or not hasattr(module, "load_quantized") or getattr(module.spec, "fmt", None) == "bf16":
                problems.append(f"{mname!r} is not a quantized module of this model; build the sampler's model "
                                "with the trainer's recipe (rl4bit.trainer.models.build_policy_model)")
                continue
            if module.served is None:
                problems += module.quantized_problems(qweights, prefix=f"{mname}.")
                loads.append((module, qweights))
                continue
            for param, q in qweights.items():
                if param not in module.served:
                    problems.append(f"unknown quantized weight {mname}.{param}")
                    continue
                found = qtensor_problems(f"{mname}.{param}", q, module.served[param].fmt, module.served[param].shape)
                if found:
                    problems += found
                    continue
                for part in ("data", "scale", "outer"):  # and the live storage's exact shapes and dtypes
                    dst, src = getattr(module.served[param], part), getattr(q, part)
                    found = _tensor_problems(f"{mname}.{param}.{part}", src, dst, values=False)  # read above
                    problems += found
                    if not found:
                        copies.append((dst, src))
        return copies, loads


def _tensor_problems(name: str, t, dst: torch.Tensor, cast_ok: bool = False, values: bool = True) -> list[str]:
    """cast_ok: an FP32 tensor is fine for any live dtype (the trainer's master, copied with a cast into a
    weight served pre-cast, serving_dtype.py); values: also check for NaN/Inf."""
    if not isinstance(t, torch.Tensor):
        return [f"{name}: {type(t).__name__} is not a tensor"]
    if t.shape != dst.shape:
        return [f"{name}: shape {tuple(t.shape)} != model's {tuple(dst.shape)}"]
    if t.dtype != dst.dtype and not (cast_ok and t.dtype == torch.float32):
        return [f"{name}: dtype {t.dtype} != model's {dst.dtype}; cast it to {dst.dtype} before sending"]
    if values and not all_finite(t):
        return [f"{name}: holds NaN/Inf values"]
    return []


def _to_device(q, device):
    return dataclasses.replace(q, data=q.data.to(device), scale=q.scale.to(device), outer=q.outer.to(device))


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
