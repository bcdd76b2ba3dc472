"""`trainer.padding`: the engine's mark of its padding rows, as the fused router reads it."""

from __future__ import annotations

import pytest
import torch

from rl4bit.trainer import padding


def test_the_mask_is_seen_only_inside_for_its_row_count_and_device():
    live = torch.tensor([1, 0, 0], dtype=torch.int32)
    assert padding.current(3, live.device) is None
    with padding.live_rows(live):
        assert padding.current(3, live.device) is live
        with padding.ignored():  # the benchmark's A/B: as if unmarked
            assert padding.current(3, live.device) is None
        assert padding.current(4, live.device) is None  # a call over other rows than the forward's
        with padding.live_rows(None):  # nested: cleared inside, restored after
            assert padding.current(3, live.device) is None
        assert padding.current(3, live.device) is live
        if torch.cuda.is_available():
            assert padding.current(3, torch.device("cuda")) is None
    assert padding.current(3, live.device) is None


def test_a_bad_mask_is_refused():
    with pytest.raises(ValueError, match="int32 or int64"):
        with padding.live_rows(torch.ones(3, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match="int32 or int64"):
        with padding.live_rows(torch.ones(2, 3, dtype=torch.int32)):
            pass

