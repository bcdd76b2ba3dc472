"""`model.path`: a local Hugging Face checkpoint runs with its own tokenizer, and a checkpoint that cannot run the
job (blocks of 32, vocabulary, context) is refused at load with what is wrong.

The checkpoints are written here: a tiny Qwen3-MoE saved with `save_pretrained`, beside a character tokenizer
whose ids run in another order than rl4bit's built-in one, so a job that used the built-in tokenizer would
feed the checkpoint other ids than its own.
"""

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rl4bit.config import load_config, trainer_args, warm_start_args
from rl4bit.trainer.models import build_model, build_policy_model
from rl4bit.trainer.tokenizer import ALPHABET, SPECIAL_TOKENS, build_tokenizer, char_tokenizer

TINY = ["model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
        "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32", "sampler.max_new_tokens=8"]


def _reversed_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in alphabet with the ids in reverse order, specials last; no pad token (as many LLMs ship)."""
    vocab = {tok: i for i, tok in enumerate(list(reversed(ALPHABET)) + SPECIAL_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


CHAT_TEMPLATE = ("{% for m in messages %}<bos>Q: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}A: {% endif %}")
"""A one-turn template in the tokenizer's own alphabet (what an instruct checkpoint's tokenizer_config carries)."""


def _save(tmp_path, extra=(), tokenizer=True, chat=False, **hf_overrides):
    cfg = load_config(None, TINY + list(extra))
    model = build_model(cfg.model, len(char_tokenizer()), seed=0)
    for k, v in hf_overrides.items():
        setattr(model.config, k, v)
    model.save_pretrained(tmp_path)
    if tokenizer:
        tok = _reversed_tokenizer()
        if chat:
            tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(tmp_path)
    return load_config(None, TINY + list(extra) + [f"model.path={tmp_path}"])


def test_a_checkpoint_runs_with_its_own_tokenizer(tmp_path):
    cfg = _save(tmp_path)
    tok = build_tokenizer(cfg.model)
    order = list(reversed(ALPHABET))  # the saved vocabulary's ids, by construction
    assert tok("12+30=", add_special_tokens=False).input_ids == [order.index(c) for c in "12+30="]
    assert tok("12+30=").input_ids != char_tokenizer()("12+30=").input_ids
    assert tok.pad_token is None and tok.eos_token == "<eos>"  # as saved (the warm start pads with eos)
    model = build_policy_model(cfg.model, cfg.recipe, cfg.run.seed)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tok("1+1=").input_ids]))
    assert out.logits.shape[-1] == len(tok) and torch.isfinite(out.logits).all()


def test_the_trainer_and_the_export_use_the_checkpoints_tokenizer(tmp_path):
    from rl4bit.export import _build
    from rl4bit.trainer.actor import Trainer

    cfg = _save(tmp_path / "ckpt", ["trainer.device=cpu"])
    ids = _reversed_tokenizer()("7+8=", add_special_tokens=False).input_ids
    assert Trainer(**trainer_args(cfg)).tokenizer("7+8=", add_special_tokens=False).input_ids == ids
    assert _build(cfg)[2]("7+8=", add_special_tokens=False).input_ids == ids


def test_a_local_checkpoint_trains_end_to_end_with_its_own_tokenizer(tmp_path):
    """The whole loop on a saved checkpoint (local mode, 2 steps, warm start included): sampler and trainer
    agree bitwise under the checkpoint's tokenizer, every rollout is served, the checkpoint is written."""
    from rl4bit import driver
    from rl4bit.metrics import read_metrics

    cfg = _save(tmp_path / "ckpt")
    small = ["rl.steps=2", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "run.warmup_sft_steps=2",
             "run.warmup_batch_size=8", "run.cpu_threads=1", "run.progress=false", "data.eval_size=4",
             "ray.mode=local", "trainer.device=cpu", "sampler.max_new_tokens=6"]
    out = tmp_path / "run"
    assert driver.main(None, out=str(out), overrides=TINY + small + [f"model.path={cfg.model.path}"]) == 0
    steps = read_metrics(out)[1:]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/k3"] == 0.0 and r["rollout/errors"] == 0.0 for r in steps), steps
    assert (out / "checkpoints" / "latest.json").is_file()


@pytest.mark.parametrize("extra, hf, match", [
    (["model.max_seq_len=64"], {"max_position_embeddings": 32},
     r"max_seq_len=64 is past its max_position_embeddings 32"),
    ([], {"vocab_size": 40}, r"vocab_size 40 is smaller than its tokenizer's \d+ ids"),
])
def test_a_checkpoint_that_cannot_run_the_job_is_refused_by_name(tmp_path, extra, hf, match):
    cfg = _save(tmp_path, **hf)
    cfg.model.max_seq_len = load_config(None, TINY + extra).model.max_seq_len
    with pytest.raises(ValueError, match=match):
        build_policy_model(cfg.model, cfg.recipe, cfg.run.seed)


def test_a_hidden_size_off_the_32_block_is_refused(tmp_path):
    from transformers import AutoConfig

    from rl4bit.trainer.models import checkpoint_problems

    cfg = _save(tmp_path)
    hf = AutoConfig.from_pretrained(tmp_path)
    hf.hidden_size, hf.moe_intermediate_size = 48, 40
    problems = checkpoint_problems(hf, cfg.model, len(_reversed_tokenizer()))
    assert [p.split(" is not")[0] for p in problems] == ["hidden_size 48", "the experts' intermediate size 40"]


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path):
    cfg = _save(tmp_path, tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"holds no tokenizer .*tokenizer.save_pretrained"):
        build_tokenizer(cfg.model)


def test_chat_template_wraps_every_prompt_the_same_way(tmp_path, monkeypatch):
    """data.chat_template: rollouts, evaluation and the warm start send the templated ids; rewards keep the raw
    prompt; a tokenizer without a template is refused at start, naming the setting."""
    from rl4bit import driver, rollouts
    from rl4bit.config import ConfigError
    from rl4bit.trainer.tokenizer import prompt_ids

    cfg = _save(tmp_path / "ckpt", ["data.chat_template=true"], chat=True)
    tok = build_tokenizer(cfg.model)
    want = tok("<bos>Q: 3+4=\nA: ", add_special_tokens=False).input_ids
    assert prompt_ids(tok, "3+4=", chat=True) == want != prompt_ids(tok, "3+4=")
    req = rollouts._request(cfg, tok, {"prompt": "3+4=", "answer": "7"}, n=2, seed=1, rid="r")
    assert req.prompt_ids == want and req.prompt == "3+4="

    import rl4bit.trainer.warmstart as ws
    from rl4bit.trainer.actor import Trainer

    calls = []
    monkeypatch.setattr(ws, "prompt_ids", lambda t, text, chat=False: calls.append(chat) or prompt_ids(t, text, chat))
    trainer = Trainer(**trainer_args(cfg))
    cfg.run.warmup_sft_steps, cfg.run.warmup_batch_size = 1, 2
    trainer.warm_start([{"prompt": "1+1=", "answer": "2"}], **warm_start_args(cfg))
    assert calls == [True, True]  # both samples' prompts, templated

    plain = _save(tmp_path / "plain", ["data.chat_template=true"])
    with pytest.raises(ConfigError, match="data.chat_template: the tokenizer has no chat template"):
        driver.main(None, out=str(tmp_path / "run"), overrides=TINY + [
            "data.chat_template=true", "ray.mode=local", "trainer.device=cpu", f"model.path={plain.model.path}"])


@pytest.mark.parametrize("template", ["<bos> $A", "<bos> $A <eos>", "$A <eos>"])
def test_raw_prompts_get_the_tokenizers_own_bos_and_no_eos(template):
    """A Llama-style tokenizer adds BOS to raw text: prompt_ids keeps it (the model was trained with it); an EOS
    the tokenizer would append is left out (it would end the prompt)."""
    from tokenizers import processors

    from rl4bit.trainer.tokenizer import prompt_ids

    tok = _reversed_tokenizer()
    bos, eos = tok.convert_tokens_to_ids("<bos>"), tok.convert_tokens_to_ids("<eos>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<bos>", bos), ("<eos>", eos)])
    plain = tok("1+1=", add_special_tokens=False).input_ids
    assert prompt_ids(tok, "1+1=") == ([bos] if template.startswith("<bos>") else []) + plain


def test_the_export_carries_the_checkpoints_generation_config(tmp_path):
    """Its eos ids (a list, beyond config.json's one) reach the export, which vLLM stops on."""
    import json

    from rl4bit.common.checkpoint_format import write_checkpoint
    from rl4bit.export import _build

    cfg = _save(tmp_path / "ckpt")
    gen = json.loads((tmp_path / "ckpt" / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 2]
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps(gen))
    model, plan, tok = _build(cfg)
    out = write_checkpoint(tmp_path / "export", model, plan, tokenizer=tok)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 2]
