"""Build the policy model: a tiny Hugging Face model from `ModelConfig`, or a local checkpoint.

`build_model(model_cfg, vocab_size, seed)` returns a transformers causal LM in
`model_cfg.dtype`: with `model_cfg.path` it loads that local checkpoint (no
downloads; `checkpoint_problems` first checks its config against the recipe's
blocks, the tokenizer and `model.max_seq_len`); otherwise it builds
`model_cfg.tiny` (Qwen3-MoE by default, OLMoE, or dense Qwen3) from the
config's sizes with weights drawn from `seed`, so two processes (trainer and
sampler actors) build identical models.

Leaves out: the numerics recipe (applied afterwards by
`rl4bit.trainer.surgery.convert_model`) and tokenizer resizing for loaded
checkpoints (`rl4bit.trainer.tokenizer.build_tokenizer` loads the checkpoint's own).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl4bit.trainer.config import ModelConfig
from rl4bit.trainer.recipe import RecipeConfig
from rl4bit.trainer.surgery import convert_model
from rl4bit.trainer.tokenizer import build_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def tiny_config(model_cfg: ModelConfig, vocab_size: int, pad_token_id: int = 0):
    """The transformers config of the `tiny` model described by `model_cfg`."""
    from transformers import OlmoeConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=model_cfg.hidden_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_heads,
        max_position_embeddings=model_cfg.max_seq_len,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
    )
    if model_cfg.tiny == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=model_cfg.hidden_size // model_cfg.num_heads,
            intermediate_size=2 * model_cfg.expert_intermediate_size,
            moe_intermediate_size=model_cfg.expert_intermediate_size,
            num_experts=model_cfg.num_experts,
            num_experts_per_tok=model_cfg.experts_per_token,
            norm_topk_prob=True,
        )
    if model_cfg.tiny == "olmoe":
        return OlmoeConfig(
            **common,
            intermediate_size=model_cfg.expert_intermediate_size,
            num_experts=model_cfg.num_experts,
            num_experts_per_tok=model_cfg.experts_per_token,
        )
    return Qwen3Config(
        **common,
        head_dim=model_cfg.hidden_size // model_cfg.num_heads,
        intermediate_size=model_cfg.expert_intermediate_size,
    )


def checkpoint_problems(hf_cfg, model_cfg: ModelConfig, vocab_size: int) -> list[str]:
    """What keeps a loaded checkpoint's config (`hf_cfg`) from running this job: the recipe's blocks of 32 along
    the expert GEMMs' K dims, the tokenizer's ids, `model.max_seq_len`. The `model.*` shape fields describe the
    built `tiny` model only; a checkpoint's own config gives its shapes."""
    problems = []
    hidden = getattr(hf_cfg, "hidden_size", None)
    experts = getattr(hf_cfg, "num_experts", None) or getattr(hf_cfg, "num_local_experts", None)
    inter = getattr(hf_cfg, "moe_intermediate_size", None) or getattr(hf_cfg, "intermediate_size", None)
    for name, v in (("hidden_size", hidden), ("the experts' intermediate size", inter if experts else None)):
        if v is not None and v % 32:
            problems.append(f"{name} {v} is not a multiple of 32 (the MXFP8 block the recipe quantizes along)")
    vocab = getattr(hf_cfg, "vocab_size", None)
    if vocab is not None and vocab < vocab_size:
        problems.append(f"its vocab_size {vocab} is smaller than its tokenizer's {vocab_size} ids; save the "
                        f"tokenizer that belongs to this model")
    ctx = getattr(hf_cfg, "max_position_embeddings", None)
    if ctx is not None and model_cfg.max_seq_len > ctx:
        problems.append(f"model.max_seq_len={model_cfg.max_seq_len} is past its max_position_embeddings {ctx}; "
                        f"lower model.max_seq_len")
    return problems


def build_model(model_cfg: ModelConfig, vocab_size: int, seed: int):
    """A causal LM in `model_cfg.dtype`, in eval mode, on the CPU (callers move it)."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[model_cfg.dtype]
    if model_cfg.path is not None:
        path = str(Path(model_cfg.path).expanduser())
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"model.path: {model_cfg.path!r} is not a directory; point it at a local Hugging Face checkpoint "
                "(config.json + safetensors) or set model.path to null to build the tiny model"
            )
        from transformers import AutoConfig

        problems = checkpoint_problems(AutoConfig.from_pretrained(path, local_files_only=True), model_cfg, vocab_size)
        if problems:
            raise ValueError(f"model.path {model_cfg.path!r}: " + "; ".join(problems))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    else:
        cfg = tiny_config(model_cfg, vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(cfg)
        model = model.to(dtype)
    model.eval()
    return model


def autocast_dtype(model_cfg) -> torch.dtype | None:
    """The autocast dtype trainer and embedded samplers both run the policy's forward under: BF16 for
    `model.dtype: bfloat16` (the converted model holds FP32 masters; `rl4bit.trainer.surgery`), None (no
    autocast) for float32. One function, so the two sides cannot disagree on the compute dtype."""
    return torch.bfloat16 if model_cfg.dtype == "bfloat16" else None


def build_policy_model(model: ModelConfig, recipe: RecipeConfig, seed: int):
    """The model as trainer and samplers hold it: `build_model` then the recipe conversion.

    `rl4bit.trainer.surgery.convert_model` swaps in the quantized modules of
    `recipe` (every recipe, bf16 included, so all share one code path) and
    makes the parameters FP32 master weights; names are unchanged, so a
    state dict moves between trainer and samplers as is.
    """
    policy = build_model(model, len(build_tokenizer(model)), seed)
    convert_model(policy, recipe)
    return policy
