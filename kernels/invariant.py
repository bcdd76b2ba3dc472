"""Invariant-kernel mode: route torch's dense products and means on one device type through `invariant_triton`.

    set_mode(True)      # from `model.invariant_kernels`: the trainer and each sampler, in their own processes
    set_mode(False)     # in local mode the driver turns it off when the job ends

It registers `aten::mm`, `addmm`, `bmm` and `mean.dim` for the device's dispatch key (CUDA by default) through
`torch.library` (a public registration API, no patching), so everything above the dispatcher (`nn.Linear`,
`torch.matmul`, HF's RMSNorm, autocast, autograd's backward products) runs the fixed-order kernels and the
trainer recomputes a sampled token's logprob with the reduction orders the sampler used, whatever the batch.
Process-global. Products in dtypes the kernels do not take (float64, integers) run as a broadcast multiply and
sum: slow, and never cuBLAS, whose row-count dependence this mode exists to remove.

Leaves out: softmax, other products and reductions (`baddbmm`, `sum`, SDPA, ...: new model code must not bring
them in), `torch._grouped_mm`, convolutions, and CPU; `set_mode` lists them and why.
"""

from __future__ import annotations

import torch

_STATE: dict = {"lib": None, "device_type": None}


def _covered(*tensors) -> bool:
    """True for operands the Triton kernels take; raises, as ATen does, for mixed dtypes."""
    from rl4bit.kernels.invariant_triton import FLOATS

    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise RuntimeError(f"expected operands of one dtype, got {[str(t.dtype) for t in tensors]}")
    return tensors[0].dtype in FLOATS


def _slow_bmm(a, b):
    """Products in dtypes the kernels do not take (float64, integers; no model path uses them): a broadcast
    multiply and a sum (memory M*K*N), which reach neither mm nor bmm, so no recursion into this mode."""
    return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)


def _mm(a, b):
    from rl4bit.kernels.invariant_triton import bmm

    return bmm(a.unsqueeze(0), b.unsqueeze(0))[0] if _covered(a, b) else _slow_bmm(a, b)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    from rl4bit.kernels.invariant_triton import bmm

    if _covered(bias, a, b):
        return bmm(a.unsqueeze(0), b.unsqueeze(0), bias=bias, alpha=alpha, beta=beta)[0]
    product = alpha * _slow_bmm(a, b)
    return product if beta == 0 else product + beta * bias


def _bmm(a, b):
    from rl4bit.kernels.invariant_triton import bmm

    return bmm(a, b) if _covered(a, b) else _slow_bmm(a, b)


def _out(out, result):
    """The `.out` variants' contract: resize `out` to the result's shape, then write it."""
    out.resize_(result.shape)
    return out.copy_(result)


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    from rl4bit.kernels.invariant_triton import FLOATS, mean

    if (dtype or x.dtype) in FLOATS:
        return mean(x, dim, keepdim, dtype)
    if not (dtype or x.dtype).is_floating_point and not (dtype or x.dtype).is_complex:
        raise RuntimeError(f"mean(): could not infer output dtype from input dtype {x.dtype}: give a floating "
                           "dtype= or cast the input")
    x = x.to(dtype) if dtype is not None else x
    dims = list(dim) if dim else list(range(x.dim()))
    n = 1
    for d in dims:
        n *= x.shape[d]
    return x.sum(dims, keepdim=keepdim) / n


def enabled() -> bool:
    """Whether the mode is on in this process."""
    return _STATE["lib"] is not None


def set_mode(on: bool, device_type: str = "CUDA") -> None:
    """Turn the mode on or off for `device_type`'s dispatch key ("CUDA"; "CPU" for the interpreter tests).

    Idempotent. Turning it on for another device type first turns it off for the current one. Not
    thread-safe: called when actors are built and when a job ends, not while forwards run.

    Covered: `aten::mm`, `aten::addmm`, `aten::bmm`, `aten::mean.dim`: `nn.Linear` / `F.linear` (-> mm / addmm),
    `torch.matmul` on batches (-> bmm), HF's RMSNorm (`pow(2).mean(-1)`), autocast (it casts, then dispatches
    here) and autograd (the backward's products land here too while the mode is on).

    Not covered: `aten::_log_softmax` and softmax (row-local in ATen already: one block per row whose shape is
    the row length); other products and reductions that no trainer or sampler forward path calls (`baddbmm`,
    `addbmm`, `addmm_`, `mv`, `dot`, `mean.out`, `sum`, `var`, `norm`, SDPA: they stay on ATen, so new model code
    must not bring them in); `torch._grouped_mm` (the `bf16` recipe's expert forward checks `enabled()` and takes
    `invariant_triton.grouped_mm` instead; its backward keeps `_grouped_mm`, no logprob depends on it; the
    `nvfp4` and `mxfp8` recipes' grouped products are rl4bit's own fixed-order kernels anyway), convolutions,
    and CPU (whose GEMM rows are already independent of the row count above MIN_ROWS; see
    `rl4bit.sampler.kv_cache`). `device_type` exists so the CPU tests can drive the same registration through
    the Triton interpreter.
    """
    lib = _STATE["lib"]
    if lib is not None and (not on or _STATE["device_type"] != device_type):
        lib._destroy()  # torch.library's own way to drop a Library's registrations
        _STATE["lib"] = _STATE["device_type"] = None
    if on and _STATE["lib"] is None:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm", _mm, device_type)
        lib.impl("mm.out", lambda a, b, *, out: _out(out, _mm(a, b)), device_type)
        lib.impl("addmm", _addmm, device_type)
        lib.impl("addmm.out", lambda bias, a, b, *, beta=1, alpha=1, out: _out(out, _addmm(bias, a, b, beta=beta,
                                                                                            alpha=alpha)), device_type)
        lib.impl("bmm", _bmm, device_type)
        lib.impl("bmm.out", lambda a, b, *, out: _out(out, _bmm(a, b)), device_type)
        lib.impl("mean.dim", _mean_dim, device_type)
        _STATE["lib"], _STATE["device_type"] = lib, device_type
