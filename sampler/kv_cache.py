"""Preallocated KV cache and the batch-invariant pieces of the engine's forward.

The engine runs Hugging Face's own model forward on a packed batch (every active sequence's new tokens end to
end in one row [1, T], explicit position ids). Two plug-ins registered through transformers' public interfaces
make that forward batch-invariant:
- attention (`AttentionInterface`, "rl4bit_engine"): writes the new keys and values into this cache (one slot
  per sequence, [slots, kv_heads, max_len, head_dim] per layer), then attends per sequence with shapes from that
  sequence alone: its query rows (padded to `min_rows`) against all `max_len` positions, later ones masked. With
  the fused kernels on, `rl4bit.kernels.attention` instead (the kernel the trainer's `train_attention` runs).
- experts (`ExpertsInterface`, "rl4bit_engine"): HF's eager loop over experts in index order, each expert's
  rows padded to `min_rows` (MIN_ROWS says why); it lives in `rl4bit.trainer.batch_invariant`, which the
  trainer's logprob recompute shares.

Leaves out: paged blocks (one contiguous slot per sequence: a shared prompt is copied, not referenced),
sliding-window attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from rl4bit.kernels.attention import attend, fused_attention_ok
from rl4bit.trainer.batch_invariant import MIN_ROWS, pad_rows

ENGINE_IMPL = "rl4bit_engine"
"""The engine's attention (over this cache), registered with transformers' AttentionInterface."""


class KVCache:
    """One preallocated K and V tensor per layer: [slots, kv_heads, max_len, head_dim]."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.slot_rows = kv_heads * max_len
        """A slot's size in cache rows (positions x kv heads): slot s starts at row s * slot_rows."""
        self.free = list(range(slots))[::-1]

    def acquire(self) -> int:
        slot = self.free.pop()
        # Stale values are masked out (exp(-inf) = 0 exactly), but zeroing keeps
        # a NaN left by a previous occupant from ever reaching 0 * NaN.
        for k, v in zip(self.k, self.v):
            k[slot].zero_()
            v[slot].zero_()
        return slot

    def reserve_scratch(self) -> int:
        """Take the highest slot out of circulation for good: rows that only pad a batch write their K/V there."""
        slot = max(self.free)
        self.free.remove(slot)
        return slot

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Copy the first n positions of slot `src`'s K/V (every layer) into slot `dst`."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]

    def release(self, slot: int) -> None:
        self.free.append(slot)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class StepLayout:
    """Where each packed token of one forward goes; passed to attention as kwarg `rl4bit_step`."""

    cache: KVCache
    slots: list[int]
    """Per sequence: its cache slot."""
    spans: list[tuple[int, int]]
    """Per sequence: [start, end) of its tokens in the packed row."""
    starts: list[int]
    """Per sequence: cache position of its first new token."""
    token_slot: torch.Tensor
    """[T_real] int64 slot of each real packed token."""
    token_pos: torch.Tensor
    """[T_real] int64 cache position of each real packed token."""
    min_rows: int = MIN_ROWS
    _groups: dict | None = None
    """Per group size g (query heads per kv head): the step's index tensors, built once and shared by every layer."""
    _tables: dict | None = None
    """Per group size g: the fused attention kernel's (seqs, tiles, covered), built once and shared by every layer."""
    _counters: dict | None = None
    """Per (g, kv heads): a split attention's chunk counters (`split_counters`), zeroed once a step, shared by every
    layer (each call leaves them zero)."""

    def key_chunks(self) -> int:
        """Programs a row tile's keys are split over in the attention kernel (0: one program; the bits are the
        same either way): op-by-op steps keep one (prefill tiles are many already)."""
        return 0

    def split_counters(self, g: int, hkv: int, device) -> torch.Tensor | None:
        """The chunk counters a split attention call of this step takes (`attention_triton.split_counters`: one
        zeroing a step, not a launch a layer); None while `key_chunks` is 0."""
        if not self.key_chunks():
            return None
        from rl4bit.kernels.attention_triton import split_counters

        if self._counters is None:
            self._counters = {}
        if (g, hkv) not in self._counters:
            self._counters[g, hkv] = split_counters(self.attention_tables(g, device)[1].shape[1], hkv, device)
        return self._counters[g, hkv]

    def attention_tables(self, g: int, device) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`attention_triton`'s sequence and tile tables for this step (keys in the cache: kv_row = the slot's
        first row, in position strides), and whether the sequences cover every packed row (then the output
        needs no clearing)."""
        from rl4bit.kernels.attention_triton import seq_table, tile_table

        if self._tables is None:
            self._tables = {}
        if g not in self._tables:
            lengths = [b - a for a, b in self.spans]
            rows = self.cache.slot_rows
            seqs = seq_table([a for a, _ in self.spans], lengths, self.starts, [s * rows for s in self.slots], device)
            self._tables[g] = (seqs, tile_table(lengths, g, device), False)
        return self._tables[g]

    def groups(self, g: int, device) -> list[tuple]:
        """Sequences with equal token counts n: (n, tok [G, n], slots [G], blocked [G, rows, max_len]: True = masked).

        Built on the first layer's call and reused by the others, so a step
        makes its host-to-device index copies once, not once per layer.
        """
        if self._groups is None:
            self._groups = {}
        if g not in self._groups:
            by_len: dict[int, list[int]] = {}
            for i, (a, b) in enumerate(self.spans):
                by_len.setdefault(b - a, []).append(i)
            keys_pos = torch.arange(self.cache.max_len, device=device)
            built = []
            for n, members in by_len.items():
                tok = torch.tensor([[self.spans[i][0] + j for j in range(n)] for i in members], device=device)
                slots = torch.tensor([self.slots[i] for i in members], device=device)
                starts = torch.tensor([self.starts[i] for i in members], device=device)
                q_pos = (starts[:, None] + torch.arange(n, device=device)).repeat(1, g)  # [G, g*n]
                allowed = pad_rows(keys_pos[None, None, :] <= q_pos[:, :, None], max(g * n, self.min_rows))
                built.append((n, tok, slots, ~allowed))
            self._groups[g] = built
        return self._groups[g]


def engine_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, rl4bit_step=None,
                     rl4bit_kv_written=False, **kwargs):
    """Per-sequence attention over the full-length cache slot (see module docstring).

    query [1, Hq, T, D], key/value [1, Hkv, T, D] (post-RoPE, this step's tokens).
    rl4bit_kv_written: the fused q/k-norm + RoPE kernel has written this step's keys and values into the cache
    already (`trainer.fused_attention`, the kernel path only).
    Returns ([1, T, Hq, D], None) like HF's eager attention. Sequences with the
    same number of new tokens are stacked into one batched matmul: each
    (sequence, kv head) is its own matrix product of a fixed shape, so the
    stacking changes no bits (tested by the batch-invariance tests).
    """
    step: StepLayout = rl4bit_step
    if step is None:
        raise RuntimeError("attention 'rl4bit_engine' needs the kwarg rl4bit_step; it runs only inside EmbeddedEngine")
    layer = module.layer_idx
    kc, vc = step.cache.k[layer], step.cache.v[layer]
    n_real = step.token_slot.numel()
    _, hq, t, d = query.shape
    hkv = kc.shape[1]
    g = hq // hkv
    dev = query.device
    if fused_attention_ok(query, key, value, kc.dtype):  # the trainer's kernel too (trainer.logprobs.train_attention)
        from rl4bit.kernels.attention_triton import cache_write

        if not rl4bit_kv_written:
            cache_write(key[0, :, :n_real].transpose(0, 1), value[0, :, :n_real].transpose(0, 1), kc, vc,
                        step.token_slot, step.token_pos)
        seqs, tiles, covered = step.attention_tables(g, dev)
        out = attend(query[0].transpose(0, 1), kc, vc, seqs, tiles, scaling, kc.dtype, covered=covered,
                     key_chunks=step.key_chunks(), counters=step.split_counters(g, hkv, dev))
        return out[None], None
    kc[step.token_slot, :, step.token_pos] = key[0, :, :n_real].transpose(0, 1).to(kc.dtype)
    vc[step.token_slot, :, step.token_pos] = value[0, :, :n_real].transpose(0, 1).to(vc.dtype)
    out = query.new_zeros(1, t, hq, d)
    for n, tok, slots, blocked in step.groups(g, dev):
        G = tok.shape[0]
        # query head h reads kv head h // g: [G, Hq, n, D] -> [G, Hkv, g*n, D]
        q = query[0][:, tok].permute(1, 0, 2, 3).reshape(G, hkv, g * n, d)
        q = pad_rows(q, step.min_rows)
        scores = torch.matmul(q, kc[slots].transpose(-1, -2)) * scaling  # [G, Hkv, rows, max_len]
        scores = scores.masked_fill(blocked[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        probs = probs.nan_to_num(0.0)  # padded query rows are all -inf
        o = torch.matmul(probs, vc[slots])[:, :, : g * n]  # [G, Hkv, g*n, D]
        out[0, tok] = o.reshape(G, hq, n, d).transpose(1, 2).to(out.dtype)  # bf16 autocast: o bf16, q FP32 (qk-norm)
    return out, None


AttentionInterface.register(ENGINE_IMPL, engine_attention)
