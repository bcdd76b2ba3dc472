"""Rewards (built-ins, loading, worker pool) and tasks (arithmetic splits, prompt files)."""

import json

import pytest

from rl4bit.reward_pool import RewardPool
from rl4bit.rewards import RewardError, exact_match, format_check, length_penalty, load_reward
from rl4bit.tasks import PromptFileError, PromptStream, arithmetic_task, load_prompt_file


def test_builtins():
    assert exact_match("12+30=", "42\n", answer="42") == 1.0
    assert exact_match("12+30=", " 42", answer="42") == 1.0
    assert exact_match("12+30=", "43", answer="42") == 0.0
    assert exact_match("12+30=", "abc", answer="42") == 0.0
    assert format_check("1+1=", "2\n") == 1.0 and format_check("1+1=", "2 apples") == 0.0
    assert length_penalty("p", "x" * 32) == -0.5 and length_penalty("p", "x" * 1000) == -1.0


def test_load_by_import_path_and_file(tmp_path):
    assert load_reward("rl4bit.rewards:format_check") is format_check
    f = tmp_path / "my_reward.py"
    f.write_text("def half(prompt, completion, **s):\n    return 0.5\n")
    assert load_reward(f"{f}:half")("p", "c") == 0.5
    with pytest.raises(RewardError, match="no function 'nope'$"):
        load_reward(f"{f}:nope")
    with pytest.raises(RewardError, match="no function 'exact_matc'; did you mean 'exact_match'\\?"):
        load_reward("rl4bit.rewards:exact_matc")
    with pytest.raises(RewardError, match="no function 'Pat'$"):  # never an import of the module (Path)
        load_reward("rl4bit.rewards:Pat")
    with pytest.raises(RewardError, match="cannot import module 'no_such_mod'"):
        load_reward("no_such_mod:f")
    with pytest.raises(RewardError, match="does not exist"):
        load_reward(f"{tmp_path}/missing.py:f")


def test_pool_masks_errors_times_out_and_fails_past_the_fraction(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(
        "import time\n"
        "def odd_fails(prompt, completion, answer=None, **s):\n"
        "    if int(answer) % 2: raise ValueError('odd answer')\n"
        "    return 1.0\n"
        "def slow(prompt, completion, answer=None, **s):\n"
        "    if answer == 'slow': time.sleep(30)\n"
        "    return 2.0\n"
    )
    pool = RewardPool([f"{f}:odd_fails"], [0.5], max_error_fraction=0.5)
    try:
        s = pool.score([("p", "c", {"answer": str(i)}) for i in range(4)])
        assert s.totals == [0.5, None, 0.5, None] and s.errors == 2
        assert "odd answer" in s.messages[0] and "odd_fails" in s.messages[0]
        with pytest.raises(RewardError, match="2/3 samples failed"):
            pool.score([("p", "c", {"answer": a}) for a in ("1", "3", "2")])
    finally:
        pool.close()
    pool = RewardPool([f"{f}:slow"], [1.0], timeout_s=0.5, max_error_fraction=0.5)
    try:
        s = pool.score([("p", "c", {"answer": a}) for a in ("1", "slow", "2")])
        assert s.totals == [2.0, None, 2.0] and "timed out" in s.messages[0]
        assert pool.score([("p", "c", {"answer": "3"})]).totals == [2.0]  # the worker was restarted
    finally:
        pool.close()


def test_list_signatures_trl_and_batched_score_through_the_pool(tmp_path):
    """A TRL reward (first parameter `completions`, `prompts` and dataset columns as keyword lists) and the
    `fn.batched` form run unchanged in the pool; a list of the wrong length masks the sample, naming why."""
    f = tmp_path / "trl_rewards.py"
    f.write_text(
        "def trl_match(completions, prompts, answer, **kwargs):\n"
        "    return [float(c.strip() == a) + 0.25 * len(p) for c, p, a in zip(completions, prompts, answer)]\n"
        "def trl_len(completions, **kwargs):\n"
        "    return [float(len(c)) for c in completions]\n"
        "def ours(prompts, completions, answer, **s):\n"
        "    return [2.0 * (c == a) for c, a in zip(completions, answer)]\n"
        "ours.batched = True\n"
        "def too_many(completions, **kwargs):\n"
        "    return [1.0, 2.0]\n"
        "def trl_prompts_first(prompts, completions, **kwargs):\n"
        "    return [float(len(p)) for p in prompts]\n"
        "def trl_keyword_only(*, completions, answer, **kwargs):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
    )
    specs = [f"{f}:{n}" for n in ("trl_match", "trl_len", "ours", "trl_prompts_first", "trl_keyword_only")]
    pool = RewardPool(specs, [1.0, 0.5, 1.0, 0.5, 1.0], max_error_fraction=1.0)
    try:
        s = pool.score([("1+1=", "2", {"answer": "2"}), ("10+1=", "12 ", {"answer": "11"})])
        assert s.totals == [1.0 + 1.0 + 0.5 + 2.0 + 2.0 + 1.0, 0.0 + 1.25 + 1.5 + 0.0 + 2.5 + 0.0], s.messages
        assert s.errors == 0
    finally:
        pool.close()
    pool = RewardPool([f"{f}:too_many"], [1.0], max_error_fraction=1.0)
    try:
        s = pool.score([("p", "c", {})])
        assert s.totals == [None] and "one value per completion" in s.messages[0]
    finally:
        pool.close()


def test_arithmetic_splits_are_disjoint_and_seeded():
    train, evals = arithmetic_task(2, 64, seed=0)
    assert len(evals) == 64 and len(train) == 10_000 - 64
    assert not {s["prompt"] for s in train} & {s["prompt"] for s in evals}
    a, b = evals[0]["prompt"][:-1].split("+")
    assert int(evals[0]["answer"]) == int(a) + int(b)
    assert arithmetic_task(2, 64, seed=0)[1] == evals and arithmetic_task(2, 64, seed=1)[1] != evals


def test_prompt_stream_resumes_from_its_state():
    s = PromptStream([{"prompt": str(i)} for i in range(5)], seed=3)
    first = s.next(3)
    state = s.state()
    rest = s.next(6)  # crosses an epoch
    s2 = PromptStream([{"prompt": str(i)} for i in range(5)], seed=3)
    s2.load_state(state)
    assert s2.next(6) == rest and sorted(p["prompt"] for p in first + rest[:2]) == list("01234")


def test_prompt_files(tmp_path):
    good = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": "1+1=", "answer": 2, "level": "easy"}), "", json.dumps({"prompt": "x"})]
    good.write_text("\n".join(lines) + "\n")
    rows = load_prompt_file(good)
    assert rows[0] == {"prompt": "1+1=", "answer": "2", "level": "easy"} and rows[1] == {"prompt": "x"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n{not json\n")
    with pytest.raises(PromptFileError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompt_file(bad)
    bad.write_text(json.dumps({"question": "a"}) + "\n")
    with pytest.raises(PromptFileError, match=r"bad.jsonl:1: missing a string 'prompt'.*question"):
        load_prompt_file(bad)
    for name in ("completion", "completions", "prompts"):  # each would collide with a reward signature's argument
        bad.write_text(json.dumps({"prompt": "a", name: "b"}) + "\n")
        with pytest.raises(PromptFileError, match=rf"bad.jsonl:1: the field '{name}' is reserved.*rename it"):
            load_prompt_file(bad)
    pq = tmp_path / "p.parquet"
    pq.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(PromptFileError, match="needs pyarrow"):
            load_prompt_file(pq)


def test_prompt_lengths_are_checked_against_the_context():
    from rl4bit.config import ConfigError
    from rl4bit.tasks import check_prompt_lengths

    def count(texts):  # one token a character
        return [len(t) for t in texts]

    fits, long, empty = {"prompt": "ab"}, {"prompt": "x" * 8}, {"prompt": ""}
    assert check_prompt_lengths([fits], [fits], count, 8) is None
    warning = check_prompt_lengths([fits, long], [empty], count, 8)
    assert "1 of 2 train and 1 of 1 eval prompts" in warning and "max_seq_len=8" in warning
    with pytest.raises(ConfigError, match=r"none of the 2 train prompts fits model.max_seq_len=8 \(prompt 0 has 8"):
        check_prompt_lengths([long, empty], [], count, 8)
