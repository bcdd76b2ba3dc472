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
worker killed with its process group, i.e. with what the reward started, and
restarted when it died or timed out), and the step fails only when more
than `max_error_fraction` of its samples fail. Each reward is logged as
`reward/<function name>`: two rewards with one name, or a name the driver's own
metrics use (`RESERVED_NAMES`: mean, std, ...), are refused when the pool is built.
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
import signal
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
    """Resolve `pkg.module:function` or `path/to/file.py:function` to the function.

    A file loads as `python path/to/file.py` would run it: its directory goes first on sys.path (so its
    `from helpers import score` finds `helpers.py` beside it) and the module is in sys.modules while it runs
    (so `@dataclass` under `from __future__ import annotations` works), under a name unique to the file, and
    once per process however many of its functions are named. Meant for the worker processes: the sys.path
    entry stays, for imports a reward makes when called. Two reward files in different folders that each import
    a module of one name from their own folder (two `helpers.py`) are refused: the process would hold the first
    folder's for both (a module both import only when called is not detected). A module name is imported as is,
    from the installed packages: the worker does not put the working directory on sys.path.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise RewardError(f"reward {spec!r}: expected 'pkg.module:function' or 'path/file.py:function'")
    if target.endswith(".py") or "/" in target:
        module = _load_file(spec, Path(target).expanduser())
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: cannot import module {target!r}: {type(e).__name__}: {e}"
                              + _module_hint(target, name, e)) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        names = [n for n, v in vars(module).items()  # the module's own callables, not what it imports
                 if callable(v) and getattr(v, "__module__", None) == module.__name__ and not n.startswith("_")]
        close = difflib.get_close_matches(name, names, n=1)
        raise RewardError(f"reward {spec!r}: {target} has no function {name!r}"
                          + (f"; did you mean {close[0]!r}?" if close else ""))
    return fn


def _load_file(spec: str, path: Path):
    """Execute the reward file `path` as a module (see `load_reward`); an error names the spec and the file."""
    if not path.is_file():
        raise RewardError(f"reward {spec!r}: file {str(path)!r} does not exist (paths are relative to the working "
                          "directory)")
    resolved = path.resolve()
    mod_name = f"rl4bit_reward_{abs(hash(str(resolved))):x}"
    if mod_name in sys.modules:  # another function of the same file
        return sys.modules[mod_name]
    folder = resolved.parent
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    module_spec = importlib.util.spec_from_file_location(mod_name, resolved)
    module = importlib.util.module_from_spec(module_spec)
    # a module name another reward folder already brought in, which this folder also holds: set aside while this
    # file runs, so that an import of it finds this folder's; which of them the file imported is then known
    others = {n for n, d in _IMPORTED_FROM.items() if d != folder and _provides(folder, n)}
    aside = {n: m for n, m in sys.modules.items() if n.partition(".")[0] in others}
    for n in aside:
        del sys.modules[n]
    before = set(sys.modules)
    sys.modules[mod_name] = module  # before exec, as `import` does: dataclasses look their module up there
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise RewardError(f"reward {spec!r}: importing {path} failed: {type(e).__name__}: {e} "
                          f"(its directory {str(folder)!r} is first on sys.path)") from e
    finally:
        clash = sorted({n.partition(".")[0] for n in sys.modules} & others)
        for n in [n for n in sys.modules if n.partition(".")[0] in others]:
            del sys.modules[n]
        sys.modules.update(aside)
    if clash:
        del sys.modules[mod_name]
        raise RewardError(f"reward {spec!r}: it imports its own {clash[0]!r} from {folder}, but a reward file in "
                          f"{_IMPORTED_FROM[clash[0]]} already imported a {clash[0]!r} from there, and one process "
                          f"holds one module of a name (a call that imports it later would get either). Rename one "
                          f"of the two modules, or keep the reward files that share helpers in one folder")
    new = [n for n in set(sys.modules) - before if "." not in n and n not in aside]  # aside: put back, not new
    astray = sorted(n for n in new if _provides(folder, n) and not _from_folder(sys.modules[n], folder))
    if astray:  # e.g. its folder's namespace package lost to another reward folder's module of that name
        del sys.modules[mod_name]
        raise RewardError(f"reward {spec!r}: it imports {astray[0]!r}, which its folder {folder} holds, but Python "
                          f"found another reward folder's {astray[0]!r} first (a folder without __init__.py loses to "
                          f"a module of the same name anywhere on sys.path). Rename one of the two, or give the "
                          f"package an __init__.py")
    for name in new:  # the top-level modules this file brought in from its own folder
        if _from_folder(sys.modules[name], folder):
            _IMPORTED_FROM.setdefault(name, folder)
    return module


_IMPORTED_FROM: dict[str, Path] = {}
"""Top-level module name -> the reward file folder it was imported from, in this process (`_load_file`)."""


def _from_folder(module, folder: Path) -> bool:
    """Whether the top-level `module` was found in `folder`: a file there, or a package (regular or namespace:
    the latter has no __file__, only __path__) whose directory is there."""
    where = getattr(module, "__file__", None)
    places = [Path(where).resolve().parent] if where else []
    places += [Path(p).resolve() for p in getattr(module, "__path__", None) or []]
    return any(p == folder or p.parent == folder for p in places)


def _provides(folder: Path, name: str) -> bool:
    """Whether `folder` holds a module `name` that `import name` would find there (a file or a package)."""
    return (folder / f"{name}.py").is_file() or (folder / name).is_dir()


def _module_hint(target: str, name: str, e: Exception) -> str:
    """What to try when the module `target` itself (not something it imports) is not found: naming it by path."""
    if not isinstance(e, ModuleNotFoundError) or not e.name or not (target + ".").startswith(e.name + "."):
        return ""
    as_file = target.replace(".", "/") + ".py"
    example = f"{as_file}:{name}" if Path(as_file).is_file() else f"path/to/{target.rpartition('.')[2]}.py:{name}"
    return (f"; the reward worker does not look in the working directory for modules: name a file by its path, "
            f"e.g. {example!r}, or install its package")


RESERVED_NAMES = ("mean", "std", "errors", "zero_spread_frac")
"""Names the driver's own `reward/<name>` metrics use (`rollouts.rollout_metrics`); a reward may not take them."""


def reward_name(spec: str) -> str:
    """Short metric name of a reward spec: the function name (logged as `reward/<name>`)."""
    return spec.rpartition(":")[2]


def check_names(specs: list[str]) -> list[str]:
    """The rewards' metric names, in order; RewardError when two rewards share one (one metric would hide the
    other) or one takes a name of the driver's own (`RESERVED_NAMES`). Names are never made unique behind the
    user's back: the error says which function to rename."""
    seen: dict[str, str] = {}
    for spec in specs:
        name = reward_name(spec)
        if name in RESERVED_NAMES:
            raise RewardError(f"reward {spec!r}: the name {name!r} is taken by the metric reward/{name} "
                              f"(reserved: {', '.join(RESERVED_NAMES)}); rename the function, or wrap it in one "
                              f"with another name")
        if name in seen:
            raise RewardError(f"rewards {seen[name]!r} and {spec!r} would both log as reward/{name}; give each "
                              f"function its own name (rename one, or wrap it: `def {name}_2(prompt, completion, "
                              f"**sample): return {name}(prompt, completion, **sample)`)")
        seen[name] = spec
    return list(seen)


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
    reward's own file (else the deepest frame outside this module), or None when there is no such frame."""
    frames = traceback.extract_tb(e.__traceback__)
    try:
        own = str(Path(inspect.getsourcefile(fn) or "").resolve())
    except TypeError:  # a builtin or a C function
        own = ""
    here = str(Path(__file__).resolve())
    mine = [f for f in frames if own and str(Path(f.filename).resolve()) == own]
    outside = [f for f in frames if str(Path(f.filename).resolve()) != here]
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
    """`python -m rl4bit.rewards [--memory-mb M] [--cpu-s C] SPEC...`: JSON lines in on stdin, out on stdout
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
            [sys.executable, "-P", "-m", "rl4bit.rewards", "--memory-mb", str(self.memory_mb),
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
