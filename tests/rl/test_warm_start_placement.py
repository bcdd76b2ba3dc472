"""The warm start only where it belongs: off by default, never on RL's own prompts unless asked, an eval split
carved from a prompt file without eval_file (said in the log), and a cache that spares the same warm start twice.
"""

import json

import pytest
import torch

from rl4bit.config import ConfigError, load_config
from rl4bit.tasks import load_task, warmup_split
from rl4bit.trainer.models import build_model
from rl4bit.trainer.tokenizer import char_tokenizer
from rl4bit.trainer.warmstart import supervised_warm_start

from .conftest import QUICKSTART, SMALL


def _file(path, n):
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return str(path)


def test_off_unless_asked_and_a_prompt_file_needs_its_own_warmup_prompts(tmp_path):
    assert load_config(None).run.warmup_sft_steps == 0
    assert load_config(QUICKSTART).run.warmup_sft_steps > 0  # the quickstart asks for it
    f = _file(tmp_path / "p.jsonl", 20)
    with pytest.raises(ConfigError, match=r"needs data\.warmup_file.*run\.warmup_sft_steps: 0.*warmup_prompts: train"):
        load_config(QUICKSTART, ["data.task=file", f"data.train_file={f}"])
    load_config(QUICKSTART, ["data.task=file", f"data.train_file={f}", "run.warmup_sft_steps=0"])
    load_config(QUICKSTART, ["data.task=file", f"data.train_file={f}", "run.warmup_prompts=train"])


def test_the_warm_start_never_sees_rls_prompts_unless_asked(tmp_path):
    cfg = load_config(QUICKSTART)
    train, evals = load_task(cfg.data)
    rl, warm = warmup_split(train, cfg.data, cfg.run)
    prompts = lambda xs: {s["prompt"] for s in xs}  # noqa: E731
    assert warm and rl and not prompts(rl) & prompts(warm) and not prompts(warm) & prompts(evals)
    assert len(rl) + len(warm) == len(train)
    cfg = load_config(QUICKSTART, ["run.warmup_prompts=train"])
    assert warmup_split(train, cfg.data, cfg.run) == (train, train)
    f, w = _file(tmp_path / "p.jsonl", 20), _file(tmp_path / "w.jsonl", 5)
    cfg = load_config(QUICKSTART, ["data.task=file", f"data.train_file={f}", f"data.warmup_file={w}"])
    train, _ = load_task(cfg.data)
    assert warmup_split(train, cfg.data, cfg.run)[1] == [json.loads(x) for x in open(w)]


def test_a_prompt_file_without_eval_file_gives_up_an_eval_split_and_says_so(tmp_path, capsys):
    f = _file(tmp_path / "p.jsonl", 40)
    cfg = load_config(QUICKSTART, ["data.task=file", f"data.train_file={f}", "run.warmup_sft_steps=0",
                                   "data.eval_fraction=0.25"])
    train, evals = load_task(cfg.data)
    assert len(evals) == 10 and len(train) == 30
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in evals}
    assert "10 of the 40 prompts" in capsys.readouterr().err
    assert load_task(cfg.data) == (train, evals)  # seeded: the same split every time


def test_the_same_warm_start_is_reused_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RL4BIT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(QUICKSTART, SMALL)
    tok = char_tokenizer()
    samples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    runs = []
    for _ in range(2):
        model = build_model(cfg.model, len(tok), seed=0)
        out = supervised_warm_start(model, tok, samples, steps=5, lr=3e-3, batch_size=8, seed=0)
        runs.append((out, {k: v.clone() for k, v in model.state_dict().items()}))
    (first, w1), (second, w2) = runs
    assert "warmup/cached" not in first and second["warmup/cached"] == 1.0
    assert second["warmup/cache"] == first["warmup/cache"] and first["warmup/cache"].endswith(".safetensors")
    assert second["warmup/loss_last"] == first["warmup/loss_last"]
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    untrained = build_model(cfg.model, len(tok), seed=0).state_dict()
    assert not torch.equal(w1["lm_head.weight"], untrained["lm_head.weight"])
    other = build_model(cfg.model, len(tok), seed=1)  # another seed: another key, trained
    assert "warmup/cached" not in supervised_warm_start(other, tok, samples, steps=5, lr=3e-3, batch_size=8, seed=0)
