"""Fixtures for the checkpoint / weight-sync tests: a tiny Qwen3-MoE converted to the nvfp4 recipe.

3 decoder layers, 4 experts, hidden 64, expert width 32: with a high-precision
tail of 1/3, layers 0-1 run NVFP4 and layer 2 MXFP8, so one export holds every
stored format. Dense weights are rounded to BF16 values first, so a BF16 export
is lossless and logits can be compared bitwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: make ckpt_models importable

from ckpt_models import make_trainer_model  # noqa: E402


@pytest.fixture(scope="session")
def trainer_model():
    return make_trainer_model(0)
