"""Where the plain classes run: the ONE place they are wrapped for Ray.

    cluster = Cluster(cfg, run_dir)             # starts Ray (or not, in local mode)
    trainer = cluster.actor(Trainer, **trainer_args(cfg))   # a proxy: trainer.train_step(batch) returns a future
    metrics = get(trainer.train_step(batch))    # ray.get in ray mode, the value itself in local mode
    cluster.shutdown()

`ray` mode: every actor is `ray.remote(cls)` on a Ray cluster. Without
`ray.address` the command starts a private one: bound to 127.0.0.1, no
dashboard, usage stats off, its temp/session files and its auth token
(`auth_token`, mode 0600, instead of ~/.ray/auth_token) under `RUN_DIR/ray` (or
`ray.temp_dir`). Unix socket paths are limited to ~107 bytes, so Ray is
pointed at a short symlink in /tmp to that directory (removed at shutdown).
Actors ask for 0 CPUs (they take turns: sample, then train), and each process
gets `run.cpu_threads` torch threads. `local` mode builds the same classes
in-process; calls run when made, so pdb and pytest work.

A dead actor (killed, OOM, segfault) surfaces from `get` as `ActorDiedError`
naming it (e.g. "the Trainer actor died", "the Sampler 2 of 4 actor died"),
never as a bare Ray error; an exception an actor's method raises comes back as
itself, with a note naming the actor.
`cluster.actor(cls, ..., restarts=N)` lets Ray restart it up to N times (it is
rebuilt from the same constructor arguments); the caller decides what a
restarted actor needs (the driver re-sends the samplers the current weights
and redoes the step's rollouts). In-flight calls are never retried by Ray.

Leaves out: placement groups, GPU packing of several actors per device,
restarting the Trainer (its state lives in checkpoints: `--resume`).
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from pathlib import Path

from rl4bit.config import ConfigError, JobConfig


def resolve_mode(cfg: JobConfig) -> str:
    if cfg.ray.mode != "auto":
        return cfg.ray.mode
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        return "local"
    return "ray"


class _Done:
    """A local call's result, shaped like a future."""

    def __init__(self, value):
        self.value = value


def _value(x):
    return x.value if isinstance(x, _Done) else x


def _named(e: BaseException, label: str) -> BaseException:
    """`e` with a note naming the actor that raised it (its type kept, so callers still catch it as before)."""
    note = f"raised by the {label} actor"
    if note not in getattr(e, "__notes__", ()):
        e.add_note(note)
    return e


class _LocalProxy:
    def __init__(self, obj, label: str):
        self._obj, self._label = obj, label

    def __getattr__(self, name):
        fn = getattr(self._obj, name)

        def call(*a, **k):
            try:
                return _Done(fn(*[_value(x) for x in a], **{n: _value(v) for n, v in k.items()}))
            except Exception as e:
                raise _named(e, self._label)
        return call


def is_local(actor) -> bool:
    """True for an actor built in this process (`local` mode): its calls run here, on the objects themselves."""
    return isinstance(actor, _LocalProxy)


class ActorDiedError(RuntimeError):
    """An actor process died (killed, out of memory, crashed); `actor` is its class name, `label` the name the
    message gives it (e.g. "Sampler 2 of 4" where several replicas run)."""

    def __init__(self, actor: str, detail: str, hint: str = "", label: str | None = None):
        self.actor, self.detail, self.label = actor, detail, label or actor
        super().__init__(f"the {self.label} actor died ({detail})" + (f"; {hint}" if hint else ""))


class _RayFuture:
    """A Ray ObjectRef plus the class name and label of the actor computing it (for the errors `get` raises)."""

    def __init__(self, ref, actor: str, label: str):
        self.ref, self.actor, self.label = ref, actor, label


def _ref(x):
    return x.ref if isinstance(x, _RayFuture) else x


class _RayProxy:
    def __init__(self, handle, actor: str, label: str):
        self._handle, self._actor, self._label = handle, actor, label

    def __getattr__(self, name):
        method = getattr(self._handle, name)
        return lambda *a, **k: _RayFuture(method.remote(*[_ref(x) for x in a], **{n: _ref(v) for n, v in k.items()}),
                                          self._actor, self._label)


def get(futures):
    """Wait for one future or a list of them (the results, in order).

    An actor's exception is re-raised as itself, with a note naming the actor
    (its label: "Sampler 2 of 4"); a dead actor raises ActorDiedError naming it.
    The futures are awaited in order, so the first one that failed is the one named.
    """
    many = isinstance(futures, list)
    items = futures if many else [futures]
    if all(isinstance(f, _Done) for f in items):
        values = [f.value for f in items]
    else:
        import ray

        values = []
        for f in items:
            try:
                values.append(ray.get(_ref(f)))
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, ray.exceptions.RayActorError):  # a future argument's actor died
                    raise _died(items, e.cause) from None
                if isinstance(e.cause, Exception):
                    raise (_named(e.cause, f.label) if isinstance(f, _RayFuture) else e.cause) from None
                raise
            except ray.exceptions.RayActorError as e:
                raise _died(items, e) from None
    return values if many else values[0]


def _died(items: list, err: Exception) -> ActorDiedError:
    """ActorDiedError naming the first of `items` whose actor is dead."""
    import ray

    futures = [f for f in items if isinstance(f, _RayFuture)]
    dead = futures[0] if futures else None
    for f in futures:
        try:
            ray.get(f.ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead = f
            break
        except Exception:  # not ready, or failed for another reason
            continue
    detail = str(err).strip().splitlines()
    return ActorDiedError(dead.actor if dead else "?", detail[0] if detail else type(err).__name__,
                          label=dead.label if dead else None)


def wait_alive(proxy, timeout_s: float = 300.0) -> dict:
    """Call `proxy.health()` until the (restarting) actor answers; its answer. ActorDiedError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return get(proxy.health())
        except ActorDiedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Cluster:
    """Starts (and stops) what the actors run on; `actor(cls, *args)` builds one."""

    def __init__(self, cfg: JobConfig, run_dir: str | Path):
        self.mode = resolve_mode(cfg)
        self.cfg = cfg
        self._link = None
        self._saved_env = {}
        self._handles = []
        if self.mode == "ray":
            self._start_ray(Path(run_dir))

    def _start_ray(self, run_dir: Path) -> None:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        threads = str(self.cfg.run.cpu_threads or os.cpu_count() or 1)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "RAY_USAGE_STATS_ENABLED": "0"}
        if "RL4BIT_FUSED" in os.environ:  # every actor runs the fused kernels as the driver says (kernels.fused)
            env["RL4BIT_FUSED"] = os.environ["RL4BIT_FUSED"]
        if self.cfg.ray.address is not None:
            ray.init(address=self.cfg.ray.address, runtime_env={"env_vars": env}, log_to_driver=True)
            return
        temp = Path(self.cfg.ray.temp_dir or run_dir / "ray").expanduser().resolve()
        if temp.exists() and not temp.is_dir():
            raise ConfigError(f"ray.temp_dir: {temp} exists and is not a directory; point it at a directory")
        temp.mkdir(parents=True, exist_ok=True)
        token = temp / "auth_token"  # Ray's token auth: this cluster's token lives here, not in ~/.ray
        if not token.exists():
            fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self._saved_env = {"RAY_AUTH_TOKEN_PATH": os.environ.get("RAY_AUTH_TOKEN_PATH")}
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)  # Ray turns token auth on by default for a new local cluster
        self._link = Path(tempfile.mkdtemp(prefix="rl4bit-")) / "r"
        self._link.symlink_to(temp, target_is_directory=True)
        ray.init(
            num_cpus=self.cfg.ray.num_cpus or os.cpu_count(),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            _temp_dir=str(self._link),
            runtime_env={"env_vars": env},
            log_to_driver=True,
            configure_logging=False,
        )

    def actor(self, cls, *args, num_gpus: float = 0, restarts: int = 0, label: str | None = None, **kwargs):
        """An instance of the plain class `cls` here (local) or as a Ray actor (ray); calls return futures.

        `restarts`: how often Ray may rebuild a dead actor from these arguments (ray mode only). `label`: the
        name its errors give it (default: the class name; "Sampler 2 of 4" for one of several replicas).
        """
        label = label or cls.__name__
        if self.mode == "local":
            return _LocalProxy(cls(*args, **kwargs), label)
        import ray

        handle = ray.remote(cls).options(num_cpus=0, num_gpus=num_gpus, max_restarts=restarts,
                                         max_task_retries=0).remote(*args, **kwargs)
        self._handles.append(handle)
        return _RayProxy(handle, cls.__name__, label)

    def shutdown(self) -> None:
        if self.mode != "ray":
            return
        import ray

        for h in self._handles:
            ray.kill(h)
        self._handles = []
        ray.shutdown()
        if self._link is not None:
            self._link.unlink(missing_ok=True)
            self._link.parent.rmdir()
            self._link = None
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self._saved_env = {}
