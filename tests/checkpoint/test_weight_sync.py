"""Weight sync: bitwise between Ray actors, fail-stop on a corrupt or interrupted update, gloo broadcast.

Run: /work/venv-probe/bin/python -m pytest tests/checkpoint/test_weight_sync.py -q
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rl4bit.weight_sync import WeightReceiver, WeightSender, WeightSyncError, sync_ray

from ckpt_models import bump_weights, make_sampler_model, make_trainer_model

from sync_helpers import BUCKET_BYTES, assert_serves, broadcast_worker, corrupted, interrupted


@pytest.fixture(scope="module")
def ray_actors():
    ray = pytest.importorskip("ray")
    here = str(Path(__file__).parent)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": here}})
    Receiver = ray.remote(num_cpus=0)(WeightReceiver)
    actors = [Receiver.remote(make_sampler_model) for _ in range(2)]
    yield ray, actors
    ray.shutdown()


@pytest.mark.slow
def test_ray_sync_bitwise_then_fail_stop(ray_actors):
    """Two Ray actors: v1 bitwise; a corrupt bucket and an interrupted sender are rejected (v1 serves); v2 bitwise."""
    ray, actors = ray_actors
    trainer, plan = make_trainer_model(0)
    sender = WeightSender(trainer, plan, bucket_bytes=BUCKET_BYTES)
    assert sender.num_buckets >= 3

    sync_ray(sender, actors, version=1)
    for a in actors:
        assert ray.get(a.serving_version.remote()) == 1
        assert_serves(ray.get(a.snapshot.remote()), trainer)
    v1 = copy.deepcopy(trainer)

    bump_weights(trainer)  # policy v2
    with pytest.raises(WeightSyncError, match="bucket 1"):
        sync_ray(sender, actors, version=2, buckets=corrupted(sender.buckets(2), which=1))
    with pytest.raises(WeightSyncError, match="trainer died"):
        sync_ray(sender, actors, version=2, buckets=interrupted(sender.buckets(2), after=2))
    for a in actors:
        assert ray.get(a.serving_version.remote()) == 1
        assert_serves(ray.get(a.snapshot.remote()), v1)

    sync_ray(sender, actors, version=2)
    for a in actors:
        assert ray.get(a.serving_version.remote()) == 2
        assert_serves(ray.get(a.snapshot.remote()), trainer)


def test_receiver_fail_stop_in_process():
    trainer, plan = make_trainer_model(0)
    sender = WeightSender(trainer, plan, bucket_bytes=BUCKET_BYTES)
    rx = WeightReceiver(make_sampler_model())
    rx.begin(1, sender.num_buckets, sender.layout())
    for b in sender.buckets(1):
        rx.receive(1, b.index, b.payload, b.sha256)
    rx.commit(1)
    served = rx.quantized()
    ptrs = {(m, p): q.data.data_ptr() for m, ps in served.items() for p, q in ps.items()}
    v1 = copy.deepcopy(trainer)

    bump_weights(trainer)
    # interrupted: half the buckets, then commit -> rejected, v1 keeps serving
    rx.begin(2, sender.num_buckets, sender.layout())
    for b in list(sender.buckets(2))[: sender.num_buckets // 2]:
        rx.receive(2, b.index, b.payload, b.sha256)
    with pytest.raises(WeightSyncError, match="incomplete"):
        rx.commit(2)
    assert rx.serving_version() == 1
    assert_serves(rx.snapshot(), v1)
    # stale version and a truncated bucket are rejected too
    with pytest.raises(WeightSyncError, match="not newer"):
        rx.begin(1, sender.num_buckets, sender.layout())
    rx.begin(2, sender.num_buckets, sender.layout())
    b = sender.bucket(2, 0)
    with pytest.raises(WeightSyncError, match="bucket 0"):
        rx.receive(2, 0, b.payload[:-10], b.sha256)
    assert_serves(rx.snapshot(), v1)

    rx.begin(2, sender.num_buckets, sender.layout())
    for b in sender.buckets(2):
        rx.receive(2, b.index, b.payload, b.sha256)
    rx.commit(2)
    assert_serves(rx.snapshot(), trainer)
    after = {(m, p): q.data.data_ptr() for m, ps in rx.quantized().items() for p, q in ps.items()}
    assert after == ptrs, "served QTensors were reallocated: the update must be applied in place"


@pytest.mark.slow
def test_gloo_broadcast_two_processes(tmp_path):
    """torch.distributed broadcast (gloo, 2 processes): bitwise; corrupt and interrupted updates fail-stop."""
    import torch.multiprocessing as mp

    mp.spawn(broadcast_worker, args=(2, str(tmp_path / "pg")), nprocs=2, join=True)


def test_sync_into_embedded_engine():
    """The sampler engine as a target: served QTensors in place, dense weights via update_weights, version switched."""
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams
    from rl4bit.tokenizer import build_tokenizer

    trainer, plan = make_trainer_model(0)
    sender = WeightSender(trainer, plan, bucket_bytes=BUCKET_BYTES)
    engine = EmbeddedEngine(make_sampler_model(), build_tokenizer(), max_batch_size=2)
    rx = WeightReceiver(engine)
    for v in (1, 2):
        rx.begin(v, sender.num_buckets, sender.layout())
        for b in sender.buckets(v):
            rx.receive(v, b.index, b.payload, b.sha256)
        rx.commit(v)
        assert engine.version == v
        assert_serves(rx.snapshot(), trainer)
        bump_weights(trainer)
    out = engine.generate([Request(id="r", prompt_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=3))])
    assert out[0].policy_version == 2
