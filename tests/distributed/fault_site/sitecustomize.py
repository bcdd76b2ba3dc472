"""Imported as `sitecustomize` (this folder on PYTHONPATH) by the trainer ranks of test_fsdp's non-finite test.

On the rank named by RL4BIT_TEST_NONFINITE_RANK, the Nth `deferred_checks()` block (N =
RL4BIT_TEST_NONFINITE_CALL, default 1: the first micro-batch) raises NonFiniteInputError at its exit: what a
quantize kernel's NaN/Inf flag does on CUDA, after that micro-batch's forward and backward (and their
collectives) have run on every rank. Any other process: does nothing.
"""

import os
import sys

_rank = os.environ.get("RL4BIT_TEST_NONFINITE_RANK")
if _rank is not None and sys.orig_argv[-3:-1] == ["rl4bit.trainer_group", _rank]:
    from contextlib import contextmanager

    import rl4bit.trainer.actor as _actor
    from rl4bit.kernels import NonFiniteInputError

    _real, _calls, _nth = _actor.deferred_checks, [], int(os.environ.get("RL4BIT_TEST_NONFINITE_CALL", "1"))

    @contextmanager
    def _fails_once(host: bool = False):
        with _real(host=host):
            yield
        _calls.append(True)
        if len(_calls) == _nth:
            raise NonFiniteInputError(f"injected on rank {_rank}: a quantize met NaN/Inf (test)")

    _actor.deferred_checks = _fails_once
