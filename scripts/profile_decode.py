"""Where does a decode step's time go? Profiles the embedded engine's generate (bench 1B Qwen3-MoE, BF16 and NVFP4).

    python -P scripts/profile_decode.py --device cuda --batch 64 --new 16 [--temperature 1.0]

Prints per recipe the decode ms/step, the number of kernel launches and host syncs per decode step, and the
top ops by device time and by host time."""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from rl4bit.bench.rollout import build_model, served_model
from rl4bit.sampler.engine import EmbeddedEngine
from rl4bit.sampler.types import Request, SamplingParams


def kernel_table(prof, decode_steps: int, rows: int) -> None:
    """GPU kernels by total time, per decode step: calls a step, µs a step, µs a call (the prefill's calls are in
    the totals too: profile with many new tokens so that they weigh little)."""
    from torch.autograd import DeviceType

    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        t = by_name.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.elapsed_us()
    if not by_name:
        return
    total = sum(t[1] for t in by_name.values())
    steps = max(decode_steps, 1)
    print(f"GPU kernels: {total / steps:.0f} µs a decode step in {sum(t[0] for t in by_name.values()) / steps:.0f} "
          f"launches (prefill included)")
    print(f"{'µs/step':>9} {'calls/step':>10} {'µs/call':>8}  kernel")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:rows]:
        print(f"{us / steps:9.1f} {n / steps:10.2f} {us / n:8.2f}  {name[:90]}")


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--device", default="cuda")
    a.add_argument("--model", default="1b")
    a.add_argument("--batch", type=int, default=64)
    a.add_argument("--prompt", type=int, default=128)
    a.add_argument("--new", type=int, default=16)
    a.add_argument("--rows", type=int, default=25)
    a.add_argument("--graphs", default="auto",
                   help="decode steps: auto (cuda on a CUDA device), cuda (CUDA graphs), static, off")
    a.add_argument("--temperature", type=float, default=0.0, help="0: greedy; RL samples at 1.0")
    args = a.parse_args()
    model = build_model(args.model, args.prompt + args.new + 1, torch.bfloat16, args.device)
    prompts = torch.randint(1, model.config.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(0))
    reqs = [Request(str(i), r.tolist(), SamplingParams(temperature=args.temperature, max_new_tokens=args.new, seed=i))
            for i, r in enumerate(prompts)]
    for name, m in (("bf16", served_model(model, "bf16")), ("nvfp4", served_model(model, "nvfp4"))):
        eng = EmbeddedEngine(m, None, max_batch_size=args.batch, device=args.device,
                             max_seq_len=args.prompt + args.new + 1, max_prefill_tokens=args.batch * args.prompt,
                             decode_graphs=args.graphs)
        eng.generate([Request(r.id, r.prompt_ids, SamplingParams(max_new_tokens=3)) for r in reqs])  # compiles, graphs
        eng.prefill_s = eng.decode_s = 0.0
        eng.decode_steps = 0
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
        with profile(activities=acts) as prof:
            eng.generate(reqs)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        print(f"\n### {name}: prefill {eng.prefill_s:.3f} s, decode {eng.decode_s:.3f} s over {eng.decode_steps} steps "
              f"= {1e3 * eng.decode_s / max(eng.decode_steps, 1):.1f} ms/step")
        events = prof.key_averages()
        steps = max(eng.decode_steps + 1, 1)
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        syncs = sum(e.count for e in events if "Synchronize" in e.key)
        print(f"per step (prefill + decode steps = {steps}): {launches / steps:.0f} kernel launches, "
              f"{syncs / steps:.1f} host syncs")
        kernel_table(prof, eng.decode_steps, args.rows)
        key = "cuda_time_total" if args.device.startswith("cuda") else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.rows, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
