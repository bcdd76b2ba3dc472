"""`rl4bit bench sync`: bytes and seconds per full weight sync, NVFP4 vs BF16, over Ray.

The same Qwen3-MoE (random init, seeded) is converted twice: recipe nvfp4 with
no high-precision tail (every expert weight NVFP4) and recipe bf16; each is
synced trainer -> one Ray receiver actor with `rl4bit.trainer.weight_sync.sync_ray`
(buckets of layers, SHA-256 per bucket, verify + stage + commit in place). A
sync is timed in two parts, each the median of `repeats` syncs: encode (the
sender quantizes its weights, i.e. the forward's QTensors, packs and hashes the
buckets) and transfer + apply (object store, verify, decode, copy in place);
bytes are the payload bytes sent, the BF16 baseline's dense weights in BF16.
Target (issue 5): expert bytes at most 0.30x BF16 (4.5 bits + scales vs 16),
seconds in proportion.

Leaves out: several receivers, NCCL broadcast timing (see weight_sync), GPU
receivers; with device="cuda" only the sender's model lives on the GPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def _shape(quick: bool) -> dict:
    if quick:
        return dict(hidden_size=128, num_hidden_layers=2, num_experts=8, moe_intermediate_size=128, vocab_size=256)
    return dict(hidden_size=512, num_hidden_layers=4, num_experts=16, moe_intermediate_size=256, vocab_size=1024)


def _config(quick: bool):
    from transformers import AutoConfig

    s = _shape(quick)
    return AutoConfig.for_model("qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                intermediate_size=2 * s["moe_intermediate_size"], num_experts_per_tok=2,
                                max_position_embeddings=128, tie_word_embeddings=False, **s)


def _model(recipe: str, quick: bool, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(quick))
    plan = convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0))
    return model.eval(), plan


def _receiver_factory(recipe: str, quick: bool):
    return lambda: _model(recipe, quick, seed=1)[0]


def _measure(ray, recipe: str, quick: bool, device: str, repeats: int) -> dict:
    import torch

    from rl4bit.trainer.weight_sync import WeightReceiver, WeightSender, sync_ray

    model, plan = _model(recipe, quick)
    model.to(device)
    sender = WeightSender(model, plan, bucket_bytes=(4 << 20) if quick else (32 << 20), dense_dtype=torch.bfloat16)
    expert_bytes = 0
    for b in sender.buckets(0):
        from safetensors.torch import load

        expert_bytes += sum(t.numel() * t.element_size() for k, t in load(b.payload).items() if ".mlp.experts." in k)
    actor = ray.remote(num_cpus=0)(WeightReceiver).remote(_receiver_factory(recipe, quick))
    ray.get(actor.serving_version.remote())  # the actor's model is built before timing
    encode, transfer, sent = [], [], 0
    for v in range(1, repeats + 1):
        t0 = time.perf_counter()
        buckets = list(sender.buckets(v))  # sender: quantize (the trainer forward's QTensors) + pack + SHA-256
        t1 = time.perf_counter()
        sent = sync_ray(sender, [actor], version=v, buckets=buckets)  # object store, verify, stage, apply
        encode.append(t1 - t0)
        transfer.append(time.perf_counter() - t1)
    ray.kill(actor)
    e, t = statistics.median(encode), statistics.median(transfer)
    return {"recipe": recipe, "bytes": sent, "expert_bytes": expert_bytes, "encode_s": e, "transfer_s": t,
            "seconds": e + t, "buckets": sender.num_buckets}


def run(device: str = "cpu", quick: bool = False, out: str | None = None, repeats: int = 3) -> dict:
    """Measure and print the NVFP4 vs BF16 sync table; returns the figures (also written to out/bench_sync.json)."""
    import ray
    from rich.console import Console
    from rich.table import Table

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = {r: _measure(ray, r, quick, device, repeats) for r in ("nvfp4", "bf16")}
    finally:
        if started:
            ray.shutdown()
    nv, bf = rows["nvfp4"], rows["bf16"]
    ratios = {k: nv[k] / bf[k] for k in ("bytes", "expert_bytes", "seconds", "encode_s", "transfer_s")}
    s = _shape(quick)
    table = Table(title=f"weight sync over Ray ({device}; Qwen3-MoE {s['num_hidden_layers']} layers x "
                        f"{s['num_experts']} experts, hidden {s['hidden_size']}, "
                        f"expert width {s['moe_intermediate_size']})")
    for col in ("recipe", "buckets", "expert bytes", "total bytes", "encode s", "transfer+apply s", "s / sync"):
        table.add_column(col, justify="right")
    for r in (nv, bf):
        table.add_row(r["recipe"], str(r["buckets"]), f"{r['expert_bytes']:,}", f"{r['bytes']:,}",
                      f"{r['encode_s']:.3f}", f"{r['transfer_s']:.3f}", f"{r['seconds']:.3f}")
    table.add_section()
    table.add_row("nvfp4 / bf16", "", f"{ratios['expert_bytes']:.3f}x", f"{ratios['bytes']:.3f}x",
                  f"{ratios['encode_s']:.3f}x", f"{ratios['transfer_s']:.3f}x", f"{ratios['seconds']:.3f}x")
    Console(width=140).print(table)
    result = {"device": device, "quick": quick, "shape": s, "rows": rows, "ratios": ratios,
              "target_expert_bytes_ratio": 0.30}
    if out is not None:
        from rl4bit.common.atomic import atomic_write_text

        atomic_write_text(Path(out) / "bench_sync.json", json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    run(quick=True)
