"""The vLLM serving form of an rl4bit export: which stored weight vLLM gets in which format, and its tensors.

`ServingForm` maps each export entry to the format vLLM serves it in (NVFP4 experts as BF16 on CPU, MXFP8 as BF16
where vLLM has no kernel, fused q/k/v and gate/up groups with differing NVFP4 global scales as BF16), encodes a
model weight (QTensor or dense) into vLLM's compressed-tensors checkpoint tensors, and builds the `config.json`
(with its `quantization_config`) vLLM loads. The rules and why: `rl4bit.sampler.vllm_engine`'s module doc. No
vLLM import; `VLLMEngine` uses it for its first load and for every weight update.
"""

from __future__ import annotations

import torch

from rl4bit.common import checkpoint_format as ckf
from rl4bit.common import ct_layout
from rl4bit.kernels import QTensor, dequantize

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linears vLLM fuses into one layer (qkv_proj, gate_up_proj): one NVFP4 global scale per fused layer."""

EXPERT_FORMS = ("bf16", "nvfp4")


def _fused_group(module: str) -> tuple[str, ...] | None:
    parent, _, last = module.rpartition(".")
    for group in FUSED_SIBLINGS:
        if last in group:
            return tuple(f"{parent}.{g}" for g in group)
    return None


class ServingForm:
    """Which stored weight vLLM gets in which format, and how to encode it (export dir -> vLLM dir)."""

    def __init__(self, entries: list[ckf.Entry], config: dict, *, experts: str, keep_mxfp8: bool):
        if experts not in EXPERT_FORMS:
            raise ValueError(f"experts={experts!r}: use one of {EXPERT_FORMS} (bf16 on CPU, nvfp4 needs a GPU)")
        self.entries = {e.name: e for e in entries}
        self.config = config
        self.fmt: dict[str, str] = {}
        """entry name -> served format: nvfp4 | mxfp8 | bf16 | dense."""
        for e in entries:
            if e.fmt == "nvfp4" and e.fused:
                self.fmt[e.name] = experts
            elif e.fmt == "mxfp8" and (e.fused or not keep_mxfp8):
                self.fmt[e.name] = "bf16"  # MXFP8 experts are left out (module doc); dense ones where vLLM has a kernel
            else:
                self.fmt[e.name] = e.fmt

    def split_mismatched_groups(self, qweights: dict[str, QTensor]) -> list[str]:
        """Serve in BF16 every fused group whose NVFP4 global scales differ (vLLM shares one); returns them."""
        demoted = []
        for name, e in self.entries.items():
            group = _fused_group(e.module) if self.fmt[name] == "nvfp4" and not e.fused else None
            if group and not self._group_scales_agree(group, qweights):
                for m in group:
                    if self.fmt.get(f"{m}.weight") == "nvfp4":
                        self.fmt[f"{m}.weight"] = "bf16"
                        demoted.append(m)
        return demoted

    def _group_scales_agree(self, group, qweights: dict[str, QTensor]) -> bool:
        outers = [qweights[f"{m}.weight"].outer.reshape(-1) for m in group if f"{m}.weight" in qweights]
        return all(torch.equal(o, outers[0]) for o in outers[1:])

    def encode(self, name: str, value) -> dict[str, torch.Tensor]:
        """vLLM checkpoint tensors of one model weight (QTensor or dense tensor) in its served format."""
        e = self.entries[name]
        served = self.fmt[name]
        if served in ("nvfp4", "mxfp8"):
            if not isinstance(value, QTensor) or value.fmt != served:
                raise ValueError(f"{name}: vLLM serves it as {served}; send its {served} QTensor, not "
                                 f"{type(value).__name__}{'/' + value.fmt if isinstance(value, QTensor) else ''}")
            return ct_layout.encode_qtensor(e.module, e.param, value, fused_experts=e.fused)
        if isinstance(value, QTensor):
            value = dequantize(value, torch.bfloat16)
            value = value if e.fused else value.reshape(e.shape[1:])
        return ct_layout.encode_dense(e.module, e.param, value, fused_experts=e.fused,
                                      dtype=torch.bfloat16 if value.is_floating_point() else None)

    def quantization_config(self) -> dict | None:
        plan, experts = {}, set()
        for name, e in self.entries.items():
            if e.fmt in ("nvfp4", "mxfp8"):
                plan[e.module] = self.fmt[name]
                if e.fused:
                    experts.add(e.module)
        qc = ct_layout.quantization_config(plan, experts)
        if qc is not None:  # vLLM matches FusedMoE layers by their module name, not per-expert names
            qc["ignore"] += sorted(m for m in experts if plan[m] == "bf16")
        return qc

    def vllm_config(self) -> dict:
        cfg = dict(self.config)
        cfg.pop("quantization_config", None)
        qc = self.quantization_config()
        if qc is not None:
            cfg["quantization_config"] = qc
        if not cfg.get("architectures"):  # models built from a config carry none; vLLM needs the class name
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]]
        return cfg

    def check_groups(self, qweights: dict[str, QTensor]) -> list[str]:
        """Problems: fused groups served as NVFP4 whose global scales no longer agree."""
        problems = []
        for name, e in self.entries.items():
            group = _fused_group(e.module) if self.fmt[name] == "nvfp4" and not e.fused else None
            if group and group[0] == e.module and not self._group_scales_agree(group, qweights):
                problems.append(f"{', '.join(group)}: NVFP4 global scales differ, but vLLM serves them as one fused "
                                "layer with one scale; give them one shared outer scale in the trainer, or restart "
                                "the engine (the group is then served in BF16)")
        return problems
