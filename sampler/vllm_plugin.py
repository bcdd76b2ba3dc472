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

It also asks Linux for AMX tile permission in each of those processes
(`request_amx_tiles`): on x86-64 hosts with AMX (Sapphire Rapids and later),
vLLM's CPU attention runs AMX tile instructions, and a process that has not
asked for the tile state dies with SIGILL at the first one (measured on an
AMX host in vLLM's spawned workers: Linux clears the permission on exec).
Unrun here: these machines have no AMX.

Leaves out: NVFP4 MoE experts on CPU (vLLM has no CPU MoE backend for NVFP4;
`vllm_engine` serves experts in BF16 there) and any non-CPU platform (there
vLLM's own registry already has NVFP4 kernels). Idempotent: vLLM may load
plugins several times per process.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import warnings

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
"""Linux's names (asm/prctl.h, fpu/xstate.h): permission requests are per process, for one extended state."""


def cpu_has_amx() -> bool:
    """Whether this is an x86-64 Linux host whose CPU reports AMX tiles (`amx_tile` in /proc/cpuinfo)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in f)
    except OSError:
        return False


def request_amx_tiles() -> bool:
    """Ask the kernel for this process's permission to use AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM);
    True once granted. False, doing nothing, on hosts without AMX; a refusal (a kernel before 5.16) warns and
    returns False: vLLM's AMX paths would then die with SIGILL, so the warning says where to look."""
    if not cpu_has_amx():
        return False
    err = _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if err:
        warnings.warn(f"AMX tile permission refused (arch_prctl errno {err}): vLLM's CPU attention may die with "
                      "SIGILL on this host; a Linux kernel >= 5.16 grants it")
        return False
    return True


def amx_tiles_permitted() -> bool:
    """Whether this process holds AMX tile permission (arch_prctl ARCH_GET_XCOMP_PERM); False without AMX."""
    if not cpu_has_amx():
        return False
    mask = ctypes.c_uint64(0)
    return not _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def _arch_prctl(code: int, arg) -> int:
    """The arch_prctl syscall through libc: 0, or the errno of its failure."""
    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.syscall(_SYS_ARCH_PRCTL, code, arg) == 0 else ctypes.get_errno()


def register() -> None:
    """On vLLM's CPU platform: AMX tile permission for this process, and EmulationNvFp4LinearKernel added to
    vLLM's NVFP4 kernels (once)."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    request_amx_tiles()
    if EmulationNvFp4LinearKernel in linear._POSSIBLE_NVFP4_KERNELS.get(PlatformEnum.CPU, []):
        return
    linear.register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
