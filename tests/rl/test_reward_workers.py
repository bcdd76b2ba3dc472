"""Reward workers: timeouts judged on fresh replies, files loaded as Python runs them, metric names, process groups.

Each test starts real worker processes (about 0.2 s each); the timings leave margins of 0.5 s or more.
"""

import os
import re
import time
from pathlib import Path

import pytest

from rl4bit.reward_pool import RewardPool, check_rewards
from rl4bit.rewards import RewardError, load_reward

REPO = Path(__file__).resolve().parents[2]


def test_a_reply_in_time_is_not_judged_a_timeout_while_another_worker_restarts(tmp_path):
    """Slot 0 times out on 'hang' at 3 s and is restarted, which takes 2.5 s (its import sleeps once 'hang' has
    run); slot 1 answered 'a' at 1.5 s, got 'b' then, and answered it at 3.75 s, before its deadline (4.5 s), during
    that restart: it scores (the old code judged it after the restart, at 5.5 s). Every margin is 0.75 s or more."""
    f = tmp_path / "slow_restart.py"
    f.write_text(
        "import os, time\n"
        f"MARKER = {str(tmp_path / 'hung')!r}\n"
        "if os.path.exists(MARKER):\n"
        "    time.sleep(2.5)\n"
        "def r(prompt, completion, **s):\n"
        "    if prompt == 'hang':\n"
        "        open(MARKER, 'w').close()\n"
        "    time.sleep({'a': 1.5, 'b': 2.25}.get(prompt, 60))\n"
        "    return 1.0\n"
    )
    pool = RewardPool([f"{f}:r"], [1.0], workers=2, timeout_s=3.0, max_error_fraction=1.0)
    try:
        s = pool.score([(p, "c", {}) for p in ("hang", "a", "b")])
    finally:
        pool.close()
    assert s.totals == [None, 1.0, 1.0], s.messages
    assert s.errors == 1 and "timed out after 3.0 s on prompt 'hang'" in s.messages[0]


def test_a_reward_file_imports_like_python_runs_it(tmp_path):
    """`from helpers import ...` finds the file's neighbour (the worker runs with -P), and `@dataclass` under
    `from __future__ import annotations` finds its module in sys.modules; two functions of one file share it."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helpers.py").write_text("def score(completion):\n    return float(len(completion))\n")
    (proj / "my_rewards.py").write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "from helpers import score\n"
        "CALLS = []\n"
        "@dataclass\n"
        "class Bonus:\n"
        "    value: float = 0.5\n"
        "def length(prompt, completion, **s):\n"
        "    CALLS.append('length')\n"
        "    return score(completion) + Bonus().value\n"
        "def calls(prompt, completion, **s):\n"
        "    return float(len(CALLS))  # 1: length ran in this same module\n"
    )
    pool = RewardPool([f"{proj}/my_rewards.py:length", f"{proj}/my_rewards.py:calls"], [1.0, 1.0], workers=1)
    try:
        s = pool.score([("p", "abc", {})])
    finally:
        pool.close()
    assert s.per_reward == {"length": [3.5], "calls": [1.0]} and s.errors == 0, s.messages


def test_two_folders_with_a_helper_of_one_name_are_refused_not_mixed(tmp_path):
    """rw/a.py and rwc/b.py each import their own `helper`: one process holds one module of a name, so b.py got
    a.py's helper and logged its values as its own (a README walk found it). Now the pool refuses at start, naming
    the module and both folders; a second file of the same folder still shares it."""
    for folder, value in (("rw", 1.0), ("rwc", 100.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "helper.py").write_text(f"VALUE = {value}\n")
        (tmp_path / folder / f"{folder}_reward.py").write_text(
            "from helper import VALUE\n"
            f"def {folder}(prompt, completion, **s):\n    return VALUE\n")
    (tmp_path / "rw" / "also.py").write_text("from helper import VALUE\ndef also(prompt, completion, **s):\n"
                                             "    return VALUE + 1\n")
    specs = [f"{tmp_path}/rw/rw_reward.py:rw", f"{tmp_path}/rwc/rwc_reward.py:rwc"]
    with pytest.raises(RewardError, match=r"imports its own 'helper' from .*rwc, but a reward file in .*rw already "
                                          r"imported a 'helper'"):
        RewardPool(specs, [1.0, 1.0], workers=1)
    pool = RewardPool([specs[0], f"{tmp_path}/rw/also.py:also"], [1.0, 1.0], workers=1)
    try:
        assert pool.score([("p", "c", {})]).per_reward == {"rw": [1.0], "also": [2.0]}
    finally:
        pool.close()


def test_same_named_helper_packages_are_caught_and_unused_ones_are_not(tmp_path):
    """Helper packages without __init__.py (namespace packages: no __file__) are caught too, and so is one that
    loses to another folder's regular package of its name (f1 would silently get f3's V = 100); a folder that only
    holds a same-named module its reward file does not import loads beside a regular package of that name, in
    either order."""
    def reward(folder, imports, body, init=False):
        (tmp_path / folder / "lib").mkdir(parents=True)
        (tmp_path / folder / "lib" / "helper.py").write_text("V = 1.0\n")
        if init:
            (tmp_path / folder / "lib" / "__init__.py").write_text("")
        (tmp_path / folder / f"{folder}.py").write_text(f"{imports}\ndef {folder}(prompt, completion, **s):\n"
                                                         f"    return {body}\n")
        return f"{tmp_path}/{folder}/{folder}.py:{folder}"

    def loads(specs):
        pool = RewardPool(specs, [1.0] * len(specs), workers=1)
        try:
            return pool.score([("p", "c", {})]).errors == 0
        finally:
            pool.close()

    f1, f2 = reward("f1", "from lib.helper import V", "V"), reward("f2", "from lib.helper import V", "V")
    with pytest.raises(RewardError, match="imports its own 'lib'"):
        loads([f1, f2])
    (tmp_path / "f3" / "lib").mkdir(parents=True)  # a regular package f3.py never imports
    (tmp_path / "f3" / "lib" / "__init__.py").write_text("")
    (tmp_path / "f3" / "lib" / "helper.py").write_text("V = 100.0\n")
    (tmp_path / "f3" / "f3.py").write_text("import math\ndef f3(prompt, completion, **s):\n    return math.pi\n")
    f3 = f"{tmp_path}/f3/f3.py:f3"
    with pytest.raises(RewardError, match="found another reward folder's 'lib' first"):
        loads([f3, f1])
    g1 = reward("g1", "from lib.helper import V", "V", init=True)
    assert loads([g1, f3]) and loads([f3, g1])


def test_a_module_name_that_is_not_found_suggests_the_file_form():
    suggestion = r"cannot import module 'no_such_helpers'.*'path/to/no_such_helpers.py:score'"
    with pytest.raises(RewardError, match=suggestion):
        load_reward("no_such_helpers:score")


def test_reward_names_must_differ_and_not_shadow_the_drivers_metrics(tmp_path):
    """`a.py:reward` and `b.py:reward` would share reward/reward, a reward `mean` would overwrite reward/mean: both
    refused when the pool is built (`check_rewards` at job start builds one), before any worker starts."""
    for stem in ("a", "b"):
        (tmp_path / f"{stem}.py").write_text("def reward(prompt, completion, **s):\n    return 1.0\n"
                                            "def mean(prompt, completion, **s):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"'.*a.py:reward' and '.*b.py:reward' would both log as reward/reward; "
                                          r"give each function its own name"):
        RewardPool([f"{tmp_path}/a.py:reward", f"{tmp_path}/b.py:reward"], [1.0, 1.0])
    with pytest.raises(RewardError, match=r"the name 'mean' is taken by the metric reward/mean.*rename the function"):
        check_rewards([f"{tmp_path}/a.py:mean"], {"prompt": "1+1=", "answer": "2"})


def test_reserved_names_cover_the_reward_metrics_the_driver_writes():
    """Every literal `reward/<name>` key in driver.py, rollouts.py and metrics.py is reserved (read from the source, not
    imported: importing the driver takes seconds)."""
    from rl4bit.rewards import RESERVED_NAMES

    keys = set()
    for path in ("rl4bit/driver.py", "rl4bit/rollouts.py", "rl4bit/metrics.py"):
        keys |= set(re.findall(r"[\"']reward/(\w+)[\"']", (REPO / path).read_text()))
    assert keys and keys <= set(RESERVED_NAMES), sorted(keys - set(RESERVED_NAMES))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and awaiting its reaper, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timed_out_or_closed_worker_takes_the_processes_its_reward_started(tmp_path):
    """A reward waiting on `sleep 47` times out; another leaves `sleep 47` running and returns: after close()
    neither sleep is alive."""
    f = tmp_path / "spawns.py"
    f.write_text(
        "import subprocess\n"
        f"DIR = {str(tmp_path)!r}\n"
        "def r(prompt, completion, **s):\n"
        "    p = subprocess.Popen(['sleep', '47'])\n"
        "    open(f'{DIR}/{prompt}.pid', 'w').write(str(p.pid))\n"
        "    if prompt == 'waits':\n"
        "        p.wait()\n"
        "    return 1.0\n"
    )
    pool = RewardPool([f"{f}:r"], [1.0], workers=1, timeout_s=1.0, max_error_fraction=1.0)
    pids = []
    try:
        s = pool.score([("waits", "c", {}), ("leaves", "c", {})])
        assert s.totals == [None, 1.0] and "timed out" in s.messages[0]
        pids = [int((tmp_path / f"{p}.pid").read_text()) for p in ("waits", "leaves")]
    finally:
        pool.close()
    try:
        deadline = time.monotonic() + 5  # SIGKILL is prompt; 5 s is for a loaded machine
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], "sleep 47 outlived its reward worker"
    finally:
        for pid in pids:  # never leave them behind, even when the test fails
            if _alive(pid):
                os.kill(pid, 9)
