"""Reward functions: what a reward is, the built-ins, and loading one by import or file path.

A reward is a plain function `reward(prompt: str, completion: str, **sample) -> float` (`sample`: the prompt's other
fields, e.g. `answer`). A batched one sets `fn.batched = True` and takes lists: `fn(prompts, completions, **samples)
-> list[float]`. One with a `completions` parameter (not `batched`) is called as TRL calls it, by keyword,
`fn(prompts=..., completions=..., **columns) -> list[float]`, but with plain-string completions (not TRL's
`[{"content": ...}]`), no `completion_ids` / `trainer_state`, and a None in the list an error. Each call scores one
sample (lists of one). The config names each by `pkg.module:function` or `path/to/file.py:function`:

    rewards:
      functions:
        - {fn: rl4bit.rewards:exact_match, weight: 1.0}
        - {fn: my_rewards.py:brevity, weight: 0.1}

Each logs as `reward/<function name>`; a name two share, or the driver's own metrics use (`RESERVED_NAMES`), is refused.
Run one: `python -c 'from rl4bit.rewards import exact_match; print(exact_match("1+1=", "2", answer="2"))'`.
Leaves out: running them (rl4bit.reward_pool: worker processes, timeouts, limits), rewards that need a GPU or a model
(run them in your own service and call it from a function), async rewards.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import re
import sys
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
