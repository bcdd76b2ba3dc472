"""A plain install (no `triton` extra) runs the CPU paths: every non-kernel module imports, and the quickstart's
job runs a few RL steps in local mode, in a subprocess where `import triton` fails as if it were not installed.

The blocker replaces the path finder in `sys.meta_path` by one that finds no `triton` (so
`importlib.util.find_spec("triton")` is None and `import triton` raises ModuleNotFoundError, as without the
package); everything else, the model code included, is the real thing. Leaves out Ray mode (its workers are
fresh interpreters without the blocker) and the GPU paths (they need triton, an extra)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCK_TRITON = """
import importlib.util, sys
from importlib.machinery import PathFinder

class NoTriton(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return PathFinder.find_spec(name, path, target)

assert not any(m == "triton" or m.startswith("triton.") for m in sys.modules), "triton loaded before the blocker"
sys.meta_path[:] = [NoTriton if f is PathFinder else f for f in sys.meta_path]
assert importlib.util.find_spec("triton") is None
try:
    import triton
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker let triton import")
"""

NEEDS_TRITON = ("triton_dispatch",)  # besides every `*_triton` module: GPU-only by design
NEEDS_VLLM = ("vllm_engine", "vllm_plugin")  # the vllm extra's modules, tested in tests/vllm


def run_blocked(code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-c", BLOCK_TRITON + code, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout)


def test_modules_import_without_triton():
    code = """
import importlib, pkgutil
import rl4bit, rl4bit.kernels, rl4bit.trainer, rl4bit.sampler
names = [m.name for p in (rl4bit, rl4bit.kernels, rl4bit.trainer, rl4bit.sampler)
         for m in pkgutil.iter_modules(p.__path__, p.__name__ + ".")]
skip = %r
imported = 0
for name in names:
    leaf = name.rsplit(".", 1)[1]
    if leaf.endswith("_triton") or leaf in skip or name in ("rl4bit.kernels", "rl4bit.trainer", "rl4bit.sampler"):
        continue
    importlib.import_module(name)
    imported += 1
assert "triton" not in sys.modules
print("imported", imported)
""" % (NEEDS_TRITON + NEEDS_VLLM,)
    r = run_blocked(code)
    assert r.returncode == 0, f"a module imports triton on import; make that import lazy:\n{r.stderr[-4000:]}"
    assert int(r.stdout.split("imported")[1]) > 60, r.stdout  # the walk found the packages' modules


def test_quickstart_runs_without_triton(tmp_path):
    """The quickstart's config (nvfp4 recipe: quantized expert GEMMs, attention, sampler, recompute) cut to 2
    warm-start and 2 RL steps; the trainer and the embedded sampler must still agree bitwise."""
    out = tmp_path / "run"
    code = """
from rl4bit.cli import main
code = main(sys.argv[1:])
assert "triton" not in sys.modules
sys.exit(code)
"""
    r = run_blocked(code, "train", str(REPO / "configs/quickstart.yaml"), "-o", "ray.mode=local",
                    "-o", "rl.steps=2", "-o", "run.warmup_sft_steps=2", "-o", "rl.prompts_per_step=4",
                    "-o", "data.eval_size=8", "--out", str(out), timeout=600)
    assert r.returncode == 0, f"the quickstart failed without triton:\n{r.stderr[-4000:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in steps if "mismatch/k3" in m]
    assert [m["step"] for m in rl] == [1, 2], steps
    assert all(m["mismatch/k3"] == 0.0 for m in rl), [m["mismatch/k3"] for m in rl]
