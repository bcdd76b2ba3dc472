"""`rl4bit bench ce`: compute efficiency (CE) of the nvfp4 recipe against mxfp8, as in the TML blog.

Trains the same small Qwen3-MoE-shaped language model (random init, same
seed, same data) under bf16, mxfp8 and nvfp4, plus the nvfp4 ablations
(four_over_six off, stochastic_requant off), on a generated corpus of
arithmetic lines ("37+485=522;", char level, operands seeded). Reports final
smoothed losses and, for each nvfp4 variant, the CE gap

    gap = 1 - s / S

where S is the run length and s the first step at which the MXFP8 run's
smoothed loss reaches the variant's final smoothed loss (s = S when it never
does: the variant is then at least as good as MXFP8 and the gap is <= 0; it is
reported as 0 with `reached: false`). Writes results.json and ce_curves.png
to `out`.

Leaves out: held-out evaluation (each batch is freshly generated, so the
training loss is an unbiased estimate of the test loss), several seeds,
learning-rate sweeps. The blog reports ~2% CE cost in pretraining.

    python -m rl4bit.bench.ce --quick --out /tmp/ce
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from rl4bit.bench.common import bench_parser, parse_bench_args
from rl4bit.common.atomic import atomic_write_bytes, atomic_write_text

ALPHABET = "0123456789+=;"
VOCAB = 32  # ALPHABET padded: lm_head stays BF16, any size works

VARIANTS = {
    # label: RecipeConfig overrides
    "bf16": dict(name="bf16"),
    "mxfp8": dict(name="mxfp8"),
    "nvfp4": dict(name="nvfp4"),
    "nvfp4 no 4/6": dict(name="nvfp4", four_over_six=False),
    "nvfp4 no SR requant": dict(name="nvfp4", stochastic_requant=False),
}

SIZES = {
    # name: (model config overrides, batch, seq, steps, lr)
    "quick": (dict(hidden_size=64, num_hidden_layers=6, moe_intermediate_size=32, num_experts=4), 4, 32, 60, 3e-3),
    "full": (dict(hidden_size=128, num_hidden_layers=6, moe_intermediate_size=128, num_experts=8), 16, 128, 600, 2e-3),
}


def arithmetic_batch(gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """[batch, seq + 1] token ids of ';'-separated "a+b=c" lines, operands uniform in 0..999."""
    rows = []
    for _ in range(batch):
        text = ""
        while len(text) < seq + 1:
            a, b = torch.randint(0, 1000, (2,), generator=gen).tolist()
            text += f"{a}+{b}={a + b};"
        rows.append([ALPHABET.index(c) for c in text[: seq + 1]])
    return torch.tensor(rows)


def model_config(overrides: dict):
    from transformers import Qwen3MoeConfig

    hidden = overrides["hidden_size"]
    return Qwen3MoeConfig(
        vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
        intermediate_size=4 * hidden, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, use_cache=False, tie_word_embeddings=False, **overrides,
    )


def train_curve(recipe_overrides: dict, size: str, steps: int, device: str, seed: int = 0,
                autocast: bool | None = None) -> list[float]:
    """Training losses, one per step, of one recipe (same init and data for every recipe)."""
    from transformers import AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, set_step

    overrides, batch, seq, _, lr = SIZES[size]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(overrides))
    convert_model(model, RecipeConfig(seed=seed, **recipe_overrides))
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    gen = torch.Generator().manual_seed(seed + 1)
    if autocast is None:  # BF16 autocast on GPUs; CPUs here have no fast BF16 GEMM, so FP32 compute there
        autocast = torch.device(device).type == "cuda"
    losses = []
    for step in range(steps):
        ids = arithmetic_batch(gen, batch, seq).to(device)
        set_step(model, step)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def smooth(losses: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(losses):
        acc += v
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def ce_gap(reference: list[float], variant: list[float]) -> dict:
    """1 - s/S: s = first step where the smoothed reference reaches the variant's final smoothed loss."""
    target = variant[-1]
    s = next((i + 1 for i, v in enumerate(reference) if v <= target), None)
    n = len(reference)
    return {"gap": 0.0 if s is None else 1.0 - s / n, "step": s if s is not None else n, "reached": s is not None}


def _plot(curves: dict, path: Path, title: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=label, lw=1.2)
    lo = min(min(c[len(c) // 4 :]) for c in curves.values())
    hi = max(c[len(c) // 4] for c in curves.values())
    ax.set_ylim(lo - 0.02 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (smoothed)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _results(size, steps, device, seed, window, raw, smoothed, seconds) -> dict:
    return {
        "size": size, "steps": steps, "device": device, "seed": seed, "smoothing_window": window,
        "compute": "bf16 autocast" if torch.device(device).type == "cuda" else "fp32",
        "final_loss": {k: v[-1] for k, v in smoothed.items()}, "seconds": seconds,
        "ce_gap_vs_mxfp8": {k: ce_gap(smoothed["mxfp8"], v) for k, v in smoothed.items() if k.startswith("nvfp4")},
        "losses": raw,
    }


def run(steps: int | None = None, quick: bool = False, out: str | None = None, device: str = "cpu",
        variants: list[str] | None = None, seed: int = 0) -> dict:
    """Train every variant, print the table, write results.json + ce_curves.png under `out`; returns the results."""
    size = "quick" if quick else "full"
    steps = steps or SIZES[size][3]
    variants = variants or list(VARIANTS)
    if "mxfp8" not in variants:
        variants = ["mxfp8", *variants]
    window = max(1, steps // 10)
    raw, smoothed, seconds = {}, {}, {}
    for label in variants:
        t0 = time.time()
        raw[label] = train_curve(VARIANTS[label], size, steps, device, seed)
        seconds[label] = time.time() - t0
        smoothed[label] = smooth(raw[label], window)
        print(f"{label:>20}: final smoothed loss {smoothed[label][-1]:.4f}  ({seconds[label]:.0f} s)", flush=True)
        results = _results(size, steps, device, seed, window, raw, smoothed, seconds)
        if out:  # after every run, so an interrupted bench keeps what it measured
            atomic_write_text(Path(out) / "results.json", json.dumps(results, indent=1))
    for label, g in results["ce_gap_vs_mxfp8"].items():
        note = "" if g["reached"] else " (MXFP8 never reached it: no measurable cost)"
        print(f"CE gap {label} vs mxfp8: {100 * g['gap']:.1f}%  (s={g['step']}, S={steps}){note}")
    if out:
        _plot(smoothed, Path(out) / "ce_curves.png", f"CE bench ({size}, {steps} steps, seed {seed})")
        print(f"wrote {Path(out) / 'results.json'} and {Path(out) / 'ce_curves.png'}")
    return results


def main(argv: list[str] | None = None) -> None:
    p = bench_parser("rl4bit.bench.ce", __doc__, out="directory for results.json and ce_curves.png",
                     quick="tiny model, 60 steps (a smoke run on a CPU: about 7 minutes on 2 cores; its CE gaps "
                           "move in steps of 1/60)")
    p.add_argument("--steps", type=int, help="override the run length")
    p.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    p.add_argument("--seed", type=int, default=0)
    a = parse_bench_args(p, argv)
    run(steps=a.steps, quick=a.quick, out=a.out, device=a.device, seed=a.seed,
        variants=a.variants.split(",") if a.variants else None)


if __name__ == "__main__":
    main()
