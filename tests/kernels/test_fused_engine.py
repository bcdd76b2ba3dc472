"""The embedded engine with the fused kernels on (norms, residual add + norm, q/k norm + RoPE, attention, router, MoE
combine): still batch-invariant, its scoring pass, its static decode forward (the CUDA graphs' tables) and the
trainer's logprob
recompute (with and without gradients) give the sampled logprobs bitwise, and the kernels are in effect.

CPU: TRITON_INTERPRET=1 (triton_setup) with the fused kernels enabled for CPU tensors; with CUDA the compiled
kernels on the GPU in the invariant mode (static decode there is the graphs' forward run eagerly). A converted model
(bf16 recipe under
BF16 autocast with FP32 masters, as the trainer holds it), so every fused path of `convert_model` runs.
"""

from __future__ import annotations

from triton_setup import DEVICE  # noqa: F401  (sets TRITON_INTERPRET before triton loads)

# isort: split

import contextlib
from unittest import mock

import torch

from rl4bit.kernels import (
    attention,
    attention_triton,
    combine_triton,
    fused,
    invariant,
    qk_rope_triton,
    rmsnorm_triton,
    router_triton,
)
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams


def _model(max_positions: int = 64):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = Qwen3MoeConfig(vocab_size=48, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=max_positions, pad_token_id=0,
                         eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 0.1).add_(1.0 if p.ndim == 1 else 0.0)
    convert_model(model, RecipeConfig(name="bf16"))
    return model.eval().to(DEVICE)


@contextlib.contextmanager
def _fused_kernels():
    """The fused kernels on for this test's device (CUDA: in the invariant mode too, since cuBLAS picks GEMM
    kernels by row count and batch invariance on the GPU needs the mode); the settings restored after. Yields
    the device type."""
    dev = torch.device(DEVICE).type
    saved, mode_was = fused.state(), invariant.enabled()
    fused.set_enabled(True, dev)
    if dev == "cuda":
        invariant.set_mode(True, "CUDA")
    try:
        yield dev
    finally:
        fused.set_enabled(saved is not None, saved or "cuda")
        if dev == "cuda" and not mode_was:
            invariant.set_mode(False)


def test_engine_with_fused_kernels_is_batch_invariant_and_scores_its_samples():
    from rl4bit.trainer.actor import sequence_logprobs

    # not 1 (a division by 1 is exact in any form): on CUDA, dividing by a Python float multiplies by its
    # reciprocal while the sampler's per-row temperatures divide, and the recompute missed the samples by a
    # bit before `sampling.temperature_scaled` (twenty-third session)
    temperature = 0.7

    torch.set_num_threads(1)
    model = _model()
    g = torch.Generator().manual_seed(5)
    reqs = [Request(str(i), torch.randint(1, 48, (3 + 2 * i,), generator=g).tolist(),
                    SamplingParams(temperature=temperature, seed=i, max_new_tokens=4)) for i in range(4)]
    spies = [mock.patch.object(m, n, wraps=getattr(m, n)) for m, n in
             ((rmsnorm_triton, "rms_norm"), (qk_rope_triton, "qk_norm_rope"), (combine_triton, "combine"),
              (attention_triton, "attention"), (router_triton, "route_topk"), (rmsnorm_triton, "add_rms_norm"))]
    with _fused_kernels() as dev:
        with spies[0] as norms, spies[1] as ropes, spies[2] as combines, spies[3] as attentions, spies[4] as routers, \
                spies[5] as add_norms:
            engine = EmbeddedEngine(model, None, max_batch_size=4, autocast=torch.bfloat16,
                                    max_seq_len=32, device=DEVICE, decode_graphs="off")
            alone = [engine.generate([r])[0] for r in reqs]
            together = engine.generate(reqs[::-1])[::-1]
            scores = [engine.score(r.prompt_ids, r.completion_ids, temperature) for r in together]
            static = EmbeddedEngine(model, None, max_batch_size=4, autocast=torch.bfloat16,
                                    max_seq_len=32, device=DEVICE, decode_graphs="static").generate(reqs)
            prompts, completions = [r.prompt_ids for r in together], [r.completion_ids for r in together]
            with torch.autocast(dev, torch.bfloat16), torch.no_grad():
                recomputed = sequence_logprobs(model, prompts, completions, temperature, 32)[0]
            with torch.autocast(dev, torch.bfloat16), torch.enable_grad():  # the training forward
                trained = sequence_logprobs(model, prompts, completions, temperature, 32)[0]
            with mock.patch.object(attention, "reference", wraps=attention.reference) as backwards:
                trained[0].sum().backward()  # through the fused attention's backward
        assert all(s.call_count for s in (norms, ropes, combines, attentions, routers, add_norms))
    for a, b in zip(alone, together):
        assert (a.completion_ids, a.logprobs) == (b.completion_ids, b.logprobs), a.request_id
    for a, b in zip(static, together):
        assert (a.completion_ids, a.logprobs) == (b.completion_ids, b.logprobs), a.request_id
    for r, s, x, y in zip(together, scores, recomputed, trained):
        assert s == r.logprobs, r.request_id
        assert x.tolist() == r.logprobs and y.tolist() == r.logprobs, r.request_id
    assert backwards.call_count == 2  # each layer's fused attention differentiated (the engine precast the
    # model's projection weights to BF16 buffers, so the gradient reaches the norms and embeddings, not them)


def test_decode_steps_split_over_key_chunks_give_the_unsplit_bits():
    """Contexts past KEY_CHUNK: the static decode forward (the CUDA graphs' tables, which split each row's keys
    over programs) samples the same tokens and logprobs as op-by-op decode (one program a row) and as the
    trainer's recompute."""
    from rl4bit.kernels.attention_triton import KEY_CHUNK
    from rl4bit.trainer.actor import sequence_logprobs

    torch.set_num_threads(1)
    model = _model(max_positions=KEY_CHUNK + 64)
    g = torch.Generator().manual_seed(6)
    reqs = [Request(str(i), torch.randint(1, 48, (KEY_CHUNK + 5 - 7 * i,), generator=g).tolist(),
                    SamplingParams(temperature=1.0, seed=i, max_new_tokens=3)) for i in range(2)]
    with _fused_kernels() as dev:
        runs = {}
        for mode in ("off", "static"):
            engine = EmbeddedEngine(model, None, max_batch_size=2, autocast=torch.bfloat16,
                                    max_seq_len=KEY_CHUNK + 32, device=DEVICE, decode_graphs=mode)
            with mock.patch.object(attention_triton, "attention", wraps=attention_triton.attention) as calls:
                runs[mode] = engine.generate(reqs)
            split = [c.kwargs.get("key_chunks", 0) for c in calls.call_args_list]
            assert (max(split) > 1) == (mode == "static"), (mode, split)  # static: the decode steps split
        prompts, completions = [r.prompt_ids for r in reqs], [r.completion_ids for r in runs["off"]]
        with torch.autocast(dev, torch.bfloat16), torch.no_grad():
            recomputed = sequence_logprobs(model, prompts, completions, 1.0, KEY_CHUNK + 32)[0]
    for a, b, x in zip(runs["off"], runs["static"], recomputed):
        assert (a.completion_ids, a.logprobs) == (b.completion_ids, b.logprobs), a.request_id
        assert x.tolist() == a.logprobs, a.request_id


def test_padding_rows_ride_on_row_0s_experts_and_real_rows_keep_their_bits():
    """The engine pads each forward to MIN_ROWS rows (and each static decode forward to its bucket); with the fused
    router the padding rows take row 0's experts (`trainer.padding`), so an MoE layer's experts see no expert that
    only padding picked; the completions and logprobs equal those of the same engine with padding left unmarked
    (what the router did before), op by op and in the static decode forward."""
    from rl4bit.trainer import padding

    torch.set_num_threads(1)
    model = _model()
    g = torch.Generator().manual_seed(7)
    reqs = [Request(str(i), torch.randint(1, 48, (4 + 3 * i,), generator=g).tolist(),
                    SamplingParams(temperature=1.0, seed=i, max_new_tokens=3)) for i in range(2)]
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        seen.append(args[1].detach().cpu().clone())  # top_k_index [rows, k]

    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    with _fused_kernels(), contextlib.ExitStack() as hooks:
        for m in experts:
            hooks.callback(m.register_forward_pre_hook(record, with_kwargs=True).remove)
        runs = {}
        for mode in ("off", "static"):
            engine = EmbeddedEngine(model, None, max_batch_size=2, autocast=torch.bfloat16,
                                    max_seq_len=32, device=DEVICE, decode_graphs=mode)
            seen.clear()
            runs[mode] = engine.generate(reqs[:1])  # one sequence: every forward has padding rows
            assert seen and all(idx.shape[0] == engine.min_rows for idx in seen)
            prompt_len = len(reqs[0].prompt_ids)
            for i, idx in enumerate(seen):  # each layer's first call is the prefill (prompt_len real rows)
                real = prompt_len if i < len(experts) else 1
                assert (idx[real:] == idx[0]).all(), (mode, i, idx)
            with padding.ignored():
                seen.clear()
                runs[mode + " unmarked"] = engine.generate(reqs[:1])
            assert any((idx[1:] != idx[0]).any() for idx in seen[len(experts):])  # unmarked decode padding rows
            # go elsewhere (else this test could not fail)
            runs[mode + " batch"] = engine.generate(reqs)
    want = runs["off unmarked"][0]
    for name, got in runs.items():
        assert (got[0].completion_ids, got[0].logprobs) == (want.completion_ids, want.logprobs), name
