"""Settings that cannot work are refused before a job starts, with the fix in the message: a micro-batch smaller
than one rollout, more prompts a step than the prompt file holds, a model.path that does not exist.

The refusals that need the job's prompts run through `rl4bit train` itself (`rl4bit.cli.main`): they come before
any actor starts, and the run dir they leave is empty of any run.
"""

import json
from pathlib import Path

import pytest

from rl4bit import cli
from rl4bit.config import ConfigError, load_config

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
QUIET = ["run.progress=false", "ray.mode=local", "run.warmup_sft_steps=0", "rl.steps=1"]


def _prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def _train(tmp_path, capsys, overrides) -> tuple[int, str]:
    out = tmp_path / "run"
    argv = ["train", QUICKSTART, "--out", str(out)]
    for o in QUIET + overrides:
        argv += ["-o", o]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert not (out / "config.yaml").exists(), "a refused job must leave no run behind"
    return code, err


def test_a_microbatch_smaller_than_any_rollout_is_refused_at_config_load():
    with pytest.raises(ConfigError, match=r"trainer\.tokens_per_microbatch: 6 is smaller than one rollout.*"
                                          r"sampler\.max_new_tokens=6.*tokens_per_microbatch="):
        load_config(QUICKSTART, ["trainer.tokens_per_microbatch=6"])
    load_config(QUICKSTART, ["trainer.tokens_per_microbatch=12"])  # the longest quickstart rollout: 6 + 6 tokens


def test_a_microbatch_smaller_than_the_longest_rollout_is_refused_at_job_start(tmp_path, capsys):
    """Prompts of 20 characters + 6 new tokens: a micro-batch of 10 tokens holds no rollout."""
    train = _prompts(tmp_path / "train.jsonl", ["1234567890+123456789=", "1+1="])
    evals = _prompts(tmp_path / "eval.jsonl", ["2+2="])
    code, err = _train(tmp_path, capsys, ["data.task=file", f"data.train_file={train}", f"data.eval_file={evals}",
                                          "rl.prompts_per_step=2", "trainer.tokens_per_microbatch=10"])
    assert code == 1
    assert "trainer.tokens_per_microbatch: 10 is smaller than one rollout (27 tokens" in err, err
    assert "-o trainer.tokens_per_microbatch=" in err


def test_more_prompts_a_step_than_the_file_holds_is_refused(tmp_path, capsys):
    train = _prompts(tmp_path / "train.jsonl", ["1+1=", "1+2=", "1+3="])
    evals = _prompts(tmp_path / "eval.jsonl", ["2+2="])
    code, err = _train(tmp_path, capsys, ["data.task=file", f"data.train_file={train}", f"data.eval_file={evals}",
                                          "rl.prompts_per_step=8"])
    assert code == 1
    assert f"rl.prompts_per_step: 8 is larger than the 3 train prompts of {train}" in err, err
    assert "-o rl.prompts_per_step=3" in err


def test_a_model_path_that_does_not_exist_is_named_as_such(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    code, err = _train(tmp_path, capsys, [f"model.path={missing}"])
    assert code == 1
    assert f"model.path: {str(missing)!r} does not exist" in err, err
    assert "holds no tokenizer" not in err
    assert "set model.path to null" in err
