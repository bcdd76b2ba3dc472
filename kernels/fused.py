"""The process-global switch for rl4bit's fused decode-path kernels (RMSNorm, MoE grouping, RoPE, combine, router,
attention).

Each fused kernel replaces a run of small torch ops with one launch and keeps
the bits the trainer and the samplers agree on (each kernel's docstring says
which reference it matches). On by default for CUDA tensors; `set_enabled(False)`
sends every call back to the torch ops (A/B benchmarks: `rl4bit bench rollout
--compare-unfused`); `set_enabled(True, "cpu")` runs the kernels on CPU tensors
through the Triton interpreter (tests only). Not thread-safe: switch between
forwards, and the same way in every process of a job (trainer and samplers
must run the same kernels to agree bitwise). The environment variable
`RL4BIT_FUSED=0` (or false/off/no) starts a process with them off (Ray actors inherit it): the
A/B of whole jobs (`RL4BIT_FUSED=0 rl4bit bench step ...`).
"""

from __future__ import annotations

import contextlib
import functools
import os


def _default() -> str | None:
    """The setting a process starts with: on for CUDA tensors unless RL4BIT_FUSED is 0/false/off/no, the build is
    ROCm (the kernels hold NVIDIA PTX) or Triton is not installed (an optional extra)."""
    import importlib.util

    import torch

    if os.environ.get("RL4BIT_FUSED", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if getattr(torch.version, "hip", None) or importlib.util.find_spec("triton") is None:
        return None
    return "cuda"


_STATE = {"device_type": _default()}
"""Which tensors take the fused kernels: "cuda", "cpu" (interpreter tests) or None (torch ops everywhere)."""


def enabled(device_type: str = "cuda") -> bool:
    """Whether tensors of `device_type` take the fused kernels."""
    return _STATE["device_type"] == device_type


def set_enabled(on: bool, device_type: str = "cuda") -> None:
    _STATE["device_type"] = device_type if on else None


def state() -> str | None:
    """The current setting (for callers that cache work done under it: the decode graphs)."""
    return _STATE["device_type"]


@contextlib.contextmanager
def disabled():
    """Within the block every fused call runs its torch ops; the previous setting is restored after."""
    saved = _STATE["device_type"]
    _STATE["device_type"] = None
    try:
        yield
    finally:
        _STATE["device_type"] = saved


def install(module, flag: str, suffix: str, reproduces, forward) -> bool:
    """Route `module.forward` through `functools.partial(forward, module, <its own forward>)` when its class name
    ends with `suffix` and `reproduces(module)` holds (the caller's probe of the replacement); the attribute
    `flag` marks it, so a second call changes nothing. Returns whether the module runs the replacement."""
    if getattr(module, flag, False):
        return True
    if not type(module).__name__.endswith(suffix) or not reproduces(module):
        return False
    module.forward = functools.partial(forward, module, module.forward)
    setattr(module, flag, True)
    return True
