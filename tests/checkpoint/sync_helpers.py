"""Helpers shared by the weight-sync tests, in an importable module.

The gloo test's worker lives here, not in the test module: processes started
by torch.multiprocessing's spawn import the worker by module name, and a test
module collected with --import-mode=importlib has no importable name, while
this folder is on sys.path (tests/checkpoint/conftest.py), which spawn passes
on to its children.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ckpt_models import bump_weights, make_sampler_model, make_trainer_model

from rl4bit.trainer.surgery import quantized_weights
from rl4bit.trainer.weight_sync import WeightReceiver, WeightSender, WeightSyncError

BUCKET_BYTES = 40_000  # several buckets for the tiny model
STALE_0 = r"expected bucket 0/\d+ of v2, but the payload is bucket 0/\d+ of v1"  # `stale(..., which=0)` into v2
MISROUTED_1 = r"expected bucket 1/\d+ of v2, but the payload is bucket 2/\d+ of v2"  # `misrouted(..., which=1)`


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_serves(snapshot: bytes, model) -> None:
    """A receiver's snapshot (served QTensors + dense weights) equals the trainer's, bit for bit."""
    from safetensors.torch import load

    got = load(snapshot)
    want = quantized_weights(model)
    served = {k.rsplit(".", 1)[0][2:] for k in got if k.startswith("q.")}
    assert served == {f"{m}.{p}" for m, ps in want.items() for p in ps}
    for module, params in want.items():
        for param, q in params.items():
            for f in ("data", "scale", "outer"):
                mine, theirs = _bits(getattr(q, f)).reshape(-1), _bits(got[f"q.{module}.{param}.{f}"]).reshape(-1)
                if f == "outer":
                    mine = mine.expand(theirs.numel()) if mine.numel() == 1 else mine
                n = int((mine != theirs).sum())
                assert n == 0, f"{module}.{param}.{f}: {n} values differ"
    sd = model.state_dict()
    dense = {k[6:]: v for k, v in got.items() if k.startswith("dense.")}
    assert dense
    for k, v in dense.items():
        if k in sd:
            assert torch.equal(v, sd[k].to(v.dtype)), k


def corrupted(buckets, which: int):
    for b in buckets:
        if b.index == which:
            blob = bytearray(b.payload)
            blob[len(blob) // 2] ^= 0x01
            b = dataclasses.replace(b, payload=bytes(blob))
        yield b


def stale(buckets, old: list, which: int):
    """Bucket `which` replaced by the one of an earlier version (`old`, as built): a leftover or replayed send."""
    for b in buckets:
        yield old[which] if b.index == which else b


def misrouted(buckets, which: int):
    """Buckets `which` and `which + 1` swap payloads (and checksums) under their own labels: each valid, each
    sent as the other's index."""
    buckets = list(buckets)
    a, b = buckets[which], buckets[which + 1]
    buckets[which] = dataclasses.replace(a, payload=b.payload, sha256=b.sha256)
    buckets[which + 1] = dataclasses.replace(b, payload=a.payload, sha256=a.sha256)
    yield from buckets


def interrupted(buckets, after: int):
    for b in buckets:
        if b.index == after:
            raise ConnectionError("trainer died mid-sync")
        yield b


def raising(err: Exception):
    """A stand-in method that raises `err` (a step failing with an error other than WeightSyncError)."""
    def fail(*args, **kwargs):
        raise err
    return fail


def garbling_first(bcast):
    """`weight_sync.bcast_bytes` whose first blob (the update header) arrives garbled."""
    sent = []

    def send(data, src, group):
        if not sent:
            sent.append(True)
            data = b"{not json"
        return bcast(data, src, group)
    return send


def broadcast_worker(rank: int, world: int, init_file: str) -> None:
    from datetime import timedelta
    from unittest import mock

    import torch.distributed as dist

    from rl4bit.trainer import weight_sync
    from rl4bit.trainer.sharding import bind_world_defaults_early
    from rl4bit.trainer.weight_sync import broadcast_update

    bind_world_defaults_early()  # else destroy_process_group frees nothing and gloo can abort at exit
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # a lost peer fails the test instead of hanging it
    try:
        trainer, plan = make_trainer_model(0)  # both ranks build it: rank 1 uses it as the expected values
        sender = WeightSender(trainer, plan, bucket_bytes=BUCKET_BYTES)
        if rank == 0:
            broadcast_update(0, sender=sender, version=1)
            old = list(sender.buckets(1))
            bump_weights(trainer)
            with pytest.raises(WeightSyncError, match="bucket 1"):
                broadcast_update(0, sender=sender, version=2, buckets=corrupted(sender.buckets(2), 1))
            with pytest.raises(WeightSyncError, match="trainer died"):
                broadcast_update(0, sender=sender, version=2, buckets=interrupted(sender.buckets(2), 2))
            with pytest.raises(WeightSyncError, match=STALE_0):
                broadcast_update(0, sender=sender, version=2, buckets=stale(sender.buckets(2), old, 0))
            with pytest.raises(WeightSyncError, match=MISROUTED_1):
                broadcast_update(0, sender=sender, version=2, buckets=misrouted(sender.buckets(2), 1))
            for _ in ("receive", "commit"):  # the receiver raises something other than WeightSyncError
                with pytest.raises(WeightSyncError, match="receiver failed on rank 1"):
                    broadcast_update(0, sender=sender, version=2)
            with mock.patch.object(weight_sync, "bcast_bytes", garbling_first(weight_sync.bcast_bytes)):
                with pytest.raises(WeightSyncError, match="rank 1 could not read the update header"):
                    broadcast_update(0, sender=sender, version=2)
            sender.layout = raising(RuntimeError("layout broke"))
            with pytest.raises(WeightSyncError, match="sender failed before the header.*layout broke"):
                broadcast_update(0, sender=sender, version=2)
            del sender.layout
            broadcast_update(0, sender=sender, version=2)
        else:
            rx = WeightReceiver(make_sampler_model())
            assert broadcast_update(0, receiver=rx) == 1
            assert_serves(rx.snapshot(), trainer)
            # corrupt bucket, a sender dying mid-stream, a v1 bucket in the v2 stream, two buckets sent swapped
            for what in ("bucket 1", "aborted", STALE_0, MISROUTED_1):
                with pytest.raises(WeightSyncError, match=what):
                    broadcast_update(0, receiver=rx)
                assert rx.serving_version() == 1
                assert_serves(rx.snapshot(), trainer)
            # a receiver step raising an unexpected error (a device OOM) must not leave the sender waiting
            for step, err, then in (("receive", MemoryError("out of device memory"), "keeps serving"),
                                    ("commit", RuntimeError("copy failed"), "may be partly updated")):
                setattr(rx, step, raising(err))
                with pytest.raises(WeightSyncError, match=f"receiver failed on rank 1 .*{err}.*{then}"):
                    broadcast_update(0, receiver=rx)
                delattr(rx, step)
                assert rx.serving_version() == 1 and rx._staging is None
                assert_serves(rx.snapshot(), trainer)
            # an unreadable header: this rank drains the stream with the others (no hang) and keeps v1
            with pytest.raises(WeightSyncError, match="could not read the update header.*keeps serving"):
                broadcast_update(0, receiver=rx)
            assert rx.serving_version() == 1
            with pytest.raises(WeightSyncError, match="sender failed before the header"):
                broadcast_update(0, receiver=rx)
            assert rx.serving_version() == 1
            assert broadcast_update(0, receiver=rx) == 2
            bump_weights(trainer)
            assert_serves(rx.snapshot(), trainer)
        dist.barrier()  # both ranks past their last collective before either closes its pairs (as close_group)
    finally:  # no barrier after a failure: the peer may be inside another collective
        dist.destroy_process_group()
