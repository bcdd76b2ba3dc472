"""samples.jsonl: the completions of a few prompts every run.samples_every steps, with rewards, advantages and
sampler logprobs; `rl4bit inspect RUN --samples` prints the latest; TensorBoard gets the same as text."""

import json

from rl4bit import driver
from rl4bit.cli import main as cli

from .conftest import QUICKSTART, SMALL


def test_a_run_keeps_samples_and_inspect_prints_the_latest(tmp_path, capsys):
    out = tmp_path / "run"
    driver.main(QUICKSTART, out=str(out), overrides=SMALL + [
        "rl.steps=2", "run.warmup_sft_steps=0", "ray.mode=local", "run.samples_every=2", "run.samples_prompts=2"])
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # the first step, then every 2nd
    metrics = {json.loads(line)["step"]: json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()}
    for r in records:
        assert len(r["prompts"]) == 2 and r["mismatch/k3"] == metrics[r["step"]]["mismatch/k3"]
        for p in r["prompts"]:
            assert p["answer"] is not None and len(p["completions"]) == 4  # the whole GRPO group
            rewards = [c["reward"] for c in p["completions"]]
            advs = [c["advantage"] for c in p["completions"]]
            assert all(isinstance(x, float) for x in rewards) and abs(sum(advs)) < 1e-5
            for c in p["completions"]:
                assert len(c["sampler_logprobs"]) == len(c["token_ids"]) and c["finish_reason"] in ("stop", "length")
    capsys.readouterr()
    assert cli(["inspect", str(out), "--samples"]) == 0
    printed = capsys.readouterr().out
    assert "step 2" in printed and records[-1]["prompts"][0]["prompt"] in printed
    assert repr(records[-1]["prompts"][0]["completions"][0]["text"]) in printed

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = acc.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [1, 2]
    assert records[-1]["prompts"][0]["prompt"] in texts[-1].tensor_proto.string_val[0].decode()
