"""Trainer pieces (micro-batching, logprob parity with the sampler) and the checkpoint files."""

import json

import pytest
import torch

from rl4bit.common.checkpoint import load_checkpoint, save_checkpoint
from rl4bit.config import load_config, trainer_args
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler.types import Request, SamplingParams
from rl4bit.trainer.actor import TrainBatch, Trainer, microbatches
from rl4bit.trainer.models import build_policy_model

from .conftest import QUICKSTART


def test_microbatches_respect_the_token_budget():
    assert microbatches([5, 5, 5, 12, 1], 10) == [[0, 1], [2], [3], [4]]
    assert microbatches([3, 3], 100) == [[0, 1]]


def _sync(trainer, sampler) -> int:
    """The driver's weight sync, in-process: bytes shipped."""
    version, count, layout = trainer.weight_header()
    sampler.begin_update(version, count, layout)
    shipped = sum(sampler.receive_bucket(trainer.weight_bucket(i)) for i in range(count))
    assert sampler.commit_update(version) == version == sampler.version
    return shipped


def _rollouts(cfg, trainer):
    sampler = Sampler(lambda: build_policy_model(cfg.model, cfg.recipe, cfg.run.seed), trainer.tokenizer, cfg.sampler,
                      device="cpu", max_seq_len=cfg.model.max_seq_len)
    _sync(trainer, sampler)
    reqs = [Request(str(i), trainer.tokenizer(p, add_special_tokens=False).input_ids,
                    SamplingParams(max_new_tokens=6, n=3, seed=i))
            for i, p in enumerate(["1+2=", "33+4=", "9+90="])]
    return sampler.generate(reqs)


def test_trainer_logprobs_equal_the_samplers_and_microbatching_agrees(small):
    # bf16 recipe, one epoch: no stochastic rounding keyed by call count, so micro-batches change only summation order
    small = small + ["recipe.name=bf16", "rl.ppo_epochs=1"]
    cfg = load_config(QUICKSTART, small)
    trainer = Trainer(**trainer_args(cfg))
    trainer.setup_rl()
    outs = _rollouts(cfg, trainer)
    batch = TrainBatch([o.prompt_ids for o in outs], [o.completion_ids for o in outs], [o.logprobs for o in outs],
                       [1.0, -1.0, 0.5] * 3)
    state = trainer.state()
    m_big = trainer.train_step(batch)
    assert m_big["mismatch/k3"] == 0.0 and m_big["ratio/min"] <= 1.0 <= m_big["ratio/max"]
    assert m_big["loss"] != 0.0

    small_mb = load_config(QUICKSTART, small + ["trainer.tokens_per_microbatch=12"])
    t2 = Trainer(**trainer_args(small_mb))
    t2.setup_rl()
    t2.load_state(*state)
    m_small = t2.train_step(batch)
    assert m_small["mismatch/k3"] == 0.0
    assert m_small["loss"] == pytest.approx(m_big["loss"], rel=1e-5, abs=1e-7)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-4)
    assert m_small["policy/entropy"] == pytest.approx(m_big["policy/entropy"], rel=1e-6)


def test_checkpoint_is_atomic_safetensors_and_json_and_pruned(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step))}, {"x": step}, keep=2)
    ck = tmp_path / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest.json", "step_000002", "step_000003"]
    assert {f.suffix for f in (ck / "step_000003").iterdir()} == {".safetensors", ".json"}
    tensors, meta = load_checkpoint(tmp_path)
    assert tensors["w"].tolist() == [3.0, 3.0] and meta["x"] == 3 and meta["step"] == 3
    assert json.loads((ck / "latest.json").read_text())["dir"] == "step_000003"
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        load_checkpoint(tmp_path / "elsewhere")


def test_non_finite_steps_are_skipped_then_stop_the_job(small):
    from rl4bit.trainer.actor import NonFiniteError

    cfg = load_config(QUICKSTART, small + ["recipe.name=bf16", "rl.ppo_epochs=1", "trainer.max_nonfinite_steps=2"])
    trainer = Trainer(**trainer_args(cfg))
    trainer.setup_rl()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    bad = TrainBatch([[5, 14, 6, 17]], [[7, 2]], [[-1.0, -1.0]], [float("nan")])
    m = trainer.train_step(bad)
    assert m["train/skipped_steps"] == 1.0
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed on a skipped step"
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        trainer.train_step(bad)
