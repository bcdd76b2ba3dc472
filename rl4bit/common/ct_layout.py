"""The compressed-tensors layout of rl4bit's quantized weights: tensor names, encodings, quantization_config.

One layout for export (`rl4bit.common.checkpoint_format`) and weight sync
(`rl4bit.trainer.weight_sync`). Per planned module (`rl4bit.trainer.plan.quant_plan`,
the single source of the quantization scope):

tensors, per expert `{experts}.{e}.{gate_proj,up_proj,down_proj}` or per linear `{linear}`:
- nvfp4: `weight_packed` uint8 [N, K/2], `weight_scale` float8_e4m3fn [N, K/16],
  `weight_global_scale` fp32 [1] (ENCODE scale G), `input_global_scale` fp32 [1]
- mxfp8: `weight` float8_e4m3fn [N, K], `weight_scale` uint8 [N, K/32] (E8M0 biased exponents)
- bf16: `weight` in the dense dtype (experts split per expert as well)

References checked (search tool, corpus code):
- vLLM `vllm/model_executor/models/qwen3_moe.py` `get_expert_mapping` ->
  `FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj",
  ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj")`: checkpoint
  names `mlp.experts.{e}.gate_proj.<suffix>` load into `mlp.experts.w13_<suffix>`
  (shard w1), `up_proj` -> w13 (w3), `down_proj` -> `w2_<suffix>`. transformers 5
  itself saves Qwen3-MoE's fused `gate_up_proj` [E, 2I, H] (gate = rows [:I]) under
  the same per-expert names, so plain transformers reads them back too.
- vLLM `compressed_tensors_moe.py` `CompressedTensorsW4A4Nvfp4MoEMethod.create_weights`:
  w13_weight_packed uint8 [E, 2I, H/2], w13_weight_scale e4m3 [E, 2I, H/16],
  w13_weight_global_scale fp32 [E, 2] (gate and up; vLLM warns unless equal: ours
  are, one outer scale per expert), w2_* likewise with [E], and ALWAYS
  `w13_input_global_scale` [E, 2] / `w2_input_global_scale` [E] (allocated with
  torch.empty, so they must be in the checkpoint); it uses 1/G as decode scales.
- compressed-tensors 0.20 `compressors/nvfp4/base.py` (`NVFP4PackedCompressor`,
  format `nvfp4-pack-quantized`): decode = unpack(weight_packed) * (weight_scale /
  weight_global_scale), in BF16 by default; `compressors/mxfp8/base.py`
  (`MXFP8QuantizationCompressor`, `mxfp8-quantized`): weight * 2**(weight_scale - 127).
  Preset schemes NVFP4 / MXFP8 in `quantization/quant_scheme.py` (copied below;
  the tests compare against the installed presets).

Global scale: our decode is `(q * s) * D` with D = QTensor.outer = 1/S_enc (TE chain,
numerics.md); compressed-tensors decodes `q * (s / G)`, a different rounding order.
We store G ~ 1/D, picked among fl(1/D) and its fp32 neighbours (+-16 ulps) so that
compressed-tensors' BF16 decode equals `rl4bit.kernels.dequantize(q, bfloat16)` for
EVERY (code, E4M3 scale) pair, checked exhaustively per expert (`global_scale_for`;
fl(1/D) alone fails for a few experts in 10^4, more often when amaxes have few
bits). Our own D is kept exactly (float.hex, `outer_hex`) in the shard's
safetensors metadata, so rl4bit's loader rebuilds the trainer's QTensors bit for
bit whatever G is. compressed-tensors' 0.125 floor on its own encode scale plays
no part in decoding ours.

Activations: the recipe quantizes activations dynamically with a per-token outer
scale (no calibration); vLLM's NVFP4 MoE kernels take one static activation
global scale per expert input instead. We write `input_global_scale` = 1.0
(INPUT_GLOBAL_SCALE): the E4M3 block scales alone then cover block amaxes from
6*2**-9 to 6*448, no calibration; blocks with amax below 6*2**-6 (~0.09) get
subnormal E4M3 scales (1-3 mantissa bits) and below ~6*2**-10 are zeroed, so
inputs of small magnitude (e.g. some models' down-projection inputs) lose
precision there; at the other end a block whose amax passes 6*448 = 2688 gets
the largest scale, 448, and its values clip to +-2688 (large activation
outliers). A calibrated scale per expert input (448*6 / amax from the
trainer's activations) would fix that; not done. vLLM serving therefore does NOT
reproduce the trainer's activation numerics bit for bit; rl4bit's own sampler
does (it reads the QTensors, not this field).

Leaves out: MXFP8 expert weights in vLLM (its compressed-tensors MoE support for
`mxfp8-quantized` depends on the vLLM version), per-expert scheme overrides,
tensor-parallel sharding.
"""

from __future__ import annotations

import re
import warnings

import torch

from rl4bit.kernels import QTensor, dequantize

EXPERT_PROJS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
"""Fused transformers-5 expert tensor -> the per-expert projections it holds, in row order."""

INPUT_GLOBAL_SCALE = 1.0
"""Activation ENCODE global scale written for vLLM (see the module docstring: dynamic activations)."""

NVFP4_SCHEME = {
    "weights": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
                "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"},
    "input_activations": {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                          "strategy": "tensor_group", "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn",
                          "observer": "static_minmax"},
    "output_activations": None,
    "format": "nvfp4-pack-quantized",
}
MXFP8_SCHEME = {
    "weights": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                "dynamic": False, "scale_dtype": "torch.uint8"},
    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
                          "dynamic": True, "scale_dtype": "torch.uint8"},
    "output_activations": None,
    "format": "mxfp8-quantized",
}
SCHEMES = {"nvfp4": NVFP4_SCHEME, "mxfp8": MXFP8_SCHEME}

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """Decoder layer index in a tensor/module name, None outside the layers (embeddings, final norm, lm_head)."""
    m = _LAYER_RE.search(name + ".")
    return int(m.group(1)) if m else None


def expert_prefixes(module: str, param: str, num_experts: int) -> list[list[str]]:
    """[expert][projection] checkpoint prefixes of fused `module.param`, e.g. `...experts.3.up_proj`."""
    return [[f"{module}.{e}.{proj}" for proj in EXPERT_PROJS[param]] for e in range(num_experts)]


# ------------------------------------------------------------------ global scale (NVFP4)

_E2M1 = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E4M3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive finite scale


def _ct_decode_matches(g: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[n] bool: compressed-tensors' bf16(q * (s / g)) == our bf16((q * s) * d) for every E2M1 q and E4M3 s."""
    ours = ((_E2M1[:, None] * _E4M3[None, :])[None] * d[:, None, None]).bfloat16()
    theirs = (_E2M1[None, :, None] * (_E4M3[None, None, :] / g[:, None, None])).bfloat16()
    return (ours.view(torch.int16) == theirs.view(torch.int16)).flatten(1).all(1)


def global_scale_for(outer: torch.Tensor, where: str = "") -> torch.Tensor:
    """fp32 ENCODE global scales G [n] ~ 1/D for decode outers D [n], CT's BF16 decode == ours (see docstring)."""
    d = outer.reshape(-1).float().cpu()
    best = torch.tensor(1.0) / d
    chosen = best.clone()
    todo = torch.ones_like(d, dtype=torch.bool)
    up, down = best.clone(), best.clone()
    for step in range(17):  # fl(1/D), then +-1..16 ulps: a relative change of at most 2**-19
        for cand in ((best,) if step == 0 else (up, down)):
            ok = todo & _ct_decode_matches(cand, d)
            chosen = torch.where(ok, cand, chosen)
            todo &= ~ok
        if not bool(todo.any()):
            return chosen
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
    warnings.warn(f"{where}: for {int(todo.sum())} expert(s) compressed-tensors' BF16 decode differs from "
                  "rl4bit's by one BF16 ulp on some (code, scale) pairs; rl4bit's loader is still exact")
    return chosen


def outer_hex(q: QTensor) -> list[str]:
    """Our exact decode outers (one per expert) as float.hex strings, stored in the safetensors metadata."""
    return [float(v).hex() for v in q.outer.reshape(-1).float().tolist()]


# ------------------------------------------------------------------ encode: QTensor -> compressed-tensors tensors


def _rows(q: QTensor, e: int, lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Expert e, rows [lo, hi) of a 3D QTensor as compressed-tensors tensors (without the global scale)."""
    if q.fmt == "nvfp4":
        return {"weight_packed": q.data[e, lo:hi].clone(), "weight_scale": q.scale[e, lo:hi].clone()}
    if q.fmt == "mxfp8":
        return {"weight": q.data[e, lo:hi].clone(), "weight_scale": q.scale[e, lo:hi].clone().view(torch.uint8)}
    raise ValueError(f"QTensor format {q.fmt!r} has no checkpoint layout; expected nvfp4 or mxfp8")


def encode_qtensor(module: str, param: str, q: QTensor, *, fused_experts: bool) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one weight QTensor [E, N, K] (a linear's is [1, N, K]), split per expert/projection."""
    if q.data.dim() != 3:
        raise ValueError(f"{module}.{param}: expected a 3D [E, N, K] QTensor, got data shape {tuple(q.data.shape)}")
    n_exp, n_rows = q.data.shape[0], q.data.shape[1]
    g = global_scale_for(q.outer, f"{module}.{param}") if q.fmt == "nvfp4" else None
    out: dict[str, torch.Tensor] = {}
    if fused_experts:
        projs = EXPERT_PROJS[param]
        if n_rows % len(projs):
            raise ValueError(f"{module}.{param}: {n_rows} rows do not split into {projs}")
        rows = n_rows // len(projs)
        layout = [(f"{module}.{e}.{proj}", e, i * rows, (i + 1) * rows)
                  for e in range(n_exp) for i, proj in enumerate(projs)]
    else:
        layout = [(module, 0, 0, n_rows)]
    for prefix, e, lo, hi in layout:
        for k, t in _rows(q, e, lo, hi).items():
            out[f"{prefix}.{k}"] = t
        if g is not None:
            out[f"{prefix}.weight_global_scale"] = g[e].reshape(1).clone()
            out[f"{prefix}.input_global_scale"] = torch.tensor([INPUT_GLOBAL_SCALE], dtype=torch.float32)
    return out


def encode_dense(module: str, param: str, w: torch.Tensor, *, fused_experts: bool, dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of a dense weight; fused experts [E, N, K] split into per-expert `.weight`s."""
    w = w.detach()
    w = w.to(dtype) if dtype is not None else w
    if not fused_experts:
        return {f"{module}.{param}": w.clone()}
    projs = EXPERT_PROJS[param]
    rows = w.shape[1] // len(projs)
    return {f"{module}.{e}.{proj}.weight": w[e, i * rows:(i + 1) * rows].clone()
            for e in range(w.shape[0]) for i, proj in enumerate(projs)}


# ------------------------------------------------------------------ decode: compressed-tensors tensors -> QTensor


def _take(tensors: dict, name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise KeyError(f"tensor {name!r} is missing from the checkpoint/update; re-export or resend it") from None


def decode_qtensor(tensors: dict, module: str, param: str, fmt: str, shape, *, fused_experts: bool,
                   outer: list[str] | None = None) -> QTensor:
    """Rebuild the exact QTensor [E, N, K] of `module.param` from its checkpoint tensors (inverse of encode_qtensor).

    `outer`: the exact decode outers (`outer_hex`) from the shard metadata; without
    them (a checkpoint from another tool) the outer is 1 / weight_global_scale.
    """
    n_exp, n_rows, k = (int(s) for s in shape)
    if fused_experts:
        prefixes = [[f"{module}.{e}.{proj}" for proj in EXPERT_PROJS[param]] for e in range(n_exp)]
    else:
        prefixes = [[module]]
    data_key = "weight_packed" if fmt == "nvfp4" else "weight"

    def stack(key):
        return torch.stack([torch.cat([_take(tensors, f"{p}.{key}") for p in row]) for row in prefixes])

    data, scale = stack(data_key), stack("weight_scale")
    if fmt == "nvfp4":
        g = torch.stack([_take(tensors, f"{row[0]}.weight_global_scale").reshape(()) for row in prefixes])
        for row in prefixes:  # gate and up share the expert's scale by construction
            for p in row[1:]:
                first = _take(tensors, f"{row[0]}.weight_global_scale")
                if not torch.equal(_take(tensors, f"{p}.weight_global_scale"), first):
                    raise ValueError(f"{p}.weight_global_scale differs from {row[0]}'s; rl4bit writes one per expert")
        if outer is not None:
            if len(outer) != n_exp:
                raise ValueError(f"{module}.{param}: {len(outer)} stored outer scales for {n_exp} experts")
            outer = torch.tensor([float.fromhex(h) for h in outer], dtype=torch.float32).reshape(n_exp, 1, 1)
        else:
            outer = (torch.tensor(1.0) / g.float()).reshape(n_exp, 1, 1)
    elif fmt == "mxfp8":
        scale = scale.view(torch.float8_e8m0fnu)
        outer = torch.ones(1, 1, 1)
    else:
        raise ValueError(f"format {fmt!r} has no checkpoint layout; expected nvfp4 or mxfp8")
    q = QTensor(data=data, scale=scale, outer=outer, fmt=fmt, shape=torch.Size((n_exp, n_rows, k)))
    want_cols = k // 2 if fmt == "nvfp4" else k
    if tuple(data.shape) != (n_exp, n_rows, want_cols):
        raise ValueError(f"{module}.{param}: stored codes have shape {tuple(data.shape)}, expected "
                         f"{(n_exp, n_rows, want_cols)} for a {fmt} weight of shape {(n_exp, n_rows, k)}")
    return q


def decode_dense(tensors: dict, module: str, param: str, shape, *, fused_experts: bool) -> torch.Tensor:
    """A dense weight back in the model's layout (fused experts re-stacked)."""
    if not fused_experts:
        return _take(tensors, f"{module}.{param}")
    n_exp = int(shape[0])
    return torch.stack([torch.cat([_take(tensors, f"{module}.{e}.{proj}.weight") for proj in EXPERT_PROJS[param]])
                        for e in range(n_exp)])


def dequantized(q: QTensor, dtype) -> torch.Tensor:
    """The decoded weight (what a plain transformers model holds), via rl4bit.kernels.dequantize."""
    return dequantize(q, dtype)


# ------------------------------------------------------------------ quantization_config


def _expert_target(module: str) -> str:
    return "re:^" + re.escape(module) + r"\.\d+\.(gate_proj|up_proj|down_proj)$"


def quantization_config(plan: dict[str, str], expert_modules: set[str]) -> dict | None:
    """The `quantization_config` of config.json: one config group per format, ignore = the plan's bf16 modules.

    None when nothing is quantized (the checkpoint is then a plain dense one).
    """
    groups, ignore = {}, []
    for fmt in ("nvfp4", "mxfp8"):
        targets = [(_expert_target(m) if m in expert_modules else m) for m, f in plan.items() if f == fmt]
        if targets:
            groups[f"group_{len(groups)}"] = {"targets": targets, **SCHEMES[fmt]}
    for m, f in plan.items():
        if f == "bf16":
            ignore.append(_expert_target(m) if m in expert_modules else m)
    if not groups:
        return None
    formats = [g["format"] for g in groups.values()]
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }
