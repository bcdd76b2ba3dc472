"""QTensor: a quantized tensor (codes + block scales + outer scale), the shared contract.

    q = quantize(x, "nvfp4")      # rl4bit.kernels.api: a QTensor; q.data, q.scale, q.outer, q.fmt, q.shape

One dataclass for all three formats of rl4bit (NVFP4, MXFP8, S2F6; see docs/numerics.md). It only holds data:
quantizing and dequantizing live in ``nvfp4.py`` / ``mxfp8.py`` / ``s2f6.py`` and the dispatching ``api.py``.
Decoded value = code value x block scale x outer, blocks always along the last (K) dimension; ``QTensor``'s
docstring gives each format's field layouts.

Leaves out: swizzled (128x4) scale layouts for Blackwell GEMMs, and any tensor-subclass / autograd behaviour
(torchao's NVFP4Tensor does that; here a QTensor is plain data that kernels and exporters read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("nvfp4", "mxfp8", "s2f6")
BLOCK = {"nvfp4": 16, "mxfp8": 32, "s2f6": 32}
_BITS_PER_VALUE = {"nvfp4": 4.5, "mxfp8": 8.25, "s2f6": 8.25}


@dataclass
class QTensor:
    """A block-quantized tensor. Field layouts (blocks always along the last, K, dimension):

    | fmt   | data                                   | scale                      | outer                         |
    |-------|----------------------------------------|----------------------------|-------------------------------|
    | nvfp4 | uint8 [..., K/2] (two codes a byte)    | float8_e4m3fn [..., K/16]  | float32 1/S_enc (see below)   |
    | mxfp8 | float8_e4m3fn [..., K]                 | float8_e8m0fnu [..., K/32] | float32 ones (shape [1]*ndim) |
    | s2f6  | int8 [..., K] (value = int8/64)        | float8_e8m0fnu [..., K/32] | float32 ones (shape [1]*ndim) |

    nvfp4 data: element 2i in the low nibble, code = sign<<3 or magnitude index; its outer scale broadcasts to
    [..., 1].
    """

    data: torch.Tensor
    """Element codes: uint8 (two E2M1 codes a byte), float8_e4m3fn, or int8."""
    scale: torch.Tensor
    """Block scales: float8_e4m3fn per 16 (nvfp4) or float8_e8m0fnu per 32 (mxfp8, s2f6)."""
    outer: torch.Tensor
    """float32 decode multiplier broadcastable to [..., 1] (nvfp4: 1/S_enc; others: 1)."""
    fmt: str
    """"nvfp4" | "mxfp8" | "s2f6"."""
    shape: torch.Size
    """Logical shape of the tensor that was quantized."""

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"QTensor fmt {self.fmt!r} is not one of {FORMATS}")
        self.shape = torch.Size(self.shape)

    @property
    def bits_per_value(self) -> float:
        """Storage bits per logical value, block scales included, outer scale excluded."""
        return _BITS_PER_VALUE[self.fmt]

    @property
    def block_size(self) -> int:
        """Number of elements that share one block scale (16 or 32)."""
        return BLOCK[self.fmt]

    @property
    def nbytes(self) -> int:
        """Bytes held: data + scale + outer."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.outer))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __repr__(self) -> str:
        return (
            f"QTensor(fmt={self.fmt!r}, shape={tuple(self.shape)}, data={self.data.dtype}"
            f"{tuple(self.data.shape)}, scale={self.scale.dtype}{tuple(self.scale.shape)}, "
            f"outer={tuple(self.outer.shape)}, device={self.data.device})"
        )
