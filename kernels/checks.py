"""Input checks shared by the quantizers: clear ValueErrors that name the problem and the fix.

Every quantizer calls ``check_input`` before touching the data, so bad input
(wrong dtype, a last dimension that is not a multiple of the block, NaN/Inf
where the format cannot hold it) fails loudly instead of producing garbage.
Inside ``host_deferred()`` (a trainer micro-batch) NaN/Inf is recorded instead
and the quantizer returns garbage (nvfp4: Inf saturates, NaN stays NaN; s2f6:
NaN becomes 0; mxfp8: Inf saturates), which the caller must discard when the
block's exit raises.

Leaves out: padding. rl4bit never pads silently; callers pad K themselves
(zeros quantize to zero codes in every format) and slice the result.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    idx = torch.nonzero(mask)[0]
    return tuple(int(i) for i in idx)


def layout_problem(x, fmt: str, block: int) -> str | None:
    """What makes x unquantizable to `fmt` before its values are read (type, dtype, shape), or None.

    Shared by the reference (`check_input` raises it) and the Triton wrappers,
    so both name the problem and the fix in the same words.
    """
    if not isinstance(x, torch.Tensor):
        return f"{fmt}: expected a torch.Tensor, got {type(x).__name__}"
    if x.dtype not in FLOAT_DTYPES:
        return (
            f"{fmt}: input dtype {x.dtype} is not a high-precision float; pass float32, bfloat16, "
            f"float16 or float64 (to re-quantize an already quantized tensor, dequantize it first)"
        )
    if x.dim() == 0 or x.numel() == 0:
        return f"{fmt}: cannot quantize a tensor of shape {tuple(x.shape)}; it needs a non-empty last dimension"
    k = x.shape[-1]
    if k % block:
        padded = (k + block - 1) // block * block
        return (
            f"{fmt}: last dimension {k} of shape {tuple(x.shape)} is not a multiple of {block} "
            f"({fmt} block); pad it with zeros to {padded} (or exclude this tensor from {fmt})"
        )
    return None


class NonFiniteInputError(ValueError):
    """A quantize got NaN/Inf it cannot encode (a ValueError, so callers that catch bad input still do).

    Its own class so a training step can tell "this step's numbers blew up" (skip the step) from a
    programming or shape error (stop), on every device and whether the check ran per call or deferred."""


_HOST = {"depth": 0, "nonfinite": False}
"""`host_deferred()` blocks open, and whether a host-side NaN/Inf check inside them found one."""


@contextmanager
def host_deferred():
    """Within the block, NaN/Inf found by `check_input` (the reference quantizers, hence every quantize on the
    CPU) or reported through `defer_host` is recorded instead of raised; the outermost block's normal exit raises
    one NonFiniteInputError if any was. Layout and dtype problems still raise at once.

    For blocks that ranks of a group must leave at the same point: the trainer's micro-batch, whose ranks meet
    in collectives after it (a rank raising mid-backward would leave the others inside one). The computation
    goes on through the NaN: the quantizers do not fail on it, their outputs are garbage (the module docstring
    says which), and the caller discards what the block produced when its exit raises (the trainer: the
    micro-batch's loss, gradients, "old" logprobs and metrics). An exception leaving the outermost block clears
    the record unread."""
    _HOST["depth"] += 1
    try:
        yield
    except BaseException:
        _HOST["depth"] -= 1
        if _HOST["depth"] == 0:
            _HOST["nonfinite"] = False
        raise
    _HOST["depth"] -= 1
    if _HOST["depth"] == 0 and _HOST["nonfinite"]:
        _HOST["nonfinite"] = False
        raise NonFiniteInputError("a quantize or check on the host inside a deferred block got NaN/Inf input (nvfp4 "
                                  "and s2f6 cannot encode NaN, no format encodes Inf); rerun the step outside the "
                                  "block to find the tensor")


def host_deferring() -> bool:
    """True inside `host_deferred()`."""
    return _HOST["depth"] > 0


def defer_host(found: bool) -> None:
    """Record a NaN/Inf found by a check inside `host_deferred()`; outside one, a no-op (nothing would read it
    but the next block, which would then raise on finite data)."""
    if _HOST["depth"] > 0:
        _HOST["nonfinite"] = _HOST["nonfinite"] or bool(found)


def check_input(x, fmt: str, block: int, *, allow_nan: bool) -> None:
    """Raise ValueError if x cannot be quantized to `fmt` with blocks of `block` along the last dim
    (NonFiniteInputError for NaN/Inf values; inside `host_deferred()` those are recorded instead)."""
    problem = layout_problem(x, fmt, block)
    if problem is not None:
        raise ValueError(problem)
    if host_deferring():
        defer_host(not bool(torch.isfinite(x).all()) if not allow_nan else bool(torch.isinf(x).any()))
        return
    inf = torch.isinf(x)
    if bool(inf.any()):
        raise NonFiniteInputError(
            f"{fmt}: input of shape {tuple(x.shape)} has {int(inf.sum())} Inf value(s), first at index "
            f"{_first_index(inf)}; {fmt} cannot encode Inf: find where the activations or gradients overflow"
        )
    if not allow_nan:
        nan = torch.isnan(x)
        if bool(nan.any()):
            raise NonFiniteInputError(
                f"{fmt}: input of shape {tuple(x.shape)} has {int(nan.sum())} NaN value(s), first at index "
                f"{_first_index(nan)}; {fmt} cannot encode NaN: find where the NaN is produced"
            )


_NAN_BITS = {  # (mask, value): a 1-byte float is NaN or Inf when (bits & mask) == value
    torch.float8_e4m3fn: (0x7F, 0x7F),  # S.1111.111 is NaN; no Inf
    torch.float8_e5m2: (0x7C, 0x7C),  # exponent all ones: Inf or NaN
    torch.float8_e8m0fnu: (0xFF, 0xFF),  # the one NaN; no sign, no Inf
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN/Inf; integers always do. 1-byte floats by their bit patterns: torch's
    `isfinite` is not implemented for float8_e4m3fn and calls an E8M0 NaN finite."""
    if not t.is_floating_point():
        return True
    if t.element_size() > 1:
        return bool(torch.isfinite(t).all())
    if t.dtype in _NAN_BITS:
        mask, value = _NAN_BITS[t.dtype]
        return not bool(((t.view(torch.uint8) & mask) == value).any())
    return bool(torch.isfinite(t.float()).all())


def _broadcasts_to(shape, target: tuple) -> bool:
    try:
        return len(shape) <= len(target) and torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def qtensor_problems(name: str, q, fmt: str, shape: tuple) -> list[str]:
    """What keeps `q` from being the `fmt` QTensor of a tensor of `shape` (qtensor.py's layouts), or []:
    its type, format, logical shape, each part's dtype and shape, NaN/Inf in the scales, outer or codes."""
    from rl4bit.kernels.qtensor import BLOCK, QTensor

    if not isinstance(q, QTensor):
        return [f"{name}: {type(q).__name__} is not a QTensor"]
    if q.fmt != fmt:
        return [f"{name}: format {q.fmt!r} != {fmt!r}"]
    shape = tuple(shape)
    if tuple(q.shape) != shape:
        return [f"{name}: QTensor of shape {tuple(q.shape)} != the weight's {shape}"]
    k, lead = shape[-1], shape[:-1]
    want = {
        "data": ({"nvfp4": torch.uint8, "mxfp8": torch.float8_e4m3fn, "s2f6": torch.int8}[fmt],
                 lead + (k // 2 if fmt == "nvfp4" else k,)),
        "scale": (torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu, lead + (k // BLOCK[fmt],)),
    }
    problems = []
    for part, (dtype, part_shape) in want.items():
        t = getattr(q, part)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != part_shape:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            problems.append(f"{name}.{part}: dtype and shape {got}, expected {dtype} {part_shape}")
    outer, row = q.outer, lead + (1,)
    if not isinstance(outer, torch.Tensor) or outer.dtype != torch.float32 or not _broadcasts_to(outer.shape, row):
        got = f"{outer.dtype} {tuple(outer.shape)}" if isinstance(outer, torch.Tensor) else type(outer).__name__
        problems.append(f"{name}.outer: {got} is not a float32 tensor broadcastable to {row}")
    if problems:
        return problems
    return [f"{name}.{part}: holds NaN/Inf values" for part in ("data", "scale", "outer")
            if not all_finite(getattr(q, part))]


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {tuple(choices)}")
