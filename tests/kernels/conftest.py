"""Shared setup for the kernel tests.

Puts this folder on ``sys.path`` so tests can ``from bitwise import
assert_bitwise_equal`` (the suite runs with ``--import-mode=importlib``, which
adds nothing to ``sys.path``), and sets a small hypothesis profile so property
tests stay within seconds on 2 CPU cores.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "rl4bit-kernels",
        max_examples=int(os.environ.get("RL4BIT_HYPOTHESIS_EXAMPLES", "60")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("rl4bit-kernels")
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
