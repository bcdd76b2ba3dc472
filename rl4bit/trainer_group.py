"""N Trainer ranks behind one object with the Trainer's methods: FSDP2-sharded training (issue 9, part 0).

    group = TrainerGroup(cfg, world=2)                 # or world=getattr(cfg.trainer, "world_size", 1)
    get(group.setup_rl())                              # every call runs on all ranks, in lockstep
    metrics = get(group.train_step(batch))             # rank 0's result (the group's reduced metrics)
    version, count, layout = get(group.weight_header())
    bucket = group.weight_bucket(i)                    # all ranks all-gather bucket i's layers; rank 0's bucket
    group.save_checkpoint(run_dir, step, {"data": ...}, keep=2)   # per-rank shards + manifest.json
    meta = group.load_checkpoint(run_dir)              # -> state.json (step, "data", ...); trainer state restored
                                                       # (a one-rank Trainer has the same two, as futures)
    group.shutdown()

Each rank is a `RankWorker` (one process: it joins the torch.distributed group,
gloo on CPU / nccl on CUDA, and holds `Trainer(**trainer_args(cfg, rank, world))`; see
`rl4bit.trainer.sharding`). Where they run: `cluster=` a `rl4bit.actors.Cluster`
in ray mode makes them Ray actors (one GPU each on CUDA); otherwise they are
local processes (`python -m rl4bit.trainer_group RANK PORT`) answering over a
127.0.0.1 socket in frames of JSON plus raw blobs (`send_msg` / `recv_msg`:
bytes as they are, tensors as safetensors bytes, only the TrainBatch and
Bucket dataclasses rebuilt by name; nothing pickled). Methods return
futures for `rl4bit.actors.get` (rank 0's; the other ranks' results are
waited for first so any rank's error surfaces), so the driver code is the
same as for one Trainer.

Checkpoints: rl4bit.common.checkpoint's format, sharded: `RUN_DIR/checkpoints/step_NNNNNN/`
holds `shard_RRRRR.safetensors` per rank (written by the ranks themselves into
the temporary directory: no rank gathers the state), `state.json` and the one
`manifest.json` (SHA-256 and size per file, plus the per-rank tensor index);
swapped in atomically, then `latest.json` moves. On load the driver verifies
the manifest and state.json, each rank its own shard; a bad file raises
CheckpointError naming it and the intact previous checkpoint.

A local rank process that exits, or drops its connection, raises
ActorDiedError("Trainer", ...) (the driver's "the Trainer actor died" + resume hint).

Leaves out: multi-node groups (the rendezvous is 127.0.0.1), restarts of a
dead rank (a failed rank fails the call; the others may block in a collective:
they get ERROR_GRACE_S, then the call raises the failed rank's error and the
local ranks are ended; Ray ranks are killed by `Cluster.shutdown`).
"""

from __future__ import annotations

import dataclasses
import json
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from rl4bit.actors import ActorDiedError, _Done, get
from rl4bit.config import trainer_args
from rl4bit.trainer.actor import Trainer

START_TIMEOUT_S = 600.0
"""Most seconds for the local rank processes to start and connect (imports on a loaded machine)."""
ERROR_GRACE_S = 30.0
"""After one rank failed, seconds the others get to answer before the group is stopped (they may hang in a
collective)."""
CLOSE_TIMEOUT_S = 60.0
"""Most seconds `shutdown` waits for the ranks' barrier + destroy_process_group before ending them."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorker:
    """One trainer rank: joins the group, holds `Trainer(**trainer_args(cfg, rank, world))`."""

    def __init__(self, cfg, rank: int, world: int, addr: str, port: int, local_device: int = 0):
        from rl4bit.trainer.sharding import init_group

        want = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device("cuda", local_device) if want.startswith("cuda") else torch.device("cpu")
        init_group(rank, world, addr, port, device)
        self.rank, self.world = rank, world
        self.trainer = Trainer(**trainer_args(cfg, rank, world))

    def call(self, name: str, *args, **kwargs):
        return getattr(self.trainer, name)(*args, **kwargs)

    def save_shard(self, dir_: str) -> tuple[dict, dict]:
        from rl4bit.trainer.sharding import save_shard

        tensors, meta = self.trainer.state()
        shapes = meta.pop("global_shapes", {})
        return save_shard(dir_, self.rank, self.world, tensors, shapes, meta), meta

    def load_shard(self, dir_: str) -> None:
        from rl4bit.trainer.sharding import load_shard

        tensors, meta = load_shard(dir_, self.rank, self.world)
        self.trainer.load_state(tensors, meta)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The model's full tensors on rank 0 (collectives; for tests and exports, not checkpoints)."""
        return self.trainer.full_state_dict()

    def close(self) -> None:
        from rl4bit.trainer.sharding import close_group

        close_group()


# --------------------------------------------------------------------------- local ranks: JSON frames, nothing pickled


def _dataclasses() -> dict:
    """The dataclasses that may cross between the driver and a local rank (by name; nothing else is built)."""
    from rl4bit.trainer.actor import TrainBatch
    from rl4bit.trainer.weight_sync import Bucket

    return {"TrainBatch": TrainBatch, "Bucket": Bucket}


def _errors() -> dict:
    """Exception types a rank's error is rebuilt as on the driver (others arrive as RuntimeError)."""
    from rl4bit.common.checkpoint_format import CheckpointError
    from rl4bit.config import ConfigError
    from rl4bit.trainer.actor import NonFiniteError
    from rl4bit.trainer.weight_sync import WeightSyncError

    builtin = (ValueError, RuntimeError, TypeError, KeyError, IndexError, FileNotFoundError, TimeoutError,
               NotImplementedError, AssertionError, MemoryError)
    return {c.__name__: c for c in (*builtin, NonFiniteError, WeightSyncError, CheckpointError, ConfigError,
                                    torch.OutOfMemoryError)}  # the driver names the phase and what to shrink


def encode(obj, blobs: list[bytes]):
    """obj -> JSON-able data; bytes and tensors go to `blobs` (tensors as safetensors bytes)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        blobs.append(bytes(obj))
        return {"$": "bytes", "blob": len(blobs) - 1}
    if isinstance(obj, torch.Tensor):
        from safetensors.torch import save

        blobs.append(save({"t": obj.detach().cpu().contiguous()}))
        return {"$": "tensor", "blob": len(blobs) - 1}
    if isinstance(obj, tuple):
        return {"$": "tuple", "items": [encode(v, blobs) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, blobs) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and "$" not in obj:
            return {k: encode(v, blobs) for k, v in obj.items()}
        return {"$": "dict", "items": [[encode(k, blobs), encode(v, blobs)] for k, v in obj.items()]}
    name = type(obj).__name__
    if dataclasses.is_dataclass(obj) and _dataclasses().get(name) is type(obj):
        return {"$": "dataclass", "type": name,
                "fields": {f.name: encode(getattr(obj, f.name), blobs) for f in dataclasses.fields(obj)}}
    raise TypeError(f"a {name} cannot cross between trainer ranks (JSON, bytes, tensors and the dataclasses "
                    f"{sorted(_dataclasses())} only); return plain data from the Trainer method")


def decode(data, blobs: list[bytes]):
    """The inverse of `encode`."""
    if isinstance(data, list):
        return [decode(v, blobs) for v in data]
    if not isinstance(data, dict):
        return data
    tag = data.get("$")
    if tag is None:
        return {k: decode(v, blobs) for k, v in data.items()}
    if tag == "bytes":
        return blobs[data["blob"]]
    if tag == "tensor":
        from safetensors.torch import load

        return load(blobs[data["blob"]])["t"]
    if tag == "tuple":
        return tuple(decode(v, blobs) for v in data["items"])
    if tag == "dict":
        return {decode(k, blobs): decode(v, blobs) for k, v in data["items"]}
    if tag == "dataclass":
        return _dataclasses()[data["type"]](**{k: decode(v, blobs) for k, v in data["fields"].items()})
    raise ValueError(f"unknown tag {tag!r} in a trainer-rank message (driver and rank run different rl4bit versions?)")


def send_msg(sock: socket.socket, obj) -> None:
    """One frame: u64 JSON length, u64 blob count, the JSON, then each blob as u64 length + bytes."""
    blobs: list[bytes] = []
    head = json.dumps(encode(obj, blobs)).encode()
    sock.sendall(struct.pack("<QQ", len(head), len(blobs)) + head)
    for b in blobs:
        sock.sendall(struct.pack("<Q", len(b)))
        sock.sendall(b)


def recv_msg(sock: socket.socket):
    n_head, n_blobs = struct.unpack("<QQ", _read(sock, 16))
    head = json.loads(_read(sock, n_head))
    blobs = [_read(sock, struct.unpack("<Q", _read(sock, 8))[0]) for _ in range(n_blobs)]
    return decode(head, blobs)


def _read(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the other end closed the connection")
        got += k
    return bytes(buf)


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}


def _raise(rank: int, err: dict):
    cls = _errors().get(err["type"])
    msg = err["message"] if cls is not None else f"{err['type']}: {err['message']}"
    try:
        e = (cls or RuntimeError)(msg)
    except Exception:  # noqa: BLE001 - a constructor with other arguments
        e = RuntimeError(f"{err['type']}: {msg}")
    e.add_note(f"raised on trainer rank {rank}:\n{err['traceback']}")
    raise e


def _serve(rank: int, control_port: int) -> None:
    """A local rank process (`python -m rl4bit.trainer_group RANK PORT`): answer {method, args} frames until "close"."""
    from rl4bit.config import JobConfig, from_dict, validate

    sock = socket.create_connection(("127.0.0.1", control_port))
    send_msg(sock, {"rank": rank})
    init = recv_msg(sock)
    try:
        cfg = from_dict(JobConfig, init["cfg"], "")
        validate(cfg)
        worker = RankWorker(cfg, rank, init["world"], init["addr"], init["port"], local_device=rank)
        send_msg(sock, {"ok": None})
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which raises it
        send_msg(sock, {"err": _error(e)})
        return
    while True:
        msg = recv_msg(sock)
        try:
            reply = {"ok": getattr(worker, msg["method"])(*msg["args"], **msg["kwargs"])}
        except BaseException as e:  # noqa: BLE001
            reply = {"err": _error(e)}
        send_msg(sock, reply)
        if msg["method"] == "close":
            return


def _ray_results(futures: list, fetch_rank0: bool = True) -> list:
    """The ranks' results (ready futures, or None to skip; rank 0's left unfetched, None, unless `fetch_rank0`).

    A dead rank is reported before the errors the others raised when it vanished
    from a collective, and as the Trainer (what the driver names): ActorDiedError("Trainer", ...)."""
    values, error = [None] * len(futures), None
    for r, f in enumerate(futures):
        if f is None or (r == 0 and not fetch_rank0):  # None: not ready
            continue
        try:
            values[r] = get(f)
        except ActorDiedError as e:
            raise ActorDiedError("Trainer", f"trainer rank {r} (a RankWorker actor) died: {e.detail}") from None
        except Exception as e:  # noqa: BLE001 - raised below, once no rank turned out dead
            error = error or e
    if error is not None:
        if not fetch_rank0:
            _ray_results(futures[:1])  # did rank 0 die?
        raise error
    return values


class TrainerGroup:
    """`world` trainer ranks (see module docstring); the methods mirror `Trainer`'s and return futures."""

    def __init__(self, cfg, world: int | None = None, *, cluster=None, timeout_s: float = 3600.0):
        self.world = int(world if world is not None else getattr(cfg.trainer, "world_size", 1))
        if self.world < 1:
            raise ValueError(f"trainer.world_size={self.world}; use 1 (one process) or more ranks")
        self.timeout_s = timeout_s
        addr, port = "127.0.0.1", free_port()
        self._procs, self._conns, self._actors = [], [], []
        if cluster is not None and cluster.mode == "ray":
            cuda = str(cfg.trainer.device).startswith("cuda") or (cfg.trainer.device == "auto"
                                                                  and torch.cuda.is_available())
            gpu = 1 if cuda else 0
            self._actors = [cluster.actor(RankWorker, cfg, r, self.world, addr, port, 0, num_gpus=gpu)
                            for r in range(self.world)]
            return
        from rl4bit.config import to_dict

        server = socket.create_server(("127.0.0.1", 0))
        try:
            control = server.getsockname()[1]
            self._procs = [subprocess.Popen([sys.executable, "-m", "rl4bit.trainer_group", str(r), str(control)])
                           for r in range(self.world)]
            self._conns = [None] * self.world
            deadline = time.monotonic() + min(self.timeout_s, START_TIMEOUT_S)
            server.settimeout(1.0)
            while any(c is None for c in self._conns):
                self._check_alive("start")
                if time.monotonic() > deadline:
                    self._kill()
                    raise TimeoutError(f"trainer ranks did not connect within {START_TIMEOUT_S:.0f} s; "
                                       "the group was stopped")
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(self.timeout_s)
                self._conns[recv_msg(conn)["rank"]] = conn
        finally:
            server.close()
        init = {"cfg": to_dict(cfg), "world": self.world, "addr": addr, "port": port}
        for conn in self._conns:
            send_msg(conn, init)
        self._collect("start")

    # ------------------------------------------------------------------ transport
    def _check_alive(self, what: str, ranks=None) -> None:
        for r, p in enumerate(self._procs):
            if (ranks is None or r in ranks) and p.poll() is not None:
                self._kill()
                raise ActorDiedError("Trainer", f"trainer rank {r} exited with code {p.returncode} during {what}; "
                                     "its stderr is above; the group was stopped")

    def _collect(self, what: str) -> list:
        """Every rank's reply; a rank's error is raised once the others answered (or after ERROR_GRACE_S)."""
        results: list = [None] * self.world
        pending = {conn: r for r, conn in enumerate(self._conns)}
        deadline, error = time.monotonic() + self.timeout_s, None
        while pending:
            left = deadline - time.monotonic()
            ready = select.select(list(pending), [], [], max(0.0, min(left, 1.0)))[0]
            if not ready:
                if time.monotonic() >= deadline:
                    self._kill()
                    if error is not None:  # the others hang in a collective the failed rank left
                        _raise(*error)
                    raise TimeoutError(f"trainer ranks {sorted(pending.values())} did not answer {what} within "
                                       f"{self.timeout_s:.0f} s (a rank failed or hangs in a collective); "
                                       "the group was stopped")
                self._check_alive(what, set(pending.values()))
                continue
            for conn in ready:
                r = pending.pop(conn)
                try:
                    msg = recv_msg(conn)
                except (ConnectionError, OSError) as e:
                    self._kill()
                    raise ActorDiedError("Trainer", f"trainer rank {r} dropped its connection during {what} ({e}); "
                                         "the group was stopped") from None
                if "err" in msg and error is None:
                    error = (r, msg["err"])
                    deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
                results[r] = msg.get("ok")
        if error is not None:
            _raise(*error)
        return results

    def _all(self, name: str, *args, **kwargs) -> list:
        """Call `name` on every rank (in lockstep) and return every rank's result."""
        what = args[0] if name == "call" else name  # the Trainer method, for errors
        if self._actors:
            futures = [getattr(a, name)(*args, **kwargs) for a in self._actors]
            self._ray_wait(futures, what, self.timeout_s)
            return _ray_results(futures)
        for r, conn in enumerate(self._conns):
            try:
                send_msg(conn, {"method": name, "args": list(args), "kwargs": kwargs})
            except OSError as e:  # the rank process is gone (killed, crashed)
                self._kill()
                raise ActorDiedError("Trainer", f"trainer rank {r} is unreachable for {what} ({e}); "
                                     "the group was stopped") from None
        return self._collect(what)

    def _rank0(self, name: str, *args, **kwargs):
        if self._actors:
            futures = [getattr(a, name)(*args, **kwargs) for a in self._actors]
            self._ray_wait(futures, args[0] if name == "call" else name, self.timeout_s)
            _ray_results(futures, fetch_rank0=False)  # surfaces any rank's error; rank 0's future goes on unfetched
            return futures[0]
        return _Done(self._all(name, *args, **kwargs)[0])

    def _ray_wait(self, futures: list, what: str, timeout_s: float) -> None:
        """Until every rank's future is ready (not fetched). When some are done and others still run ERROR_GRACE_S
        later, a failed one's error is raised (the others may hang in a collective it left; Ray shutdown ends them)."""
        import ray

        refs = [f.ref for f in futures]
        start, first_done = time.monotonic(), None
        while True:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=1.0, fetch_local=False)
            if not pending:
                return
            now = time.monotonic()
            if done and first_done is None:
                first_done = now
            if first_done is not None and now - first_done > ERROR_GRACE_S:
                _ray_results([f if f.ref in done else None for f in futures])  # raises a failed rank's error
                first_done = now
            if now - start > timeout_s:
                ranks = [r for r, ref in enumerate(refs) if ref in pending]
                raise TimeoutError(f"trainer ranks {ranks} did not answer {what} within {timeout_s:.0f} s "
                                   "(a rank failed or hangs in a collective)")

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait(10)
        for c in self._conns:
            if c is not None:
                c.close()

    # ------------------------------------------------------------------ the Trainer's methods
    def warm_start(self, samples, **settings):
        return self._rank0("call", "warm_start", samples, **settings)

    def setup_rl(self):
        return self._rank0("call", "setup_rl")

    def train_step(self, batch):
        return self._rank0("call", "train_step", batch)

    def weight_header(self):
        return self._rank0("call", "weight_header")

    def weight_bucket(self, index: int):
        return self._rank0("call", "weight_bucket", index)

    def full_state_dict(self):
        return self._rank0("full_state_dict")

    def state(self):
        raise NotImplementedError("a sharded trainer writes its own checkpoint shards: call "
                                  "group.save_checkpoint(run_dir, step, meta) instead of state() + save_checkpoint")

    def load_state(self, tensors, meta):
        raise NotImplementedError("a sharded trainer reads its own shards: call group.load_checkpoint(run_dir)")

    # ------------------------------------------------------------------ sharded checkpoints
    def save_checkpoint(self, run_dir: str | Path, step: int, meta: dict, keep: int = 2) -> Path:
        """Every rank writes its shard into the temporary dir; state.json + manifest; swapped in atomically; pruned.

        state.json holds `meta`, the step and rank 0's trainer meta (each rank's own is in its shard)."""
        from rl4bit.common.checkpoint import begin_checkpoint, commit_checkpoint
        from rl4bit.trainer.sharding import merge_shards

        tmp = begin_checkpoint(run_dir, step)
        try:
            results = self._all("save_shard", str(tmp))
            files, index = merge_shards([r[0] for r in results])
        except BaseException:  # the shards written so far are a copy of the training state: do not leave them
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return commit_checkpoint(tmp, step, {"trainer": results[0][1], **meta}, files, keep=keep, index=index)

    def load_checkpoint(self, run_dir: str | Path) -> dict:
        """Restore every rank from the latest sharded checkpoint (call after setup_rl); returns its state.json.

        FileNotFoundError when the run has none; CheckpointError for a bad file (named) or another world size."""
        from rl4bit.common.checkpoint import open_checkpoint

        ckpt, _, meta = open_checkpoint(run_dir, self.world)
        self._all("load_shard", str(ckpt))
        return meta

    def shutdown(self) -> None:
        """Barrier + destroy the group on every rank (at most CLOSE_TIMEOUT_S), then end the local processes.

        Ray mode: a rank that does not close in time raises TimeoutError; `Cluster.shutdown` kills its actor."""
        if self._actors:
            futures, self._actors = [a.close() for a in self._actors], []
            self._ray_wait(futures, "close", CLOSE_TIMEOUT_S)
            _ray_results(futures)
            return
        if not self._conns:
            return
        try:
            if all(p.poll() is None for p in self._procs):  # after a timeout the ranks are already ended
                self.timeout_s = min(self.timeout_s, CLOSE_TIMEOUT_S)
                self._all("close")
        finally:
            for p in self._procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            self._kill()
            self._procs, self._conns = [], []


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
