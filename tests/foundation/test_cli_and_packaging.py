"""The `rl4bit` console script, the installed package layout, the run dir, atomic writes, and CI wiring."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl4bit.cli import main
from rl4bit.common.atomic import atomic_write_text
from rl4bit.config import load_config
from rl4bit.rundir import create_run_dir

REPO = Path(__file__).resolve().parents[2]
RL4BIT = Path(sys.executable).with_name("rl4bit")


def run(*args, cwd=None):
    return subprocess.run([str(RL4BIT), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_console_script_help():
    r = run("--help")
    assert r.returncode == 0
    for sub in ("train", "parity", "bench", "export", "inspect", "config"):
        assert sub in r.stdout


@pytest.mark.parametrize("sub", ["train", "parity", "bench", "export", "inspect", "config"])
def test_each_subcommand_has_help(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([sub, "--help"])
    assert e.value.code == 0
    assert "usage: rl4bit " + sub in capsys.readouterr().out


def test_config_prints_the_resolved_tree(capsys):
    cfg = load_config(REPO / "configs/quickstart.yaml")
    assert main(["config", str(REPO / "configs/quickstart.yaml"), "-o", "trainer.lr=1e-6"]) == 0
    out = capsys.readouterr().out
    rollouts = cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt
    assert "lr: 1.0e-06" in out and f"rollouts_per_step: {rollouts}" in out


def test_config_error_exits_nonzero_with_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rl:\n  samples_per_prompt: 0\n")
    assert main(["config", str(bad)]) == 1
    assert "rl.samples_per_prompt" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["soak", "step"])
def test_bench_overrides_reach_the_job(what, capsys):
    """`rl4bit bench soak -o` was refused ("takes no override argument": its run() named the parameter
    `overrides`); every bench that runs a job takes -o. A misspelt key shows it reached the job's config."""
    code = main(["bench", what, str(REPO / "configs/quickstart.yaml"), "--steps", "3", "-o", "rl.stepz=1"])
    err = capsys.readouterr().err
    assert code == 1 and "rl.stepz" in err and "takes no override" not in err, err


def test_train_refuses_arguments_a_resume_would_ignore(tmp_path, capsys):
    """A config or --out beside --resume is refused: a resumed run keeps its run dir's config.yaml and directory."""
    assert main(["train", str(REPO / "configs/quickstart.yaml"), "--resume", str(tmp_path)]) == 2
    assert "keeps its own config.yaml" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "drop --out" in capsys.readouterr().err


def test_packages_import_from_outside_the_repo(tmp_path):
    code = (
        "import importlib.util, rl4bit.kernels, rl4bit.trainer, rl4bit.sampler;"
        "assert importlib.util.find_spec('kernels') is None, 'a top-level kernels module is importable';"
        "assert importlib.util.find_spec('trainer') is None and importlib.util.find_spec('sampler') is None;"
        "import transformers.models.qwen3_moe.modeling_qwen3_moe"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_no_top_level_kernels_in_this_process():
    assert importlib.util.find_spec("kernels") is None


def test_run_dir_holds_the_config_and_refuses_to_clobber(tmp_path):
    cfg = load_config(REPO / "configs/quickstart.yaml")
    d = create_run_dir(cfg, tmp_path / "run")
    assert load_config(d / "config.yaml") == cfg
    for sub in ("logs", "plots", "checkpoints", "tensorboard"):
        assert (d / sub).is_dir()
    with pytest.raises(FileExistsError, match="wrote no checkpoint, so there is nothing to resume; choose another"):
        create_run_dir(cfg, tmp_path / "run")
    (d / "checkpoints" / "latest.json").write_text('{"step": 2, "dir": "step_000002"}')
    with pytest.raises(FileExistsError, match=f"pass --resume {d} to continue it from its last checkpoint"):
        create_run_dir(cfg, tmp_path / "run")


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "f.txt"
    atomic_write_text(target, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text().splitlines()
    i = readme.index("<!-- ci:test-command -->")
    assert readme[i + 1] == "```bash"
    cmd = readme[i + 2]
    assert "pytest" in cmd and "scripts/setup.sh" in cmd
    r = subprocess.run(
        ["awk", "/<!-- ci:test-command -->/{getline; getline; print; exit}", str(REPO / "README.md")],
        capture_output=True, text=True,
    )
    assert r.stdout.strip() == cmd
    assert "awk" in (REPO / ".ci/run").read_text()


def test_unbuilt_subcommands_say_so(capsys, tmp_path):
    # The feature behind `inspect` may or may not be built; either way no fake output.
    code = main(["inspect", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and err
