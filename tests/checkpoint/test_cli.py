"""`rl4bit export` (from a config and from a run dir's latest checkpoint) and `rl4bit inspect`."""

from __future__ import annotations

import json

import torch

from rl4bit.common import checkpoint_format as ckf

OVERRIDES = ["model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4"]


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def test_export_config_then_run_dir_then_inspect(tmp_path, capsys):
    from rl4bit.cli import main as cli
    from rl4bit.common.checkpoint import save_checkpoint
    from rl4bit.config import dump_yaml, load_config
    from rl4bit.export import _build
    from rl4bit.trainer.surgery import quantized_weights

    overrides = [a for o in OVERRIDES for a in ("-o", o)]
    assert cli(["export", "configs/quickstart.yaml", "--out", str(tmp_path / "a"), *overrides]) == 0
    layout = json.loads((tmp_path / "a" / ckf.LAYOUT).read_text())
    assert layout["recipe"] == "nvfp4" and layout["policy_version"] == 0

    # a run dir: its config + a checkpoint holding other weights (a trained policy, version 7)
    cfg = load_config("configs/quickstart.yaml", OVERRIDES)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(cfg))
    model, plan, _ = _build(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-0.5)
    save_checkpoint(run, 7, {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
                    {"trainer": {"version": 7}})
    assert cli(["export", str(run), "--out", str(tmp_path / "b")]) == 0
    back = ckf.load_qtensors(tmp_path / "b")
    for module, params in quantized_weights(model).items():
        for param, q in params.items():
            assert torch.equal(_bits(back[module][param].data), _bits(q.data)), module
            assert torch.equal(_bits(back[module][param].scale), _bits(q.scale)), module
    assert json.loads((tmp_path / "b" / ckf.LAYOUT).read_text())["policy_version"] == 7

    capsys.readouterr()
    assert cli(["inspect", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "nvfp4" in out and "quantized" in out and "total" in out
    # 4.5 bits + per-expert scales: the expert weights are at most 0.30x BF16
    from rl4bit.export import module_rows

    rows = [r for r in module_rows(tmp_path / "b") if r["format"] == "nvfp4"]
    assert rows and all(4.5 <= r["bits"] < 4.8 for r in rows)
    assert sum(r["bytes"] for r in rows) / sum(r["bf16_bytes"] for r in rows) <= 0.30


def test_export_into_a_directory_that_is_not_an_export_is_refused(tmp_path, capsys):
    from rl4bit.cli import main as cli

    home = tmp_path / "my_models"  # `rl4bit export ... --out ~/my_models`, a directory of other things
    (home / "other_model").mkdir(parents=True)
    (home / "notes.txt").write_text("precious")
    capsys.readouterr()
    assert cli(["export", "configs/quickstart.yaml", "--out", str(home), *sum((["-o", o] for o in OVERRIDES), [])]) == 1
    err = capsys.readouterr().err
    assert str(home) in err and "not an rl4bit export" in err, err
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt", "other_model"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_models"], "no temporary export left beside it"


def test_export_of_a_missing_source_names_both_kinds(tmp_path, capsys):
    """`rl4bit export runs/nope`: the message says a config or a run dir was expected."""
    from rl4bit.cli import main as cli

    assert cli(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "does not exist: pass a YAML config" in err and "or a run dir" in err, err
    assert not (tmp_path / "x").exists()


def test_export_of_a_run_dir_refuses_settings_its_checkpoint_was_not_trained_with(tmp_path, capsys):
    """`-o recipe.name=mxfp8` on an nvfp4 run: the FP32 masters load under any recipe, so without the check the
    export would hold quantized tensors the trainer's forward never used. Refused, naming the setting."""
    from rl4bit.cli import main as cli
    from rl4bit.common.checkpoint import save_checkpoint
    from rl4bit.config import dump_yaml, load_config
    from rl4bit.export import _build
    from rl4bit.trainer.resume_checks import job_settings

    cfg = load_config("configs/quickstart.yaml", OVERRIDES)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(cfg))
    model, _, _ = _build(cfg)
    save_checkpoint(run, 7, {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
                    {"trainer": {"version": 7}, "job": job_settings(cfg)})
    capsys.readouterr()
    assert cli(["export", str(run), "--out", str(tmp_path / "b"), "-o", "recipe.name=mxfp8"]) == 1
    err = capsys.readouterr().err
    assert "recipe.name: checkpoint 'nvfp4', export 'mxfp8'" in err and "without -o overrides" in err, err
    assert not (tmp_path / "b").exists()
    assert cli(["export", str(run), "--out", str(tmp_path / "b")]) == 0  # the run's own settings export
    assert json.loads((tmp_path / "b" / ckf.LAYOUT).read_text())["recipe"] == "nvfp4"
