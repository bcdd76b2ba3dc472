"""The embedded engine's decode step as static-shape forwards, captured as CUDA graphs.

A decode step (every active sequence feeds one token) is launch-bound when run op by op (thousands of launches a
step for a 16-layer MoE). Here it runs at a fixed row count P (the next bucket >= the batch) from static device
buffers (`inputs` int64 [4, P]: tokens, positions, slots, liveness; `logits` float32 [P, V]); padding rows
write the cache's scratch slot and route onto row 0's experts (`trainer.padding`). The forward is the engine's
own with a `DecodeLayout` computed on the device, so nothing reads the host: on CUDA each bucket is captured
once and replayed; on the CPU (mode "static") the same static forward runs eagerly, which is how the tests
check it. Numerics: the eager step's ops on the same rows, padded to P; rows never mix, so tokens and logprobs
are the eager path's bitwise (tested on CPU and, for the tiny test model, on CUDA; at real sizes cuBLAS may
pick another kernel for M = P, which is not checked). A forward that cannot be captured falls back to op by
op with a warning (`error` says why). `DecodeGraphs` lists what a graph may read and when it is dropped.

Leaves out: graphs for prefill or mixed steps (those run eagerly), sampling (eager after the replay: per-row
parameters vary), multiple streams."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch

from rl4bit.kernels import fused
from rl4bit.kernels.transfer import to_device
from rl4bit.sampler.kv_cache import StepLayout
from rl4bit.trainer import padding
from rl4bit.trainer.batch_invariant import pad_rows

MODES = ("off", "static", "cuda")
SPLIT_MAX_ROWS = 16
"""Decode steps of at most this many rows split their attention over key chunks (`DecodeLayout.key_chunks`);
the bits do not depend on it. At 16 rows the split loses at contexts under ~512 and wins from ~1024
(`scripts/sweep_attention.py`): 16 favours long rollouts (the choice is static for a bucket's graph)."""


@dataclass
class DecodeLayout(StepLayout):
    """A StepLayout for P one-token rows whose index tensors are device ops on `token_slot`/`token_pos`.

    Same tensors, same values as `StepLayout.groups` builds for a decode step
    (one group, n = 1), but without host lists, so a CUDA graph can hold it.
    """

    def groups(self, g: int, device) -> list[tuple]:
        if self._groups is None:
            self._groups = {}
        if g not in self._groups:
            rows = self.token_slot.numel()
            keys_pos = torch.arange(self.cache.max_len, device=device)
            tok = torch.arange(rows, device=device)[:, None]
            q_pos = self.token_pos[:, None].repeat(1, g)  # [P, g]
            allowed = pad_rows(keys_pos[None, None, :] <= q_pos[:, :, None], max(g, self.min_rows))
            self._groups[g] = [(1, tok, self.token_slot, ~allowed)]
        return self._groups[g]

    def key_chunks(self) -> int:
        """A decode step of few rows splits each row's keys over cdiv(cache length, KEY_CHUNK) programs (one
        program a (row, kv head) would walk the whole context alone: 4 programs at batch 1); above
        SPLIT_MAX_ROWS rows the tiles fill the GPU already. Static for a bucket (a CUDA graph's grid)."""
        from rl4bit.kernels.attention_triton import KEY_CHUNK

        chunks = -(-self.cache.max_len // KEY_CHUNK)
        return chunks if chunks > 1 and self.token_slot.numel() <= SPLIT_MAX_ROWS else 0

    def attention_tables(self, g: int, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`StepLayout.attention_tables` for P one-token rows, as device ops on `token_slot`/`token_pos` (every
        row is a sequence: padding rows read and write the scratch slot)."""
        from rl4bit.kernels.attention_triton import BLOCK_M

        if self._tables is None:
            self._tables = {}
        if g not in self._tables:
            rows = self.token_slot.numel()
            per = -(-g // BLOCK_M)  # row tiles a one-token sequence needs
            first = torch.arange(rows, device=device)
            seqs = torch.stack([first, torch.ones_like(first), self.token_pos,
                                self.token_slot * self.cache.slot_rows])
            at = torch.arange(rows * per, device=device)
            self._tables[g] = (seqs, torch.stack([at // per, at % per * BLOCK_M]), True)
        return self._tables[g]


class _Bucket:
    """Static buffers of one row count P, and its graph once captured."""

    def __init__(self, rows: int, logits: torch.Tensor):
        self.rows = rows
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=logits.device)
        self.logits = logits[:rows]
        """The first `rows` rows of the output buffer every bucket shares (one step at a time reads it)."""
        self.graph = None


class DecodeGraphs:
    """Per-bucket static decode forwards of one EmbeddedEngine; `logits(...)` runs one step.

    Every tensor a graph reads is owned by the model, the cache, these buffers, the graph's pool or the quantize
    kernels' per-device NaN flag (never freed): quantized serving modules pass their row counts as device
    tensors (tile maps built inside the graph), never a cached map that could be freed behind the graph's back.
    Graphs read weights and the KV cache by address: weight updates copy in place, and anything that replaces a
    tensor (a module put into serving mode) must call `reset()`. A change of the fused-kernels setting drops the
    graphs (they hold the kernels chosen at capture). Autocast's weight-cast cache is off inside the graphed
    forward: a cast cached outside the capture would be frozen into the graph.
    """

    def __init__(self, engine, mode: str):
        if mode not in MODES:
            raise ValueError(f"decode graphs mode {mode!r}: use one of {MODES}")
        if mode == "cuda" and engine.device.type != "cuda":
            raise ValueError(f"decode graphs mode 'cuda' needs a CUDA engine, this one runs on {engine.device}")
        self._engine = weakref.ref(engine)  # no reference cycle: deleting the engine frees its cache and graphs
        self.mode = mode
        self.scratch_slot = engine.cache.reserve_scratch()
        top = max(engine.max_batch_size, engine.min_rows)
        sizes, p = [], engine.min_rows
        while p < top:
            sizes.append(p)
            p *= 2
        self.sizes = sizes + [top]
        """Row counts with a static forward: min_rows doubling up to the batch capacity."""
        self._buckets: dict[int, _Bucket] = {}
        self._logits: torch.Tensor | None = None
        self._pool = None
        self._side = None
        """The warm-ups' stream: one for every capture (the allocator caches blocks per stream, so a new stream
        per capture would strand each warm-up's freed memory)."""
        self._fused_state = fused.state()
        """The fused-kernels setting (`rl4bit.kernels.fused`) the captured graphs were built under."""
        self.captures = 0
        self.replays = 0
        self.error: str | None = None
        """Why capturing failed (a host read or CPU tensor inside the model's forward); decode then runs op by op."""

    @property
    def engine(self):
        return self._engine()

    def reset(self) -> None:
        """Drop every captured graph (their buffers and memory pool) and a past capture failure: the next step
        captures again (after a module was put into serving mode, whose forward may now be capturable)."""
        self._buckets.clear()
        self._pool = None
        self.error = None

    def bucket_rows(self, batch: int) -> int:
        if batch > self.sizes[-1]:
            raise ValueError(f"a decode step of {batch} rows exceeds the engine's batch capacity {self.sizes[-1]}")
        return next(p for p in self.sizes if p >= batch)

    def logits(self, tokens, positions: list[int], slots: list[int]) -> torch.Tensor | None:
        """float32 [B, V] next-token logits of B one-token rows (token, cache position, cache slot per row).

        tokens: a list of ints, or an int64 device tensor [B] (the previous step's sampled tokens, not yet
        read by the host: copied on the device, no host wait). The result is a view of the bucket's static
        output, valid until the next call. None when this model's forward cannot be captured (`error` says
        why): the caller runs the step op by op.
        """
        if self.error is not None:
            return None
        if fused.state() != self._fused_state:  # captured graphs hold the kernels chosen at capture
            self._buckets.clear()
            self._fused_state = fused.state()
        b = len(tokens)
        rows = self.bucket_rows(b)
        bucket = self._buckets.get(rows)
        if bucket is None:
            if self._logits is None:
                self._logits = torch.zeros(self.sizes[-1], self.engine.vocab_size, dtype=torch.float32,
                                           device=self.engine.device)
            bucket = self._buckets[rows] = _Bucket(rows, self._logits)
        pad = rows - b
        on_device = isinstance(tokens, torch.Tensor)
        host = torch.tensor([([0] * b if on_device else tokens) + [0] * pad, positions + [0] * pad,
                             slots + [self.scratch_slot] * pad, [1] * b + [0] * pad], dtype=torch.long)
        bucket.inputs.copy_(to_device(host, bucket.inputs.device))  # pinned, no host wait (a pageable copy syncs)
        if on_device:
            bucket.inputs[0, :b].copy_(tokens)
        if self.mode == "static":
            bucket.logits.copy_(self._forward(bucket))
        elif bucket.graph is None:
            try:  # the warm-up runs this step's rows; the replay below recomputes the same values
                self._capture(bucket)
            except torch.OutOfMemoryError:
                raise  # not a property of the model: do not turn graphs off for good
            except RuntimeError as e:
                cause = e.__context__ if isinstance(e.__context__, Exception) else e  # capture_end's error hides it
                self.reset()
                self.error = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
                warnings.warn(f"decode steps run op by op: this model's decode forward cannot be captured in a "
                              f"CUDA graph ({self.error}); sampler.cuda_graphs=false silences this", stacklevel=2)
                return None
        if bucket.graph is not None:
            bucket.graph.replay()
            self.replays += 1
        return bucket.logits[:b]

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        eng = self.engine
        ids, pos, slot, live = bucket.inputs[0:1], bucket.inputs[1:2], bucket.inputs[2], bucket.inputs[3]
        layout = DecodeLayout(eng.cache, [], [], [], slot, pos[0], eng.min_rows)
        base = getattr(eng.model, eng.model.base_model_prefix)
        with padding.live_rows(live), torch.autocast(eng.device.type, eng.autocast or torch.bfloat16,
                                                     enabled=eng.autocast is not None, cache_enabled=False):
            hidden = base(input_ids=ids, position_ids=pos, use_cache=False, rl4bit_step=layout).last_hidden_state[0]
            return eng.model.get_output_embeddings()(hidden).float()

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (Triton compiles, allocator), then capture the forward into `bucket.graph`.

        The caller's stream is current again afterwards, also when the capture
        fails (a failing `capture_end` leaves torch.cuda.graph's stream current).
        """
        device = self.engine.device
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        side, caller = self._side, torch.cuda.current_stream(device)
        try:
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                bucket.logits.copy_(self._forward(bucket))
            caller.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits.copy_(self._forward(bucket))
        finally:
            torch.cuda.set_stream(caller)
        self._pool = graph.pool()
        bucket.graph = graph
        self.captures += 1
