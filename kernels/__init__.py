"""rl4bit.kernels: NVFP4 / MXFP8 / S2F6 quantization with stochastic rounding, 4/6 and RHT.

Plain-PyTorch references (one concept per file: e2m1, e4m3, e8m0, nvfp4,
four_over_six, mxfp8, s2f6, hadamard, requant, stochastic, philox) and, on
CUDA, Triton kernels bitwise equal to them (``*_triton.py``, picked by
``api.py`` through ``triton_dispatch.py``). Importing this package never
imports Triton, so it works on machines without it. Spec:
``shared/docs/numerics.md``.
"""

from contextlib import nullcontext

from rl4bit.kernels.api import dequantize, quantize, quantize_columnwise, quantize_reference, requantize
from rl4bit.kernels.checks import NonFiniteInputError, host_deferred
from rl4bit.kernels.hadamard import inverse_rht, rht
from rl4bit.kernels.philox import derive_seed, random_bits, sr_bits
from rl4bit.kernels.qtensor import QTensor


def deferred_checks(host: bool = False):
    """Context manager: quantize kernels inside it skip their per-call host read of the non-finite flag
    (so a decode step can be captured in a CUDA graph, and a training micro-batch makes one host sync for
    them, not one per quantize); one check at exit raises NonFiniteInputError (a ValueError) if any input
    held NaN/Inf. `host=True` also defers the host-side checks (`checks.host_deferred`: the reference
    quantizers, which run every quantize on the CPU, and qgemm's gradient checks), so that NaN/Inf fails the
    block at its exit on every device (layout errors still raise at once). Without Triton only that part exists.
    After `graph.replay()` call `rl4bit.kernels.triton_dispatch.check_deferred()`."""
    try:
        from rl4bit.kernels import triton_dispatch
    except ImportError:
        return host_deferred() if host else nullcontext()
    return triton_dispatch.deferred_checks(host=host)


__all__ = [
    "NonFiniteInputError",
    "QTensor",
    "deferred_checks",
    "quantize",
    "quantize_columnwise",
    "quantize_reference",
    "dequantize",
    "requantize",
    "rht",
    "inverse_rht",
    "derive_seed",
    "random_bits",
    "sr_bits",
]
