"""The batch-invariant pieces of the policy forward that the engine and the trainer's logprob recompute share.

Hugging Face's model forward runs on a packed batch (every sequence's tokens end to end in one row); these make
each row's bits independent of the others: every GEMM padded to at least MIN_ROWS rows (`pad_rows`), and the MoE
experts run through `invariant_experts` (registered with transformers' ExpertsInterface as EXPERTS_IMPL), HF's
eager loop in expert index order with each expert's rows padded. `model_implementations` routes a model's
attention (the engine's or the trainer's) and experts through them.

Leaves out: the attention itself (the engine's over its KV cache in `rl4bit.sampler.kv_cache`, the trainer's
cache-free one in `rl4bit.trainer.logprobs`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface

from rl4bit.trainer.fused_swiglu import swiglu
from rl4bit.trainer.qgemm import bf16_grouped, expert_grouping

EXPERTS_IMPL = "rl4bit_engine"
"""The name `invariant_experts` is registered under in transformers' ExpertsInterface."""
MIN_ROWS = 16
"""GEMMs are padded to at least this many rows. Why: on CPU (torch 2.13) an fp32 GEMM row's bits depend on M for
M in {1,2,3,5,6,7,9,10,11} (small-M kernels) and are identical for every other M; in BF16 M=1 (a GEMV path)
differed on one 4096x2048 weight; with 1 neither the fp32 nor the bf16 tiny Qwen3-MoE engine was batch-invariant.
Padding to >= 16 rows makes each row's result independent of the other rows: observed, not guaranteed by any
BLAS contract (test_gemm_rows_do_not_depend_on_row_count_above_min_rows guards it). Rows never mix in a GEMM,
softmax or norm, so with fixed per-row shapes the whole forward is row-local."""


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad dim -2 with zeros up to `rows` (the engine and the trainer pad every GEMM to MIN_ROWS with it)."""
    m = x.shape[-2]
    if m >= rows:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-2], rows - m, x.shape[-1])], dim=-2)


def _gate(experts, h: torch.Tensor) -> torch.Tensor:
    """The experts module's `_apply_gate(h)`; HF's default one (`act_fn(gate) * up`) through the fused SwiGLU
    (`trainer.fused_swiglu`: one kernel where it applies, as the trainer's experts run it)."""
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", None) is _default_apply_gate:
        return swiglu(h, experts.act_fn)
    return experts._apply_gate(h)


def invariant_experts(self, hidden_states, top_k_index, top_k_weights):
    """HF's eager experts loop (expert index order), each expert's rows padded to MIN_ROWS.

    BF16 on CUDA: one grouped GEMM per projection instead (`bf16_grouped`, the
    bf16 recipe's product), with the per-expert counts left on the device: no
    host sync, so the decode step can be captured in a CUDA graph.
    """
    out = torch.zeros_like(hidden_states)
    flat = top_k_index.reshape(-1)
    if hidden_states.is_cuda and hidden_states.dtype == self.gate_up_proj.dtype == torch.bfloat16:
        order, tok, counts, _ = expert_grouping(flat, self.num_experts, top_k_index.shape[1])
        h = _gate(self, bf16_grouped(hidden_states[tok], self.gate_up_proj, counts))
        y = bf16_grouped(h, self.down_proj, counts) * top_k_weights.reshape(-1)[order, None]
        return out.index_add_(0, tok, y.to(out.dtype))
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    tok_all, kpos_all = order // top_k_index.shape[1], order % top_k_index.shape[1]
    at = 0
    for e, c in enumerate(counts):
        if c == 0 or e >= self.num_experts:
            at += c
            continue
        tok, kpos = tok_all[at : at + c], kpos_all[at : at + c]
        at += c
        x = pad_rows(hidden_states[tok], MIN_ROWS)
        h = _gate(self, F.linear(x, self.gate_up_proj[e]))
        y = F.linear(h, self.down_proj[e])[:c]
        y = y * top_k_weights[tok, kpos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


ExpertsInterface.register(EXPERTS_IMPL, invariant_experts)


@contextlib.contextmanager
def model_implementations(model, attn_impl: str):
    """Route `model`'s attention through `attn_impl` and its HF experts through the engine's padded loop.

    The sampler uses its ENGINE_IMPL attention (over its KV cache, `rl4bit.sampler.kv_cache`); the trainer's
    logprob recompute uses its own cache-free copy of it. Experts always take the
    batch-invariant loop (EXPERTS_IMPL). Restores the model's settings on exit.
    """
    cfg = model.config
    saved = (cfg._attn_implementation, getattr(cfg, "_experts_implementation", None))
    cfg._attn_implementation = attn_impl
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = EXPERTS_IMPL
    try:
        yield
    finally:
        cfg._attn_implementation = saved[0]
        if hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = saved[1]
