"""Security and resource limits: rewards only in limited worker processes, nothing unpickled or unsafely parsed,
the private Ray cluster on 127.0.0.1 with no dashboard, output paths checked before anything is written."""

import os
import re
import stat
import time
from pathlib import Path

import pytest

from rl4bit import driver, rundir
from rl4bit.actors import Cluster
from rl4bit.config import ConfigError, load_config
from rl4bit.reward_pool import RewardPool, check_rewards
from rl4bit.rewards import RewardError

from .conftest import QUICKSTART, SMALL

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("rl4bit", "kernels", "trainer", "sampler")

REWARDS = '''
import os, time
def whoami(prompt, completion, **s):
    with open({pids!r}, "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    return 1.0
def hog(prompt, completion, **s):
    if completion == "big":
        block = bytearray(1 << 30)  # 1 GiB: past the worker's memory limit
        return float(len(block))
    return 1.0
def reads_stdin(prompt, completion, **s):
    import sys
    return float(len(sys.stdin.read()))  # the worker's stdin is /dev/null: 0, never the protocol's lines
def spin(prompt, completion, **s):
    if completion == "spin":
        t = time.process_time()
        while time.process_time() - t < 30:
            pass
    return 1.0
'''


@pytest.fixture
def rewards(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARDS.format(pids=str(tmp_path / "pids")))
    return f


def test_reward_code_never_runs_in_this_process(rewards, tmp_path):
    check_rewards([f"{rewards}:whoami"], {"prompt": "1+1=", "answer": "2"})
    pool = RewardPool([f"{rewards}:whoami"], [1.0], workers=2)
    try:
        assert pool.score([("p", "c", {})] * 4).totals == [1.0] * 4
        workers = set(pool.pids())
    finally:
        pool.close()
    pids = {int(x) for x in (tmp_path / "pids").read_text().split()}
    assert os.getpid() not in pids and len(pids) >= 2
    assert pids - workers, "the start-up check ran in its own worker too"


def test_a_reward_reading_stdin_gets_nothing_and_the_pool_goes_on(rewards):
    pool = RewardPool([f"{rewards}:reads_stdin"], [1.0], workers=1, timeout_s=20)
    try:
        assert pool.score([("p", str(i), {}) for i in range(3)]).totals == [0.0, 0.0, 0.0]
    finally:
        pool.close()


def test_memory_limit_masks_the_sample(rewards):
    pool = RewardPool([f"{rewards}:hog"], [1.0], memory_mb=256, max_error_fraction=0.5)
    try:
        s = pool.score([("p", "small", {}), ("p", "big", {})])
    finally:
        pool.close()
    assert s.totals == [1.0, None] and "MemoryError" in s.messages[0] and "hog" in s.messages[0]


def test_cpu_limit_kills_the_worker_and_it_is_replaced(rewards):
    pool = RewardPool([f"{rewards}:spin"], [1.0], timeout_s=25, cpu_s=1, max_error_fraction=0.5)
    try:
        t0 = time.monotonic()
        s = pool.score([("p", "spin", {}), ("p", "ok", {})])
        assert time.monotonic() - t0 < 15, "the CPU limit, not the 25 s timeout, ended the call"
        assert s.totals == [None, 1.0] and "exit code -24" in s.messages[0], s.messages
        assert pool.score([("p", "ok", {})]).totals == [1.0]
    finally:
        pool.close()


def test_a_reward_that_cannot_load_is_named_without_running_here(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("raise SystemExit('import-time exit')\n")
    with pytest.raises(RewardError, match=r"bad.py"):
        RewardPool([f"{f}:x"], [1.0])


UNSAFE = [
    (re.compile(r"\b(c?pickle|dill|cloudpickle|joblib|marshal)\.loads?\s*\("), "unpickling"),
    (re.compile(r"\bUnpickler\b"), "unpickling"),
    (re.compile(r"\bshelve\.open\s*\("), "shelve (pickle files)"),
    (re.compile(r"\btorch\.load\s*\("), "torch.load"),
    (re.compile(r"allow_pickle\s*=\s*True|weights_only\s*=\s*False"), "pickle-enabled load"),
    (re.compile(r"\byaml\.(unsafe_load|full_load|load_all)\s*\("), "unsafe YAML load"),
    (re.compile(r"\byaml\.load\s*\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"\b(yaml\.)?(Full|Unsafe)?Loader\s*=\s*yaml\.(Unsafe|Full)?Loader\b"), "unsafe YAML loader"),
]
"""What would deserialize code from a file or payload. (multiprocessing and Ray pickle their own in-memory
messages between the job's processes; nothing here unpickles bytes read from disk or a config.)"""


def test_no_pickle_torch_load_or_unsafe_yaml_in_the_package():
    files = [p for d in PACKAGE_DIRS for p in (REPO / d).rglob("*.py")]
    assert len(files) > 20
    hits = []
    for p in files:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            for rx, what in UNSAFE:
                if rx.search(line):
                    hits.append(f"{p.relative_to(REPO)}:{n}: {what}: {line.strip()}")
    assert not hits, "untrusted-data loaders in the package:\n" + "\n".join(hits)


def test_the_grep_finds_what_it_looks_for():
    for bad in ("pickle.loads(b)", "x = torch.load(f)", "yaml.load(text)", "yaml.unsafe_load(s)", "cloudpickle.load(f)",
                "np.load(p, allow_pickle=True)", "pickle.Unpickler(f)"):
        assert any(rx.search(bad) for rx, _ in UNSAFE), bad
    assert not any(rx.search("yaml.load(text, Loader=yaml.SafeLoader)") for rx, _ in UNSAFE)


def test_private_ray_cluster_binds_localhost_without_dashboard(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    seen = {}
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    cfg = load_config(QUICKSTART, SMALL + ["ray.mode=ray"])
    cluster = Cluster(cfg, tmp_path)
    try:
        assert seen["include_dashboard"] is False and seen["_node_ip_address"] == "127.0.0.1"
        assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
        token = tmp_path / "ray" / "auth_token"
        assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token.resolve())
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
    finally:
        cluster.shutdown()


def test_ray_temp_dir_that_is_a_file_is_refused(tmp_path):
    pytest.importorskip("ray")
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="ray.temp_dir.*not a directory"):
        Cluster(load_config(QUICKSTART, SMALL + ["ray.mode=ray", f"ray.temp_dir={f}"]), tmp_path)


def test_output_paths_are_resolved_and_checked_before_writing(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("keep me")
    with pytest.raises(ConfigError, match="not a directory"):
        driver.main(QUICKSTART, out=str(f), overrides=SMALL)
    assert f.read_text() == "keep me"
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    assert rundir.checked_out_dir(str(link / ".." / "x")) == (tmp_path / "x").resolve()
    assert rundir.checked_out_dir(str(link)) == (tmp_path / "real").resolve()
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not a writable directory"):
            rundir.checked_out_dir(locked / "run")
    with pytest.raises(FileNotFoundError, match="nowhere does not exist; pass the run dir"):
        driver.main(None, resume=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.yaml is missing"):
        driver.main(None, resume=str(tmp_path / "empty"))
