"""`bench rollout`'s read floor counts the bytes the benchmarked models actually hold.

`read_floor` derives a decode step's bytes from the model's shape; these tests
check its all-weights total against the tensors of the models the benchmark
builds (the bf16 recipe's model's parameters; the NVFP4 model's non-expert parameters
plus its served expert codes and scales), and the per-step terms at the edges
(one token picks exactly top-k experts; a large batch touches all of them). Without vLLM the vLLM
columns are skipped with a note.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rl4bit.bench.rollout import MODELS, build_model, read_floor, served_model


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="module")
def models():
    m = build_model("small", 80, torch.bfloat16, "cpu")
    return served_model(m, "bf16"), served_model(m, "nvfp4")


def test_weight_bytes_match_the_bf16_models_parameters(models):
    m, _ = models
    assert read_floor("small", 1, 32, 32, "bf16")["weight_bytes"] == sum(_nbytes(p) for p in m.parameters())


def test_weight_bytes_match_the_nvfp4_models_tensors(models):
    _, q = models
    dense = sum(_nbytes(p) for n, p in q.named_parameters() if ".experts." not in n)
    served = [t for mod in q.modules() if hasattr(mod, "served") for t in mod.served.values()]
    assert served, "no served NVFP4 experts found"
    codes_and_scales = sum(_nbytes(t.data) + _nbytes(t.scale) for t in served)  # outer scales: left out
    assert read_floor("small", 1, 32, 32, "nvfp4")["weight_bytes"] == dense + codes_and_scales


def test_step_terms():
    c = MODELS["small"]
    one = read_floor("small", 1, 32, 32, "bf16")
    assert one["experts_touched"] == pytest.approx(c["num_experts_per_tok"])
    assert read_floor("small", 4096, 32, 32, "bf16")["experts_touched"] == pytest.approx(c["num_experts"])
    kv_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    assert one["kv_bytes"] == kv_token * (32 + 16)
    # a batch that touches every expert reads all the weights but the embedding table (one row a token) once
    big = read_floor("small", 4096, 32, 32, "bf16")
    table = c["vocab_size"] * c["hidden_size"] * 2
    assert big["step_bytes"] == pytest.approx(big["weight_bytes"] - table + 4096 * c["hidden_size"] * 2
                                              + big["kv_bytes"])
    # one token reads less than the whole model; NVFP4 experts read fewer bytes than BF16 ones
    assert one["step_bytes"] < one["weight_bytes"]
    assert read_floor("small", 1, 32, 32, "nvfp4")["step_bytes"] < one["step_bytes"]


def test_samples_above_the_bound_are_refused_before_anything_is_built(capsys):
    """`--samples` sizes the engine (batch x samples rows, their KV cache): above sampler.types.MAX_N it is refused
    up front, as a request's n is, instead of building an engine that large first."""
    from rl4bit.bench import rollout as bench_rollout
    from rl4bit.sampler.types import MAX_N

    with pytest.raises(SystemExit):
        bench_rollout.main(["--samples", str(MAX_N + 1)])
    assert f"--samples: n: {MAX_N + 1} must be an int in [1, {MAX_N}]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="n: 0 must be"):
        bench_rollout.run(samples=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed (tests/vllm runs them)")
def test_vllm_columns_are_skipped_with_a_note_without_vllm(capsys, tmp_path):
    """Where vLLM is not importable the bench runs its other columns and names why the vLLM ones are missing."""
    from rl4bit.bench import rollout as bench_rollout

    res = bench_rollout.run(quick=True, batches=[1], new_tokens=2, out=str(tmp_path))
    assert all(r["vllm_bf16"] is None and r["vllm_nvfp4"] is None for r in res["rows"])
    assert all("which is not installed" in n for n in res["vllm"]["notes"].values())
    assert json.loads((tmp_path / "results.json").read_text())["vllm"]["notes"] == res["vllm"]["notes"]
    out = capsys.readouterr().out
    assert "vLLM BF16 column skipped: sampler.backend vllm needs vLLM" in out
    assert "vLLM NVFP4 column skipped: " in out


def test_no_hf_leaves_the_hf_baseline_out(capsys, tmp_path):
    """`--no-hf`: no HF `generate` run (minutes on a GPU at 512 new tokens), its cells shown as "-"."""
    from rl4bit.bench import rollout as bench_rollout

    bench_rollout.main(["--device", "cpu", "--quick", "--batches", "1", "--new-tokens", "2", "--no-hf", "--no-vllm",
                        "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert rows[0]["hf"] is None and rows[0]["engine"]["gen_tok_s"] > 0
    out = capsys.readouterr().out
    assert "HF generate" not in out.split("rollout:")[0]  # the per-batch line names no HF figure
    assert " / -" in out
