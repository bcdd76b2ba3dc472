"""The training numerics recipe: which format each GEMM of the model runs in.

`RecipeConfig` is the typed config (YAML `recipe:` maps onto it). It is
dependency-free (dataclasses only) so `rl4bit.config` can import it cheaply;
the per-module plan that applies it to a model lives in `rl4bit.trainer.plan`.

Recipes (spec: the recipe table in shared/docs/numerics.md):
  bf16   every GEMM in the model's compute dtype (the reference).
  mxfp8  the in-scope GEMMs MXFP8 (E4M3 + E8M0 per 32) forward and backward.
  nvfp4  the in-scope GEMMs NVFP4 forward (activations per-token outer + 4/6,
         weights per-expert outer), MXFP8 backward with the saved NVFP4 tensors
         stochastically re-quantized; the last `high_precision_tail` of the
         layers run the mxfp8 recipe instead.

Leaves out: BF16 tails (the tail is MXFP8, as in the blog), RHT on wgrad.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

RECIPES = ("bf16", "mxfp8", "nvfp4")
SCOPES = ("experts", "all_linear")
GRAD_ROUNDINGS = ("nearest", "stochastic")


@dataclass
class RecipeConfig:
    name: str = "nvfp4"
    """Which recipe: "bf16" | "mxfp8" | "nvfp4" (see the module docstring)."""

    four_over_six: bool = True
    """nvfp4: pick the 4- or 6-scaled block encoding by MSE for activations (Cook et al.); weights never use it."""

    stochastic_requant: bool = True
    """nvfp4: the backward re-quantizes saved NVFP4 tensors to MXFP8 with stochastic rounding (unbiased); False =
    nearest (biased; ablation)."""

    weight_tiles_16x16: bool = False
    """nvfp4: weight block scales per 16x16 tile (NVIDIA's W/Wᵀ-consistent variant) instead of 1x16 (ablation)."""

    high_precision_tail: float = 1 / 6
    """nvfp4: fraction of the LAST decoder layers whose quantized GEMMs run MXFP8 instead; floor(n_layers * fraction +
    1/2) layers (half rounds up), in [0, 1]."""

    scope: str = "experts"
    """Which GEMMs are quantized: "experts" (MoE expert GEMMs only) or "all_linear" (also attention and dense MLP
    projections). Router, embeddings, norms and lm_head always stay in the compute dtype."""

    grad_rounding: str = "nearest"
    """Rounding of output gradients to MXFP8 in the backward: "nearest" (default) or "stochastic"."""

    seed: int = 0
    """Root seed of every stochastic rounding; the random bits are keyed by (seed, step, layer, tensor, call), so runs
    reproduce."""

    def validate(self) -> "RecipeConfig":
        """Raise ValueError naming the field, its value and the valid choices; return self."""
        choices = {"name": RECIPES, "scope": SCOPES, "grad_rounding": GRAD_ROUNDINGS}
        for field, valid in choices.items():
            value = getattr(self, field)
            if value not in valid:
                raise ValueError(f"recipe.{field} = {value!r} is not valid; choose one of {', '.join(valid)}")
        for field in ("four_over_six", "stochastic_requant", "weight_tiles_16x16"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"recipe.{field} = {getattr(self, field)!r} must be true or false")
        tail = self.high_precision_tail
        if isinstance(tail, bool) or not isinstance(tail, (int, float)) or not 0.0 <= tail <= 1.0:
            raise ValueError(f"recipe.high_precision_tail = {tail!r} must be a fraction in [0, 1] (default 1/6)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"recipe.seed = {self.seed!r} must be a non-negative integer")
        return self

    @classmethod
    def from_dict(cls, d: dict) -> "RecipeConfig":
        """Build from a mapping (e.g. YAML); an unknown key is an error naming the valid ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown recipe key(s) {unknown}; valid keys: {', '.join(known)}")
        return cls(**d).validate()
