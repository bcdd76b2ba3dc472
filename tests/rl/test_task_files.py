"""Prompt files and the arithmetic task's bounds: every bad file is a PromptFileError naming the file (and line)."""

import json
import random
import sys
import types

import pytest

from rl4bit.config import MAX_DIGITS, ConfigError
from rl4bit.tasks import PromptFileError, arithmetic_task, load_prompt_file


@pytest.fixture
def fake_parquet(monkeypatch):
    """Install a stand-in `pyarrow.parquet` whose read_table returns `table` or raises `error` (pyarrow is optional)."""
    state = {"rows": [], "error": None}

    def read_table(path):
        if state["error"] is not None:
            raise state["error"]
        return types.SimpleNamespace(to_pylist=lambda: [dict(r) for r in state["rows"]])

    pq = types.ModuleType("pyarrow.parquet")
    pq.read_table = read_table
    pa = types.ModuleType("pyarrow")
    pa.parquet = pq
    monkeypatch.setitem(sys.modules, "pyarrow", pa)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", pq)
    return state


def test_zero_row_parquet_has_no_prompts(tmp_path, fake_parquet):
    f = tmp_path / "p.parquet"
    f.write_bytes(b"PAR1")
    with pytest.raises(PromptFileError, match=r"p\.parquet: no prompts"):
        load_prompt_file(f)
    fake_parquet["rows"] = [{"prompt": "1+1=", "answer": 2}]
    assert load_prompt_file(f) == [{"prompt": "1+1=", "answer": "2"}]


def test_parquet_reader_errors_name_the_file(tmp_path, fake_parquet):
    f = tmp_path / "p.parquet"
    f.write_bytes(b"PAR1")
    fake_parquet["error"] = ValueError("Parquet magic bytes not found in footer")
    with pytest.raises(PromptFileError, match=r"p\.parquet: cannot be read as Parquet \(ValueError: Parquet magic"):
        load_prompt_file(f)


def test_real_zero_row_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), f)
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompt_file(f)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_jsonl_has_no_prompts(tmp_path, text):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(PromptFileError, match=r"p\.jsonl: no prompts"):
        load_prompt_file(f)


def test_non_utf8_line_is_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(json.dumps({"prompt": "é"}, ensure_ascii=False).encode() + b"\r\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: not UTF-8 \(byte 0xe9 at column 16\)"):
        load_prompt_file(f)


def test_line_numbers_follow_text_mode_newlines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r\n{not json\n')
    with pytest.raises(PromptFileError, match=r"p\.jsonl:3: not valid JSON"):
        load_prompt_file(f)
    f.write_bytes(b'{"prompt": "a"}\r{"prompt": "b"}\r\n')
    assert [r["prompt"] for r in load_prompt_file(f)] == ["a", "b"]


def test_arithmetic_digits_are_bounded():
    for digits in (0, MAX_DIGITS + 1):
        with pytest.raises(ConfigError, match=rf"data\.digits: {digits} must be 1 to {MAX_DIGITS}"):
            arithmetic_task(digits, 1, seed=0)


@pytest.mark.parametrize("digits", [1, 2])
def test_arithmetic_order_is_unchanged(digits):
    """The splits and their order are part of every recorded run (parity references): pin them."""
    n = 10**digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    random.Random(5).shuffle(pairs)
    want = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    assert arithmetic_task(digits, 7, seed=5) == (want[7:], want[:7])
