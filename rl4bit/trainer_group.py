"""N Trainer ranks behind one object with the Trainer's methods: FSDP2-sharded training (issue 9, part 0).

    group = TrainerGroup(cfg, world=2)                 # or world=getattr(cfg.trainer, "world_size", 1)
    get(group.setup_rl())                              # every call runs on all ranks, in lockstep
    metrics = get(group.train_step(batch))             # rank 0's result (the group's reduced metrics)
    version, count, layout = get(group.weight_header())
    bucket = group.weight_bucket(i)                    # all ranks all-gather bucket i's layers; rank 0's bucket
    group.save_checkpoint(run_dir, step, {"data": ...}, keep=2)   # per-rank shards + index.json
    meta = group.load_checkpoint(run_dir)              # -> the extra meta (e.g. "data"); trainer state restored
    group.shutdown()

Each rank is a `RankWorker` (one process: it joins the torch.distributed group,
gloo on CPU / nccl on CUDA, and holds `Trainer(cfg, rank, world)`; see
`rl4bit.trainer.sharding`). Where they run: `cluster=` a `rl4bit.actors.Cluster`
in ray mode makes them Ray actors (one GPU each on CUDA); otherwise they are
torch.multiprocessing processes (spawn) answering over a Pipe. Methods return
futures for `rl4bit.actors.get` (rank 0's; the other ranks' results are
waited for first so any rank's error surfaces), so the driver code is the
same as for one Trainer.

Checkpoints: `RUN_DIR/checkpoints/step_NNNNNN/` holds `shard_RRRRR.safetensors`
per rank (written by the ranks themselves: no rank gathers the state),
`index.json` and `state.json`; the directory is written under a temporary
name, fsynced and swapped in (`rl4bit.atomic`), then `latest.json` moves.

Leaves out: multi-node groups (the rendezvous is 127.0.0.1), restarts of a
dead rank (a failed rank fails the call; the others may block in a collective
until `timeout_s`, then the local processes are ended).
"""

from __future__ import annotations

import json
import shutil
import socket
import traceback
from pathlib import Path

import torch

from rl4bit.actors import _Done
from rl4bit.atomic import atomic_write_text, fsync_tree, replace_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorker:
    """One trainer rank: joins the group, holds `Trainer(cfg, rank, world)`."""

    def __init__(self, cfg, rank: int, world: int, addr: str, port: int, local_device: int = 0):
        from rl4bit.trainer.sharding import init_group

        want = cfg.trainer.device if cfg.trainer.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device("cuda", local_device) if want.startswith("cuda") else torch.device("cpu")
        init_group(rank, world, addr, port, device)
        from rl4bit.trainer.actor import Trainer

        self.rank, self.world = rank, world
        self.trainer = Trainer(cfg, rank, world)

    def call(self, name: str, *args):
        return getattr(self.trainer, name)(*args)

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
        """The model's full tensors on rank 0 (a collective per tensor; for tests and exports, not checkpoints)."""
        from rl4bit.trainer.sharding import full_value

        out = {k: full_value(v).detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}
        return out if self.rank == 0 else None

    def close(self) -> None:
        from rl4bit.trainer.sharding import close_group

        close_group()


def _serve(conn, cfg, rank, world, addr, port) -> None:
    """A local rank process: build the worker, then answer (method, args) messages until "close"."""
    try:
        worker = RankWorker(cfg, rank, world, addr, port, local_device=rank)
        conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("err", _portable(e)))
        return
    while True:
        name, args = conn.recv()
        try:
            result = getattr(worker, name)(*args)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001
            conn.send(("err", _portable(e)))
        if name == "close":
            return


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it can cross the pipe, else a RuntimeError with its text and traceback."""
    import pickle  # the Pipe's own transport (in-memory, never a file)

    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


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
            gpu = 1 if str(cfg.trainer.device).startswith("cuda") or (cfg.trainer.device == "auto" and torch.cuda.is_available()) else 0
            self._actors = [cluster.actor(RankWorker, cfg, r, self.world, addr, port, 0, num_gpus=gpu)
                            for r in range(self.world)]
            return
        ctx = torch.multiprocessing.get_context("spawn")
        for r in range(self.world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, cfg, r, self.world, addr, port), daemon=True)
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
        self._collect("start")

    # ------------------------------------------------------------------ transport
    def _collect(self, what: str) -> list:
        results, error = [], None
        for r, conn in enumerate(self._conns):
            if not conn.poll(self.timeout_s):
                self._kill()
                raise TimeoutError(f"trainer rank {r} did not answer {what} within {self.timeout_s} s "
                                   "(a rank failed or hangs in a collective); the group was stopped")
            status, value = conn.recv()
            if status == "err" and error is None:
                error = value
            results.append(value)
        if error is not None:
            raise error
        return results

    def _all(self, name: str, *args) -> list:
        """Call `name` on every rank (in lockstep) and return every rank's result."""
        if self._actors:
            from rl4bit.actors import get

            return get([getattr(a, name)(*args) for a in self._actors])
        for conn in self._conns:
            conn.send((name, args))
        return self._collect(name)

    def _rank0(self, name: str, *args):
        if self._actors:
            from rl4bit.actors import get

            futures = [getattr(a, name)(*args) for a in self._actors]
            get(futures[1:])  # surfaces another rank's error; rank 0's future goes on unfetched
            return futures[0]
        return _Done(self._all(name, *args)[0])

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(10)

    # ------------------------------------------------------------------ the Trainer's methods
    def warm_start(self, samples):
        return self._rank0("call", "warm_start", samples)

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
        """Every rank writes its shard into a temporary dir; index + state.json; swapped in atomically; pruned."""
        from rl4bit.trainer.sharding import write_index

        root = Path(run_dir) / "checkpoints"
        root.mkdir(parents=True, exist_ok=True)
        name = f"step_{step:06d}"
        final, tmp = root / name, root / f".{name}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        results = self._all("save_shard", str(tmp))
        infos = [r[0] for r in results]
        write_index(tmp, self.world, infos, {"sharded": True, "step": step, "trainer": results[0][1], **meta})
        fsync_tree(tmp)
        replace_dir(tmp, final)
        atomic_write_text(root / "latest.json", json.dumps({"step": step, "dir": name}))
        for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-max(keep, 1)]:
            shutil.rmtree(old)
        return final

    def load_checkpoint(self, run_dir: str | Path) -> dict:
        """Restore every rank from the latest sharded checkpoint (call after setup_rl); returns its state.json."""
        root = Path(run_dir) / "checkpoints"
        pointer = root / "latest.json"
        if not pointer.is_file():
            raise FileNotFoundError(f"{run_dir} has no checkpoint ({pointer} is missing)")
        ckpt = root / json.loads(pointer.read_text())["dir"]
        meta = json.loads((ckpt / "state.json").read_text())
        if not meta.get("sharded"):
            raise ValueError(f"{ckpt} is a one-process checkpoint; resume it with trainer.world_size=1")
        self._all("load_shard", str(ckpt))
        return meta

    def shutdown(self) -> None:
        """Barrier + destroy the group on every rank, then end the local processes."""
        if self._actors:
            try:
                self._all("close")
            finally:
                self._actors = []
            return
        if not self._conns:
            return
        try:
            if all(p.is_alive() for p in self._procs):  # after a timeout the ranks are already ended
                self._all("close")
        finally:
            for p in self._procs:
                p.join(30)
            self._kill()
            self._procs, self._conns = [], []
