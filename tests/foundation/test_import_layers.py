"""Imports never go up the layers: kernels <- trainer <- sampler <- the job layer (the modules directly in rl4bit/).

Walks the AST of every module under kernels/, trainer/, sampler/ and rl4bit/ (module-level and function-level
imports alike, `if TYPE_CHECKING:` ones too) and resolves each import to an rl4bit module. A subpackage of rl4bit/
(say rl4bit/common/) is the shared lower layer: trainer and sampler may import it, it imports only kernels;
rl4bit/bench/ (the benchmarks, which run whole jobs) belongs to the job layer.
The test fails on any upward import (KNOWN_VIOLATIONS, now empty, would list tolerated ones: the ratchet only
tightens).

Leaves out: imports by string (`importlib.import_module`), and what a module imports transitively.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"kernels": "rl4bit.kernels", "trainer": "rl4bit.trainer", "sampler": "rl4bit.sampler", "rl4bit": "rl4bit"}
SUBPACKAGES = ("rl4bit.kernels", "rl4bit.trainer", "rl4bit.sampler")
LAYER_NAMES = {0: "kernels", 1: "shared lower layer (rl4bit/<subpackage>/)", 2: "trainer", 3: "sampler",
               4: "job layer (rl4bit/*.py)"}

KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
"""(importing module, imported module) pairs allowed to go up: none (issue 41, item 4 emptied the list)."""


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO)
    parts = [FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]]
    name = ".".join(parts)
    return name.removesuffix(".__init__")


def all_modules() -> dict[str, Path]:
    mods = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            mods[module_name(path)] = path
    return mods


def layer(module: str) -> int | None:
    """The layer of an rl4bit module (None: not ours)."""
    if module != "rl4bit" and not module.startswith("rl4bit."):
        return None
    for rank, pkg in ((0, "rl4bit.kernels"), (2, "rl4bit.trainer"), (3, "rl4bit.sampler")):
        if module == pkg or module.startswith(pkg + "."):
            return rank
    if module == "rl4bit.bench" or module.startswith("rl4bit.bench."):
        return 4  # the benchmarks drive whole jobs: part of the job layer, in their own folder
    parts = module.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and (REPO / "rl4bit" / parts[1]).is_dir()):
        return 1  # a subpackage of rl4bit/ other than the three folders: the shared lower layer
    return 4  # rl4bit itself and the modules directly in it


def imported_modules(tree: ast.AST, name: str, is_package: bool, known: set[str]):
    """(imported rl4bit module, line) of every import statement anywhere in the module."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub if sub in known else source), node.lineno


def upward_imports() -> dict[tuple[str, str], str]:
    mods = all_modules()
    known = set(mods)
    found = {}
    for name, path in mods.items():
        mine = layer(name)
        tree = ast.parse(path.read_text(), filename=str(path))
        for target, line in imported_modules(tree, name, path.name == "__init__.py", known):
            theirs = layer(target)
            if theirs is None or theirs <= mine:
                continue
            if target == "rl4bit":
                continue  # `import rl4bit.x` binds rl4bit; the submodule is what counts
            found.setdefault((name, target), f"{path.relative_to(REPO)}:{line}")
    return found


def test_the_walk_sees_the_layers():
    mods = all_modules()
    assert {layer(m) for m in mods} >= {0, 2, 3, 4}, sorted(mods)[:5]
    assert layer("rl4bit.kernels.qgemm_triton") == 0 and layer("rl4bit.common.config") == 1
    assert layer("rl4bit.bench.gemm") == 4 and layer("rl4bit.common.checkpoint") == 1
    assert layer("rl4bit.trainer.actor") == 2 and layer("rl4bit.sampler.engine") == 3 and layer("rl4bit.driver") == 4
    # a function-level import counts, as do relative ones
    tree = ast.parse("def f():\n    from rl4bit.sampler.kv_cache import KVCache\n    from ..sampler import engine\n")
    found = set(imported_modules(tree, "rl4bit.trainer.logprobs", False, {"rl4bit.sampler.engine"}))
    assert found == {("rl4bit.sampler.kv_cache", 2), ("rl4bit.sampler.engine", 3)}, found


def test_no_new_upward_imports():
    found = upward_imports()
    new = {k: v for k, v in found.items() if k not in KNOWN_VIOLATIONS}
    assert not new, "imports that go up the layers (kernels <- trainer <- sampler <- job layer):\n" + "\n".join(
        f"  {where}: {a} imports {b} ({LAYER_NAMES[layer(a)]} -> {LAYER_NAMES[layer(b)]})"
        for (a, b), where in sorted(new.items(), key=lambda kv: kv[1])
    ) + "\nmove what both sides need down (into kernels/, trainer/ or a subpackage of rl4bit/), or pass it in."


def test_known_violations_are_still_there():
    gone = KNOWN_VIOLATIONS - set(upward_imports())
    assert not gone, f"these upward imports are gone; remove them from KNOWN_VIOLATIONS in {Path(__file__).name}: " \
                     f"{sorted(gone)}"
