"""Weight sync: bitwise between Ray actors; corrupt, interrupted, stale, misrouted updates fail-stop; gloo broadcast.

Run: /work/venv-probe/bin/python -m pytest tests/checkpoint/test_weight_sync.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from pathlib import Path

import pytest
from ckpt_models import bump_weights, make_sampler_model, make_trainer_model
from sync_helpers import (
    BUCKET_BYTES,
    MISROUTED_1,
    STALE_0,
    assert_serves,
    broadcast_worker,
    corrupted,
    interrupted,
    misrouted,
    stale,
)

from rl4bit.trainer.weight_sync import WeightReceiver, WeightSender, WeightSyncError, sync_ray


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
    old = list(sender.buckets(1))

    bump_weights(trainer)  # policy v2
    with pytest.raises(WeightSyncError, match="bucket 1"):
        sync_ray(sender, actors, version=2, buckets=corrupted(sender.buckets(2), which=1))
    with pytest.raises(WeightSyncError, match="trainer died"):
        sync_ray(sender, actors, version=2, buckets=interrupted(sender.buckets(2), after=2))
    with pytest.raises(WeightSyncError, match=STALE_0):
        sync_ray(sender, actors, version=2, buckets=stale(sender.buckets(2), old, which=0))
    with pytest.raises(WeightSyncError, match=MISROUTED_1):
        sync_ray(sender, actors, version=2, buckets=misrouted(sender.buckets(2), which=1))
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


def test_receiver_rejects_stale_or_misrouted_bucket():
    """A bucket whose payload was built for another (version, index) fails its receive, whatever its labels say;
    the update is dropped and the previous version keeps serving."""
    from rl4bit.common.checkpoint_format import pack, unpack

    trainer, plan = make_trainer_model(0)
    sender = WeightSender(trainer, plan, bucket_bytes=BUCKET_BYTES)
    n = sender.num_buckets
    assert n >= 3
    rx = WeightReceiver(make_sampler_model())
    rx.begin(1, n, sender.layout())
    for b in sender.buckets(1):
        rx.receive(1, b.index, b.payload, b.sha256)
    rx.commit(1)
    v1, old = copy.deepcopy(trainer), list(sender.buckets(1))
    bump_weights(trainer)
    new = list(sender.buckets(2))

    relabelled = dataclasses.replace(old[0], version=2)  # a v1 leftover passed off as v2 (e.g. a replayed send)
    no_stamp = pack(*unpack(new[0].payload, "bucket 0", new[0].sha256))  # right tensors, no (version, index) stamp
    cases = [
        ((2, 0, old[0].payload, old[0].sha256), STALE_0),
        ((relabelled.version, relabelled.index, relabelled.payload, relabelled.sha256), STALE_0),
        ((2, 1, new[2].payload, new[2].sha256), MISROUTED_1),
        ((2, 0, no_stamp, hashlib.sha256(no_stamp).hexdigest()), r"carries no \(version, index\) stamp"),
    ]
    for (version, index, payload, sha256), what in cases:
        rx.begin(2, n, sender.layout())
        for b in new[:index]:
            rx.receive(2, b.index, b.payload, b.sha256)
        with pytest.raises(WeightSyncError, match=what) as err:
            rx.receive(version, index, payload, sha256)
        assert "update dropped, v1 keeps serving" in str(err.value)
        with pytest.raises(WeightSyncError, match="without a staged update"):  # the staging went with the error
            rx.commit(2)
        assert rx.serving_version() == 1
        assert_serves(rx.snapshot(), v1)

    rx.begin(2, n, sender.layout())
    for b in new:
        rx.receive(2, b.index, b.payload, b.sha256)
    assert rx.commit(2) == 2
    assert_serves(rx.snapshot(), trainer)


@pytest.mark.slow
def test_gloo_broadcast_two_processes(tmp_path):
    """torch.distributed broadcast (gloo, 2 processes): bitwise; corrupt and interrupted updates fail-stop."""
    import torch.multiprocessing as mp

    mp.spawn(broadcast_worker, args=(2, str(tmp_path / "pg")), nprocs=2, join=True)


def test_sync_into_embedded_engine():
    """The sampler engine as a target: served QTensors in place, dense weights via update_weights, version switched."""
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.sampler.types import Request, SamplingParams
    from rl4bit.trainer.tokenizer import build_tokenizer

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
