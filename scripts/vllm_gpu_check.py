"""Does vLLM serve the trainer's NVFP4 experts on this GPU, and how fast beside the embedded engine?

Builds a random Qwen3-MoE, converts it with the nvfp4 recipe, exports it, and
serves it twice on one GPU: `VLLMEngine(experts="nvfp4")` and the embedded
engine over the same frozen QTensors. Reports which kernels vLLM picked, greedy
agreement, the logprob mismatch, rollout throughput, and the seconds and bytes
of a weight update (A -> B -> A, each checked against a fresh result).

    python scripts/vllm_gpu_check.py --size small --batch 64 --new 128 --out /tmp/vllm-check
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2),
    "small": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4),
    "1b": dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=768, num_hidden_layers=16,
               num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=4),
}


def build(size: str, seed: int, max_len: int, tail: float):
    """(converted trainer model on CUDA, plan) of a random Qwen3-MoE under the nvfp4 recipe."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model
    from rl4bit.trainer.tokenizer import build_tokenizer

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=len(build_tokenizer()), max_position_embeddings=max_len,
                               norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, **SIZES[size])
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:  # routers included (HF zeroes them): tokens spread over the experts
                p.normal_(0, 0.05 if "embed" not in name else 1.0)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    plan = convert_model(model, RecipeConfig(name="nvfp4", high_precision_tail=tail))
    return model.cuda().eval(), plan


def update_of(model, version: int):
    from rl4bit.sampler.types import WeightUpdate
    from rl4bit.trainer.surgery import quantized_weights

    q = quantized_weights(model)
    dense = {k: v for k, v in model.state_dict().items() if not any(k.startswith(m + ".") for m in q)}
    return WeightUpdate(version, dense), q


def nbytes(update, q) -> int:
    n = sum(t.numel() * t.element_size() for t in update.tensors.values())
    for params in q.values():
        for qt in params.values():
            n += sum(t.numel() * t.element_size() for t in (qt.data, qt.scale, qt.outer) if t is not None)
    return n


def digest(eng) -> dict:
    """(sum, abs sum) of every parameter and buffer vLLM's worker holds, by name ({} where unreachable)."""
    def sums(model):
        items = list(model.named_parameters()) + list(model.named_buffers())
        return {n: (float(t.float().sum()), float(t.float().abs().sum())) for n, t in items}
    try:
        return eng.llm.apply_model(sums)[0]
    except Exception as e:  # multiprocess: the function must pickle; the check goes on without it
        print("digest unavailable:", type(e).__name__, e, flush=True)
        return {}


def timed(fn, *args):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tail", type=float, default=1 / 6, help="recipe.high_precision_tail (MXFP8 last layers)")
    ap.add_argument("--skip-embedded", action="store_true", help="vLLM alone (e.g. its multiprocess transport)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import vllm

    from rl4bit.common.checkpoint_format import write_checkpoint
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams
    from rl4bit.sampler.vllm_engine import VLLMEngine
    from rl4bit.trainer.surgery import load_quantized, quantized_weights
    from rl4bit.trainer.tokenizer import build_tokenizer

    res: dict = dict(vllm=vllm.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                     args=vars(a))
    print(json.dumps(res), flush=True)
    max_len = a.prompt + a.new + 8
    out = Path(a.out or "/tmp/vllm-check")
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    (ma, plan), (mb, _) = build(a.size, 0, max_len, a.tail), build(a.size, 1, max_len, a.tail)
    export = write_checkpoint(out / "export-a", ma, plan, tokenizer=tok)
    eng, res["vllm_init_s"] = timed(lambda: VLLMEngine(export, experts="nvfp4", workdir=out / "w",
                                                       max_batch_size=a.batch, max_seq_len=max_len,
                                                       gpu_memory_utilization=0.35))
    res["transport"] = eng.transport
    res["served_formats"] = sorted({f"{e.fmt}->{eng.form.fmt[n]}" for n, e in eng.form.entries.items()})
    res["kernels"] = eng.kernels()
    print("vLLM kernels:", json.dumps(res["kernels"], indent=1), flush=True)

    g = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(4, len(tok), (a.prompt - 1,), generator=g).tolist() for _ in range(a.batch)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=a.new, ignore_eos=True)
    reqs = [Request(str(i), p, greedy) for i, p in enumerate(prompts)]
    warm = [Request(r.id, r.prompt_ids, dataclasses.replace(greedy, max_new_tokens=4)) for r in reqs]

    def rollout(engine, label):
        engine.generate(warm)
        rs, s = timed(engine.generate, reqs)
        errs = [r.error for r in rs if r.error]
        gen = sum(len(r.completion_ids) for r in rs)
        res[label] = dict(seconds=s, generated=gen, tok_s=gen / s, errors=errs[:3])
        print(f"{label}: {gen} tokens in {s:.3f} s = {gen / s:.0f} tok/s, {len(errs)} errors", flush=True)
        return rs

    va = rollout(eng, "vllm_nvfp4")

    emb = None
    if not a.skip_embedded:
        served = copy.deepcopy(ma)  # frozen serving mode from the trainer's own QTensors
        load_quantized(served, quantized_weights(served))
        emb = EmbeddedEngine(served, tok, max_batch_size=a.batch, device="cuda", max_seq_len=max_len,
                             autocast=torch.bfloat16)
        ea = rollout(emb, "embedded_nvfp4")
        same = sum(x.completion_ids == y.completion_ids for x, y in zip(va, ea))
        first = [next((i for i, (s, t) in enumerate(zip(x.completion_ids, y.completion_ids)) if s != t),
                      len(x.completion_ids)) for x, y in zip(va, ea)]
        d = []
        for r in va[:16]:  # the embedded engine scores vLLM's tokens: the sampler-vs-trainer-form mismatch
            lp = emb.score(r.prompt_ids, r.completion_ids)
            d += [abs(x - y) for x, y in zip(r.logprobs, lp)]
        res["agreement"] = dict(identical_greedy=f"{same}/{len(va)}", mean_first_divergence=sum(first) / len(first),
                                mean_abs_dlogprob=sum(d) / len(d), max_abs_dlogprob=max(d))
        print("agreement:", res["agreement"], flush=True)

    va8 = eng.generate(reqs[:8])  # greedy is batch-variant in vLLM: compare batches of one size
    before = digest(eng)
    ua0, qa0 = update_of(ma, 1)
    eng.update_weights(ua0, qa0)  # A -> A: a reload of the same weights must change nothing
    res["a_a"] = dict(same_greedy=all(x.completion_ids == y.completion_ids
                                      for x, y in zip(eng.generate(reqs[:8]), va8)),
                      changed=sorted(k for k, v in digest(eng).items() if before.get(k) != v)[:24])
    print("A->A:", res["a_a"], flush=True)
    ub, qb = update_of(mb, 2)
    res["update_bytes"] = nbytes(ub, qb)
    _, res["update_b_s"] = timed(eng.update_weights, ub, qb)
    vb = eng.generate(reqs[:8])
    ua, qa = update_of(ma, 3)
    _, res["update_a_s"] = timed(eng.update_weights, ua, qa)
    res["update_a_phases_s"] = dict(eng.update_seconds)
    va2 = eng.generate(reqs[:8])
    res["a_b_a"] = dict(b_differs=any(x.completion_ids != y.completion_ids for x, y in zip(vb, va8)),
                        a_restored=all(x.completion_ids == y.completion_ids for x, y in zip(va2, va8)),
                        a_restored_logprob_max_diff=max(abs(p - q) for x, y in zip(va2, va8)
                                                        for p, q in zip(x.logprobs, y.logprobs)))
    if emb is not None:
        _, res["embedded_update_s"] = timed(emb.update_weights, ub, qb)
    print(f"update ({eng.transport}): {res['update_bytes'] / 1e6:.1f} MB, vLLM {res['update_b_s']:.3f} / "
          f"{res['update_a_s']:.3f} s, embedded {res.get('embedded_update_s', float('nan')):.3f} s; "
          f"A->B->A {res['a_b_a']}; phases of the last, s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in res["update_a_phases_s"].items()), flush=True)
    (out / "result.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
