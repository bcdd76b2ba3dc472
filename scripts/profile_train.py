"""Where does an RL train step's time go, per recipe? Device time by kernel family, and the host side.

    source scripts/device_env.sh && python3 -P scripts/profile_train.py [--recipes nvfp4,bf16] [--new 64]

Builds the bench job's Trainer (`configs/gpu-h200.yaml`, random init), a synthetic TrainBatch of `--seqs`
rollouts (prompt 12 tokens, `--new` completion tokens), runs two untimed train steps (compiles, allocator),
then one under torch.profiler. Prints per recipe the step's wall time, its device time by kernel family (NVFP4
GEMM, MXFP8 GEMMs, format kernels, cuBLAS/cutlass GEMMs, attention, elementwise/other), the top kernels, and the
host side (sync-like calls, top ops by self host time; `--cprofile`: Python functions by host time).
`--sites`: records Python stacks too and charges each kernel's device time (on the CPU: each op's own time) to
the line of this repository that issued its op, so the elementwise glue reads as source lines.

Leaves out: the sampler and weight sync (`profile_decode.py`, `bench step`)."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rl4bit.config import load_config, trainer_args
from rl4bit.trainer.actor import TrainBatch, Trainer

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpu-h200.yaml"
REPO_DIRS = ("/kernels/", "/trainer/", "/sampler/", "/rl4bit/")
"""Path parts that mark a stack frame as this repository's (the installed package and the checkout)."""
FAMILIES = (("nvfp4 grouped GEMM", ("_nvfp4_grouped", "_predecode", "_tile_map")),
            ("mxfp8 GEMMs", ("_mx_rows", "_mx_wgrad")),
            ("format kernels", ("_nvfp4_kernel", "_mxfp8_", "_requant", "_s2f6")),
            ("cuBLAS / cutlass GEMM", ("gemm", "sm90_", "cutlass", "nvjet", "cublas")),
            ("softmax / log_softmax", ("softmax",)),
            ("reductions", ("reduce",)))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "elementwise / other"


def _site(evt) -> str:
    """The innermost frame of this repository in the Python stack that issued evt, e.g.
    `trainer/qgemm.py(231): _pad_rows` (the profiler records frames as the op's enclosing python_function
    events, or in older releases as the op's `stack`); else the nearest enclosing autograd node's name."""
    node = None
    e = evt.cpu_parent
    frames = list(evt.stack or ())
    while e is not None:
        frames.append(e.name)
        frames.extend(e.stack or ())
        if node is None and ("Backward" in e.name or e.name.startswith("autograd::")):
            node = e.name
        e = e.cpu_parent
    mine = _mine(frames)
    if not mine:
        return node or "?"
    via = next((f for f in mine[1:] if not f.startswith("kernels/")), None)  # the trainer's line that called it
    return mine[0] if via is None or not mine[0].startswith("kernels/") else f"{mine[0]} <- {via}"


def _mine(frames: list[str]) -> list[str]:
    """The frames of this repository among `frames`, innermost first, as `dir/file.py(line): function`."""
    out = []
    for frame in frames:
        part = next((p for p in REPO_DIRS if p in frame and ".py(" in frame), None)
        if part is not None:
            out.append(part.lstrip("/") + frame.split(part, 1)[1])
    return out


def sites(events, waits: bool = False) -> list[tuple[tuple[str, str], list[float]]]:
    """[((source line, op), [µs, launches])] sorted by time: each op's kernels' device time (an op without
    kernels: its own host time, the CPU's case), charged to the repository line that issued it (`_site`).
    Only leaf-most ops count: an op's time is not charged again to the op that called it.
    waits: instead the host's synchronize calls (the op is the one that waited, e.g. aten::item's)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in events:
        if evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        if waits:
            if "Synchronize" not in evt.name:
                continue
            op, us, n = (evt.cpu_parent or evt).name, evt.cpu_time_total, 1
        elif evt.kernels:
            op, us, n = evt.name, sum(k.duration for k in evt.kernels), len(evt.kernels)
        elif not evt.cpu_children and evt.name.startswith("aten::"):
            op, us, n = evt.name, evt.self_cpu_time_total, 1
        else:
            continue
        slot = out[(_site(evt), op)]
        slot[0] += us
        slot[1] += n
    return sorted(out.items(), key=lambda kv: -kv[1][0])


def batch(vocab: int, seqs: int, new: int) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (seqs, 12), generator=g).tolist()
    comps = torch.randint(3, vocab, (seqs, new), generator=g).tolist()
    return TrainBatch(prompts, comps, [[-1.0] * new for _ in comps], [(-1.0) ** i for i in range(seqs)])


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--recipes", default="nvfp4,bf16")
    a.add_argument("--seqs", type=int, default=256)
    a.add_argument("--new", type=int, default=64)
    a.add_argument("--rows", type=int, default=15)
    a.add_argument("--cprofile", action="store_true",
                   help="also run one step under cProfile and print the top functions by cumulative host time "
                        "(meaningful on the GPU, where kernels run asynchronously)")
    a.add_argument("--sites", action="store_true",
                   help="also print the repository source lines whose ops took the most device time (with_stack)")
    a.add_argument("-o", "--override", action="append", default=[])
    args = a.parse_args()
    for recipe in args.recipes.split(","):
        cfg = load_config(CONFIG, ["run.warmup_sft_steps=0", "ray.mode=local", f"recipe.name={recipe}",
                                   *args.override])
        trainer = Trainer(**trainer_args(cfg))
        trainer.setup_rl()
        b = batch(len(trainer.tokenizer), args.seqs, args.new)
        for _ in range(2):
            trainer.train_step(b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.sites) as prof:
            t0 = time.perf_counter()
            trainer.train_step(b)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels)
        by = defaultdict(float)
        for e in kernels:
            by[family(e.key)] += e.self_device_time_total
        print(f"\n### {recipe}: train step {wall:.3f} s wall, {total / 1e6:.3f} s device")
        for fam, us in sorted(by.items(), key=lambda kv: -kv[1]):
            print(f"  {fam:<26}{us / 1e6:>9.3f} s  {100 * us / total:>5.1f}%")
        print(f"  top {args.rows} kernels:")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.rows]:
            print(f"  {e.self_device_time_total / 1e3:>10.1f} ms  {e.count:>6}x  {e.key[:90]}")
        ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        syncs = sum(e.count for e in ops if "Synchronize" in e.key or e.key == "aten::_local_scalar_dense")
        print(f"  host: {syncs} sync-like calls (synchronize / host reads of a value); "
              f"top {args.rows} ops by self host time:")
        for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[: args.rows]:
            print(f"  {e.self_cpu_time_total / 1e3:>10.1f} ms  {e.count:>6}x  {e.key[:90]}")
        if args.sites:
            print(f"  top {2 * args.rows} source lines by the device time of the ops they issued:")
            for (line, op), (us, n) in sites(prof.events())[: 2 * args.rows]:
                print(f"  {us / 1e3:>10.1f} ms  {n:>6}x  {op[:32]:<32}  {line}")
            print(f"  top {args.rows} source lines by the host's waits for the device (stream/device synchronize):")
            for (line, op), (us, n) in sites(prof.events(), waits=True)[: args.rows]:
                print(f"  {us / 1e3:>10.1f} ms  {n:>6}x  {op[:32]:<32}  {line}")
        if args.cprofile:
            torch.cuda.synchronize()
            prof_py = cProfile.Profile()
            prof_py.enable()
            trainer.train_step(b)
            torch.cuda.synchronize()
            prof_py.disable()
            print(f"  cProfile ({recipe}): top {3 * args.rows} functions by cumulative host time")
            stats = pstats.Stats(prof_py)
            stats.sort_stats("cumulative").print_stats(3 * args.rows)
            stats.sort_stats("tottime").print_stats(2 * args.rows)
        del trainer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
