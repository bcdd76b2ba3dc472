"""The exported checkpoint: compressed-tensors decodes it bitwise, vLLM's names, plain transformers, safety.

Run: /work/venv-probe/bin/pytest tests/checkpoint -q
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from ckpt_models import make_config, make_trainer_model
from safetensors.torch import save as st_save

from rl4bit.common import checkpoint_format as ckf
from rl4bit.common import ct_layout
from rl4bit.kernels import dequantize
from rl4bit.trainer.surgery import load_quantized, quantized_weights


@pytest.fixture(scope="module")
def exported(trainer_model, tmp_path_factory):
    from rl4bit.trainer.tokenizer import build_tokenizer

    model, plan = trainer_model
    out = tmp_path_factory.mktemp("export") / "ckpt"
    ckf.write_checkpoint(out, model, plan, tokenizer=build_tokenizer(), max_shard_bytes=60_000)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _ndiff(a, b) -> int:
    return int((_bits(a) != _bits(b)).sum())


def _ct_config(out):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])


def _scheme_for(qc, name: str):
    for group in qc.config_groups.values():
        for t in group.targets:
            if (t.startswith("re:") and re.match(t[3:], name)) or t == name:
                return group
    return None


def test_files_and_index(exported):
    names = sorted(p.name for p in exported.iterdir())
    assert "config.json" in names and ckf.INDEX in names and ckf.LAYOUT in names
    assert any(n.startswith("tokenizer") for n in names), names
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1, "max_shard_bytes should have split the export"
    index = json.loads((exported / ckf.INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards) == set(index["metadata"]["shards"])
    assert not any(n.endswith(".pt") or n.endswith(".bin") for n in names)


def test_config_groups_match_ct_presets_and_plan(exported, trainer_model):
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    _, plan = trainer_model
    qc = _ct_config(exported)
    by_format = {g.format: g for g in qc.config_groups.values()}
    assert set(by_format) == {"nvfp4-pack-quantized", "mxfp8-quantized"}
    for fmt, preset in (("nvfp4-pack-quantized", "NVFP4"), ("mxfp8-quantized", "MXFP8")):
        want = preset_name_to_scheme(preset, ["x"])
        for part in ("weights", "input_activations"):
            assert getattr(by_format[fmt], part).model_dump(mode="json") == getattr(want, part).model_dump(mode="json")
    # every planned module is targeted by its own format's group, every bf16 one ignored: the plan is the scope
    for module, fmt in plan.items():
        probe = module + ".0.gate_proj" if module.endswith("experts") else module
        group = _scheme_for(qc, probe)
        ignored = any((t.startswith("re:") and re.match(t[3:], probe)) or t == probe for t in qc.ignore)
        if fmt == "bf16":
            assert group is None and ignored, module
        else:
            assert group is not None and group.format.startswith(fmt) and not ignored, module


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_compressed_tensors_decodes_bitwise(exported, trainer_model, fmt):
    """The real compressed-tensors compressors decode each stored expert to our dequantize(), bit for bit."""
    from compressed_tensors.compressors.base import BaseCompressor

    model, plan = trainer_model
    qc = _ct_config(exported)
    tensors = ckf.read_tensors(exported)
    qw = quantized_weights(model)
    checked = 0
    for module, f in plan.items():
        if f != fmt:
            continue
        for param, q in qw[module].items():
            ours = dequantize(q, torch.bfloat16)  # [E, N, K]
            projs = ct_layout.EXPERT_PROJS[param]
            rows = ours.shape[1] // len(projs)
            for e in range(ours.shape[0]):
                for i, proj in enumerate(projs):
                    prefix = f"{module}.{e}.{proj}"
                    scheme = _scheme_for(qc, prefix)
                    compressor = BaseCompressor.get_value_from_registry(scheme.format)
                    sd = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
                    sd.pop("input_global_scale", None)
                    theirs = compressor.decompress(sd, scheme)["weight"]
                    want = ours[e, i * rows:(i + 1) * rows]
                    assert theirs.dtype == want.dtype and theirs.shape == want.shape
                    assert _ndiff(theirs, want) == 0, f"{prefix}: {_ndiff(theirs, want)} values differ"
                    checked += 1
    assert checked > 0


def test_global_scale_is_the_encode_scale_and_ct_exact_for_every_code_and_scale():
    """G ~ 1/D, and CT's bf16(q * (s / G)) == our bf16((q * s) * D) for all E2M1 q x E4M3 s, on many outers.

    Amaxes with few significant bits (BF16 weights) are where fl(1/D) alone fails most.
    """
    from rl4bit.kernels.nvfp4 import encode_scale

    torch.manual_seed(0)
    amax = torch.cat([torch.exp(torch.rand(3000) * 20 - 10), torch.exp(torch.rand(3000) * 20 - 10).bfloat16().float()])
    d = torch.tensor(1.0) / encode_scale(amax)
    naive_ok = ct_layout._ct_decode_matches(torch.tensor(1.0) / d, d)
    g = ct_layout.global_scale_for(d, "test")
    assert bool(ct_layout._ct_decode_matches(g, d).all())
    assert torch.allclose(g * d, torch.ones_like(d), rtol=2e-6, atol=0)
    assert not bool(naive_ok.all()), "no outer needed the search: the test lost its teeth"


def vllm_expert_mapping(num_experts: int):
    """vLLM FusedMoE.make_expert_params_mapping as called by qwen3_moe.get_expert_mapping (see ct_layout docstring)."""
    return [("experts.w13_" if w in ("gate_proj", "up_proj") else "experts.w2_", f"experts.{e}.{w}.", e, shard)
            for e in range(num_experts) for shard, w in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]


# params vLLM's MoE methods create per layer (CompressedTensorsW4A4Nvfp4MoEMethod / unquantized FusedMoE)
VLLM_NVFP4_PARAMS = {f"w{i}_{s}" for i in ("13", "2") for s in
                     ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")}


def test_vllm_qwen3_moe_names_and_shapes(exported):
    cfg = make_config()
    tensors = ckf.read_tensors(exported)
    mapping = vllm_expert_mapping(cfg.num_experts)
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for layer in range(2):  # the NVFP4 layers
        prefix = f"model.layers.{layer}.mlp."
        names = [k for k in tensors if k.startswith(prefix + "experts.")]
        assert len(names) == E * 3 * 4
        for name in names:
            hits = [(p, w, e, s) for p, w, e, s in mapping if w in name]
            assert len(hits) == 1, name
            param_name, weight_name, e, shard = hits[0]
            vllm_name = name.replace(weight_name, param_name)
            assert vllm_name.startswith(prefix + "experts.w")
            assert vllm_name[len(prefix + "experts."):] in VLLM_NVFP4_PARAMS, vllm_name
        for e in range(E):
            for proj, n, k in (("gate_proj", inter, H), ("up_proj", inter, H), ("down_proj", H, inter)):
                p = f"{prefix}experts.{e}.{proj}."
                packed, scale = tensors[p + "weight_packed"], tensors[p + "weight_scale"]
                assert packed.dtype == torch.uint8 and tuple(packed.shape) == (n, k // 2)
                assert scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (n, k // 16)
                for g in ("weight_global_scale", "input_global_scale"):
                    assert tensors[p + g].dtype == torch.float32 and tensors[p + g].numel() == 1
            # vLLM keeps one w13 global scale per expert and warns unless gate == up
            assert torch.equal(tensors[f"{prefix}experts.{e}.gate_proj.weight_global_scale"],
                               tensors[f"{prefix}experts.{e}.up_proj.weight_global_scale"])
    mx = "model.layers.2.mlp.experts.0.gate_proj."
    assert tensors[mx + "weight"].dtype == torch.float8_e4m3fn and tensors[mx + "weight_scale"].dtype == torch.uint8
    assert tuple(tensors[mx + "weight_scale"].shape) == (inter, H // 32)


def test_loads_into_plain_transformers(exported, trainer_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    model, plan = trainer_model
    sd = ckf.load_state_dict(exported, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(exported)
    cfg.quantization_config = None
    del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(make_config())
    plain.load_state_dict(sd, strict=True)
    qw = quantized_weights(model)
    for module, params in qw.items():
        for param, q in params.items():
            assert _ndiff(plain.get_parameter(f"{module}.{param}").data, dequantize(q, torch.float32)) == 0
    with torch.no_grad():
        logits = plain(torch.arange(10)[None]).logits
    assert torch.isfinite(logits).all()


def test_serving_mode_logits_bitwise(exported, trainer_model):
    """QTensors read back -> a converted model in serving mode: logits equal the trainer's quantized forward."""
    model, _ = trainer_model
    fresh, _ = make_trainer_model(seed=1)
    dense = {k: v for k, v in ckf.load_state_dict(exported, dtype=torch.float32).items()
             if k in fresh.state_dict() and not k.endswith(("gate_up_proj", "down_proj"))}
    fresh.load_state_dict(dense, strict=False)
    load_quantized(fresh, ckf.load_qtensors(exported))
    ids = torch.tensor([[3, 17, 42, 5, 99, 8, 1, 64]])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = model(ids).logits
        got = fresh(ids).logits
    assert _ndiff(got, want) == 0


def test_qtensors_roundtrip_bitwise(exported, trainer_model):
    model, _ = trainer_model
    back = ckf.load_qtensors(exported)
    for module, params in quantized_weights(model).items():
        for param, q in params.items():
            r = back[module][param]
            assert r.fmt == q.fmt and r.shape == q.shape
            assert _ndiff(r.data, q.data) == 0 and _ndiff(r.scale, q.scale) == 0
            r_outer = r.outer.expand_as(q.outer) if r.outer.numel() <= q.outer.numel() else r.outer
            assert _ndiff(r_outer, q.outer.expand_as(r.outer)) == 0


def _tensor_span(path, name):
    blob = path.read_bytes()
    header, start = ckf._header(blob, str(path))
    lo, hi = header[name]["data_offsets"]
    return start + lo, start + hi


def test_corrupted_shard_names_file_and_tensor(exported, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    index = json.loads((bad / ckf.INDEX).read_text())
    name = "model.layers.1.mlp.experts.2.up_proj.weight_packed"
    shard = bad / index["weight_map"][name]
    lo, hi = _tensor_span(shard, name)
    blob = bytearray(shard.read_bytes())
    blob[(lo + hi) // 2] ^= 0x10
    shard.write_bytes(bytes(blob))
    with pytest.raises(ckf.CheckpointError) as err:
        ckf.load_qtensors(bad)
    assert shard.name in str(err.value) and name in str(err.value)


def test_truncated_shard_names_file_and_tensor(exported, tmp_path):
    import shutil

    bad = tmp_path / "trunc"
    shutil.copytree(exported, bad)
    index = json.loads((bad / ckf.INDEX).read_text())
    shard = bad / sorted(index["metadata"]["shards"])[0]
    blob = shard.read_bytes()
    shard.write_bytes(blob[: len(blob) - 100])
    with pytest.raises(ckf.CheckpointError) as err:
        ckf.read_tensors(bad)
    msg = str(err.value)
    assert shard.name in msg and "truncated" in msg
    header, _ = ckf._header(blob, "x")
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    assert repr(last) in msg


def test_interrupted_export_keeps_previous(exported, trainer_model, tmp_path, monkeypatch):
    import shutil

    model, plan = trainer_model
    out = tmp_path / "ckpt"
    shutil.copytree(exported, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls = {"n": 0}
    real = ckf.pack

    def dying_pack(tensors, outers=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed mid-export")
        return real(tensors, outers)

    monkeypatch.setattr(ckf, "pack", dying_pack)
    with pytest.raises(KeyboardInterrupt):
        ckf.write_checkpoint(out, model, plan, max_shard_bytes=60_000)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "temporary export dir left behind"
    monkeypatch.setattr(ckf, "pack", real)
    ckf.write_checkpoint(out, model, plan, max_shard_bytes=60_000)  # a complete re-export replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    ckf.read_tensors(out)


def test_a_crash_between_the_swap_renames_keeps_the_previous_export(exported, trainer_model, tmp_path, monkeypatch):
    """Killed after the old export was moved aside and before the new one was renamed in: `out` is missing for a
    moment. The next reader (or export) puts the previous export back, whole."""
    import os
    import shutil
    from pathlib import Path

    from rl4bit.common import atomic

    model, plan = trainer_model
    out = tmp_path / "ckpt"
    shutil.copytree(exported, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.rename

    def dying_rename(src, dst):  # os.rename itself (every module's): the export's shard writes rename too
        if Path(dst) == out:  # the new export's rename into place, after the old one went aside
            raise KeyboardInterrupt("killed mid-swap")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        ckf.write_checkpoint(out, model, plan, max_shard_bytes=60_000)
    monkeypatch.setattr(atomic.os, "rename", real)
    assert not out.exists() and len(list(tmp_path.glob(".ckpt.old-*"))) == 1  # the window itself
    mine = tmp_path / ".ckpt.old-mine"  # a user's directories that only look like holders: never touched
    (mine / "notes").mkdir(parents=True)
    backup = tmp_path / ".ckpt.old-backup"  # the holder's content, not its name's form
    shutil.copytree(exported, backup / "ckpt")
    ckf.read_tensors(out)  # the reader restores it (and deletes nothing: the emptied holder stays)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(list(tmp_path.glob(".ckpt.old-*"))) == 3 and (mine / "notes").is_dir()
    with pytest.raises(KeyboardInterrupt):  # the same crash again, then a complete re-export
        monkeypatch.setattr(atomic.os, "rename", dying_rename)
        ckf.write_checkpoint(out, model, plan, max_shard_bytes=60_000)
    monkeypatch.setattr(atomic.os, "rename", real)
    ckf.write_checkpoint(out, model, plan, max_shard_bytes=60_000)  # the writer removes its own spent holders
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.old-backup", ".ckpt.old-mine", "ckpt"]
    assert (mine / "notes").is_dir() and (backup / "ckpt" / "config.json").is_file()
    ckf.read_tensors(out)


def test_a_step_directory_left_aside_is_restored_on_resume(tmp_path):
    """The checkpoint side: a rewritten step directory caught mid-swap is put back by `latest_dir`."""
    from rl4bit.common import checkpoint as ck

    root = tmp_path / "checkpoints"
    held = root / ".step_000003.old-k3j_9x0a"  # mkdtemp's form
    (held / "step_000003").mkdir(parents=True)
    (held / "step_000003" / "state.json").write_text("{}")
    (root / "latest.json").write_text(json.dumps({"step": 3, "dir": "step_000003"}))
    assert ck.latest_dir(tmp_path) == root / "step_000003"
    assert (root / "step_000003" / "state.json").read_text() == "{}" and not (held / "step_000003").exists()


# ------------------------------------------------------------------ what export refuses to overwrite


def test_export_refuses_a_file_or_a_directory_that_is_not_an_export(trainer_model, tmp_path):
    model, plan = trainer_model
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"precious")
    with pytest.raises(FileExistsError, match=re.escape(str(a_file))):
        ckf.write_checkpoint(a_file, model, plan)
    assert a_file.read_bytes() == b"precious"

    home = tmp_path / "my_models"  # `--out ~/my_models`: other models and notes in it
    (home / "other_model").mkdir(parents=True)
    (home / "notes.txt").write_text("precious")
    hf = tmp_path / "hf_model"  # a Hugging Face download has an index too, but not rl4bit's
    hf.mkdir()
    (hf / ckf.INDEX).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": {}}))
    for out in (home, hf):
        before = sorted(p.name for p in out.iterdir())
        with pytest.raises(FileExistsError, match="not an rl4bit export") as err:
            ckf.write_checkpoint(out, model, plan)
        assert str(out) in str(err.value) and "new or empty directory" in str(err.value)
        assert sorted(p.name for p in out.iterdir()) == before
    assert (home / "notes.txt").read_text() == "precious"

    empty = tmp_path / "empty"
    empty.mkdir()
    ckf.write_checkpoint(empty, model, plan)  # an empty directory, then a previous export: replaced
    ckf.write_checkpoint(empty, model, plan)
    ckf.read_tensors(empty)


# ------------------------------------------------------------------ damage the checksums cannot describe


def _flip_header_key(d):  # one bit in a shard's safetensors header: "data_offsets" -> "data_offsetr"
    shard = sorted(d.glob("model-*.safetensors"))[0]
    b = bytearray(shard.read_bytes())
    b[b.index(b"data_offsets") + 11] ^= 0x01
    shard.write_bytes(bytes(b))
    return shard


def _flip_index(d):
    b = bytearray((d / ckf.INDEX).read_bytes())
    b[0] ^= 0x01
    (d / ckf.INDEX).write_bytes(bytes(b))
    return d / ckf.INDEX


def _truncate_layout(d):
    (d / ckf.LAYOUT).write_bytes((d / ckf.LAYOUT).read_bytes()[:100])
    return d / ckf.LAYOUT


def _transpose_in_layout(d):  # valid JSON claiming another shape: only the layout's own checksum sees it
    layout = json.loads((d / ckf.LAYOUT).read_text())
    e = next(x for x in layout["entries"]
             if x["fmt"] == "dense" and len(x["shape"]) == 2 and x["shape"][0] != x["shape"][1])
    e["shape"] = e["shape"][::-1]
    (d / ckf.LAYOUT).write_text(json.dumps(layout))
    return d / ckf.LAYOUT


@pytest.mark.parametrize("damage", [_flip_header_key, _flip_index, _truncate_layout, _transpose_in_layout])
def test_damaged_headers_and_json_are_named_checkpoint_errors(exported, tmp_path, damage):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    hit = damage(bad)
    for read in (ckf.load_state_dict, ckf.load_qtensors):
        with pytest.raises(ckf.CheckpointError) as err:
            read(bad)
        assert str(hit) in str(err.value) and "re-export" in str(err.value)


# ------------------------------------------------------------------ NaN/Inf weights


def test_export_refuses_nan_and_inf_weights(tmp_path):
    model, plan = make_trainer_model(seed=2)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    out = tmp_path / "ckpt"
    with pytest.raises(ckf.CheckpointError, match="model.norm.weight") as err:
        ckf.write_checkpoint(out, model, plan)
    assert "NaN/Inf" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing may be written"
    with torch.no_grad():
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[0, 0] = float("inf")
    with pytest.raises(ckf.CheckpointError, match="lm_head.weight"):
        ckf.write_checkpoint(out, model, plan)


def _reseal_with(d, name, edit):
    """Another tool's export: tensor `name` edited by `edit`, the shard's checksums in the index made to match."""
    from safetensors.torch import load as st_load

    index = json.loads((d / ckf.INDEX).read_text())
    shard = d / index["weight_map"][name]
    blob = shard.read_bytes()
    meta: dict = {}
    ckf._header(blob, str(shard), meta)
    tensors = st_load(blob)
    tensors[name] = edit(tensors[name].clone())
    blob = st_save(tensors, metadata=meta)
    shard.write_bytes(blob)
    index["metadata"]["shards"][shard.name] = {"sha256": hashlib.sha256(blob).hexdigest(), "bytes": len(blob)}
    index["metadata"]["tensor_crc32"].update(ckf.tensor_crcs(tensors))
    (d / ckf.INDEX).write_text(json.dumps(index))
    return shard


def _nan_bf16(t):
    t.view(-1)[0] = float("nan")
    return t


def _nan_e4m3(t):  # NVFP4 block scale, float8_e4m3fn: 0x7F is its NaN
    t.view(torch.uint8).view(-1)[0] = 0x7F
    return t


def _nan_e8m0(t):  # MXFP8 block scale, E8M0 stored as uint8: 0xFF is its NaN
    t.view(-1)[0] = 0xFF
    return t


@pytest.mark.parametrize("name, edit", [
    ("model.norm.weight", _nan_bf16),
    ("model.layers.0.mlp.experts.1.up_proj.weight_scale", _nan_e4m3),
    ("model.layers.2.mlp.experts.0.gate_proj.weight_scale", _nan_e8m0),
])
def test_loading_an_export_holding_nan_names_the_tensor(exported, tmp_path, name, edit):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(exported, bad)
    shard = _reseal_with(bad, name, edit)
    for read in (ckf.read_tensors, ckf.load_state_dict, ckf.load_qtensors):
        with pytest.raises(ckf.CheckpointError, match="NaN/Inf") as err:
            read(bad)
        assert str(shard) in str(err.value) and name in str(err.value)
