"""The broadcast weight sync in a job (`sampler_sync.broadcast_sync`: Ray actors, the update's tensors over one
torch.distributed group): a Ray-mode run forced onto it (gloo between CPU actors) learns exactly what the same run
with buckets learns, and ships the direct path's tensor bytes. The path's own protocol:
tests/checkpoint/test_tensor_broadcast.py. On GPUs the same code runs over NCCL (not run: one GPU lent at most)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl4bit.config import ConfigError, load_config, trainer_args
from rl4bit.metrics import read_metrics
from rl4bit.trainer.actor import Trainer
from rl4bit.trainer.weight_sync import update_bytes

from .conftest import QUICKSTART, learned


def _ray_run(out: Path, overrides: list[str], sync: str) -> list[dict]:
    args = [str(Path(sys.executable).with_name("rl4bit")), "train", str(QUICKSTART), "--out", str(out)]
    for o in overrides:
        args += ["-o", o]
    env = {**os.environ, "RL4BIT_WEIGHT_SYNC": sync}
    r = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return read_metrics(out)


@pytest.mark.slow
def test_a_ray_run_broadcasting_its_updates_learns_what_buckets_learn(tmp_path, small):
    pytest.importorskip("ray")
    overrides = small + ["ray.mode=ray", "ray.num_cpus=2", "sampler.replicas=2", "run.checkpoint_every=0",
                         "run.tensorboard=false"]
    buckets = _ray_run(tmp_path / "buckets", overrides, "buckets")
    broadcast = _ray_run(tmp_path / "broadcast", overrides, "broadcast")
    assert learned(broadcast) == learned(buckets)
    trainer = Trainer(**trainer_args(load_config(QUICKSTART, small + ["ray.mode=local"])))
    trainer.setup_rl()
    per_sampler = update_bytes(*trainer.weight_tensors())
    steps = [r for r in broadcast if "sync/bytes" in r]
    assert steps and all(r["sync/bytes"] == 2 * per_sampler for r in steps)  # tensors, not bucket payloads
    assert all(r["sync/bytes"] != 2 * per_sampler for r in buckets if "sync/bytes" in r)


def test_broadcast_is_refused_in_local_mode_before_the_job_starts(tmp_path, small, monkeypatch):
    from rl4bit import driver

    monkeypatch.setenv("RL4BIT_WEIGHT_SYNC", "broadcast")
    with pytest.raises(ConfigError, match="RL4BIT_WEIGHT_SYNC=broadcast needs Ray mode"):
        driver.main(QUICKSTART, out=str(tmp_path / "run"), overrides=small + ["ray.mode=local"])
    assert not list(tmp_path.glob("run/metrics.jsonl"))  # refused as the actors start, before step 0
