"""`rl4bit export CONFIG_OR_RUN --out DIR [--format compressed-tensors|hf]` and `rl4bit inspect DIR [--samples]`.

Two forms, one source (the trainer's own tensors):
- `compressed-tensors` (default): the quantized tensors as they are, for vLLM and rl4bit (`CT_CONSUMERS`);
- `hf`: a plain BF16 Hugging Face checkpoint (`rl4bit.export_hf`), for transformers, lm-eval-harness and PEFT
  (`HF_CONSUMERS`); exported from a run dir, its greedy accuracy on the run's eval split is printed beside the
  run's own (`--eval`; by default when the model is small enough to run on this machine quickly).
Both say at export, and `inspect` says again, which consumers read them.

export: a YAML config -> the model it builds (`rl4bit.trainer.models.build_model`,
seeded), converted by its recipe (`trainer.surgery.convert_model`); a run dir ->
the same, with the weights of its latest checkpoint (`rl4bit.common.checkpoint`,
tensors `model.<state-dict name>`) and its policy version; a model or recipe
setting (from config.yaml or `-o`) other than the checkpoint's job is refused.
Either way the quantized tensors written are the converted model's own forward
QTensors (`rl4bit.common.checkpoint_format.write_checkpoint`), with the job's tokenizer
(`rl4bit.trainer.tokenizer.build_tokenizer`: a `model.path` checkpoint's own, else the
character one) and the model's generation config (its eos ids).

inspect: per stored module, its format, bits per value, bytes, and the totals
against the same weights in BF16, as a rich table.

Leaves out: other dense dtypes than BF16.
"""

from __future__ import annotations

import json
from pathlib import Path

from rl4bit.common.checkpoint_format import INDEX, read_index
from rl4bit.common.ct_layout import EXPERT_PROJS

BITS = {"nvfp4": 4.5, "mxfp8": 8.25}
SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "weight")


def _build(cfg):
    from rl4bit.trainer.models import build_model
    from rl4bit.trainer.surgery import convert_model
    from rl4bit.trainer.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    model = build_model(cfg.model, len(tokenizer), cfg.run.seed)
    plan = convert_model(model, cfg.recipe)
    return model.eval(), plan, tokenizer


def _check_job(run_dir: Path, meta: dict, cfg) -> None:
    """CheckpointError naming each model or recipe setting in which `cfg` differs from the job that wrote the
    checkpoint (`trainer.resume_checks.job_differences`). The FP32 masters have the same shapes under every
    recipe, so a `-o recipe...` override would load and export quantized tensors the trainer's forward never used."""
    from rl4bit.common.checkpoint_format import CheckpointError
    from rl4bit.trainer.resume_checks import job_differences

    diffs = job_differences(meta.get("job"), cfg, label="export")
    if diffs:
        raise CheckpointError(f"{run_dir}: the latest checkpoint was trained with other settings than this export's "
                              f"({'; '.join(diffs)}), and its weights only fit that model and recipe. Export it "
                              "without -o overrides of these settings (and with config.yaml as the run wrote it); "
                              "for another recipe, train a run with it")


FORMATS = ("compressed-tensors", "hf")

EVAL_AUTO_PARAMS = 200_000_000
"""`--eval` unset: a run dir's hf export is evaluated when the model has fewer parameters than this (seconds on a
CPU for the quickstart's; a large model would take far longer than the export)."""


def main(source: str, out: str, overrides: list[str] | None = None, fmt: str = "compressed-tensors",
         evaluate: bool | None = None) -> int:
    """Export a config's model or a run dir's latest checkpoint; prints where it went and who reads it."""
    from rl4bit.common.checkpoint_format import write_checkpoint
    from rl4bit.config import ConfigError, load_config
    from rl4bit.export_hf import CT_CONSUMERS, HF_CONSUMERS, write_hf_checkpoint

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")

    src = Path(source)
    extra = {"source": str(src)}
    if not src.exists():
        raise FileNotFoundError(f"{source!r} does not exist: pass a YAML config (its model, quantized by its recipe) "
                                "or a run dir that `rl4bit train` wrote (its latest checkpoint)")
    if src.is_dir():
        if not (src / "config.yaml").is_file():
            raise FileNotFoundError(f"{src} is a directory without config.yaml: pass a run dir or a YAML config")
        from rl4bit.common.checkpoint import load_checkpoint

        cfg = load_config(src / "config.yaml", overrides)
        tensors, meta = load_checkpoint(src)
        _check_job(src, meta, cfg)
        model, plan, tokenizer = _build(cfg)
        sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
        missing = sorted(set(model.state_dict()) - set(sd))
        if missing:
            raise ValueError(f"{src}: the latest checkpoint lacks model tensors {missing[:3]}; "
                             "was it written with another model config?")
        model.load_state_dict(sd, strict=True)
        extra["policy_version"] = int(meta.get("trainer", {}).get("version", 0))
    else:
        cfg = load_config(src, overrides)
        model, plan, tokenizer = _build(cfg)
        extra["policy_version"] = 0
    extra["recipe"] = cfg.recipe.name
    if fmt == "hf":
        path = write_hf_checkpoint(out, model, plan, tokenizer, extra)
        print(f"exported a BF16 Hugging Face checkpoint of the {cfg.recipe.name} policy v{extra['policy_version']} "
              f"(its dequantized weights) to {path}\nread by: {HF_CONSUMERS}")
        params = sum(p.numel() for p in model.parameters())
        if src.is_dir() and (evaluate or (evaluate is None and params < EVAL_AUTO_PARAMS)):
            _report_accuracy(src, cfg, path)
        return 0
    extra["consumers"] = CT_CONSUMERS
    path = write_checkpoint(out, model, plan, tokenizer=tokenizer, extra=extra)
    print(f"exported {cfg.recipe.name} checkpoint (policy v{extra['policy_version']}) to {path}\n"
          f"read by: {CT_CONSUMERS}")
    return 0


def _report_accuracy(run_dir: Path, cfg, path: Path) -> None:
    """Print the hf export's greedy accuracy on the run's eval split beside the run's own last eval/accuracy."""
    import time

    from rl4bit.export_hf import greedy_accuracy
    from rl4bit.metrics import read_metrics
    from rl4bit.tasks import load_task

    _, eval_set = load_task(cfg.data, quiet=True)
    t0 = time.perf_counter()
    acc = greedy_accuracy(path, cfg, eval_set)
    if acc is None:
        print("eval: the run's eval split has no answers; no accuracy to compare")
        return
    own = [r for r in read_metrics(run_dir) if isinstance(r.get("eval/accuracy"), (int, float))]
    theirs = (f"{own[-1]['eval/accuracy']:.3f} at step {own[-1]['step']} (the run's own numerics)" if own
              else "none logged")
    print(f"eval: greedy accuracy on the run's {len(eval_set)} eval prompts: {acc:.3f} with transformers in BF16 "
          f"({time.perf_counter() - t0:.0f} s); the run's eval/accuracy: {theirs}")


def module_rows(path: str | Path) -> list[dict]:
    """[{module, format, bits, bytes, bf16_bytes}] per stored weight group, from the index and the shard headers."""
    from rl4bit.common.checkpoint_format import _header

    path = Path(path)
    index, entries, _ = read_index(path)
    sizes: dict[str, int] = {}
    for fname in index["metadata"]["shards"]:
        with open(path / fname, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            header, _ = _header(head + f.read(n), str(path / fname))
        sizes.update({k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items()})
    rows = []
    for e in entries:
        numel = 1
        for s in e.shape:
            numel *= int(s)
        if e.fused:  # per-expert tensors `{module}.{e}.{proj}.{suffix}`
            projs = EXPERT_PROJS[e.param]
            stored = sum(v for k, v in sizes.items() if k.startswith(e.module + ".")
                         and k[len(e.module) + 1:].split(".")[1:2] in ([p] for p in projs))
        elif e.fmt in BITS:
            stored = sum(sizes.get(f"{e.module}.{s}", 0) for s in SUFFIXES)
        else:
            stored = sizes.get(e.name, 0)
        fmt = e.fmt if e.fmt in BITS else "bf16"
        rows.append({"module": e.name, "format": fmt, "bits": 8 * stored / max(numel, 1), "bytes": stored,
                     "bf16_bytes": 2 * numel, "numel": numel})
    return rows


def inspect_main(path: str, samples: bool = False) -> int:
    """Print per-module format, bits/value, bytes, and totals against BF16, and who reads the export; with
    `samples`, a run dir's latest sample completions instead (`rl4bit.samples`)."""
    from rich.console import Console
    from rich.table import Table

    from rl4bit.export_hf import CT_CONSUMERS, MARKER

    path = Path(path)
    if samples:
        from rl4bit.samples import print_latest

        return print_latest(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory; pass the --out of an `rl4bit export`")
    if (path / MARKER).is_file():
        return _inspect_hf(path)
    if not (path / INDEX).is_file():
        raise FileNotFoundError(f"{path} holds no {INDEX}; is it an `rl4bit export` directory?")
    rows = module_rows(path)
    table = Table(title=f"{path}")
    for col, just in (("module", "left"), ("format", "left"), ("bits/value", "right"), ("bytes", "right"),
                      ("vs bf16", "right")):
        table.add_column(col, justify=just)
    for r in rows:
        table.add_row(r["module"], r["format"], f"{r['bits']:.2f}", f"{r['bytes']:,}",
                      f"{r['bytes'] / r['bf16_bytes']:.3f}x")
    table.add_section()
    for label, sel in (("quantized", lambda r: r["format"] in BITS), ("total", lambda r: True)):
        rs = [r for r in rows if sel(r)]
        if not rs:
            continue
        b, bf, n = sum(r["bytes"] for r in rs), sum(r["bf16_bytes"] for r in rs), sum(r["numel"] for r in rs)
        table.add_row(label, "", f"{8 * b / max(n, 1):.2f}", f"{b:,}", f"{b / bf:.3f}x")
    Console(width=140).print(table)
    layout = json.loads((path / "rl4bit_layout.json").read_text())
    print(f"recipe {layout.get('recipe', '?')}, policy v{layout.get('policy_version', '?')}, "
          f"source {layout.get('source', '?')}")
    print(f"form: compressed-tensors (quantized); read by: {layout.get('consumers', CT_CONSUMERS)}")
    return 0


def _inspect_hf(path: Path) -> int:
    """An `--format hf` export: its tensors (all BF16) counted from the safetensors headers, and who reads it."""
    from safetensors import safe_open

    info = json.loads((path / "rl4bit_export.json").read_text())
    numel, nbytes, dtypes = 0, 0, set()
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                numel += n
                dtypes.add(sl.get_dtype())
                nbytes += 2 * n if sl.get_dtype() in ("BF16", "F16") else 4 * n
    print(f"{path}: {numel:,} values, {nbytes:,} bytes, dtypes {', '.join(sorted(dtypes))}")
    print(f"recipe {info.get('recipe', '?')}, policy v{info.get('policy_version', '?')}, "
          f"source {info.get('source', '?')}")
    print(f"form: hf (plain BF16, {info.get('weights', '')}); read by: {info.get('consumers', '')}")
    return 0
