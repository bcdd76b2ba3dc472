"""The `rl4bit` command: train, parity, bench, export, inspect, config.

Each subcommand is a thin shell over one module; heavy imports (torch, ray)
happen inside the handlers so `rl4bit --help` is instant. A subcommand whose
feature has not been built says so and exits with status 2: no fake output.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHES = {
    "kernels": ("rl4bit.bench.kernels", "format kernels: us and GB/s against a device copy"),
    "ce": ("rl4bit.bench.ce", "compute efficiency: loss curves of bf16 / mxfp8 / nvfp4 and the CE gap"),
    "train": ("rl4bit.bench.train", "trainer tokens/s and peak memory per recipe"),
    "rollout": ("rl4bit.bench.rollout", "sampler tokens/s: NVFP4 vs BF16 weights vs HF generate"),
    "sync": ("rl4bit.bench.sync", "weight-sync bytes and seconds, NVFP4 vs BF16"),
    "comm": ("rl4bit.bench.comm", "expert-parallel dispatch/combine all-to-all"),
    "gemm": ("rl4bit.bench.gemm", "quantized GEMMs (NVFP4 decode/grouped, MXFP8 backward) vs cuBLAS BF16 and HBM"),
    "step": ("rl4bit.bench.step", "the RL step, nvfp4 vs mxfp8 vs bf16: sample/score/train/sync, peak memory"),
    "soak": ("rl4bit.bench.soak", "memory per step of a long run (flat after warm-up)"),
    "all": ("rl4bit.bench.all", "every bench above but comm/ce/soak, then one summary table against the baselines"),
}


class NotBuilt(Exception):
    """A feature whose issue has not landed yet."""


def _require(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            raise NotBuilt(f"{what} is not built yet ({module} does not exist in this version of rl4bit)") from None
        raise


def _overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--override", action="append", default=[], metavar="KEY=VALUE",
        help="override a config value, e.g. -o trainer.lr=1e-6 -o sampler.backend=embedded (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl4bit",
        description="RL post-training of LLMs on 4-bit numerics (NVFP4 forward, MXFP8 backward, exact-weight sync).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run an RL fine-tuning job",
                       description="Run an RL job from a YAML config; writes a run dir.")
    p.add_argument("config", nargs="?", help="YAML job file, e.g. configs/quickstart.yaml (not needed with --resume)")
    p.add_argument("--out", help="run directory (default runs/<name>-<timestamp>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _overrides(p)

    p = sub.add_parser("parity", help="reward parity of recipes (nvfp4 vs mxfp8 vs bf16)",
                       description="Run one job per recipe and seed; write parity.md, parity.png and parity.json.")
    p.add_argument("config")
    p.add_argument("--recipes", default="nvfp4,mxfp8,bf16")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out")
    _overrides(p)

    p = sub.add_parser("bench", help="benchmarks (each figure beside its ceiling or baseline)",
                       description="Benchmarks: " + "; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    p.add_argument("what", choices=list(BENCHES))
    p.add_argument("config", nargs="?", help="job config (step, soak; default configs/gpu-h200.yaml for step)")
    p.add_argument("--steps", type=int, help="RL steps (step, soak, all)")
    p.add_argument("--new-tokens", type=int, help="generated tokens a sequence (rollout, step, all)")
    p.add_argument("--batches", help="comma-separated batch sizes (rollout, all)")
    p.add_argument("--samples", type=int, help="samples a prompt: shared prefill vs one per sample (rollout)")
    p.add_argument("--sections", help="comma-separated sections of `all` (default: all of them)")
    p.add_argument("--recipes", help="comma-separated recipes, the first the reference (step; default "
                                     "nvfp4,mxfp8,bf16)")
    p.add_argument("--decode", action="store_true", help="the decode cases alone (gemm: NVFP4 against cuBLAS BF16)")
    p.add_argument("--no-vllm", action="store_true", help="leave out the vLLM columns (rollout)")
    p.add_argument("--memory-sites", type=int, help="N: the allocation sites holding the most memory after the "
                                                    "first step (step; records live blocks' stacks: slower)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda where a GPU is "
                                                     "visible, else cpu)")
    p.add_argument("--quick", action="store_true", help="small shapes, for smoke runs on a CPU")
    p.add_argument("--out", help="directory for plots and JSON results")
    _overrides(p)

    p = sub.add_parser("export", help="write a checkpoint: quantized for vLLM (default) or plain BF16 for transformers",
                       description="compressed-tensors (default): the quantized tensors, read by vLLM and rl4bit, not "
                                   "by plain transformers. hf: a plain BF16 Hugging Face checkpoint of the same "
                                   "weights (dequantized), read by transformers, lm-eval-harness, PEFT.")
    p.add_argument("source",
                   help="a config file (its model, quantized by its recipe) or a run dir (its latest checkpoint)")
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="compressed-tensors", choices=["compressed-tensors", "hf"],
                   help="compressed-tensors (vLLM; default) or hf (plain BF16 for transformers)")
    p.add_argument("--eval", action=argparse.BooleanOptionalAction, default=None,
                   help="hf from a run dir: greedy accuracy of the export on the run's eval split beside the run's "
                        "own (default: when the model is small)")
    _overrides(p)

    p = sub.add_parser("inspect", help="an export's formats, bits, bytes and readers; or a run's latest samples")
    p.add_argument("dir", help="an `rl4bit export` --out, or a run dir with --samples")
    p.add_argument("--samples", action="store_true", help="print the run dir's latest samples.jsonl record")

    p = sub.add_parser("config", help="print the fully resolved config and derived batch sizes")
    p.add_argument("config")
    _overrides(p)

    sub.add_parser("wheelhouse", help="vLLM and its offline dependencies as wheels for an air-gapped GPU node "
                   "(rl4bit wheelhouse --help; handled before this parser)")
    return parser


def cmd_config(args) -> int:
    from rl4bit.config import dump_yaml, load_config

    cfg = load_config(args.config, args.override)
    print(dump_yaml(cfg), end="")
    print("# derived")
    for k, v in cfg.derived().items():
        print(f"# {k}: {v}")
    return 0


def cmd_bench(args) -> int:
    import inspect

    from rl4bit.bench.common import resolve_device

    module, what = BENCHES[args.what]
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"rl4bit bench {args.what}: {e}", file=sys.stderr)
        return 2
    mod = _require(module, f"`rl4bit bench {args.what}` ({what})")
    kwargs = dict(device=device, quick=args.quick, out=args.out)
    params = inspect.signature(mod.run).parameters
    if args.batches:
        try:
            args.batches = [int(x) for x in args.batches.split(",")]
        except ValueError:
            print(f"rl4bit bench: --batches {args.batches!r}: give comma-separated batch sizes, e.g. 1,16,64",
                  file=sys.stderr)
            return 2
    for name in ("config", "steps", "new_tokens", "batches", "samples", "sections", "recipes", "memory_sites",
                 "override"):
        value = getattr(args, name)
        if value is None or value == []:
            continue
        if name not in params:
            print(f"rl4bit bench {args.what}: takes no {name} argument", file=sys.stderr)
            return 2
        kwargs[name] = value
    if args.decode:
        if "decode_only" not in params:
            print(f"rl4bit bench {args.what}: takes no decode argument (only `bench gemm --decode`)", file=sys.stderr)
            return 2
        kwargs["decode_only"] = True
    if args.no_vllm:
        if "vllm" not in params:
            print(f"rl4bit bench {args.what}: takes no --no-vllm (only `bench rollout`)", file=sys.stderr)
            return 2
        kwargs["vllm"] = False
    try:
        mod.run(**kwargs)
    except getattr(mod, "ERRORS", ()) as e:  # a bench's own failures, named by its module (`bench step`'s OOM)
        print(f"rl4bit bench {args.what}: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_train(args) -> int:
    if args.config is None and args.resume is None:
        print("rl4bit train: error: give a config (e.g. configs/quickstart.yaml) or --resume RUN_DIR", file=sys.stderr)
        return 2
    if args.config is not None and args.resume is not None:
        print(f"rl4bit train: error: a config ({args.config}) and --resume ({args.resume}) together: a resumed run "
              f"keeps its own config.yaml; drop the config, and change settings with -o key=value", file=sys.stderr)
        return 2
    if args.resume is not None and args.out is not None:
        print("rl4bit train: error: --out with --resume: a resumed run writes into its own run dir; drop --out",
              file=sys.stderr)
        return 2
    mod = _require("rl4bit.driver", "`rl4bit train` (the RL loop)")
    return mod.main(args.config, out=args.out, resume=args.resume, overrides=args.override)


def cmd_parity(args) -> int:
    mod = _require("rl4bit.parity", "`rl4bit parity` (reward parity runs)")
    return mod.main(args.config, recipes=args.recipes.split(","), seeds=args.seeds, out=args.out,
                    overrides=args.override)


def cmd_export(args) -> int:
    mod = _require("rl4bit.export", "`rl4bit export` (quantized checkpoints)")
    return mod.main(args.source, out=args.out, overrides=args.override, fmt=args.format, evaluate=args.eval)


def cmd_inspect(args) -> int:
    mod = _require("rl4bit.export", "`rl4bit inspect` (quantized checkpoints)")
    return mod.inspect_main(args.dir, samples=args.samples)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["wheelhouse"]:  # its own parser, --help included
        from rl4bit import wheelhouse

        return wheelhouse.main(argv[1:])
    args = build_parser().parse_args(argv)
    handler = {
        "config": cmd_config, "bench": cmd_bench, "train": cmd_train,
        "parity": cmd_parity, "export": cmd_export, "inspect": cmd_inspect,
    }[args.command]
    from rl4bit.config import ConfigError

    try:
        return handler(args)
    except NotBuilt as e:
        print(f"rl4bit {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        ckf = sys.modules.get("rl4bit.common.checkpoint_format")  # a CheckpointError only once a command loaded it
        known = (ConfigError, FileNotFoundError, FileExistsError) + ((ckf.CheckpointError,) if ckf else ())
        if not isinstance(e, known):
            raise
        print(f"rl4bit {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
