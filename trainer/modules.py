"""Quantized drop-in modules for Hugging Face models: fused MoE experts and nn.Linear.

`QuantExperts` replaces a transformers 5.x fused-experts module (Qwen3-MoE,
OLMoE, Mixtral, Qwen2-MoE: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I],
forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])) and keeps
the same Parameter objects under the same names, so the state dict loads back
into plain transformers. `QuantLinear` is an nn.Linear (same `weight`/`bias`)
running its GEMM through `rl4bit.trainer.qgemm`.

Both can (a) return the exact QTensors their forward uses for the weights
(`quantized_weights()`), and (b) run frozen from given QTensors with no master
weights (`load_quantized(...)`, "serving" mode), bitwise equal to the training
forward on the same input (training calls `qgemm.grouped_forward`, serving `qgemm.served_product`: the same bits).

Leaves out: expert parallelism (top_k_index == num_experts, the EP "not
local" sentinel, is skipped as in HF), bias on experts, the combine's
RHT + S2F6 (a communication format; no all-to-all here).
"""

from __future__ import annotations

import torch
from torch import nn

from rl4bit.kernels.checks import qtensor_problems
from rl4bit.trainer.combine import combine
from rl4bit.trainer.fused_swiglu import swiglu
from rl4bit.trainer.qgemm import (
    GemmSpec,
    bf16_grouped,
    compute_dtype,
    expert_grouping,
    grouped_gemm,
    quantize_weight,
    served_product,
    swiglu_served,
)


class _QuantMixin:
    """Step / call counters feeding the random-bit keys, and the serving-mode switch."""

    def _init_quant(self, spec: GemmSpec, seed: int, layer_id: int) -> None:
        self.spec, self.seed, self.layer_id = spec, int(seed), int(layer_id)
        self.step, self.calls = 0, 0
        self.served: dict | None = None

    def set_step(self, step: int) -> None:
        self.step, self.calls = int(step), 0

    def _keys(self, gemm: int) -> tuple[int, int, int, int]:
        return (self.seed, self.step, 2 * self.layer_id + gemm, self.calls)

    def quantized_weights(self) -> dict:
        """{param name: QTensor} exactly as the forward quantizes them now (3D [E, N, K]; a linear is [1, N, K])."""
        if self.spec.fmt == "bf16":
            raise ValueError(f"{type(self).__name__} runs in bf16: its weights are not quantized (use the state dict)")
        if self.served is not None:
            return dict(self.served)
        return {name: quantize_weight(w, self.spec) for name, w in self._weights3d().items()}

    def quantized_problems(self, qweights: dict, prefix: str = "") -> list[str]:
        """What keeps {param name: QTensor} from being this module's weights (`load_quantized`'s check, before
        it changes anything): the names, each QTensor's format, shapes, dtypes and finite values."""
        if self.spec.fmt == "bf16":
            return [f"{prefix}{type(self).__name__} runs in bf16; load its weights with load_state_dict"]
        want = set(self._param_names)
        if not isinstance(qweights, dict) or set(qweights) != want:
            got = sorted(qweights) if isinstance(qweights, dict) else type(qweights).__name__
            return [f"{prefix}expects QTensors for {sorted(want)}, got {got}"]
        shapes = ({n: tuple(q.shape) for n, q in self.served.items()} if self.served is not None
                  else {n: tuple(w.shape) for n, w in self._weights3d().items()})
        return [p for n, q in qweights.items() for p in qtensor_problems(prefix + n, q, self.spec.fmt, shapes[n])]

    def load_quantized(self, qweights: dict, check: bool = True) -> None:
        """Freeze into serving mode from {param name: QTensor}; drops the master weights (no grad afterwards).
        check=False: the caller has run `quantized_problems` on these QTensors already (one read of the values)."""
        if self.spec.fmt == "bf16":
            raise ValueError(f"{type(self).__name__} runs in bf16; load its weights with load_state_dict")
        problems = self.quantized_problems(qweights) if check else []
        if problems:
            raise ValueError("load_quantized: " + "; ".join(problems))
        for name in self._param_names:
            if name in self._parameters:
                del self._parameters[name]
            setattr(self, name, None)
        self.served = dict(qweights)


class QuantExperts(_QuantMixin, nn.Module):
    """Fused MoE experts with quantized grouped GEMMs; HF names `gate_up_proj`, `down_proj` kept."""

    _param_names = ("gate_up_proj", "down_proj")

    def __init__(self, src: nn.Module, spec: GemmSpec, seed: int = 0, layer_id: int = 0):
        super().__init__()
        self.gate_up_proj = src.gate_up_proj
        self.down_proj = src.down_proj
        self.act_fn = src.act_fn
        self.num_experts = int(self.gate_up_proj.shape[0])
        self.expert_weight_shapes = {"gate_up_proj": tuple(self.gate_up_proj.shape),
                                     "down_proj": tuple(self.down_proj.shape)}
        self._init_quant(spec, seed, layer_id)

    def _weights3d(self) -> dict:
        return {"gate_up_proj": self.gate_up_proj, "down_proj": self.down_proj}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens' weighted expert outputs [T, H]; with `residual` [T, H], residual + that (the decoder layer's
        add, done by the combine: `trainer.fused_layer`)."""
        n_tok, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        with torch.no_grad():
            serving = self.served is not None or (self.spec.fmt == "bf16" and torch.is_inference_mode_enabled())
            maps: dict = {}  # serving: one tile map / group offsets for both GEMMs, written by the routing kernel
            if flat.is_cuda and serving:
                # Serving on CUDA (quantized modules in serving mode; bf16 ones under inference mode, which only
                # the engine uses: the trainer's passes run under no_grad): counts stay on the device (the Triton
                # GEMM or torch._grouped_mm reads them there), so the step makes no host sync here and can be
                # captured in a CUDA graph; the engine never runs expert parallelism (no EP sentinel index).
                nvfp4 = self.served is not None and self.spec.fmt == "nvfp4"
                order, tok, counts, inv = expert_grouping(flat, self.num_experts, k, maps, tile_map=nvfp4)
            else:
                order, inv = torch.argsort(flat, stable=True), None
                counts = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts].tolist()
                order = order[: sum(counts)]  # drops the EP sentinel index == num_experts, sorted last
                tok = order // k
        dt = compute_dtype(hidden_states)
        if self.served is not None:  # x = hidden_states[tok].to(dt), gathered inside the quantize where it can
            with torch.no_grad():
                h = served_product(hidden_states, self.served["gate_up_proj"], counts, self.spec, dt, maps,
                                   rows=tok, cast=dt)
        else:
            h = self._gemm(hidden_states[tok].to(dt), "gate_up_proj", counts, 0, maps)
        if self.served is not None and swiglu_served(h, self.served["down_proj"], self.spec, self.act_fn):
            with torch.no_grad():  # the SwiGLU inside the down projection's quantize: the same values
                o = served_product(h, self.served["down_proj"], counts, self.spec, h.dtype, maps, swiglu=True)
        else:
            o = self._gemm(swiglu(h, self.act_fn), "down_proj", counts, 1, maps)
        out = combine(o, top_k_weights, top_k_index, order, tok, inv, hidden_states, self.num_experts, residual)
        if self.served is None:
            self.calls += 1
        return out

    def _gemm(self, x, name, counts, gemm, maps):
        if self.served is not None:
            with torch.no_grad():
                return served_product(x, self.served[name], counts, self.spec, x.dtype, maps)
        if isinstance(counts, torch.Tensor):  # bf16 serving (see forward): no autograd, same product as training
            return bf16_grouped(x, getattr(self, name).to(x.dtype), counts, maps.get("offs"))
        return grouped_gemm(x, getattr(self, name), counts, self.spec, self._keys(gemm))

    def extra_repr(self) -> str:
        e, n, h = self.expert_weight_shapes["gate_up_proj"]
        return f"experts={e}, hidden={h}, intermediate={n // 2}, fmt={self.spec.fmt}, layer_id={self.layer_id}"


class QuantLinear(_QuantMixin, nn.Linear):
    """nn.Linear whose GEMM runs through the quantized grouped GEMM (one group)."""

    _param_names = ("weight",)

    @classmethod
    def from_linear(cls, lin: nn.Linear, spec: GemmSpec, seed: int = 0, layer_id: int = 0) -> "QuantLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight
        self.bias = lin.bias
        self._init_quant(spec, seed, layer_id)
        return self

    def _weights3d(self) -> dict:
        return {"weight": self.weight.unsqueeze(0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(x)
        x2 = x.reshape(-1, self.in_features).to(dt)
        counts = [x2.shape[0]]
        if self.served is not None:
            if x2.is_cuda:  # a device count: the tile map is built on the device (inside a CUDA graph, too)
                counts = torch.full((1,), x2.shape[0], dtype=torch.int32, device=x2.device)
            with torch.no_grad():
                y = served_product(x2, self.served["weight"], counts, self.spec, dt)
        else:
            y = grouped_gemm(x2, self.weight.unsqueeze(0), counts, self.spec, self._keys(0))
            self.calls += 1
        if self.bias is not None:
            y = y + self.bias.to(dt)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fmt={self.spec.fmt}, layer_id={self.layer_id}"
