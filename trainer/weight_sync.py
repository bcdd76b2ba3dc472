"""Weight sync trainer -> N samplers: buckets of layers, each checksummed, the update stamped with a policy version.

    sender = WeightSender(trainer_model, plan)                 # plan: rl4bit.trainer.plan.quant_plan
    receivers = [ray.remote(WeightReceiver).remote(model_factory) ...]   # or in-process WeightReceiver(model)
    sync_ray(sender, receivers, version=7)                     # Ray object store
    broadcast_update(src=0, sender=... | receiver=..., version=7)   # torch.distributed (NCCL / gloo)
    receiver.apply(*sender.tensors(version=7))                  # same process, engine target: device tensors

Payload: the checkpoint's own encoding (`rl4bit.common.checkpoint_format` /
`rl4bit.common.ct_layout`): each bucket is a safetensors blob of the stored tensors of
whole decoder layers (NVFP4 codes + E4M3 scales + global scales, MXFP8, dense),
the trainer forward's QTensors bit for bit. The sender builds one bucket at a
time, so its extra memory is one bucket (plus the transport's copy of it).

Each payload is stamped with what it is: its safetensors metadata holds
`{"version", "index", "count"}` (`STAMP_KEY`), inside the bytes the SHA-256
covers. The receiver checks the stamp against the bucket it expects (the
update it is staging, the index the transport hands it), so a bucket left over
from an earlier version, or sent under another index, cannot pass for it,
whatever the `Bucket` fields around it say.

Receiver protocol (`WeightReceiver`): `begin(version, n, layout)` ->
`receive(version, i, payload, sha256)` per bucket (verified at once: its
SHA-256, then its stamp against (version, i, n)) -> `commit(version)`. Buckets
are staged (decoded, host memory: one copy of the update, what makes the switch
all-or-nothing); `commit` checks that every bucket arrived and verified and
every tensor fits its live buffer, then copies them in place (`copy_`:
pointer-stable, so CUDA graphs stay valid) and only then switches `version`. A
corrupt, missing, duplicated, stale or misrouted bucket, or an interrupted
sender, is fail-stop: WeightSyncError naming the bucket and what to do; the
staging is dropped and the previous version keeps serving.

Targets: a model whose quantized modules are in serving mode
(`surgery.load_quantized`; the QTensors' storage is overwritten in place, the
first sync into a not-yet-serving module calls load_quantized once), a plain
model (quantized weights are decoded into its parameters), or an
EmbeddedEngine (QTensors and dense tensors together through
`engine.update_weights(update, quantized)`, which owns the engine's version).
The RL loop (`rl4bit.sampler_sync.sync_weights`) drives the same protocol through
actor calls: `Trainer.weight_header` / `weight_bucket`, `Sampler.begin_update`
/ `receive_bucket` / `commit_update`.

In-process fast path (`WeightSender.tensors` -> `WeightReceiver.apply`; the
driver's local mode with a single-rank trainer and embedded samplers:
`Trainer.weight_tensors` -> `Sampler.apply_tensors`): the same values as the
buckets (`checkpoint_format.entry_value`, the very call `encode_entry` makes:
QTensors re-quantized from the masters with nearest rounding, dense tensors as
the sender's live tensors) handed over as device tensors, as
`WeightUpdate(version, dense)` + {module: {param: QTensor}}; no bytes, no
checksums, no host staging. Dense tensors are cast to the receiver's live
dtype exactly as a bucket's are, then `engine.update_weights(update,
quantized)` checks everything (names, shapes, dtypes, formats, finite values;
the receiver first checks the version is newer and that every tensor of the
model is there) before it copies anything, and switches the version last;
a rejection is the same WeightSyncError, and the previous version keeps
serving. Memory: the whole update exists at once, i.e. one extra copy of the
quantized weights on the sender's device (plus, per receiver while it applies,
a cast copy of the dense tensors when its dtype differs from the sender's),
where the buckets stage that copy in host memory.

Leaves out: multi-node object-store tuning, NCCL-specific bucketing (the
broadcast sends the same blobs as uint8 tensors), partial (per-layer) updates.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from rl4bit.common.checkpoint_format import (
    CheckpointError,
    Entry,
    decode_entry,
    encode_entry,
    entries_from_json,
    entry_value,
    group_by_layer,
    layout_json,
    metadata,
    model_layout,
    pack,
    unpack,
)
from rl4bit.common.weight_update import WeightUpdate
from rl4bit.kernels import QTensor, dequantize
from rl4bit.kernels.checks import all_finite
from rl4bit.trainer.surgery import quant_modules

DEFAULT_BUCKET_BYTES = 256 << 20
STAMP_KEY = "rl4bit.trainer.weight_sync"  # safetensors metadata of a bucket: JSON {"version", "index", "count"}


class WeightSyncError(RuntimeError):
    """A weight update that was rejected; the receiver keeps serving its previous version."""


@dataclass
class Bucket:
    """Bucket `index` of `count` of update `version`; `payload` carries the same three in its stamp (`STAMP_KEY`)."""

    version: int
    index: int
    count: int
    payload: bytes
    sha256: str


def update_bytes(update, quantized: dict) -> int:
    """Bytes of an in-process update (`WeightSender.tensors`): dense tensors plus QTensors (data, scale, outer)."""
    return (sum(t.numel() * t.element_size() for t in update.tensors.values())
            + sum(q.nbytes for params in quantized.values() for q in params.values()))


def pack_bucket(tensors: dict[str, torch.Tensor], outers: dict, version: int, index: int, count: int) -> bytes:
    """safetensors bytes of a bucket: `checkpoint_format.pack`'s layout plus the stamp (version, index, count)."""
    stamp = json.dumps({"version": version, "index": index, "count": count})
    return pack(tensors, outers, {STAMP_KEY: stamp})


def bucket_stamp(payload: bytes, where: str = "bucket") -> dict | None:
    """The stamp {"version", "index", "count"} of a bucket payload, or None when it has none (header only)."""
    meta = metadata(payload, where)
    return json.loads(meta[STAMP_KEY]) if STAMP_KEY in meta else None


def stored_bytes(e: Entry, dense_bytes: int = 2) -> int:
    """Estimated bytes of one weight as stored (for bucket planning only)."""
    n = 1
    for s in e.shape:
        n *= int(s)
    if e.fmt == "nvfp4":
        return n // 2 + n // 16 + 8 * int(e.shape[0]) * 3
    if e.fmt == "mxfp8":
        return n + n // 32
    return n * dense_bytes


class WeightSender:
    """Streams a (converted) trainer model as checksummed buckets of whole layers."""

    def __init__(self, model, plan: dict[str, str], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dense_dtype=None):
        self.model, self.plan, self.dense_dtype = model, dict(plan), dense_dtype
        self.entries = model_layout(model, plan)
        self.groups: list[list[Entry]] = []
        size = 0
        for layer in group_by_layer(self.entries):
            b = sum(stored_bytes(e) for e in layer)
            if self.groups and size + b <= bucket_bytes:
                self.groups[-1].extend(layer)
                size += b
            else:
                self.groups.append(list(layer))
                size = b

    @property
    def num_buckets(self) -> int:
        return len(self.groups)

    def layout(self) -> dict:
        return layout_json(self.entries, self.plan)

    def bucket(self, version: int, i: int) -> Bucket:
        tensors: dict[str, torch.Tensor] = {}
        outers: dict[str, list] = {}
        quantized: dict[str, dict] = {}  # a module's weights quantized once per bucket (layers are whole in one)
        with torch.no_grad():
            for e in self.groups[i]:
                encoded = encode_entry(self.model, e, self.dense_dtype, outers, quantized)
                tensors.update({k: v.cpu() for k, v in encoded.items()})
        payload = pack_bucket(tensors, outers, version, i, len(self.groups))
        return Bucket(version, i, len(self.groups), payload, hashlib.sha256(payload).hexdigest())

    def tensors(self, version: int):
        """The whole update `version` as tensors on the model's device, for a receiver in this process.

        -> (WeightUpdate(version, {state-dict name: dense tensor}), {module: {param: QTensor}}):
        what the buckets carry, computed by the same call (`entry_value`), before
        any encoding. Dense tensors are the live ones when `dense_dtype` is None
        (not copies: receivers must only read them); the QTensors are new (one
        copy of the quantized weights, held until the caller drops them).
        """
        dense: dict[str, torch.Tensor] = {}
        quantized: dict[str, dict[str, QTensor]] = {}
        cache: dict[str, dict] = {}
        with torch.no_grad():
            for e in self.entries:
                value = entry_value(self.model, e, self.dense_dtype, cache)
                if isinstance(value, QTensor):
                    quantized.setdefault(e.module, {})[e.param] = value
                else:
                    dense[e.name] = value
        return WeightUpdate(version=version, tensors=dense), quantized

    def buckets(self, version: int) -> Iterator[Bucket]:
        for i in range(len(self.groups)):
            yield self.bucket(version, i)


# ------------------------------------------------------------------ receiver


class WeightReceiver:
    """Stages a versioned update bucket by bucket; switches only on a complete, verified update."""

    def __init__(self, target):
        self.target = target() if callable(target) and not isinstance(target, torch.nn.Module) else target
        self.version = 0
        self._staging: dict | None = None

    @property
    def model(self):
        return self.target.model if hasattr(self.target, "update_weights") else self.target  # an engine, or the model

    def serving_version(self) -> int:
        if hasattr(self.target, "update_weights"):
            return int(getattr(self.target, "version", self.version))
        return self.version

    def begin(self, version: int, count: int, layout: dict) -> None:
        self._staging = None
        if not isinstance(version, int) or version <= self.serving_version():
            raise WeightSyncError(f"update v{version} is not newer than the serving v{self.serving_version()}; "
                                  "stamp updates with increasing policy versions")
        self._staging = {"version": version, "count": int(count), "entries": entries_from_json(layout), "buckets": {}}

    def abort(self, reason: str = "aborted by the sender") -> None:
        self._staging = None

    def _fail(self, msg: str):
        self._staging = None
        raise WeightSyncError(f"{msg}; update dropped, v{self.serving_version()} keeps serving")

    def receive(self, version: int, index: int, payload: bytes, sha256: str) -> None:
        st = self._staging
        if st is None or st["version"] != version:
            self._fail(f"bucket {index} of v{version} arrived outside an update (begin(v{version}) missing or dropped)")
        if not 0 <= index < st["count"] or index in st["buckets"]:
            self._fail(f"bucket {index} of v{version} is out of range or duplicated "
                       f"(expected 0..{st['count'] - 1} once)")
        try:
            staged = unpack(payload, f"bucket {index}/{st['count']} of v{version}", sha256)
            stamp = bucket_stamp(payload)
        except Exception as e:  # CheckpointError, or a corrupt blob failing inside safetensors
            self._fail(str(e) if isinstance(e, CheckpointError) else f"bucket {index} of v{version} unreadable: {e}")
        want = {"version": version, "index": index, "count": st["count"]}
        if stamp != want:
            found = ("carries no (version, index) stamp" if not isinstance(stamp, dict) else
                     f"is bucket {stamp.get('index')}/{stamp.get('count')} of v{stamp.get('version')} by its stamp")
            self._fail(f"expected bucket {index}/{st['count']} of v{version}, but the payload {found} (a stale or "
                       f"misrouted bucket); resend update v{version} built from the trainer's current weights")
        st["buckets"][index] = staged

    def commit(self, version: int) -> int:
        st = self._staging
        if st is None or st["version"] != version:
            self._fail(f"commit of v{version} without a staged update")
        missing = sorted(set(range(st["count"])) - set(st["buckets"]))
        if missing:
            self._fail(f"update v{version} is incomplete: buckets {missing} of {st['count']} never arrived "
                       "(sender interrupted?); resend the whole update")
        tensors, outers = {}, {}
        for b, o in st["buckets"].values():
            tensors.update(b)
            outers.update(o)
        try:
            apply = _Apply(self.target, self.model)
            for e in st["entries"]:
                apply.add(e, decode_entry(tensors, e, outers))
            apply.run(version)
        except (KeyError, ValueError) as err:
            self._fail(f"update v{version} does not fit this model: {err}")
        self._staging = None
        self.version = version
        return version

    def apply(self, update, quantized: dict) -> int:
        """Apply an in-process update (`WeightSender.tensors`) to an engine target, all-or-nothing; its version.

        The fast path beside begin/receive/commit: the same checks and the same
        switch (see the module docstring), without bytes or checksums. Only
        for targets with `update_weights` (engines): a plain model takes buckets.
        """
        self._staging = None  # a whole update supersedes any half-staged bucket update
        version = getattr(update, "version", None)
        if not hasattr(self.target, "update_weights"):
            self._fail(f"update v{version} as tensors needs an engine target (update_weights); send buckets")
        if not isinstance(version, int) or version <= self.serving_version():
            self._fail(f"update v{version} is not newer than the serving v{self.serving_version()}; "
                       "stamp updates with increasing policy versions")
        try:
            apply = _Apply(self.target, self.model)
            for name, value in update.tensors.items():
                apply.add_dense(name, value)
            for module, params in quantized.items():
                for param, q in params.items():
                    apply.add_quantized(module, param, q)
            apply.check_complete()
            apply.run(version)
        except (KeyError, ValueError) as err:
            self._fail(f"update v{version} does not fit this model: {err}")
        self.version = version
        return version

    def quantized(self) -> dict:
        """{module: {param: QTensor}} now served (in-process use)."""
        return {n: dict(m.served) for n, m in quant_modules(self.model).items() if m.served is not None}

    def snapshot(self) -> bytes:
        """safetensors bytes of everything served: `q.{module}.{param}.{data,scale,outer}` (fp8 as uint8) and
        `dense.{state-dict name}`; for parity checks across processes without pickling tensors."""
        out = {}
        for module, params in self.quantized().items():
            for param, q in params.items():
                for field in ("data", "scale", "outer"):
                    t = getattr(q, field)
                    out[f"q.{module}.{param}.{field}"] = t.view(torch.uint8) if t.element_size() == 1 else t.clone()
        for k, v in self.model.state_dict().items():
            out[f"dense.{k}"] = v.detach().clone()
        return pack(out)


class _Apply:
    """Checks every (destination, source) pair first, then copies: all or nothing.

    EmbeddedEngine targets: the dense tensors and the QTensors go together
    through `engine.update_weights(update, quantized)`, which checks them all,
    copies them in place and switches the engine's version in one step.
    """

    def __init__(self, target, model):
        self.target, self.model = target, model
        self.engine = hasattr(target, "update_weights")
        self.copies: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        self.loads: list[tuple[torch.nn.Module, str, QTensor]] = []
        self.engine_dense: dict[str, torch.Tensor] = {}
        self.engine_q: dict[str, dict[str, QTensor]] = {}
        self.live = model.state_dict(keep_vars=True)

    @staticmethod
    def _check(dst: torch.Tensor, src: torch.Tensor, name: str, exact_dtype: bool) -> None:
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"{name}: update shape {tuple(src.shape)} != live {tuple(dst.shape)}")
        if exact_dtype and dst.dtype != src.dtype:
            raise ValueError(f"{name}: update dtype {src.dtype} != live {dst.dtype}")
        if not all_finite(src):
            raise ValueError(f"{name}: holds NaN/Inf")

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, name: str, exact_dtype: bool) -> None:
        self._check(dst, src, name, exact_dtype)
        self.copies.append((dst, src, name))

    def add(self, e: Entry, value) -> None:
        module = self.model.get_submodule(e.module) if e.module else self.model
        if isinstance(value, QTensor):
            served = getattr(module, "served", False)
            if served is not False and getattr(module.spec, "fmt", None) == value.fmt:
                if self.engine:
                    self.engine_q.setdefault(e.module, {})[e.param] = value
                elif served is None:
                    self.loads.append((module, e.param, value))
                else:
                    live = served[e.param]
                    for field in ("data", "scale", "outer"):
                        self._copy(getattr(live, field), getattr(value, field), f"{e.name}.{field}", True)
                return
            dst = getattr(module, e.param)
            value = dequantize(value, dst.dtype)
            value = value if e.fused else value.reshape(dst.shape)
        if self.engine:
            self.add_dense(e.name, value)
            return
        self._copy(getattr(module, e.param), value, e.name, False)

    def add_dense(self, name: str, value: torch.Tensor) -> None:
        """Engine targets: a dense tensor by state-dict name, cast to the live tensor's dtype. Shapes and values
        are checked once, by `engine.update_weights` (one finiteness read a tensor, not two)."""
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name}: {type(value).__name__} is not a tensor")
        if name not in self.live:
            raise ValueError(f"{name}: not a tensor of the sampler's model")
        self.engine_dense[name] = value.to(self.live[name].dtype)

    def add_quantized(self, module: str, param: str, q: QTensor) -> None:
        """Engine targets: a served module's QTensor (the engine checks format, shapes, dtypes and values)."""
        if not isinstance(q, QTensor):
            raise ValueError(f"{module}.{param}: {type(q).__name__} is not a QTensor")
        self.engine_q.setdefault(module, {})[param] = q

    def check_complete(self) -> None:
        """Engine targets: every dense tensor and every served module's weights are in the update."""
        missing = sorted(set(self.live) - set(self.engine_dense))
        missing += sorted(f"{n}.{p}" for n, m in quant_modules(self.model).items() if m.served is not None
                          for p in m.served if p not in self.engine_q.get(n, {}))
        if missing:
            raise ValueError(f"the update lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}; "
                             "send the whole model")

    def run(self, version: int) -> None:
        if self.engine:
            self.target.update_weights(WeightUpdate(version=version, tensors=self.engine_dense), self.engine_q)
            return
        by_module: dict[torch.nn.Module, dict] = {}
        for module, param, q in self.loads:
            by_module.setdefault(module, {})[param] = q
        problems = [p for module, qw in by_module.items() for p in module.quantized_problems(qw)]
        if problems:  # before any module changes: all or nothing
            raise ValueError("; ".join(problems))
        with torch.no_grad():
            for module, qw in by_module.items():
                module.load_quantized(qw, check=False)  # checked above
            for dst, src, _ in self.copies:
                dst.copy_(src)


# ------------------------------------------------------------------ transports


def sync_ray(sender: WeightSender, receivers: list, version: int, *, buckets: Iterable[Bucket] | None = None) -> int:
    """Push update `version` to Ray actor receivers (WeightReceiver actors) through the object store.

    One bucket in flight: each is put, received and verified by every actor
    (SHA-256, then its stamp against (`version`, `b.index`, the sender's
    bucket count): a stale `buckets` list fails there), then released. Any
    failure aborts the update on every receiver and raises WeightSyncError;
    they keep serving their previous version. Returns bytes sent per receiver.
    """
    import ray

    ray.get([r.begin.remote(version, sender.num_buckets, sender.layout()) for r in receivers])
    sent = 0
    try:
        for b in (buckets if buckets is not None else sender.buckets(version)):
            ref = ray.put(b.payload)
            ray.get([r.receive.remote(version, b.index, ref, b.sha256) for r in receivers])
            sent += len(b.payload)
            del ref
        ray.get([r.commit.remote(version) for r in receivers])
    except BaseException as e:
        ray.get([r.abort.remote(str(e)) for r in receivers])
        if isinstance(e, WeightSyncError):  # Ray's RayTaskError(WeightSyncError) is one too
            raise
        raise WeightSyncError(f"weight sync to v{version} failed ({type(e).__name__}: {e}); "
                              "receivers keep serving their previous version") from e
    return sent


def bcast_bytes(data: bytes | None, src: int, group) -> bytes | None:
    """Broadcast one byte string from `src` (None there = abort marker); returns it on every rank (None = abort)."""
    import torch.distributed as dist

    is_src = dist.get_rank() == src
    n = torch.tensor([(-1 if data is None else len(data)) if is_src else 0], dtype=torch.int64)
    dist.broadcast(n, src, group=group)
    if int(n) < 0:
        return None
    if int(n) == 0:
        return b""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if is_src else torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src, group=group)
    return data if is_src else buf.numpy().tobytes()


def bcast_header(src: int, build, group) -> tuple[bytes | None, str | None]:
    """An update's header from rank `src` (which passes `build`, a function returning its bytes) to every rank:
    (the header, None), or (None, why) on every rank when `build` raised (the receivers, waiting for a header,
    get the abort marker instead)."""
    import torch.distributed as dist

    if dist.get_rank() == src:
        try:
            blob = build()
        except Exception as e:
            bcast_bytes(None, src, group)
            return None, f"sender failed before the header ({type(e).__name__}: {e})"
        return bcast_bytes(blob, src, group), None
    blob = bcast_bytes(None, src, group)
    return (None, "sender failed before the header") if blob is None else (blob, None)


def _receiver_step(receiver: WeightReceiver, step, *args, applying: bool = False) -> str | None:
    """Run one receiver step; its failure as a message (None: it succeeded). Whatever it raises, the rank stays in
    the collective (a rank leaving on an unexpected error would hang the others) and drops the staged update.
    applying: the step is the commit, which copies into the target: an unexpected error there (a device OOM
    part-way through a plain model's modules) may leave the target's weights partly updated, and says so."""
    import torch.distributed as dist

    try:
        step(*args)
    except WeightSyncError as e:
        return str(e)
    except Exception as e:
        receiver.abort(f"{type(e).__name__}: {e}")
        where = f"receiver failed on rank {dist.get_rank()} ({type(e).__name__}: {e})"
        if applying:
            return (f"{where} while applying the update: its weights may be partly updated (still stamped "
                    f"v{receiver.serving_version()}); rebuild or resync it")
        return f"{where}; update dropped, v{receiver.serving_version()} keeps serving"
    return None


def broadcast_update(src: int, *, sender: WeightSender | None = None, receiver: WeightReceiver | None = None,
                     version: int | None = None, buckets: Iterable[Bucket] | None = None, group=None) -> int:
    """Collective weight update over torch.distributed (gloo on CPU, NCCL on GPU once blobs live on device).

    Rank `src` passes `sender` and `version`; every other rank a `receiver`,
    which checks the n-th blob of the stream as bucket n of the header's
    version (SHA-256, then stamp): buckets go in order. An exception on the
    sender before its header or mid-stream broadcasts an abort marker, so
    receivers never wait forever; a receiver step raising anything drops its
    staged update and stays in the collective. All ranks then agree
    (all_reduce MIN over the failing ranks) on whether every receiver
    committed; on any failure every rank raises
    WeightSyncError carrying the lowest failing rank's message. A receiver
    that failed keeps its previous version (or, failing while applying, says
    it may be partly updated); one that committed serves the new version.
    Returns the update's version.
    """
    import torch.distributed as dist

    me = dist.get_rank()
    if me == src:
        _, error = bcast_header(src, lambda: json.dumps(
            {"version": version, "count": sender.num_buckets, "layout": sender.layout()}).encode(), group)
        if error is None:
            try:
                for b in (buckets if buckets is not None else sender.buckets(version)):
                    bcast_bytes(b.sha256.encode() + b.payload, src, group)
            except Exception as e:  # tell the receivers, then report
                error = f"sender failed mid-stream ({type(e).__name__}: {e})"
                bcast_bytes(None, src, group)
            else:
                bcast_bytes(b"", src, group)  # end of stream
    else:
        blob, error = bcast_header(src, None, group)
        if blob is not None:
            try:
                h = json.loads(blob)
                version, count, layout = h["version"], h["count"], h["layout"]
            except (ValueError, KeyError, TypeError) as e:  # drain the stream below with the others, then report
                error = (f"receiver on rank {me} could not read the update header ({type(e).__name__}: {e}); "
                         "it keeps serving its previous version")
            else:
                error = _receiver_step(receiver, receiver.begin, version, count, layout)
            i = 0
            while True:
                blob = bcast_bytes(None, src, group)
                if blob is None:
                    error = error or f"sender aborted update v{version} after {i} bucket(s)"
                    receiver.abort(error)
                    break
                if blob == b"":
                    break
                if error is None:
                    error = _receiver_step(receiver, receiver.receive, version, i, blob[64:],
                                           blob[:64].decode(errors="replace"))
                i += 1
            if error is None:
                error = _receiver_step(receiver, receiver.commit, version, applying=True)
    failed, msg = first_failure(error, group)
    if failed is not None:
        raise WeightSyncError(error if error is not None else f"weight sync v{version} failed on rank {failed}: {msg}")
    return version


def first_failure(error: str | None, group=None) -> tuple[int | None, str | None]:
    """Collective: the lowest rank whose `error` is not None and its message, on every rank; (None, None) when no
    rank failed. How the ranks of a collective update agree on its outcome."""
    import torch.distributed as dist

    me, world = dist.get_rank(), dist.get_world_size()  # global: `me` is a global rank, also in a subgroup
    first = torch.tensor([world if error is None else me], dtype=torch.int64)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)  # lowest failing rank reports for everyone
    if int(first) == world:
        return None, None
    return int(first), bcast_bytes(error.encode() if me == int(first) else None, int(first), group).decode()
