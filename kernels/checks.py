"""Input checks shared by the quantizers: clear ValueErrors that name the problem and the fix.

Every quantizer calls ``check_input`` before touching the data, so bad input
(wrong dtype, a last dimension that is not a multiple of the block, NaN/Inf
where the format cannot hold it) fails loudly instead of producing garbage.

Leaves out: padding. rl4bit never pads silently; callers pad K themselves
(zeros quantize to zero codes in every format) and slice the result.
"""

from __future__ import annotations

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


def check_input(x, fmt: str, block: int, *, allow_nan: bool) -> None:
    """Raise ValueError if x cannot be quantized to `fmt` with blocks of `block` along the last dim
    (NonFiniteInputError for NaN/Inf values)."""
    problem = layout_problem(x, fmt, block)
    if problem is not None:
        raise ValueError(problem)
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


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {tuple(choices)}")
