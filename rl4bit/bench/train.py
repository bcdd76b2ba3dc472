"""`rl4bit bench train`: trainer tokens/s, step time and peak memory per recipe, plus per-GEMM TFLOP/s.

A Qwen3-MoE-shaped model of about 1B parameters (random init, FP32 master
weights, AdamW, BF16 autocast) trains a few steps on random tokens under bf16,
mxfp8 and nvfp4, side by side in one process. Reported: tokens/s, step time,
the step-time ratio of each recipe to bf16 (target for nvfp4 on Hopper: <= 1.15,
an emulation overhead: sm_90 has no FP4 tensor cores), peak CUDA memory, and
each expert GEMM's forward and forward+backward TFLOP/s (useful FLOPs: 2*M*N*K
forward, 6*M*N*K forward+backward) against the measured BF16 and FP8 GEMM ceilings.

`--quick` runs a tiny model for two steps on whatever device is given (the CPU
smoke test); its figures mean nothing.

Leaves out: data loading, multi-GPU, activation checkpointing.

    python -m rl4bit.bench.train --device cuda --out /tmp/bench_train
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from rl4bit.bench.common import bench_parser, parse_bench_args, sync
from rl4bit.common.atomic import atomic_write_text
from rl4bit.kernels import deferred_checks

RECIPES = ("bf16", "mxfp8", "nvfp4")

SIZES = {
    # ~1.0B parameters: 16 layers x 32 experts x 3 x 1024 x 512 = 805M expert, plus attention and embeddings
    "1b": dict(model=dict(hidden_size=1024, num_hidden_layers=16, moe_intermediate_size=512, num_experts=32,
                          num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                          intermediate_size=2816, vocab_size=32768),
               batch=4, seq=2048, warmup=2, steps=5),
    "quick": dict(model=dict(hidden_size=64, num_hidden_layers=2, moe_intermediate_size=64, num_experts=4,
                             num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=128),
                  batch=2, seq=32, warmup=1, steps=2),
}


def _timeit(fn, device: str, reps: int) -> float:
    """Seconds per call (after one warm-up call)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def ceilings(device: str, quick: bool) -> dict:
    """Measured dense GEMM TFLOP/s: BF16 torch.mm, and FP8 rowwise torch._scaled_mm where CUDA has it."""
    n = 1024 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = {"bf16_tflops": 2 * n**3 / _timeit(lambda: a @ b, device, 3 if quick else 20) / 1e12}
    if torch.device(device).type == "cuda":
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()
        sa = torch.ones(n, 1, device=device)
        sb = torch.ones(1, n, device=device)
        fp8 = lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        out["fp8_tflops"] = 2 * n**3 / _timeit(fp8, device, 20) / 1e12
    return out


def gemm_table(size: dict, device: str, quick: bool) -> list[dict]:
    """Forward and forward+backward TFLOP/s of the two expert GEMMs per recipe, tokens spread evenly over experts."""
    m = size["model"]
    e, h, i, k = m["num_experts"], m["hidden_size"], m["moe_intermediate_size"], m["num_experts_per_tok"]
    rows = size["batch"] * size["seq"] * k
    counts = [rows // e] * e
    reps = 1 if quick else 3
    return [row for gemm, (n, kk) in {"gate_up": (2 * i, h), "down": (h, i)}.items()
            for row in _gemm_rows(gemm, n, kk, counts, device, reps)]


def _gemm_rows(gemm: str, n: int, kk: int, counts: list[int], device: str, reps: int) -> list[dict]:
    """One expert GEMM ([rows, kk] x [experts, n, kk]) timed under every recipe; its tensors are freed on return."""
    from rl4bit.trainer.qgemm import GemmSpec, grouped_gemm

    rows, e = sum(counts), len(counts)
    x = torch.randn(rows, kk, device=device, dtype=torch.bfloat16)
    w = (torch.randn(e, n, kk, device=device) * 0.02).requires_grad_()
    dy = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
    flops = 2 * rows * n * kk
    table = []
    for recipe in RECIPES:
        spec = GemmSpec(recipe)
        xg = x.clone().requires_grad_()
        with deferred_checks(host=True):  # the NaN/Inf flag read once, after the timing (the trainer: a micro-batch)
            fwd = _timeit(lambda: grouped_gemm(x, w.detach(), counts, spec), device, reps)
            both = _timeit(lambda: grouped_gemm(xg, w, counts, spec).backward(dy), device, reps)
        table.append({"gemm": gemm, "recipe": recipe, "M": rows, "N": n, "K": kk, "experts": e,
                      "fwd_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * both,
                      "fwd_tflops": flops / fwd / 1e12, "fwd_bwd_tflops": 3 * flops / both / 1e12})
    return table


def train_speed(recipe: str, size: dict, device: str) -> dict:
    """Tokens/s, step seconds and peak memory of `size['steps']` training steps under one recipe."""
    out = _train_steps(recipe, size, device)  # its model and optimizer are freed on return
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return out


def _train_steps(recipe: str, size: dict, device: str) -> dict:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, set_step

    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**size["model"], use_cache=False, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    convert_model(model, RecipeConfig(name=recipe))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    ids = torch.randint(0, cfg.vocab_size, (size["batch"], size["seq"]), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def step(i):
        set_step(model, i)
        # the quantize kernels' NaN/Inf flag read once a step, as the trainer reads it once a micro-batch: a read a
        # quantize is a host sync each, which the trainer does not make
        with deferred_checks(host=True):
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(size["warmup"]):
        step(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(size["steps"]):
        loss = step(size["warmup"] + i)
    sync(device)
    dt = (time.perf_counter() - t0) / size["steps"]
    return {"recipe": recipe, "params": params, "tokens_per_step": ids.numel(), "step_s": dt,
            "tokens_per_s": ids.numel() / dt, "loss": loss.item(),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def run(quick: bool = False, out: str | None = None, device: str = "cuda", recipes=RECIPES, gemms: bool = True) -> dict:
    """Run the speed bench; prints a table and writes results.json under `out`."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("bench train needs CUDA (use --quick --device cpu for a smoke run)")
    size = SIZES["quick" if quick else "1b"]
    results = {"size": "quick" if quick else "1b", "device": device,
               "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
               "ceilings": ceilings(device, quick), "train": [], "gemms": []}
    print(f"ceilings: {results['ceilings']}", flush=True)
    for recipe in recipes:
        r = train_speed(recipe, size, device)
        results["train"].append(r)
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "n/a"
        print(f"{recipe:>6}: {r['params'] / 1e9:.2f}B params, {r['tokens_per_s']:.0f} tok/s, "
              f"{r['step_s']:.3f} s/step, peak {mem}, loss {r['loss']:.3f}", flush=True)
    base = next((r["step_s"] for r in results["train"] if r["recipe"] == "bf16"), None)
    if base:
        results["step_ratio_vs_bf16"] = {r["recipe"]: r["step_s"] / base for r in results["train"]}
        print("step time / bf16:", {k: round(v, 2) for k, v in results["step_ratio_vs_bf16"].items()})
    if gemms:
        results["gemms"] = gemm_table(size, device, quick)
        for g in results["gemms"]:
            print(f"{g['gemm']:>8} {g['recipe']:>6} M={g['M']} N={g['N']} K={g['K']}: "
                  f"fwd {g['fwd_ms']:.2f} ms ({g['fwd_tflops']:.1f} TFLOP/s), "
                  f"fwd+bwd {g['fwd_bwd_ms']:.2f} ms ({g['fwd_bwd_tflops']:.1f} TFLOP/s)", flush=True)
    if out:
        atomic_write_text(Path(out) / "results.json", json.dumps(results, indent=1))
        print(f"wrote {Path(out) / 'results.json'}")
    return results


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("rl4bit.bench.train", __doc__, quick="tiny model, 2 steps: a smoke run, e.g. on a CPU")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--no-gemms", action="store_true", help="skip the per-GEMM table")
    a = parse_bench_args(p, argv)
    run(quick=a.quick, out=a.out, device=a.device, recipes=a.recipes.split(","), gemms=not a.no_gemms)


if __name__ == "__main__":
    main()
