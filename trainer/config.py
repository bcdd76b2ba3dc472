"""The trainer's config sections: the model it builds (`ModelConfig`), its optimizer (`TrainerConfig`) and the
RL algorithm it runs (`RLConfig`).

YAML `model:`, `trainer:` and `rl:` map onto them (`rl4bit.config.JobConfig`); the recipe section is
`rl4bit.trainer.recipe.RecipeConfig`. Each `validate(path)` raises ConfigError naming the key path and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from rl4bit.common.config import ConfigError, positive


@dataclass
class ModelConfig:
    """Which model to train."""

    path: Optional[str] = None
    """Local Hugging Face checkpoint directory (config.json + safetensors). None: build `tiny` from scratch."""
    tiny: Literal["qwen3_moe", "olmoe", "qwen3"] = "qwen3_moe"
    """Architecture of the model built from scratch when `path` is None (tests, quickstart)."""
    hidden_size: int = 64
    """Hidden size of the built model (multiple of 32, the MXFP8 block)."""
    num_layers: int = 6
    """Decoder layers of the built model."""
    num_experts: int = 8
    """Experts per MoE layer of the built model."""
    experts_per_token: int = 2
    """Top-k routing of the built model."""
    expert_intermediate_size: int = 64
    """Expert MLP width of the built model (multiple of 32)."""
    num_heads: int = 4
    """Attention heads of the built model."""
    max_seq_len: int = 256
    """Longest prompt + completion the model serves, in tokens."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the non-quantized parts (attention, norms, embeddings, lm_head)."""
    invariant_kernels: bool = False
    """CUDA only: run the dense products and means of the trainer's and the samplers' forwards through
    fixed-reduction-order Triton kernels (`rl4bit.kernels.invariant`), so a sampled token's logprob is the same
    bits whatever batch computed it (cuBLAS picks kernels by row count). Measured on the H200: `mismatch/k3`
    exactly 0 (1.4e-5 without), sample phase 1.19x and train phase 1.11x slower in one short run; off by default
    until the full benchmarks are run with it. Needs the embedded sampler. No effect on the CPU, which is
    batch-invariant without it."""

    def validate(self, path: str) -> None:
        # Existence of `path` is checked where the model is loaded (rl4bit.trainer.models), not here:
        # a config for a cluster's checkpoint must validate on the laptop that edits it.
        if self.path is not None and not self.path.strip():
            raise ConfigError(f"{path}.path: empty; point it at a local HF checkpoint or set it to null to build "
                              "`tiny`")
        for name, mult in (("hidden_size", 32), ("expert_intermediate_size", 32)):
            v = getattr(self, name)
            if v <= 0 or v % mult:
                raise ConfigError(f"{path}.{name}: {v} must be a positive multiple of {mult} (NVFP4 blocks of 16, "
                                  "MXFP8 blocks of 32 along K)")
        positive(self, path, "num_layers", "num_experts", "experts_per_token", "num_heads", "max_seq_len")
        if self.experts_per_token > self.num_experts:
            raise ConfigError(f"{path}.experts_per_token: {self.experts_per_token} exceeds "
                              f"num_experts={self.num_experts}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"{path}.num_heads: {self.num_heads} does not divide hidden_size={self.hidden_size}")


@dataclass
class TrainerConfig:
    """The policy optimizer."""

    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    tokens_per_microbatch: int = 4096
    """Most tokens (prompt + completion, summed over sequences) in one forward/backward; at least one rollout
    (the longest prompt + sampler.max_new_tokens, checked when the job's prompts are known)."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N` or `auto` (cuda when available)."""
    max_nonfinite_steps: int = 3
    """Stop the job after this many consecutive steps with a NaN/Inf loss or gradient."""
    world_size: int = 1
    """Trainer ranks (processes; one GPU each on CUDA) sharding params, grads and AdamW state with FSDP2
    (`rl4bit.trainer_group`); 1 = the one-process Trainer."""
    expert_parallel: int = 1
    """Ranks the MoE experts are sharded over (all-to-all dispatch/combine): 1 (off) or trainer.world_size
    (the whole trainer group; EP groups smaller than the group are not supported)."""
    combine: Literal["rht_s2f6", "mxfp8", "bf16"] = "rht_s2f6"
    """Format of the expert-parallel combine all-to-all: rht_s2f6 (8.25 bits/value), mxfp8 (8.25), bf16
    (lossless under bf16 autocast; lossy when model.dtype=float32). The backward all-to-alls send BF16 whatever
    this is, so with model.dtype=float32 the gradients crossing ranks are rounded to BF16 too."""
    recompute: bool = False
    """Activation recomputation: keep only each decoder layer's input for the backward and re-run the layer's
    forward there (`rl4bit.trainer.recompute`). Less activation memory for about one more forward of compute;
    gradients are bitwise the same. Single-rank trainers only (not yet combined with FSDP2)."""

    def validate(self, path: str) -> None:
        if self.lr <= 0:
            raise ConfigError(f"{path}.lr: {self.lr} must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"{path}.betas: {self.betas} must be two numbers in [0, 1)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError(f"{path}: grad_clip and weight_decay must be >= 0")
        positive(self, path, "tokens_per_microbatch", "max_nonfinite_steps", "expert_parallel", "world_size")
        if self.expert_parallel not in (1, self.world_size):
            raise ConfigError(f"{path}.expert_parallel: {self.expert_parallel} with world_size={self.world_size}; "
                              f"expert parallelism spans the whole trainer group: set {path}.world_size="
                              f"{self.expert_parallel} or {path}.expert_parallel=1")
        if self.recompute and self.world_size > 1:
            raise ConfigError(f"{path}.recompute: not supported with world_size={self.world_size} yet (FSDP2 with "
                              f"recomputation is untested here); set {path}.recompute=false or {path}.world_size=1")
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"{path}.device: {self.device!r}; valid: auto, cpu, cuda, cuda:N")


@dataclass
class RLConfig:
    """The RL algorithm (GRPO with PPO-clip) and the batch vocabulary."""

    steps: int = 20
    """RL steps (one sample -> train -> sync round each)."""
    prompts_per_step: int = 16
    """Prompts sampled per step."""
    samples_per_prompt: int = 8
    """Completions per prompt (the GRPO group size)."""
    ppo_epochs: int = 1
    """Optimizer passes over each step's rollouts."""
    clip_eps: float = 0.2
    """PPO ratio clip epsilon."""
    kl_coef: float = 0.0
    """KL penalty to the frozen initial policy (0 = off, no reference model kept)."""
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    """Loss aggregation: mean over all tokens, or mean of per-sequence token means."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling cap on pi_train/pi_sampler. None: on (cap 2) only when the sampler is not
    bitwise-matched (vLLM)."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group std (GRPO); False keeps only centring (Dr. GRPO)."""

    def validate(self, path: str) -> None:
        positive(self, path, "steps", "prompts_per_step", "samples_per_prompt", "ppo_epochs")
        if self.clip_eps <= 0:
            raise ConfigError(f"{path}.clip_eps: {self.clip_eps} must be > 0")
        if self.kl_coef < 0:
            raise ConfigError(f"{path}.kl_coef: {self.kl_coef} must be >= 0")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ConfigError(f"{path}.tis_cap: {self.tis_cap} must be >= 1 or null")
