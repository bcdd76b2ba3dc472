"""The trainer's logprob recompute: the embedded sampler's batch-invariant forward, with gradients.

    logps, entropy = sequence_logprobs(model, prompts, completions, temperature, max_seq_len)

Sequences are packed end to end in one [1, T] row with their own positions; every layer's attention reads each
sequence's keys only (`train_attention`: the engine's attention minus the KV cache, registered with transformers'
AttentionInterface as TRAIN_IMPL), over a fixed `max_seq_len` of key positions, and every GEMM is padded to at
least MIN_ROWS rows (`rl4bit.trainer.batch_invariant`). So every row's bits depend only on its own sequence, and on the
same weights the trainer's logprobs equal the sampler's bitwise (`Trainer`'s `mismatch/k3` is exactly 0 on the
CPU). `TrainLayout` holds the index tensors and masks of one packed forward, built once for all its layers.

The LM head's logits go through `TargetLogprobs`: the sampled tokens' logprobs and the entropy a chunk of rows
at a time, so a real vocabulary's [tokens, V] FP32 log-softmax is never held whole.

Leaves out: the KV cache (a training forward sees whole sequences), sliding windows, chunking the LM head's
own product (its [tokens, V] output, in the compute dtype, is held for the backward).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from rl4bit.kernels.attention import attend, compute_dtype, fused_attention_ok
from rl4bit.kernels.transfer import to_device
from rl4bit.trainer.batch_invariant import MIN_ROWS, model_implementations, pad_rows
from rl4bit.trainer.temperature import temperature_scaled

TRAIN_IMPL = "rl4bit_train"


class TrainLayout:
    """The index tensors and causal masks of one packed training forward, built once and read by every layer.

    (Built per layer, each was a host-to-device copy, a host sync, per layer and micro-batch; the engine's
    `kv_cache.StepLayout` does the same for a decode step.) Values are what the per-layer code built.
    """

    def __init__(self, spans: list[tuple[int, int]], max_len: int, min_rows: int, device):
        self.max_len, self.min_rows, self.device, self.spans = max_len, min_rows, device, spans
        by_len: dict[int, list[int]] = {}
        for a, b in spans:
            by_len.setdefault(b - a, []).append(a)
        # sequences of equal length stacked, like the engine's groups: tok [G, n] packed positions
        self.groups = [(n, to_device(torch.tensor(firsts)[:, None] + torch.arange(n)[None, :], device))
                       for n, firsts in by_len.items()]
        self._allowed: dict[tuple[int, int], torch.Tensor] = {}
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention_tables(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`attention_triton`'s sequence and tile tables: keys in the packed row (kv_row = the first row)."""
        from rl4bit.kernels.attention_triton import seq_table, tile_table

        if g not in self._tables:
            lengths = [b - a for a, b in self.spans]
            starts = [a for a, _ in self.spans]
            self._tables[g] = (seq_table(starts, lengths, [0] * len(lengths), starts, self.device),
                               tile_table(lengths, g, self.device))
        return self._tables[g]

    def allowed(self, n: int, g: int) -> torch.Tensor:
        """[max(g*n, min_rows), max_len] bool: query row (head-major, position j) may read key position <= j."""
        if (n, g) not in self._allowed:
            keys_pos = torch.arange(self.max_len, device=self.device)
            q_pos = torch.arange(0, n, device=self.device).repeat(g)
            self._allowed[n, g] = pad_rows(keys_pos[None, :] <= q_pos[:, None], max(g * n, self.min_rows))
        return self._allowed[n, g]


def train_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, rl4bit_train=None, **kwargs):
    """`kv_cache.engine_attention` for whole sequences, without the KV cache (cheap to differentiate).

    With the fused kernels on (`fused_attention_ok`): the engine's Triton kernel
    reading keys in the packed row (`kernels.attention.attend`; its backward
    differentiates the torch formula). Otherwise the torch path: each
    sequence's keys/values zero-padded to `max_len` positions, exactly what its
    cache slot holds after a prefill, so every matmul, mask and softmax has the
    engine's shapes and values. Either way the outputs match the engine's bit
    for bit. Sequences of equal length are stacked into one batched matmul, as
    the engine stacks them (each (sequence, kv head) stays its own matrix).
    `rl4bit_train` is the forward's `TrainLayout`.
    """
    layout: TrainLayout = rl4bit_train
    max_len, min_rows = layout.max_len, layout.min_rows
    _, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    dtype = compute_dtype(query, key)
    if fused_attention_ok(query, key, value, dtype):  # the engine's kernel (kv_cache.engine_attention), keys in the row
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, Hkv, D]
        if k.stride() != v.stride() or k.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        seqs, tiles = layout.attention_tables(g)
        out = attend(query[0].transpose(0, 1), k, v, seqs, tiles, scaling, dtype, groups=layout.groups)
        return out[None], None
    out = query.new_zeros(1, t, hq, d)
    for n, tok in layout.groups:
        G = tok.shape[0]
        pad = (0, 0, 0, max_len - n)
        k_slot = torch.nn.functional.pad(key[0][:, tok].permute(1, 0, 2, 3), pad)  # [G, Hkv, max_len, D]
        v_slot = torch.nn.functional.pad(value[0][:, tok].permute(1, 0, 2, 3), pad)
        q = pad_rows(query[0][:, tok].permute(1, 0, 2, 3).reshape(G, hkv, g * n, d), min_rows)
        scores = torch.matmul(q, k_slot.transpose(-1, -2)) * scaling  # [G, Hkv, rows, max_len]
        scores = scores.masked_fill(~layout.allowed(n, g), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype).nan_to_num(0.0)
        o = torch.matmul(probs, v_slot)[:, :, : g * n]  # [G, Hkv, g*n, D]
        out[0, tok] = o.reshape(G, hq, n, d).transpose(1, 2).to(out.dtype)  # bf16 autocast: o is bf16, q FP32 (qk-norm)
    return out, None


AttentionInterface.register(TRAIN_IMPL, train_attention)


def sequence_logprobs(model, prompts: list[list[int]], completions: list[list[int]], temperature: float,
                      max_seq_len: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per sequence, the logprobs of its completion tokens at `temperature`; and the summed entropy (detached).

    Mirrors `EmbeddedEngine.score` for many sequences at once (one packed row).
    """
    dev = next(model.parameters()).device
    ids, pos, spans, rows, targets = [], [], [], [], []
    for p, c in zip(prompts, completions):
        seq = list(p) + list(c)[:-1]
        start = len(ids)
        spans.append((start, start + len(seq)))
        rows += range(start + len(p) - 1, start + len(seq))
        targets += list(c)
        ids += seq
        pos += range(len(seq))
    pad = max(0, MIN_ROWS - len(ids))
    base = getattr(model, model.base_model_prefix)
    with model_implementations(model, TRAIN_IMPL):
        hidden = base(input_ids=to_device(torch.tensor([ids + [0] * pad]), dev),
                      position_ids=to_device(torch.tensor([pos + [0] * pad]), dev),
                      use_cache=False, rl4bit_train=TrainLayout(spans, max_seq_len, MIN_ROWS, dev)).last_hidden_state[0]
    h = pad_rows(hidden[to_device(torch.tensor(rows), dev)], MIN_ROWS)
    logits = model.get_output_embeddings()(h)[: len(rows)]
    logp, entropy = TargetLogprobs.apply(logits, to_device(torch.tensor(targets), dev),
                                         temperature if temperature > 0 else 1.0, chunk_rows(logits.shape[-1]))
    return list(logp.split([len(c) for c in completions])), entropy


CHUNK_ELEMENTS = 2**26
"""FP32 elements of one chunk's log-softmax in `TargetLogprobs` (256 MiB): at a 152k vocabulary, 441 rows."""


def chunk_rows(vocab: int) -> int:
    """Rows of logits a chunk of `TargetLogprobs` takes: CHUNK_ELEMENTS / vocab, at least one row."""
    return max(1, CHUNK_ELEMENTS // vocab)


class TargetLogprobs(torch.autograd.Function):
    """(logp [R], entropy) = log_softmax(logits.float() / t)[r, target[r]] and the rows' summed entropy (no
    gradient), computed `chunk` rows at a time; the division is `sampling.temperature_scaled`'s, the sampler's.

    The same logprobs as the whole-tensor expression (log_softmax reduces each row on its own; the entropy's
    row sums too on the CPU, tested; on CUDA a reduction's split may follow the row count, and the entropy is a
    logged metric only), without holding the [R, V] FP32 log-softmax, its exp and their product at once, nor
    saving the log-softmax for the backward: at a real vocabulary (Qwen3's 152k) and a 32k-token micro-batch
    those are 20 GB each. The backward recomputes
    each chunk's log-softmax from the saved logits and applies log_softmax's own gradient rule,
    d z = G - exp(out) * sum(G), with G the gathered gradient scattered back, then the division by t.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, t: float, chunk: int):
        if not t > 0 or chunk < 1:
            raise ValueError(f"TargetLogprobs: temperature {t} must be > 0 (greedy scores at 1) and chunk {chunk} >= 1")
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
        ent = torch.empty(rows, dtype=torch.float32, device=logits.device)
        for a in range(0, rows, chunk):
            out = torch.log_softmax(temperature_scaled(logits[a: a + chunk], t), dim=-1)
            logp[a: a + chunk] = out.gather(1, targets[a: a + chunk, None])[:, 0]
            ent[a: a + chunk] = -(out.exp() * out).sum(-1)
        ctx.save_for_backward(logits, targets)
        ctx.t, ctx.chunk = t, chunk
        entropy = ent.sum()
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g: torch.Tensor, _entropy_grad):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for a in range(0, logits.shape[0], ctx.chunk):
            out = torch.log_softmax(temperature_scaled(logits[a: a + ctx.chunk], ctx.t), dim=-1)
            ga = g[a: a + ctx.chunk, None]
            dz = torch.zeros_like(out).scatter_(1, targets[a: a + ctx.chunk, None], ga) - out.exp() * ga
            grad[a: a + ctx.chunk] = temperature_scaled(dz, ctx.t).to(logits.dtype)
        return grad, None, None, None
