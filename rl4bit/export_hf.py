"""`rl4bit export RUN --format hf`: a plain BF16 Hugging Face checkpoint, and its greedy accuracy.

`write_hf_checkpoint(out, model, plan, tokenizer, extra)` takes the converted
(trainer) model and writes what transformers reads without any quantization
support: every quantized weight is the trainer's own QTensor decoded by
`rl4bit.kernels.dequantize` (fp32) and rounded to BF16, every other tensor
(FP32 master) rounded to BF16; a stock transformers model of the same config
receives them (`load_state_dict(strict=True)`: names as transformers expects)
and `save_pretrained` writes it, so the files use transformers' own names
(fused experts as it saves them), with no `quantization_config`. config.json
and generation_config.json carry the tokenizer's eos (and pad) ids. The
directory is written to a temporary sibling and renamed into place
(`rl4bit.common.atomic`), with `rl4bit_export.json` saying what it is and who reads it.

`greedy_accuracy(path, cfg, samples)`: the exported model loaded back with
`AutoModelForCausalLM.from_pretrained`, greedy completions of `samples`
(`prompt_ids` as the job sends them; prompts batched by length, so no padding
enters the forward), scored with `rewards.exact_match`.

Leaves out: other dtypes than BF16, sharding control (transformers' default),
merging LoRA adapters (rl4bit trains full weights).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from rl4bit.common.atomic import fsync_tree, replace_dir, temp_dir

MARKER = "rl4bit_export.json"
"""The file that makes a directory an rl4bit `--format hf` export (what it is, where it came from, who reads it)."""

HF_CONSUMERS = ("transformers (AutoModelForCausalLM.from_pretrained), lm-eval-harness's HF backend, PEFT, and vLLM "
                "or any other loader as a plain BF16 model: no quantization_config")
CT_CONSUMERS = ("vLLM (compressed-tensors quantization_config) and rl4bit itself; compressed-tensors decodes it as "
                "q * weight_scale / weight_global_scale. Not plain transformers: its compressed-tensors loader fails "
                "on MXFP8 experts and misses the NVFP4 global scale of fused experts; for transformers, "
                "lm-eval-harness or PEFT export with --format hf")


def hf_state_dict(model, plan: dict[str, str]) -> dict[str, torch.Tensor]:
    """The converted `model`'s weights as a stock transformers state dict in BF16: quantized weights are the
    trainer's QTensors dequantized (fp32) then rounded to BF16; the rest are its masters rounded to BF16."""
    from rl4bit.common.checkpoint_format import entry_value, model_layout
    from rl4bit.kernels import QTensor, dequantize

    sd, cache = {}, {}
    for e in model_layout(model, plan):
        value = entry_value(model, e, torch.bfloat16, cache)
        if isinstance(value, QTensor):
            value = dequantize(value, torch.bfloat16)
            value = value if e.fused else value.reshape(e.shape[1:])
        sd[e.name] = value.detach().to("cpu").contiguous()
    return sd


def write_hf_checkpoint(out: str | Path, model, plan: dict[str, str], tokenizer, extra: dict) -> Path:
    """Write the BF16 checkpoint of the converted `model` to `out` (new, empty or an earlier rl4bit export)."""
    from transformers import AutoModelForCausalLM

    from rl4bit.common.checkpoint_format import _check_out

    out = Path(out).resolve()
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sd = hf_state_dict(model, plan)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):  # a quantized model.path's: these weights are plain BF16
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # the init is overwritten; keep the caller's RNG as it was
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(sd, strict=True)
    plain.eval()
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "bos_token_id": tokenizer.bos_token_id}
    for name, value in ids.items():
        if value is not None or name == "eos_token_id":
            setattr(plain.config, name, value)
    gen = plain.generation_config
    gen.eos_token_id = _eos_ids(getattr(model, "generation_config", None), tokenizer.eos_token_id)
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    with temp_dir(out) as tmp:
        plain.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        info = {"format": "hf", "dtype": "bfloat16", "consumers": HF_CONSUMERS,
                "weights": "the trainer's dequantized weights (kernels.dequantize) rounded to BF16", **extra}
        (tmp / MARKER).write_text(json.dumps(info, indent=1) + "\n")
        fsync_tree(tmp)
        replace_dir(tmp, out)
    return out


def _eos_ids(gen, eos: int) -> int | list[int]:
    """The model's own generation eos ids (often a list: chat models end on several) with the tokenizer's."""
    have = getattr(gen, "eos_token_id", None) if gen is not None else None
    have = [] if have is None else ([have] if isinstance(have, int) else list(have))
    ids = have + [eos] if eos not in have else have
    return ids[0] if len(ids) == 1 else ids


def greedy_accuracy(path: str | Path, cfg, samples: list[dict]) -> float | None:
    """Exact-match accuracy of the exported model's greedy completions (sampler.max_new_tokens, stop strings, the
    job's chat_template), loaded back with transformers; None when a sample has no answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl4bit.rewards import exact_match
    from rl4bit.trainer.tokenizer import prompt_ids

    if not samples or any(s.get("answer") is None for s in samples):
        return None
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    by_len: dict[int, list[tuple[dict, list[int]]]] = {}
    for s in samples:
        ids = prompt_ids(tok, s["prompt"], cfg.data.chat_template)
        by_len.setdefault(len(ids), []).append((s, ids))
    hits = 0
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    with torch.no_grad():
        for n, group in by_len.items():
            for i in range(0, len(group), 64):
                chunk = group[i:i + 64]
                inp = torch.tensor([ids for _, ids in chunk])
                outs = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                      max_new_tokens=cfg.sampler.max_new_tokens)
                for (s, _), row in zip(chunk, outs[:, n:].tolist()):
                    cut = next((k for k, t in enumerate(row) if t in eos), len(row))
                    text = tok.decode(row[:cut], skip_special_tokens=True)
                    for stop in cfg.sampler.stop:
                        if stop in text:
                            text = text[: text.index(stop) + len(stop)]
                    hits += exact_match(s["prompt"], text, s["answer"])
    return hits / len(samples)
