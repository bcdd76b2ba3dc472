"""Running rewards: `RewardPool`, the worker processes that call them, their limits, the start-up check.

`RewardPool(specs, weights).score([(prompt, completion, sample), ...])` runs the rewards (rl4bit.rewards) in worker
processes, `python -m rl4bit.reward_pool [--memory-mb M] [--cpu-s C] SPEC...`, JSON lines over pipes: the workers
import the functions themselves, so reward code never runs in the driver or the pool's own process. A call that
raises, returns a non-finite or non-number value, exits its process or runs past `timeout_s` masks that sample
(counted in `reward/errors`, by kind: `ERROR_KINDS`; its worker killed with its process group, i.e. with what the
reward started, and restarted when it died or timed out); the step fails only when more than `max_error_fraction` of
its samples fail. `check_rewards(specs, sample)`, the start-up validation, imports and calls every reward once in a
worker; a failure raises `RewardError` naming it. Limits, set in the worker before any reward is imported: RLIMIT_DATA
(heap and private memory; unlike RLIMIT_AS it leaves out shared-library mappings, so `import torch` stays cheap) = the
worker's at start-up + `memory_mb` (past it: MemoryError, the sample masked), and a soft RLIMIT_CPU of `cpu_s` seconds
a call (past it SIGXCPU kills the worker; it is restarted, the sample masked); 0 turns a limit off. They bound
mistakes, not an attacker: a reward is your own code, with your permissions. Leaves out: what a reward is and how one
is loaded (rl4bit.rewards), rewards that need a GPU or a model, async rewards.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from rl4bit import rewards
from rl4bit.rewards import RewardError, check_names, load_reward, trl_style

# --------------------------------------------------------------------------- calling a reward


ERROR_KINDS = ("raised", "timeout", "type", "nonfinite", "died")
"""How a reward call can fail: it raised, ran past rewards.timeout_s, returned something not a number (or a list
of the wrong length), returned NaN/Inf, or its worker process died (a CPU or memory limit, os._exit). Each is
counted apart (`Scores.kinds`, metrics `reward_errors/<kind>`)."""


class BadValue(TypeError):
    """A reward returned a value that is not one finite number; `kind` is "type" or "nonfinite"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _call(fn: Callable, prompt: str, completion: str, sample: dict) -> float:
    extra = {k: v for k, v in sample.items() if k != "prompt"}
    if trl_style(fn):
        value = _one(fn(prompts=[prompt], completions=[completion], **{k: [v] for k, v in extra.items()}))
    elif getattr(fn, "batched", False):
        value = _one(fn([prompt], [completion], **{k: [v] for k, v in extra.items()}))
    else:
        value = fn(prompt, completion, **extra)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadValue("type", f"returned {value!r}; a reward must return a finite float")
    if not math.isfinite(value):
        raise BadValue("nonfinite", f"returned {value!r}; a reward must return a finite float")
    return float(value)


def _one(values):
    """The single value a list-in, list-out reward returned for a one-sample call."""
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        raise BadValue("type", f"returned {values!r} for a one-sample call; a batched or TRL-style reward returns "
                               f"a list with one value per completion")
    return values[0]


def raising_line(e: BaseException, fn: Callable) -> str | None:
    """Where in the user's code `e` was raised: `file:line in function: source` of the deepest frame in the
    reward's own file (else the deepest frame outside this module and rl4bit.rewards, the built-ins), or None when
    there is no such frame."""
    frames = traceback.extract_tb(e.__traceback__)
    try:
        own = str(Path(inspect.getsourcefile(fn) or "").resolve())
    except TypeError:  # a builtin or a C function
        own = ""
    ours = {str(Path(__file__).resolve()), str(Path(rewards.__file__).resolve())}
    mine = [f for f in frames if own and str(Path(f.filename).resolve()) == own]
    outside = [f for f in frames if str(Path(f.filename).resolve()) not in ours]
    pick = (mine or outside or [None])[-1]
    if pick is None:
        return None
    return f"{pick.filename}:{pick.lineno} in {pick.name}: {(pick.line or '').strip()}"


def check_rewards(specs: list[str], sample: dict, **limits) -> None:
    """Start-up validation, in a worker process: import every reward and call it once on `sample`
    (completion = its answer, or "0"); a failure raises RewardError naming the reward.
    `limits`: RewardPool's timeout_s / memory_mb / cpu_s."""
    completion = str(sample.get("answer") or "0")
    pool = RewardPool(specs, [1.0] * len(specs), workers=1, max_error_fraction=1.0, **limits)
    try:
        scores = pool.score([(sample["prompt"], completion, sample)])
    finally:
        pool.close()
    if scores.errors:
        where = scores.failures[0].where
        raise RewardError(f"start-up call on prompt {sample['prompt']!r} failed: {scores.messages[0]}"
                          + (f" at {where}" if where else ""))


# --------------------------------------------------------------------------- limits


def _data_bytes() -> int:
    """This process's data size (VmData: what RLIMIT_DATA counts)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def _limit_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        cap = _data_bytes() + (memory_mb << 20)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))


def _limit_cpu(cpu_s: float) -> None:
    """Soft CPU limit `cpu_s` seconds past what this process used so far (the kernel sends SIGXCPU past it)."""
    if cpu_s > 0:
        used = resource.getrusage(resource.RUSAGE_SELF)
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(used.ru_utime + used.ru_stime + math.ceil(cpu_s)) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


# --------------------------------------------------------------------------- worker processes


def _worker_main(argv: list[str]) -> None:
    """`python -m rl4bit.reward_pool [--memory-mb M] [--cpu-s C] SPEC...`: JSON lines in on stdin, out on stdout
    (nothing pickled)."""
    memory_mb, cpu_s = 0, 0.0
    while argv and argv[0] in ("--memory-mb", "--cpu-s"):
        flag, value, argv = argv[0], argv[1], argv[2:]
        memory_mb, cpu_s = (int(value), cpu_s) if flag == "--memory-mb" else (memory_mb, float(value))
    specs = argv
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a reward's print() goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # a reward reading stdin gets end of file, never the protocol's request lines
    os.close(null)
    sys.stdin = open(os.devnull)
    _limit_memory(memory_mb)  # before any reward module is imported
    try:
        fns = [load_reward(s) for s in specs]
    except BaseException as e:  # SystemExit / KeyboardInterrupt at import time too
        msg = str(e) if isinstance(e, RewardError) else f"rewards {specs}: loading raised {type(e).__name__}: {e}"
        proto.write(json.dumps({"load_error": msg}) + "\n")
        proto.flush()
        return
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in requests:
        msg = json.loads(line)
        _limit_cpu(cpu_s)
        reply = {"i": msg["i"], "values": []}
        for spec, fn in zip(specs, fns):
            try:
                reply["values"].append(_call(fn, msg["prompt"], msg["completion"], msg["sample"]))
            except Exception as e:
                kind = e.kind if isinstance(e, BadValue) else "raised"
                where = None if isinstance(e, BadValue) else raising_line(e, fn)
                reply = {"i": msg["i"], "kind": kind, "where": where,
                         "error": f"reward {spec!r}: " + traceback.format_exception_only(type(e), e)[-1].strip()}
                break
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


@dataclass
class Failure:
    """One sample that failed to score: its index in the scored list, how (`ERROR_KINDS`), the message (naming
    the reward), the line of the user's code that raised (kind "raised"), and the prompt."""

    index: int
    kind: str
    message: str
    where: str | None
    prompt: str


@dataclass
class Scores:
    """Per-sample weighted totals (None where a reward failed) and per-reward values; every failure, in order."""

    totals: list[float | None]
    per_reward: dict[str, list[float | None]]
    errors: int = 0
    messages: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def kinds(self) -> dict[str, int]:
        """Failures counted by kind, every kind of `ERROR_KINDS` present (0 when none)."""
        return {k: sum(f.kind == k for f in self.failures) for k in ERROR_KINDS}


def count_line(kinds: dict[str, int]) -> str:
    """"3 raised, 1 timeout": the kinds that occurred, for messages."""
    return ", ".join(f"{n} {k}" for k, n in kinds.items() if n) or "none"


class RewardPool:
    """Reward worker processes with a per-call timeout (a plain class; Ray wraps it in rl4bit.actors).

    Up to `workers` calls run at once, hung ones included: a worker that timed out or died is replaced by a new
    process that starts (imports the rewards) while the other workers go on scoring, and takes items again once
    it is ready. Each worker leads its own process group, so a timed-out, dead or closed worker is killed with
    every process its rewards started (a `subprocess.run` still running included); one that left the group
    (setsid, a daemon) is out of reach."""

    START_S = 60.0
    """How long a new worker may take to import the rewards before the pool gives up on it (RewardError)."""

    def __init__(self, specs: list[str], weights: list[float], *, timeout_s: float = 10.0, workers: int = 1,
                 max_error_fraction: float = 0.1, memory_mb: int = 2048, cpu_s: float | None = None):
        self.specs, self.weights = list(specs), list(weights)
        self.names = check_names(self.specs)  # before any worker starts: a job fails here, not in its first step
        self.timeout_s, self.max_error_fraction = timeout_s, max_error_fraction
        self.memory_mb = int(memory_mb)
        self.cpu_s = float(cpu_s) if cpu_s is not None else 2.0 * timeout_s  # 2x: a reward may use two threads
        self._workers: list[subprocess.Popen] = []
        self._starting: dict[int, float] = {}  # slot -> deadline of a replacement worker not yet ready
        try:
            self._workers = [self._spawn() for _ in range(workers)]  # all import at once
            deadline = time.monotonic() + self.START_S
            for proc in self._workers:
                self._await_ready(proc, deadline)  # a load error raises RewardError naming the reward
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        """Process ids of the workers (replacements still starting included)."""
        return [p.pid for p in self._workers]

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-P", "-m", "rl4bit.reward_pool", "--memory-mb", str(self.memory_mb),
             "--cpu-s", str(self.cpu_s), *self.specs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True,
        )

    def _ready_reply(self, proc: subprocess.Popen) -> None:
        """Read a started worker's first line; RewardError (the worker killed) unless it says it is ready."""
        line = proc.stdout.readline()
        reply = json.loads(line) if line else {
            "load_error": f"the reward worker for {self.specs} exited at start-up (exit code {proc.wait()}; "
                          "its stderr says why)"}
        if "load_error" in reply:
            _kill(proc)
            raise RewardError(reply["load_error"])

    def _await_ready(self, proc: subprocess.Popen, deadline: float) -> None:
        if not wait([proc.stdout], timeout=max(0.0, deadline - time.monotonic())):
            _kill(proc)
            raise RewardError(f"reward worker for {self.specs} did not start within {self.START_S:.0f} s")
        self._ready_reply(proc)

    def _start(self) -> subprocess.Popen:
        """A new worker, once it has imported the rewards; a load error raises RewardError."""
        proc = self._spawn()
        self._await_ready(proc, time.monotonic() + self.START_S)
        return proc

    def _poll_starting(self) -> None:
        """Move replacement workers that are ready out of `_starting`; RewardError for one that failed to start."""
        for slot, deadline in list(self._starting.items()):
            proc = self._workers[slot]
            if wait([proc.stdout], timeout=0):
                del self._starting[slot]
                self._ready_reply(proc)
            elif time.monotonic() >= deadline:
                del self._starting[slot]
                _kill(proc)
                raise RewardError(f"reward worker for {self.specs} did not start within {self.START_S:.0f} s")

    def _send(self, slot: int, i: int, item: tuple[str, str, dict]) -> None:
        """Send item `i` to the worker in `slot`, replacing the worker first if it died while idle."""
        prompt, completion, sample = item
        line = json.dumps({"i": i, "prompt": prompt, "completion": completion, "sample": sample}, default=str) + "\n"
        try:
            self._workers[slot].stdin.write(line)
            self._workers[slot].stdin.flush()
        except (BrokenPipeError, ValueError):
            _kill(self._workers[slot])
            self._workers[slot] = self._start()
            self._workers[slot].stdin.write(line)
            self._workers[slot].stdin.flush()

    def score(self, items: list[tuple[str, str, dict]]) -> Scores:
        """Score (prompt, completion, sample) triples; raises RewardError past max_error_fraction."""
        results: list = [None] * len(items)
        failures: list[Failure] = []
        todo = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (item index, deadline)
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and slot not in self._starting and todo:
                    i = todo.pop()
                    self._send(slot, i, items[i])
                    busy[slot] = (i, time.monotonic() + self.timeout_s)
            waiting = [*busy, *self._starting]
            deadlines = [d for _, d in busy.values()] + list(self._starting.values())
            wait([self._workers[s].stdout for s in waiting], timeout=max(0.0, min(deadlines) - time.monotonic()))
            self._poll_starting()
            for slot in list(busy):
                i, deadline = busy[slot]
                outcome = self._judge(slot, deadline, items[i][0])
                if outcome is None:
                    continue
                values, failure, dead = outcome
                results[i] = values
                if failure is not None:
                    kind, message, where = failure
                    failures.append(Failure(i, kind, message, where, items[i][0]))
                if dead:  # replaced at once; the new worker imports while the others keep scoring
                    self._workers[slot] = self._spawn()
                    self._starting[slot] = time.monotonic() + self.START_S
                del busy[slot]
        errors = sum(r is None for r in results)
        scores = Scores([], {}, errors, [f.message for f in sorted(failures, key=lambda f: f.index)],
                        sorted(failures, key=lambda f: f.index))
        if items and errors > self.max_error_fraction * len(items):
            first = scores.failures[0]
            raise RewardError(
                f"{errors}/{len(items)} samples failed to score ({count_line(scores.kinds)}; "
                f"rewards.max_error_fraction={self.max_error_fraction}); first: {first.message}"
                + (f" at {first.where}" if first.where else ""))
        scores.per_reward = {name: [r[k] if r else None for r in results] for k, name in enumerate(self.names)}
        scores.totals = [sum(w * v for w, v in zip(self.weights, r)) if r else None for r in results]
        return scores

    def _judge(self, slot: int, deadline: float, prompt: str):
        """(values or None, (kind, message, where) or None, whether the worker is gone) for the call the worker in
        `slot` is running, or None while it may still answer. Polls its pipe now, so a reply that arrived before
        the deadline is never taken for a timeout; a worker that died or timed out is killed, not restarted."""
        proc = self._workers[slot]
        if wait([proc.stdout], timeout=0):
            line = proc.stdout.readline()
            if line:
                reply = json.loads(line)
                if "error" in reply:
                    return None, (reply.get("kind", "raised"), reply["error"], reply.get("where")), False
                return reply["values"], None, False
            code = proc.wait()  # its own exit code, before the kill below could stand in for it
            _kill(proc)  # what it started may outlive it
            return None, ("died", f"rewards {self.specs}: worker died (exit code {code}; -24 = CPU limit "
                                  f"rewards.cpu_s) on prompt {prompt!r}", None), True
        if time.monotonic() >= deadline:
            _kill(proc)
            return None, ("timeout", f"rewards {self.specs}: timed out after {self.timeout_s} s on prompt {prompt!r} "
                                     f"(rewards.timeout_s)", None), True
        return None

    def close(self) -> None:
        """Stop the workers: each gets end of input and 5 s (in all) to exit; then its process group is killed,
        whatever its rewards left running."""
        for proc in self._workers:
            try:
                proc.stdin.close()
            except OSError:  # the worker is gone: nothing to flush
                pass
        deadline = time.monotonic() + 5
        for proc in self._workers:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _kill(proc)
        self._workers = []
        self._starting = {}


def _kill(proc: subprocess.Popen) -> None:
    """Kill the worker `proc` and its process group (what its rewards started), reap it, close its pipes."""
    try:
        # the group (id = the worker's pid, from start_new_session) outlives its leader while any member runs,
        # and Linux does not reuse a pid while its group exists: after the worker is reaped this reaches only
        # what it left running, or raises ProcessLookupError
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the worker exited and took no process along: nothing to kill
        pass
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
