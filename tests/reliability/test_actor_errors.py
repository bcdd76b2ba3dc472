"""Errors from actors name the actor: a method's exception comes back as itself with a note naming the actor
(its label, e.g. "Sampler 2 of 3"), a dead actor as ActorDiedError naming it; futures travel as positional and
keyword arguments alike. Local mode in this process; Ray mode in a subprocess (Ray keeps its auth token per
process, and the other Ray tests start their own clusters)."""

import json
import subprocess
import sys
import textwrap

import pytest

from rl4bit.actors import Cluster, get
from rl4bit.config import load_config

from .conftest import QUICKSTART, SMALL

WORKER = textwrap.dedent('''
    class Worker:
        def __init__(self, fail: bool):
            self.fail = fail

        def value(self, x: int = 0) -> int:
            if self.fail:
                raise ValueError(f"bad input {x}")
            return x + 1

        def add(self, a: int, b: int = 0) -> int:
            return a + b
''')
"""A tiny actor class, built from this source in both modes (Ray unpickles a script's class by value)."""

RAY_SCRIPT = textwrap.dedent('''
    import json, sys
    from rl4bit.actors import ActorDiedError, Cluster, get
    from rl4bit.config import load_config

    cluster = Cluster(load_config(*json.loads(sys.argv[1])), sys.argv[2])
    out = {}
    try:
        good = cluster.actor(Worker, False, label="Worker 1 of 2")
        bad = cluster.actor(Worker, True, label="Worker 2 of 2")
        out["sum"] = get(good.add(good.value(1), b=good.value(2)))
        try:
            get([good.value(1), bad.value(3)])
        except ValueError as e:
            out["raised"] = [type(e).__name__, str(e), getattr(e, "__notes__", [])]
        import time
        import ray
        ray.kill(bad._handle)
        deadline = time.monotonic() + 60
        while "died" not in out:  # ray.kill is asynchronous: a call sent right after may still run in the actor
            try:
                get([good.value(1), bad.value(4)])
            except ActorDiedError as e:
                out["died"] = [e.actor, e.label, str(e).split(" (")[0]]
            except ValueError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        cluster.shutdown()
    print("RESULT " + json.dumps(out))
''')
"""The Ray half: `python -P -c WORKER + RAY_SCRIPT CONFIG RUN_DIR` (CONFIG: JSON [path, overrides])."""


def _worker_class():
    scope: dict = {}
    exec(WORKER, scope)
    return scope["Worker"]


def test_local_actor_errors_name_the_actor_and_keyword_futures_resolve(tmp_path):
    worker = _worker_class()
    cluster = Cluster(load_config(QUICKSTART, SMALL + ["ray.mode=local"]), tmp_path)
    good = cluster.actor(worker, False, label="Worker 1 of 2")
    bad = cluster.actor(worker, True, label="Worker 2 of 2")
    assert get(good.add(good.value(1), b=good.value(2))) == 5  # a future as a keyword argument too
    with pytest.raises(ValueError, match="bad input 3") as e:
        get(bad.value(3))
    assert e.value.__notes__ == ["raised by the Worker 2 of 2 actor"]
    assert get(cluster.actor(worker, False).value(0)) == 1  # no label: the class name


def test_ray_actor_errors_name_the_actor(tmp_path):
    pytest.importorskip("ray")
    config = json.dumps([str(QUICKSTART), SMALL + ["ray.mode=ray", "ray.num_cpus=2"]])
    proc = subprocess.run([sys.executable, "-P", "-c", WORKER + RAY_SCRIPT, config, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["sum"] == 5
    assert out["raised"] == ["ValueError", "bad input 3", ["raised by the Worker 2 of 2 actor"]]
    assert out["died"] == ["Worker", "Worker 2 of 2", "the Worker 2 of 2 actor died"]
