"""Route ``rl4bit.kernels.quantize`` / ``requantize`` to the Triton kernels; None = no kernel here.

    q = quantize(x, "nvfp4", outer="row")      # api.py on CUDA (unless RL4BIT_KERNELS=reference); None: reference
    with deferred_checks(): ...                # CUDA graphs, decode steps: one non-finite check at exit

Every function returns a QTensor in exactly the reference's layout (``qtensor.py``), bitwise equal to what the
reference would return, or None when no kernel covers the case (16x16 tiles, FLOOR scales, bad arguments):
the reference then runs and raises its own error message. A non-finite input is found by the kernel (a flag),
and ``checks.check_input`` raises the reference's ValueError; reading the flag is one device sync per call,
which ``deferred_checks`` gathers into one read at the block's exit (its docstring: CUDA graphs, replays).

Leaves out: autotuning (tile sizes are fixed heuristics in each ``*_triton.py``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rl4bit.kernels import checks, mxfp8_triton, nvfp4_triton, s2f6_triton
from rl4bit.kernels.checks import NonFiniteInputError, _first_index, check_input, layout_problem
from rl4bit.kernels.qtensor import BLOCK, QTensor
from rl4bit.kernels.stochastic import check_seed


def _plain_ok(x, block: int) -> bool:
    """True when x passes the reference's cheap checks (type, dtype, shape); values are checked in-kernel."""
    return layout_problem(x, "", block) is None


_DEFERRED = [0]  # nesting depth of deferred_checks()


@contextmanager
def deferred_checks(host: bool = False):
    """Within the block, quantize calls skip their host read of the non-finite flag; one read at exit.

    Makes the quantize kernels capturable in a CUDA graph (no host sync). On a
    normal exit of the outermost block it calls ``check_deferred()``; if the
    outermost block raises, the flags are reset unread: the block failed anyway,
    and a flag left set would blame the next quantize, on finite data (an expert-
    parallel stop raises on every rank, whichever rank's quantize met the NaN).
    ``host=True`` defers the host-side checks too (``checks.host_deferred``: the
    reference quantizers, every quantize on the CPU).

    Inside the block no call reads its flag; the kernels keep OR-ing into the persistent per-device flag
    (``formats_triton.nonfinite_flag``) and the exit reads it once (``check_deferred()``), raising ValueError if
    any quantize in the block saw NaN/Inf (which tensor is not known then: rerun the step without deferring to
    find it). A captured graph replays the same flag writes, so after ``graph.replay()`` call
    ``check_deferred()`` (or replay inside the block).
    """
    if host:
        with checks.host_deferred(), deferred_checks():
            yield
        return
    _DEFERRED[0] += 1
    try:
        yield
    except BaseException:
        _DEFERRED[0] -= 1
        if _DEFERRED[0] == 0:
            reset_deferred()
        raise
    _DEFERRED[0] -= 1
    if _DEFERRED[0] == 0:
        check_deferred()


def reset_deferred() -> None:
    """Clear every device's non-finite flag without reading it (no host sync)."""
    from rl4bit.kernels.formats_triton import _FLAGS

    for flag in _FLAGS.values():
        flag.zero_()


def deferring() -> bool:
    """True inside `deferred_checks()`."""
    return _DEFERRED[0] > 0


def defer_nonfinite(t: torch.Tensor) -> None:
    """OR "t holds NaN/Inf" into t's device flag without a host read (inside `deferred_checks()`: for checks
    other than the quantize kernels', e.g. a gradient about to be quantized to MXFP8, which encodes NaN)."""
    from rl4bit.kernels.formats_triton import flag_nonfinite, nonfinite_flag

    flag = nonfinite_flag(t.device)
    if not flag_nonfinite(t, flag):  # one Triton pass; torch's isfinite-any is five kernels
        flag.bitwise_or_((~torch.isfinite(t)).any().to(torch.int32).reshape(1))


def check_deferred() -> None:
    """Read every device's non-finite flag once (one sync each); raise NonFiniteInputError (and reset it) if one
    is set."""
    from rl4bit.kernels.formats_triton import _FLAGS

    for device, flag in list(_FLAGS.items()):
        if int(flag.item()) != 0:
            flag.zero_()
            raise NonFiniteInputError(
                f"a quantize (or a deferred check) on {device} inside deferred_checks() got NaN/Inf input (nvfp4 "
                f"and s2f6 cannot encode NaN, no format encodes Inf); rerun the step outside deferred_checks() to "
                f"find the tensor")


def _flagged(flag: torch.Tensor) -> bool:
    """Whether a kernel set its non-finite flag (then reset): read now, unless the checks are deferred."""
    if _DEFERRED[0] or int(flag.item()) == 0:
        return False
    flag.zero_()
    return True


def _raise_if_flagged(flag: torch.Tensor, x: torch.Tensor, fmt: str, allow_nan: bool) -> None:
    if _flagged(flag):
        check_input(x, fmt, BLOCK[fmt], allow_nan=allow_nan)  # raises the reference's message
        raise NonFiniteInputError(f"{fmt}: input of shape {tuple(x.shape)} has non-finite values")


def _fused_overflow(x: torch.Tensor, swiglu: bool, cast: torch.dtype | None) -> str:
    """What a flagged row quantize overflowed when its input x (the rows it read) is finite: the SwiGLU of a
    gate-up product, or the cast to `cast`."""
    if swiglu:
        return (f"nvfp4: the SwiGLU of h {tuple(x.shape)} overflows {x.dtype} (h itself is finite): the gate-up "
                f"product is out of range")
    over = ~torch.isfinite(x.to(cast or x.dtype))
    if not bool(over.any()):
        return f"nvfp4: rows {tuple(x.shape)} of x raised the non-finite flag but hold no NaN/Inf after the cast"
    return (f"nvfp4: {int(over.sum())} value(s) of the rows {tuple(x.shape)} overflow {cast} (they are finite in "
            f"{x.dtype}), first at index {_first_index(over)}: find where the activations grow past {cast}'s range")


def nvfp4_outer(outer_rows: torch.Tensor, shape: torch.Size, outer: str) -> torch.Tensor:
    """The QTensor.outer of the reference from one S_dec per row of the flattened [rows, K] view."""
    if outer == "tensor":
        return outer_rows[:1].reshape((1,) * len(shape)).clone()
    if outer == "row":
        return outer_rows.reshape(*shape[:-1], 1)
    return outer_rows.reshape(shape[0], shape[1])[:, :1].reshape(shape[0], 1, 1).clone()


def quantize(x: torch.Tensor, fmt: str, *, rounding: str = "nearest", outer: str = "tensor",
             four_over_six: bool = False, seed=None, tiles_16x16: bool = False):
    """QTensor from a Triton kernel, or None where the reference must run."""
    if fmt not in BLOCK or rounding not in ("nearest", "stochastic") or not _plain_ok(x, BLOCK[fmt]):
        return None
    stochastic = rounding == "stochastic"
    if fmt == "nvfp4":
        if tiles_16x16 or outer not in ("tensor", "row", "group") or (four_over_six and stochastic):
            return None
        if outer == "group" and x.dim() != 3:
            return None
        if stochastic:
            seed = check_seed(seed, "nvfp4")
        data, scale, outer_rows, flag = nvfp4_triton.quantize_nvfp4(
            x, outer=outer, four_over_six=four_over_six, stochastic=stochastic, seed=seed)
        _raise_if_flagged(flag, x, "nvfp4", allow_nan=False)
        return QTensor(data=data, scale=scale.view(torch.float8_e4m3fn),
                       outer=nvfp4_outer(outer_rows, x.shape, outer), fmt="nvfp4", shape=x.shape)
    if outer != "tensor" or four_over_six or tiles_16x16:
        return None
    ones = torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
    if fmt == "mxfp8":
        if stochastic:
            seed = check_seed(seed, "mxfp8")
        data, scale, flag = mxfp8_triton.quantize_rows(x, stochastic=stochastic, seed=seed)
        _raise_if_flagged(flag, x, "mxfp8", allow_nan=True)
        return QTensor(data=data.view(torch.float8_e4m3fn), scale=scale.view(torch.float8_e8m0fnu),
                       outer=ones, fmt="mxfp8", shape=x.shape)
    if stochastic:  # s2f6 rounds to nearest only; the reference raises
        return None
    data, scale, flag = s2f6_triton.quantize_s2f6(x)
    _raise_if_flagged(flag, x, "s2f6", allow_nan=False)
    return QTensor(data=data, scale=scale.view(torch.float8_e8m0fnu), outer=ones, fmt="s2f6", shape=x.shape)


def quantize_nvfp4_rows(x: torch.Tensor, *, four_over_six: bool, decode: str | None = None, swiglu: bool = False,
                        rows: torch.Tensor | None = None, cast: torch.dtype | None = None):
    """(QTensor of x [R, K], FP16 [R, K] or None): `quantize(x, "nvfp4", outer="row", four_over_six=...)`, in the
    same launch (`nvfp4_triton.quantize_nvfp4`) x's codes decoded as the grouped GEMM's pre-decoded operand
    when `decode` names the GEMM's decode, and with `swiglu` x given as h [R, 2K] = [gate | up] and quantized
    as its SwiGLU (`swiglu_triton`'s values); with `rows` (and `cast`) the QTensor of x[rows].to(cast), read
    in place (`rows` in range is the caller's promise: checking would read the device). None where the kernel
    does not cover x (the caller runs the separate steps)."""
    k = x.shape[-1] // 2 if swiglu else x.shape[-1]
    if x.dim() != 2 or not _plain_ok(x, BLOCK["nvfp4"]) or k > nvfp4_triton.MAX_ROW_K or k % BLOCK["nvfp4"]:
        return None
    r = x.shape[0] if rows is None else rows.numel()
    xh = None if decode is None else torch.empty((r, k), dtype=torch.float16, device=x.device)
    data, scale, outer_rows, flag = nvfp4_triton.quantize_nvfp4(x, outer="row", four_over_six=four_over_six,
                                                                decoded=xh, decode=decode, swiglu=swiglu,
                                                                rows=rows, cast=cast)
    if _flagged(flag):
        xr = x if rows is None else x[rows]
        check_input(xr, "nvfp4", BLOCK["nvfp4"], allow_nan=False)  # the input's own NaN/Inf, named as the reference
        raise NonFiniteInputError(_fused_overflow(xr, swiglu, cast))
    shape = torch.Size((r, k))
    q = QTensor(data=data, scale=scale.view(torch.float8_e4m3fn), outer=nvfp4_outer(outer_rows, shape, "row"),
                fmt="nvfp4", shape=shape)
    return q, xh


def quantize_mxfp8_columnwise(x: torch.Tensor, *, rounding: str = "nearest", seed=None):
    """Columnwise MXFP8 (as ``mxfp8.quantize_mxfp8_columnwise``) in one transposing pass, or None."""
    if not _plain_ok(x, 1) or x.dim() < 2 or x.shape[-2] % 32 or rounding not in ("nearest", "stochastic"):
        return None
    stochastic = rounding == "stochastic"
    if stochastic:
        seed = check_seed(seed, "mxfp8")
    data, scale, flag = mxfp8_triton.quantize_cols(x, stochastic=stochastic, seed=seed)
    _raise_if_flagged(flag, x, "mxfp8", allow_nan=True)
    shape = torch.Size((*x.shape[:-2], x.shape[-1], x.shape[-2]))
    ones = torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
    return QTensor(data=data.view(torch.float8_e4m3fn), scale=scale.view(torch.float8_e8m0fnu),
                   outer=ones, fmt="mxfp8", shape=shape)


def requantize(q: QTensor, *, seed=None, rounding: str = "stochastic"):
    """Fused NVFP4 -> dequantize -> transpose -> MXFP8 (SR) QTensor [..., K, M], or None."""
    if not isinstance(q, QTensor) or q.fmt != "nvfp4" or len(q.shape) < 2 or q.shape[-2] % 32:
        return None
    if rounding not in ("nearest", "stochastic"):
        return None
    stochastic = rounding == "stochastic"
    if stochastic:
        seed = check_seed(seed, "requantize")
    shape = q.shape
    outer_rows = q.outer.to(torch.float32).expand(*shape[:-1], 1).reshape(-1)
    data, scale = mxfp8_triton.requantize_nvfp4(q.data, q.scale.view(torch.uint8), outer_rows, shape,
                                                stochastic=stochastic, seed=seed)
    out_shape = torch.Size((*shape[:-2], shape[-1], shape[-2]))
    ones = torch.ones((1,) * len(shape), dtype=torch.float32, device=q.data.device)
    return QTensor(data=data.view(torch.float8_e4m3fn), scale=scale.view(torch.float8_e8m0fnu),
                   outer=ones, fmt="mxfp8", shape=out_shape)


def rht_quantize_s2f6(x: torch.Tensor, seed: int):
    """quantize(rht(x, seed), "s2f6") in one pass (the MoE combine's encode), or None."""
    if not _plain_ok(x, 32):
        return None
    data, scale, flag = s2f6_triton.quantize_s2f6(x, rht_seed=int(seed))
    _raise_if_flagged(flag, x, "s2f6", allow_nan=False)
    ones = torch.ones((1,) * x.dim(), dtype=torch.float32, device=x.device)
    return QTensor(data=data, scale=scale.view(torch.float8_e8m0fnu), outer=ones, fmt="s2f6", shape=x.shape)


def dequantize_s2f6_inverse_rht(q: QTensor, seed: int, dtype: torch.dtype = torch.float32):
    """inverse_rht(dequantize(q), seed) for an S2F6 QTensor in one pass (the combine's decode), or None."""
    if not isinstance(q, QTensor) or q.fmt != "s2f6":
        return None
    return s2f6_triton.dequantize_s2f6(q.data, q.scale.view(torch.uint8), q.shape, rht_seed=int(seed)).to(dtype)
