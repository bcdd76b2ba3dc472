"""`scripts/ab_decode_config.py`: which swept decode tile it puts beside the default, and its A/B run on the CPU
(where the experts run the reference, so only the script's logic and the completions check are exercised)."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from rl4bit.kernels import qgemm_triton as qg

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("ab_decode_config", ROOT / "scripts" / "ab_decode_config.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(shape, tokens, cfg, us, bitwise=True):
    return dict(shape=shape, tokens=tokens, config=repr(cfg), fields=dataclasses.asdict(cfg), us=us, bitwise=bitwise)


def test_candidate_is_the_least_summed_time_among_configs_bitwise_everywhere():
    pick = _script().pick_candidate
    fast, slow = qg.Config(16, 32, 2, 3, True, block_k=256, w_first=True), qg.DECODE
    rows = [_row("gate_up 1", 1, slow, 10.0), _row("gate_up 1", 1, slow, 12.0),  # timed twice: mean 11
            _row("gate_up 1", 1, fast, 9.0), _row("down 16", 16, slow, 20.0), _row("down 16", 16, fast, 21.0),
            _row("down 8", 8, fast, 1.0),  # not at the rollout's tokens: ignored
            dict(shape="down 16", tokens=16, config="broken", error="OutOfResources")]
    cfg, us = pick(rows)
    assert cfg == fast and us == {"down 16": 21.0, "gate_up 1": 9.0}  # 30 against 31
    rows[2]["bitwise"] = False  # a config off TRAIN's bits on one shape is never picked
    cfg, us = pick(rows)
    assert cfg == slow and us == {"down 16": 20.0, "gate_up 1": 11.0}


def test_ab_run_on_cpu_compares_completions(tmp_path):
    rows = [_row(f"s{t}", t, qg.MID, 1.0) for t in (1, 16)]
    (tmp_path / "sweep.json").write_text(json.dumps(dict(rows=rows)))
    run = subprocess.run([sys.executable, "-P", str(ROOT / "scripts" / "ab_decode_config.py"), "--sweep",
                          str(tmp_path / "sweep.json"), "--device", "cpu", "--model", "small", "--new", "4",
                          "--prompt", "8", "--batches", "1,3", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads((tmp_path / "ab_decode.json").read_text())
    assert got["candidate"] == dataclasses.asdict(qg.MID)
    assert [r["batch"] for r in got["rows"]] == [1, 3] and all(r["equal_completions"] for r in got["rows"])
    assert all(len(r["A_tok_s"]) == len(r["B_tok_s"]) == 2 for r in got["rows"])
