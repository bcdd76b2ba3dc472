"""The two export forms of one run: `--format hf` loads in transformers with the trainer's dequantized weights
rounded to BF16 (bitwise); the default decodes with compressed-tensors' own compressors to the same values; each
says who reads it, at export and in `inspect`.

The run dir holds the quickstart model (4 layers: 3 NVFP4, the last MXFP8, as the default recipe's tail) with
weights moved away from their seeded init, saved as a trainer checkpoint would be.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rl4bit.cli import main as cli
from rl4bit.common import checkpoint_format as ckf
from rl4bit.common import ct_layout
from rl4bit.kernels import dequantize

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
OVERRIDES = ["model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4", "data.eval_size=16"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _ndiff(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return int((_bits(a) != _bits(b)).sum())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, the converted model holding the checkpoint's weights, its plan)."""
    from rl4bit.common.checkpoint import save_checkpoint
    from rl4bit.config import dump_yaml, load_config
    from rl4bit.export import _build

    cfg = load_config(QUICKSTART, OVERRIDES)
    run = tmp_path_factory.mktemp("forms") / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(cfg))
    model, plan, _ = _build(cfg)
    assert {"nvfp4", "mxfp8"} <= set(plan.values()), plan
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    save_checkpoint(run, 5, {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
                    {"trainer": {"version": 5}})
    (run / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval/accuracy": 0.25}) + "\n")
    return run, model, plan


def test_hf_form_loads_in_transformers_with_the_trainers_weights_bitwise(run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl4bit.trainer.surgery import quantized_weights

    run_dir, model, plan = run
    out = tmp_path / "hf"
    assert cli(["export", str(run_dir), "--out", str(out), "--format", "hf"]) == 0
    printed = capsys.readouterr().out
    assert "read by: transformers (AutoModelForCausalLM.from_pretrained)" in printed
    assert re.search(r"eval: greedy accuracy on the run's 16 eval prompts: \d\.\d{3} with transformers in BF16 .*"
                     r"the run's eval/accuracy: 0\.250 at step 5", printed), printed

    config = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert "quantization_config" not in config and config["eos_token_id"] == tok.eos_token_id is not None
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    params = dict(loaded.named_parameters())
    qw = quantized_weights(model)
    checked = set()
    for module, ps in qw.items():
        for param, q in ps.items():
            name = f"{module}.{param}"
            assert _ndiff(params[name].data, dequantize(q, torch.bfloat16)) == 0, name
            checked.add(name)
    assert {ct_layout.layer_of(n) for n in checked} == {0, 1, 2, 3}  # NVFP4 layers and the MXFP8 tail
    for name, t in model.state_dict().items():
        if name not in checked:
            assert _ndiff(params[name].data, t.to(torch.bfloat16)) == 0, name
    assert len(params) == len(model.state_dict())

    assert cli(["inspect", str(out)]) == 0
    assert "form: hf (plain BF16" in capsys.readouterr().out


def test_default_form_decodes_with_compressed_tensors_to_the_same_values(run, tmp_path, capsys):
    """compressed-tensors' own decoders (q * weight_scale / weight_global_scale for NVFP4) give, per expert, the
    values the hf form holds: the two forms carry one set of weights."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    run_dir, model, plan = run
    ct, hf = tmp_path / "ct", tmp_path / "hf"
    assert cli(["export", str(run_dir), "--out", str(ct)]) == 0
    assert "read by: vLLM (compressed-tensors" in capsys.readouterr().out
    assert cli(["export", str(run_dir), "--out", str(hf), "--format", "hf", "--no-eval"]) == 0
    capsys.readouterr()
    params = dict(AutoModelForCausalLM.from_pretrained(hf).named_parameters())
    qc = QuantizationConfig.model_validate(json.loads((ct / "config.json").read_text())["quantization_config"])
    tensors = ckf.read_tensors(ct)
    checked = {"nvfp4": 0, "mxfp8": 0}
    for module, fmt in plan.items():
        if fmt not in checked:
            continue
        for param, projs in ct_layout.EXPERT_PROJS.items():
            want = params[f"{module}.{param}"].data  # [E, rows * len(projs), K]
            rows = want.shape[1] // len(projs)
            for e in range(want.shape[0]):
                for i, proj in enumerate(projs):
                    prefix = f"{module}.{e}.{proj}"
                    group = next(g for g in qc.config_groups.values()
                                 if any(t.startswith("re:") and re.match(t[3:], prefix) for t in g.targets))
                    stored = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
                    stored.pop("input_global_scale", None)
                    theirs = BaseCompressor.get_value_from_registry(group.format).decompress(stored, group)["weight"]
                    assert _ndiff(theirs.to(torch.bfloat16), want[e, i * rows:(i + 1) * rows]) == 0, prefix
                    checked[fmt] += 1
    assert checked["nvfp4"] > 0 and checked["mxfp8"] > 0, checked
    assert cli(["inspect", str(ct)]) == 0
    assert "form: compressed-tensors (quantized); read by: vLLM" in capsys.readouterr().out
