"""The RL loop with the sharded Trainer: `rl4bit train` with trainer.world_size=2 (FSDP2, and FSDP2 + expert
parallelism).

What is checked, on the tests/rl tiny quickstart in local mode (2 gloo rank
processes `python -m rl4bit.trainer_group`, CPU):
- the run finishes (3 steps, a checkpoint after each) and logs every step
  metric; the EP run (bf16 autocast, trainer.expert_parallel=2) also logs the
  wire bytes `comm/*` of its all-to-alls, > 0 at every step;
- the checkpoints are rl4bit.common.checkpoint's one format, sharded:
  `shard_00000/1.safetensors` + state.json + manifest.json (format 2, SHA-256
  and size of every file, world 2, the per-rank tensor index), no second index;
- a flipped byte in a rank's shard stops `--resume` with exit status 1 and an
  error naming that shard and the intact previous checkpoint;
- after that checkpoint is deleted, `--resume` falls back to step 2 and redoes
  step 3: every logged metric (timings aside) equals the uninterrupted run's.
  This is the same state an interrupted run leaves (its last checkpoint), and
  resuming on the same world size is bitwise (tests/distributed/test_fsdp.py).
- a rank SIGKILLed mid-run stops the job (exit 1: "the Trainer actor died
  (trainer rank 1 ...)" and the `--resume` command), rank 0 is ended too and
  the last checkpoint stays intact;
- in ray mode the ranks are Ray actors (RankWorker) and the run checkpoints alike.
The fast test checks the sharded format itself without processes (including
`load_checkpoint` joining the shards into the full state, as `rl4bit export` uses).

Bounds: each `rl4bit train` is a child in its own session, killed with all its
rank processes (by process group id) past RUN_TIMEOUT_S; afterwards no rank
process of ours is left.
Run: pytest tests/distributed/test_rl_sharded.py -q   (~5 min on 2 shared cores; `-m "not slow"`: seconds)
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl4bit.metrics import STEP_KEYS, read_metrics

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
RUN_TIMEOUT_S = 420
STEPS = 3
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.expert_intermediate_size=32", "model.num_experts=4",
    "model.num_heads=2", "model.max_seq_len=32", "model.dtype=float32",
    f"rl.steps={STEPS}", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.ppo_epochs=2",
    "run.warmup_sft_steps=0", "run.cpu_threads=1", "run.progress=false", "run.tensorboard=false",
    "data.eval_size=8", "data.eval_every=2", "run.checkpoint_every=1", "run.keep_checkpoints=3",
    "sampler.max_new_tokens=6", "trainer.device=cpu", "ray.mode=local", "trainer.world_size=2",
    "rewards.functions=[{fn: 'rl4bit.rewards:length_penalty'}]",  # reward spread from step 1: something trains
]
EP = ["trainer.expert_parallel=2", "model.dtype=bfloat16", "trainer.combine=rht_s2f6"]
TIMING = ("time/", "rollout/tokens_per_s", "sync/seconds")
COMM = ("comm/dispatch_bytes", "comm/combine_bytes", "comm/combine_grad_bytes", "comm/dispatch_grad_bytes",
        "comm/routing_bytes")


def _rl4bit(*args: str, overrides=()) -> tuple[int, str]:
    """`rl4bit ARGS -o ...` in its own session; (exit status, stdout + stderr). Killed with its ranks past the
    timeout."""
    cmd = [str(Path(sys.executable).with_name("rl4bit")), *args]
    for o in overrides:
        cmd += ["-o", o]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the driver and its rank processes share the session's group id
        out, _ = proc.communicate()
        pytest.fail(f"`rl4bit {' '.join(args)}` exceeded {RUN_TIMEOUT_S} s:\n{out[-4000:]}")
    assert not _our_ranks(proc.pid), "trainer rank processes outlived `rl4bit train`"
    return proc.returncode, out


def _our_ranks(sid: int) -> list[int]:
    """Live `rl4bit.trainer_group` processes in session `sid`."""
    left = []
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or os.getsid(int(d.name)) != sid:
                continue
            if b"rl4bit.trainer_group" in (d / "cmdline").read_bytes():
                left.append(int(d.name))
        except (OSError, ProcessLookupError):
            continue
    return left


def _strip(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


def _check_sharded_checkpoint(ckpt: Path, step: int) -> None:
    from rl4bit.common.checkpoint import FORMAT

    files = sorted(p.name for p in ckpt.iterdir())
    assert files == ["manifest.json", "shard_00000.safetensors", "shard_00001.safetensors", "state.json"], files
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == FORMAT and manifest["world"] == 2
    assert sorted(manifest["files"]) == files[1:]
    for name, entry in manifest["files"].items():
        assert (ckpt / name).stat().st_size == entry["bytes"] and len(entry["sha256"]) == 64, name
    gu = manifest["tensors"]["model.model.layers.0.mlp.experts.gate_up_proj"]
    assert gu["sharded"] and gu["shape"][0] == 4 and gu["rows"] == [[0, 2], [2, 2]]  # 4 experts, 2 per rank
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == step and state["format"] == FORMAT and "data" in state and "trainer" in state


def _run_resume_and_corrupt(tmp_path, overrides, *, comm: bool):
    full = tmp_path / "full"
    rc, out = _rl4bit("train", QUICKSTART, "--out", str(full), overrides=overrides)
    assert rc == 0, out[-6000:]
    records = read_metrics(full)
    assert [r["step"] for r in records] == list(range(STEPS + 1))
    for r in records[1:]:
        missing = set(STEP_KEYS) - set(r)
        assert not missing, f"step {r['step']} lacks {missing}"
        if comm:
            assert all(r[k] > 0 for k in COMM), {k: r.get(k) for k in COMM}
    assert any(r["loss"] != 0 for r in records[1:]), "resume equality is vacuous if nothing trains"
    ck = full / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest.json"] + [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    for s in range(1, STEPS + 1):
        _check_sharded_checkpoint(ck / f"step_{s:06d}", s)

    # a corrupted shard: named, with the intact previous checkpoint; nothing is trained
    run = tmp_path / "resumed"
    shutil.copytree(full, run)
    bad = run / "checkpoints" / f"step_{STEPS:06d}" / "shard_00001.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    rc, out = _rl4bit("train", "--resume", str(run), overrides=[f"rl.steps={STEPS + 1}"])
    assert rc == 1, out[-6000:]
    assert str(bad) in out and "SHA-256" in out and f"step_{STEPS - 1:06d} is intact" in out, out[-4000:]
    assert _strip(read_metrics(run)) == _strip(records)

    # deleted as the error says: --resume falls back to the step before and redoes the last step identically
    shutil.rmtree(bad.parent)
    rc, out = _rl4bit("train", "--resume", str(run))
    assert rc == 0, out[-6000:]
    assert _strip(read_metrics(run)) == _strip(records), "the resumed steps' metrics differ from the uninterrupted run"
    _check_sharded_checkpoint(run / "checkpoints" / f"step_{STEPS:06d}", STEPS)


@pytest.mark.slow  # three `rl4bit train` runs with two rank processes each: ~1-3 min on 2 shared cores
def test_fsdp_rl_run_checkpoints_shards_and_resumes_exactly(tmp_path):
    _run_resume_and_corrupt(tmp_path, TINY + ["run.warmup_sft_steps=2", "run.warmup_batch_size=8"], comm=False)


@pytest.mark.slow
def test_ep_rl_run_logs_comm_bytes_and_resumes_exactly(tmp_path):
    _run_resume_and_corrupt(tmp_path, TINY + EP, comm=True)


# --------------------------------------------------------------------------- the sharded format, no processes


def _sharded(run_dir, step, world=2):
    """A sharded checkpoint as TrainerGroup.save_checkpoint writes it (the ranks' save_shard, done here in turn)."""
    from rl4bit.common.checkpoint import begin_checkpoint, commit_checkpoint
    from rl4bit.trainer.sharding import merge_shards, save_shard, shard_rows

    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3) + step
    tmp = begin_checkpoint(run_dir, step)
    infos = []
    for r in range(world):
        start, n = shard_rows(5, r, world)
        infos.append(save_shard(tmp, r, world, {"w": full[start: start + n], "rng": torch.tensor([r, step])},
                                {"w": (5, 3)}, {"rank": r}))
    files, index = merge_shards(infos)
    meta = {"trainer": {"rank": 0}, "data": {"pos": step}}
    return commit_checkpoint(tmp, step, meta, files, keep=3, index=index), full


def test_sharded_checkpoint_is_the_one_format(tmp_path):
    from rl4bit.common.checkpoint import CheckpointError, load_checkpoint, open_checkpoint
    from rl4bit.trainer.sharding import load_shard

    _sharded(tmp_path, 1)
    ckpt, full = _sharded(tmp_path, 2)
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text()) == {"step": 2, "dir": "step_000002"}
    assert not list((tmp_path / "checkpoints").glob(".*"))  # no temporary left
    got, manifest, meta = open_checkpoint(tmp_path, 2)
    assert got == ckpt and meta["data"] == {"pos": 2} and meta["step"] == 2
    assert manifest["tensors"]["w"] == {"shape": [5, 3], "dtype": "float32", "sharded": True, "rows": [[0, 3], [3, 2]]}
    assert manifest["tensors"]["rng"]["sharded"] is False
    pieces = [load_shard(ckpt, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p[0]["w"] for p in pieces]), full)
    assert [p[1] for p in pieces] == [{"rank": 0}, {"rank": 1}]

    tensors, meta = load_checkpoint(tmp_path)  # joined: the full state (rl4bit export of a sharded run)
    assert torch.equal(tensors["w"], full) and tensors["rng"].tolist() == [0, 2] and meta["step"] == 2
    with pytest.raises(CheckpointError, match="written by 2 trainer rank.*trainer.world_size=2"):
        load_checkpoint(tmp_path, world=1)  # a one-process resume of a sharded run
    with pytest.raises(CheckpointError, match="trainer.world_size=2"):
        open_checkpoint(tmp_path, 4)

    shard = ckpt / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        load_shard(ckpt, 1, 2)
    assert str(shard) in str(e.value) and "truncated" in str(e.value) and "step_000001 is intact" in str(e.value)
    load_shard(ckpt, 0, 2)  # the other rank's shard is fine


@pytest.mark.slow  # one `rl4bit train`, a rank SIGKILLed after the first checkpoint
def test_a_killed_rank_stops_the_job_naming_the_trainer_and_leaves_no_process(tmp_path):
    import signal
    import time

    from rl4bit.common.checkpoint import open_checkpoint

    run = tmp_path / "run"
    cmd = [str(Path(sys.executable).with_name("rl4bit")), "train", QUICKSTART, "--out", str(run)]
    for o in TINY + ["rl.steps=20"]:
        cmd += ["-o", o]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (run / "checkpoints" / "latest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its first checkpoint"
            time.sleep(0.2)
        rank1 = [pid for pid in _our_ranks(proc.pid)
                 if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[-3] == b"1"]
        assert len(rank1) == 1, rank1
        os.kill(rank1[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, out[-4000:]
    assert "rl4bit train: error: the Trainer actor died (trainer rank 1" in out, out[-4000:]
    assert f"--resume {run}" in out, out[-4000:]
    assert not _our_ranks(proc.pid), "rank 0 outlived the job"
    _, _, meta = open_checkpoint(run, 2)  # the last checkpoint is intact
    assert meta["step"] >= 1


@pytest.mark.slow  # one `rl4bit train` on a private Ray cluster (~25 s)
def test_ray_mode_runs_the_ranks_as_actors(tmp_path):
    pytest.importorskip("ray")
    run = tmp_path / "run"
    rc, out = _rl4bit("train", QUICKSTART, "--out", str(run), overrides=TINY + EP + ["ray.mode=ray", "ray.num_cpus=2",
                                                                                     "rl.steps=2"])
    assert rc == 0, out[-6000:]
    ranks = [f for f in (run / "ray").glob("session_*/logs/worker-*.out") if ":actor_name:RankWorker" in f.read_text()]
    assert len(ranks) == 2, "the 2 ranks were to run as Ray actors"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2] and all(records[-1][k] > 0 for k in COMM)
    _check_sharded_checkpoint(run / "checkpoints" / "step_000002", 2)
