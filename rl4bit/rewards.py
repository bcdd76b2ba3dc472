"""Reward functions: the built-ins, loading by import or file path, and the worker pool that runs them.

A reward is a plain function `reward(prompt: str, completion: str, **sample) -> float`
(`sample` holds the prompt's other fields, e.g. `answer`). A batched variant
sets `fn.batched = True` and takes lists: `fn(prompts, completions, **samples) -> list[float]`.
TRL-style rewards run as TRL calls them: a function with a `completions`
parameter (not marked `batched`) is called by keyword,
`fn(prompts=prompts, completions=completions, **columns) -> list[float]`, one
list entry per column. Completions are plain strings (not TRL's conversational
`[{"content": ...}]` form), TRL's `completion_ids` / `trainer_state` keywords
are not passed, and a None in the returned list is an error. Each call scores
one sample; the list forms get one-element lists.
The config names each by `pkg.module:function` or `path/to/file.py:function`:

    rewards:
      functions:
        - {fn: rl4bit.rewards:exact_match, weight: 1.0}
        - {fn: my_rewards.py:brevity, weight: 0.1}

`RewardPool` runs them in worker processes (`python -m rl4bit.rewards SPEC...`,
JSON lines over pipes; the workers import the functions themselves: reward code
never runs in the driver or the pool's own process) with a per-call timeout: a
call that raises, returns a non-finite or non-number value, exits its process
or runs past `timeout_s` masks that sample (counted in `reward/errors`, its
worker restarted when it died or timed out), and the step fails only when more
than `max_error_fraction` of its samples fail.
`check_rewards(specs, sample)` is the start-up validation: every reward is
imported and called once (in a worker) and a failure raises `RewardError` naming it.

Resource limits (`resource.setrlimit`, set in the worker before any reward is
imported): RLIMIT_DATA (heap and private memory; unlike RLIMIT_AS it does not
count shared-library mappings, so `import torch` in a reward stays cheap) = the
worker's at start-up + `memory_mb`, so a reward's imports and allocations past
it get MemoryError and the sample is masked; and a soft
CPU limit of `cpu_s` seconds per call (past it the kernel kills the worker with
SIGXCPU; it is restarted, the sample masked). 0 turns a limit off. These bound
mistakes, not an attacker: a reward is your own code, with your permissions.

Leaves out: rewards that need a GPU or a model (run them in your own service
and call it from a function), async rewards.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import resource
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

from rl4bit.config import ConfigError

# --------------------------------------------------------------------------- built-ins

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_number(text: str) -> str | None:
    """The first number in `text` (what the model answered), or None."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def exact_match(prompt: str, completion: str, answer: str | None = None, **sample) -> float:
    """1.0 when the first number of the completion equals `answer` numerically, else 0.0.

    >>> exact_match("12+30=", "42\\n", answer="42")
    1.0
    """
    if answer is None:
        raise ValueError("exact_match needs an 'answer' field in the sample (add it to the prompt file)")
    got = first_number(completion)
    if got is None:
        return 0.0
    try:
        return float(float(got) == float(answer))
    except ValueError:
        return float(got.strip() == str(answer).strip())


def format_check(prompt: str, completion: str, **sample) -> float:
    """1.0 when the completion is one number and nothing else (surrounding whitespace allowed).

    >>> format_check("1+1=", "2\\n"), format_check("1+1=", "2 apples")
    (1.0, 0.0)
    """
    return float(re.fullmatch(r"\s*-?\d+(?:\.\d+)?\s*", completion) is not None)


def length_penalty(prompt: str, completion: str, max_chars: int = 64, **sample) -> float:
    """-len(completion) / max_chars, clipped at -1: longer completions cost more.

    >>> length_penalty("1+1=", "2" * 32)
    -0.5
    """
    return -min(len(completion) / max_chars, 1.0)


# --------------------------------------------------------------------------- loading


class RewardError(ConfigError):
    """A reward that cannot be loaded, fails its start-up call, or fails too often; names the reward."""


def load_reward(spec: str) -> Callable:
    """Resolve `pkg.module:function` or `path/to/file.py:function` to the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardError(f"reward {spec!r}: expected 'pkg.module:function' or 'path/file.py:function'")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise RewardError(f"reward {spec!r}: file {str(path)!r} does not exist (paths are relative to the working directory)")
        mod_name = f"rl4bit_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: cannot import module {target!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items()  # the module's own callables, not what it imports
                 if callable(v) and getattr(v, "__module__", None) == module.__name__ and not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1)
        raise RewardError(f"reward {spec!r}: {target} has no function {name!r}"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    return fn


def reward_name(spec: str) -> str:
    """Short metric name of a reward spec: the function name."""
    return spec.rpartition(":")[2]


def trl_style(fn: Callable) -> bool:
    """Whether `fn` takes TRL's keyword `completions` (and is not marked `batched`): it is then called as TRL
    calls it, by keyword, `fn(prompts=[...], completions=[...], **columns) -> list[float]`."""
    if getattr(fn, "batched", False):
        return False
    try:
        param = inspect.signature(fn).parameters.get("completions")
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def _call(fn: Callable, prompt: str, completion: str, sample: dict) -> float:
    extra = {k: v for k, v in sample.items() if k != "prompt"}
    if trl_style(fn):
        value = _one(fn(prompts=[prompt], completions=[completion], **{k: [v] for k, v in extra.items()}))
    elif getattr(fn, "batched", False):
        value = _one(fn([prompt], [completion], **{k: [v] for k, v in extra.items()}))
    else:
        value = fn(prompt, completion, **extra)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"returned {value!r}; a reward must return a finite float")
    return float(value)


def _one(values):
    """The single value a list-in, list-out reward returned for a one-sample call."""
    if not isinstance(values, (list, tuple)) or len(values) != 1:
        raise TypeError(f"returned {values!r} for a one-sample call; a batched or TRL-style reward returns a list "
                        f"with one value per completion")
    return values[0]


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
        raise RewardError(f"start-up call on prompt {sample['prompt']!r} failed: {scores.messages[0]}")


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
    """`python -m rl4bit.rewards [--memory-mb M] [--cpu-s C] SPEC...`: JSON lines in on stdin, out on stdout (nothing pickled)."""
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
                reply = {"i": msg["i"], "error": f"reward {spec!r}: " + traceback.format_exception_only(type(e), e)[-1].strip()}
                break
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


@dataclass
class Scores:
    """Per-sample weighted totals (None where a reward failed) and per-reward values."""

    totals: list[float | None]
    per_reward: dict[str, list[float | None]]
    errors: int = 0
    messages: list[str] = field(default_factory=list)


class RewardPool:
    """Reward worker processes with a per-call timeout (a plain class; Ray wraps it in rl4bit.actors)."""

    def __init__(self, specs: list[str], weights: list[float], *, timeout_s: float = 10.0, workers: int = 1,
                 max_error_fraction: float = 0.1, memory_mb: int = 2048, cpu_s: float | None = None):
        self.specs, self.weights = list(specs), list(weights)
        self.timeout_s, self.max_error_fraction = timeout_s, max_error_fraction
        self.memory_mb = int(memory_mb)
        self.cpu_s = float(cpu_s) if cpu_s is not None else 2.0 * timeout_s  # 2x: a reward may use two threads
        self._workers: list[subprocess.Popen] = []
        try:
            for _ in range(workers):
                self._workers.append(self._start())  # a load error raises RewardError naming the reward
        except BaseException:
            self.close()
            raise

    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [p.pid for p in self._workers]

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "rl4bit.rewards", "--memory-mb", str(self.memory_mb), "--cpu-s", str(self.cpu_s),
             *self.specs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        if not wait([proc.stdout], timeout=60):
            proc.kill()
            raise RewardError(f"reward worker for {self.specs} did not start within 60 s")
        line = proc.stdout.readline()
        reply = json.loads(line) if line else {
            "load_error": f"the reward worker for {self.specs} exited at start-up (exit code {proc.wait()}; its stderr says why)"}
        if "load_error" in reply:
            proc.wait()
            proc.stdout.close()
            proc.stdin.close()
            raise RewardError(reply["load_error"])
        return proc

    def score(self, items: list[tuple[str, str, dict]]) -> Scores:
        """Score (prompt, completion, sample) triples; raises RewardError past max_error_fraction."""
        results: list = [None] * len(items)
        messages: list[str] = []
        todo = list(range(len(items)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (item index, deadline)
        while todo or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and todo:
                    i = todo.pop()
                    prompt, completion, sample = items[i]
                    msg = {"i": i, "prompt": prompt, "completion": completion, "sample": sample}
                    line = json.dumps(msg, default=str) + "\n"
                    try:
                        self._workers[slot].stdin.write(line)
                        self._workers[slot].stdin.flush()
                    except (BrokenPipeError, ValueError):  # the worker died while idle: replace it, send again
                        self._workers[slot].kill()
                        self._workers[slot].wait()
                        self._workers[slot] = self._start()
                        self._workers[slot].stdin.write(line)
                        self._workers[slot].stdin.flush()
                    busy[slot] = (i, time.monotonic() + self.timeout_s)
            timeout = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready = wait([self._workers[s].stdout for s in busy], timeout=timeout)
            for slot in list(busy):
                proc = self._workers[slot]
                i, deadline = busy[slot]
                if proc.stdout in ready:
                    line = proc.stdout.readline()
                    reply = json.loads(line) if line else {
                        "error": f"rewards {self.specs}: worker died (exit code {proc.wait()}; -24 = CPU limit "
                                 f"rewards.cpu_s) on prompt {items[i][0]!r}"}
                    results[i] = reply.get("values")
                    if "error" in reply:
                        messages.append(reply["error"])
                    if not line:
                        proc.stdout.close()
                        proc.stdin.close()
                        self._workers[slot] = self._start()
                    del busy[slot]
                elif time.monotonic() >= deadline:
                    proc.kill()
                    proc.wait()
                    proc.stdout.close()
                    proc.stdin.close()
                    messages.append(f"rewards {self.specs}: timed out after {self.timeout_s} s on prompt {items[i][0]!r}")
                    self._workers[slot] = self._start()
                    del busy[slot]
        errors = sum(r is None for r in results)
        if items and errors > self.max_error_fraction * len(items):
            raise RewardError(
                f"{errors}/{len(items)} samples failed to score (rewards.max_error_fraction={self.max_error_fraction}); first: {messages[0]}"
            )
        per = {reward_name(s): [r[k] if r else None for r in results] for k, s in enumerate(self.specs)}
        totals = [sum(w * v for w, v in zip(self.weights, r)) if r else None for r in results]
        return Scores(totals, per, errors, messages)

    def close(self) -> None:
        for proc in self._workers:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._workers = []


if __name__ == "__main__":
    _worker_main(sys.argv[1:])
