"""A multiprocess vLLM engine on our export, taken A -> B -> A: the child process of
`test_vllm_engine.test_multiprocess_engine_reloads_from_a_directory`.

    python multiprocess_run.py EXPORT_A WORKDIR OUT_JSON

Run with VLLM_ENABLE_V1_MULTIPROCESSING=1: vLLM starts its engine core and worker in processes of their own,
so weight updates cannot travel as RPC arguments and `VLLMEngine` hands the workers a safetensors directory a
version instead (on CPU; on a GPU, CUDA IPC descriptions of its device tensors). Writes the greedy completions at
each version (and the transport and versions served) to OUT_JSON for the test to compare with in-process engines.
A separate process because vLLM reads its environment once per process: the test session's engines are in-process.

Leaves out: timing, sampling at T > 0 (the in-process tests cover both paths' sampling code).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# this folder, not a package import: a child process
from conftest import GPU_ENGINE_KW, make_model, prompts, update_of  # noqa: E402

from rl4bit.sampler.types import Request, SamplingParams  # noqa: E402
from rl4bit.sampler.vllm_engine import VLLMEngine  # noqa: E402

PROMPTS = prompts(4, seed=3)


def greedy(engine) -> list[list[int]]:
    out = engine.generate([Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=8))
                           for i, p in enumerate(PROMPTS)])
    if any(r.error for r in out):
        raise RuntimeError(f"a request failed: {[r.error for r in out if r.error]}")
    return [r.completion_ids for r in out]


def main(export_a: str, workdir: str, out: str) -> None:
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1":
        raise SystemExit("run with VLLM_ENABLE_V1_MULTIPROCESSING=1")
    engine = VLLMEngine(export_a, workdir=workdir, max_batch_size=8, block_size=32, **GPU_ENGINE_KW)
    if not engine.multiprocess:
        raise SystemExit("the engine is not multiprocess")
    result = {"prompts": PROMPTS, "transport": engine.transport, "a": greedy(engine)}
    engine.update_weights(*update_of(make_model(1), 1))
    result["b"] = greedy(engine)
    engine.update_weights(*update_of(make_model(0), 2))
    result["a_again"] = greedy(engine)
    result["version"] = engine.version
    result["version_dirs"] = sorted(p.name for p in Path(workdir).iterdir() if p.is_dir())
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
