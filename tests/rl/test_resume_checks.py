"""A checkpoint that passes its checksums but does not fit the job is refused, naming why, before any state
changes: another recipe or model, a tensor of another dtype or shape, NaN/Inf, missing optimizer moments or RNG
state (trainer/resume_checks.py)."""

from __future__ import annotations

import re

import pytest
import torch

from rl4bit import driver
from rl4bit.common.checkpoint_format import CheckpointError
from rl4bit.config import ConfigError, dump_yaml, load_config, trainer_args
from rl4bit.metrics import read_metrics
from rl4bit.rundir import record_config
from rl4bit.trainer.actor import TrainBatch, Trainer

from .conftest import QUICKSTART
from .test_trainer_checkpoint import _rollouts


def _breakages():
    def nan(t, m):
        k = next(k for k in t if k.startswith("model.") and t[k].is_floating_point())
        t[k] = t[k].clone()
        t[k].view(-1)[0] = float("nan")
        return "holds NaN/Inf"

    def half(t, m):
        k = next(k for k in t if k.startswith("model.") and t[k].is_floating_point())
        t[k] = t[k].half()
        return "dtype torch.float16"

    def moment_shape(t, m):
        k = next(k for k in t if k.endswith(".exp_avg"))
        t[k] = torch.zeros(3)
        return "shape (3,)"

    def no_moments(t, m):
        for k in [k for k in t if k.startswith("optim.")]:
            del t[k]
        return "no AdamW moments"

    def no_rng(t, m):
        del t["rng.torch_cpu"]
        return "rng.torch_cpu"

    def no_meta(t, m):
        del m["opt_steps"]
        return "lacks trainer.opt_steps"

    def bad_python_rng(t, m):
        m["python_rng"] = [3, [1, 2], None]
        return "trainer.python_rng: not a Python random state"

    return [nan, half, moment_shape, no_moments, no_rng, no_meta, bad_python_rng]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from .conftest import SMALL

    cfg = load_config(QUICKSTART, list(SMALL) + ["recipe.name=bf16", "rl.ppo_epochs=1"])
    trainer = Trainer(**trainer_args(cfg))
    trainer.setup_rl()
    outs = _rollouts(cfg, trainer)
    trainer.train_step(TrainBatch([o.prompt_ids for o in outs], [o.completion_ids for o in outs],
                                  [o.logprobs for o in outs], [1.0, -1.0, 0.5] * 3))
    return cfg, trainer.state()


@pytest.mark.parametrize("breakage", _breakages(), ids=lambda f: f.__name__)
def test_bad_trainer_states_are_refused_before_loading(trained, breakage):
    cfg, (tensors, meta) = trained
    tensors, meta = dict(tensors), dict(meta)
    needle = breakage(tensors, meta)
    trainer = Trainer(**trainer_args(cfg))
    trainer.setup_rl()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        trainer.load_state(tensors, meta)
    assert trainer.opt_steps == 0 and not trainer.optimizer.state
    assert all(v.equal(before[k]) for k, v in trainer.model.state_dict().items())
    trainer.load_state(*map(dict, trained[1]))  # the intact state loads
    assert trainer.opt_steps == 1


def test_resume_under_another_recipe_is_refused(tmp_path, small, capsys):
    run = tmp_path / "run"
    base = small + ["ray.mode=local", "run.tensorboard=false", "rl.steps=1", "run.checkpoint_every=1",
                    "run.warmup_sft_steps=0"]
    assert driver.main(QUICKSTART, out=str(run), overrides=base) == 0
    capsys.readouterr()
    assert driver.main(None, resume=str(run), overrides=["rl.steps=2", "recipe.name=bf16"]) == 1
    err = capsys.readouterr().err
    assert "recipe.name: checkpoint 'nvfp4', this job 'bf16'" in err and "start a new run" in err, err
    assert driver.main(None, resume=str(run), overrides=["rl.steps=2"]) == 0  # nothing was lost


def test_a_resume_s_overrides_are_kept_for_the_next_resume(tmp_path, small, capsys):
    """`--resume -o rl.steps=N` used to change nothing on disk: a later plain `--resume` (the command every error
    prints) went back to the old rl.steps and exited 0 having run nothing. config.yaml now follows the overrides
    once the checkpoint accepted them (the old file kept under logs/), and a resume with no step left is refused
    before any actor starts."""
    run = tmp_path / "run"
    base = small + ["ray.mode=local", "run.tensorboard=false", "rl.steps=1", "run.checkpoint_every=1",
                    "run.warmup_sft_steps=0"]
    assert driver.main(QUICKSTART, out=str(run), overrides=base) == 0
    original = (run / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"last checkpoint is at step 1 and rl.steps is 1.*-o rl.steps=N with N > 1"):
        driver.main(None, resume=str(run))
    assert driver.main(None, resume=str(run), overrides=["rl.steps=2", "recipe.name=bf16"]) == 1  # refused
    assert (run / "config.yaml").read_text() == original and not list((run / "logs").glob("config-*"))
    capsys.readouterr()
    assert driver.main(None, resume=str(run), overrides=["rl.steps=2"]) == 0
    assert "now holds this run's settings" in capsys.readouterr().err
    assert load_config(run / "config.yaml").rl.steps == 2
    assert (run / "logs" / "config-before-step-2.yaml").read_text() == original
    with pytest.raises(ConfigError, match="last checkpoint is at step 2 and rl.steps is 2"):
        driver.main(None, resume=str(run))
    assert driver.main(None, resume=str(run), overrides=["rl.steps=3"]) == 0
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3]
    assert sorted(p.name for p in (run / "logs").glob("config-*")) == ["config-before-step-2.yaml",
                                                                       "config-before-step-3.yaml"]


def test_a_second_resume_from_one_checkpoint_keeps_every_earlier_config(tmp_path):
    """Two resumes from the same checkpoint (the first stopped before its next one): the original config.yaml is
    not overwritten by the first resume's."""
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_yaml(load_config(QUICKSTART, ["rl.steps=10"])))
    original = (run / "config.yaml").read_text()
    record_config(run, load_config(QUICKSTART, ["rl.steps=40"]), 10)
    first = (run / "config.yaml").read_text()
    record_config(run, load_config(QUICKSTART, ["rl.steps=40", "trainer.lr=1e-6"]), 10)
    logs = run / "logs"
    kept = sorted(p.name for p in logs.glob("config-*"))
    assert kept == ["config-before-step-11-1.yaml", "config-before-step-11.yaml"]
    assert (logs / "config-before-step-11.yaml").read_text() == original
    assert (logs / "config-before-step-11-1.yaml").read_text() == first
