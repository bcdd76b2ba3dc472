"""`model.dtype: bfloat16`: the trainer holds FP32 masters and computes under BF16 autocast; the embedded samplers
must compute under the same autocast, or sampler and trainer logprobs differ (they did: the samplers computed in
FP32 from their FP32 copies, a mismatch that grew to k3 ~0.1 on the H200 once the weights moved off the BF16 grid).

A real local-mode run per recipe and sync path: every step's sampler logprobs equal the trainer's bitwise
(`mismatch/k3` and `mismatch/max_abs` exactly 0).
"""

import pytest
import torch

from rl4bit import driver
from rl4bit.config import load_config
from rl4bit.metrics import read_metrics
from rl4bit.sampler_sync import WEIGHT_SYNC_ENV
from rl4bit.trainer.models import autocast_dtype

from .conftest import QUICKSTART, SMALL, deadline_of

BF16 = [o for o in SMALL if not o.startswith("model.dtype")] + ["model.dtype=bfloat16", "ray.mode=local",
                                                                 "run.checkpoint_every=0", "trainer.lr=1e-3"]


@pytest.mark.parametrize("recipe,sync", [("bf16", "auto"), ("nvfp4", "auto"), ("nvfp4", "buckets"), ("mxfp8", "auto")])
def test_sampler_and_trainer_logprobs_agree_bitwise_under_bf16_autocast(tmp_path, monkeypatch, recipe, sync):
    monkeypatch.setenv(WEIGHT_SYNC_ENV, sync)
    out = tmp_path / "run"
    with deadline_of(240, "bf16-compute run"):
        assert driver.main(QUICKSTART, out=str(out), overrides=BF16 + [f"recipe.name={recipe}"]) == 0
    steps = [r for r in read_metrics(out) if r.get("step", 0) >= 1]
    assert len(steps) == 2
    for r in steps:
        assert r["mismatch/k3"] == 0.0 and r["mismatch/max_abs"] == 0.0, (r["step"], r["mismatch/max_abs"])
        assert r["rollout/errors"] == 0.0, r["step"]  # every request the driver builds is served
    assert steps[-1]["sync/direct"] == float(sync == "auto")


def test_both_sides_take_the_compute_dtype_from_one_function():
    assert autocast_dtype(load_config(QUICKSTART, BF16).model) is torch.bfloat16
    assert autocast_dtype(load_config(QUICKSTART, SMALL).model) is None
