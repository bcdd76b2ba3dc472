"""vLLM general plugin: lets NVFP4 (W4A4) linears run on vLLM's CPU platform.

vLLM picks an NVFP4 linear kernel from a per-platform registry
(`vllm.model_executor.kernels.linear._POSSIBLE_NVFP4_KERNELS`) that lists no
kernel for `PlatformEnum.CPU`, so a compressed-tensors `nvfp4-pack-quantized`
checkpoint fails to load there. `register()` adds vLLM's own software kernel,
`EmulationNvFp4LinearKernel` (dequantize to the compute dtype, then a dense
matmul), through vLLM's public `register_linear_kernel`: no patching.

How it reaches vLLM: the `vllm.general_plugins` entry point (pyproject:
`[project.entry-points."vllm.general_plugins"] rl4bit_nvfp4_cpu =
"rl4bit.sampler.vllm_plugin:register"`), which vLLM's
`load_general_plugins()` runs in every process it starts, spawned workers
included. `rl4bit.sampler.vllm_engine` also calls `register()` itself before it
builds an engine, so in-process engines work without the entry point.

Leaves out: NVFP4 MoE experts on CPU (vLLM has no CPU MoE backend for NVFP4;
`vllm_engine` serves experts in BF16 there) and any non-CPU platform (there
vLLM's own registry already has NVFP4 kernels). Idempotent: vLLM may load
plugins several times per process.
"""

from __future__ import annotations


def register() -> None:
    """Add EmulationNvFp4LinearKernel to vLLM's NVFP4 kernels for the CPU platform (once)."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    if EmulationNvFp4LinearKernel in linear._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU, []):
        return
    linear.register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
