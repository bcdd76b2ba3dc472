"""Faults injected into real short runs (local mode: seconds each): the driver killed while writing a checkpoint,
corrupted or truncated checkpoints and weight-sync buckets, misbehaving rewards, NaN/Inf losses and gradients.

Each run is compared with one uninterrupted run of the same config (`reference`, built once), so "nothing
lost" means: every non-timing metric equal.
"""

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file

import rl4bit.trainer.grpo as grpo
from rl4bit import driver, rollouts
from rl4bit.actors import Cluster
from rl4bit.common.checkpoint import load_checkpoint
from rl4bit.config import load_config
from rl4bit.metrics import read_metrics
from rl4bit.rewards import RewardError
from rl4bit.rundir import create_run_dir
from rl4bit.sampler.actor import Sampler
from rl4bit.sampler_sync import WEIGHT_SYNC_ENV
from rl4bit.trainer.actor import Trainer
from rl4bit.trainer.weight_sync import WeightSyncError

from .conftest import QUICKSTART, SMALL, learned, strip_timing

STEPS = 3
CFG = SMALL + [f"rl.steps={STEPS}", "run.keep_checkpoints=3"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (3 steps, a checkpoint after each)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert driver.main(QUICKSTART, out=str(out), overrides=CFG) == 0
    return out


def _same_as(reference, run_dir, upto=STEPS):
    got, want = strip_timing(read_metrics(run_dir)), strip_timing(read_metrics(reference))[: upto + 1]
    assert [r["step"] for r in got] == list(range(upto + 1))
    assert got == want, "metrics differ from the uninterrupted run"


# --------------------------------------------------------------------------- the driver killed mid-checkpoint

KILLER = textwrap.dedent('''
    import os, signal, sys
    import rl4bit.common.checkpoint as ck
    point, out, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    write, replace = ck._write, ck.replace_dir
    def torn_write(path, data):  # half of the step-2 safetensors on disk, then SIGKILL
        if point == "mid-file" and ".step_000002.tmp" in str(path):
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2]); f.flush(); os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return write(path, data)
    def swap_then_die(tmp, final):  # step-2 directory renamed in, latest.json not yet moved: SIGKILL
        replace(tmp, final)
        if point == "before-pointer" and final.name == "step_000002":
            os.kill(os.getpid(), signal.SIGKILL)
    ck._write, ck.replace_dir = torn_write, swap_then_die
    from rl4bit import driver
    sys.exit(driver.main({quickstart!r}, out=out, overrides=overrides))
''').format(quickstart=QUICKSTART)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["mid-file", "before-pointer"])
def test_driver_killed_during_checkpoint_write_keeps_the_previous_one(tmp_path, reference, point):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", KILLER, point, str(run_dir), *CFG], capture_output=True, text=True,
                       timeout=150)
    assert r.returncode == -9, f"the driver was to die by SIGKILL mid-write: {r.returncode}\n{r.stderr[-2000:]}"
    ck = run_dir / "checkpoints"
    pointed = json.loads((ck / "latest.json").read_text())["step"]
    assert pointed == 1, "the pointer must still name the previous checkpoint"
    tensors, meta = load_checkpoint(run_dir)  # verified against its manifest: intact
    assert meta["step"] == 1
    ref = load_file(str(reference / "checkpoints" / "step_000001" / "state.safetensors"))
    assert torch.equal(tensors["rng.torch_cpu"], ref["rng.torch_cpu"])
    assert driver.main(None, resume=str(run_dir)) == 0
    _same_as(reference, run_dir)


# --------------------------------------------------------------------------- corrupted / truncated checkpoints


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_checkpoint_is_named_and_the_previous_one_resumes(tmp_path, reference, damage, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    bad = run_dir / "checkpoints" / "step_000003" / "state.safetensors"
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    else:
        data = data[: len(data) - 100]
    bad.write_bytes(bytes(data))
    assert driver.main(None, resume=str(run_dir), overrides=["rl.steps=4"]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and ("SHA-256" in err if damage == "flip" else "truncated" in err), err
    assert "step_000002 is intact" in err, err
    # the previous version is kept: delete the bad one, resume falls back to step 2 and redoes step 3 identically
    shutil.rmtree(bad.parent)
    assert driver.main(None, resume=str(run_dir)) == 0
    _same_as(reference, run_dir)


# --------------------------------------------------------------------------- corrupted / truncated sync buckets


def _run_capturing_samplers(cfg, run_dir, monkeypatch, on_step=None):
    samplers = []
    real = Cluster.actor

    def actor(self, cls, *a, **k):
        proxy = real(self, cls, *a, **k)
        if cls.__name__ == "Sampler":
            samplers.append(proxy._obj)
        return proxy

    monkeypatch.setattr(Cluster, "actor", actor)
    return samplers, lambda: driver.run(cfg, create_run_dir(cfg, run_dir), on_step=on_step)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_bad_sync_bucket_stops_the_job_and_the_samplers_keep_their_version(tmp_path, monkeypatch, damage):
    monkeypatch.setenv(WEIGHT_SYNC_ENV, "buckets")  # local mode syncs directly unless told otherwise
    cfg = load_config(QUICKSTART, CFG)
    state = {"armed": False}
    real = Trainer.weight_bucket

    def bucket(self, i):
        b = real(self, i)
        if state["armed"] and i == 0:
            p = bytearray(b.payload)
            if damage == "flip":
                p[-5] ^= 0x01
            b = dataclasses.replace(b, payload=bytes(p if damage == "flip" else p[: len(p) // 2]))
        return b

    monkeypatch.setattr(Trainer, "weight_bucket", bucket)
    samplers, go = _run_capturing_samplers(cfg, tmp_path / "run", monkeypatch,
                                           on_step=lambda step, m: state.update(armed=step == 1))
    rejected = r"bucket 0/\d+ of v3 .*(SHA-256|truncated).*v2 keeps serving"
    with pytest.raises(WeightSyncError, match=rejected) as e:
        go()
    assert "the job stops" in str(e.value)
    assert [s.version for s in samplers] == [2], "the sampler keeps serving the version of step 1 (v2)"
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0, 1]
    req = rollouts._request(cfg, samplers[0].engine.tokenizer, {"prompt": "1+2="}, n=2, seed=1, rid="after")
    assert len(samplers[0].generate([req])) == 2, "and still serves"


# --------------------------------------------------------------------------- rewards that misbehave

BAD_REWARD = '''
import math, os, time
COUNTER = {counter!r}
def flaky(prompt, completion, **sample):
    n = int(open(COUNTER).read() or 0) + 1 if os.path.exists(COUNTER) else 1
    open(COUNTER, "w").write(str(n))
    # call 1: start-up check; 2..9: step-0 eval (8 prompts); 10..25: step 1's 16 rollouts
    if n == 11: raise ValueError("boom")
    if n == 13: return math.nan
    if n == 15: return "0.5"
    if n == 17: os._exit(3)
    if n == 19: time.sleep(60)
    return -len(completion) / 10
'''


@pytest.mark.parametrize("fraction", [0.4, 0.25])
def test_rewards_that_raise_hang_exit_or_return_junk_are_masked_and_counted(tmp_path, fraction):
    f = tmp_path / "bad.py"
    f.write_text(BAD_REWARD.format(counter=str(tmp_path / "count")))
    cfg = CFG + ["rl.steps=1", "rewards.timeout_s=1.0", f"rewards.max_error_fraction={fraction}",
                 f"rewards.functions=[{{fn: '{f}:flaky'}}]"]
    t0 = time.monotonic()
    if fraction < 5 / 16:
        with pytest.raises(RewardError, match=r"5/16 samples failed to score \(.*rewards.max_error_fraction=0.25\)"):
            driver.main(QUICKSTART, out=str(tmp_path / "run"), overrides=cfg)
        return
    assert driver.main(QUICKSTART, out=str(tmp_path / "run"), overrides=cfg) == 0
    assert time.monotonic() - t0 < 60, "the hanging reward is bounded by rewards.timeout_s"
    step1 = read_metrics(tmp_path / "run")[1]
    assert step1["reward/errors"] == 5.0
    assert step1["loss"] == step1["loss"], "the masked samples take no part; the step trains"


# --------------------------------------------------------------------------- NaN / Inf loss and gradient


class _InfGrad(torch.autograd.Function):
    """Identity forward; the gradient comes back infinite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def _poison(monkeypatch, when):
    """ppo_clip_loss whose loss is NaN (odd calls) or whose gradient is Inf (even calls) while when() holds."""
    real, calls = grpo.ppo_clip_loss, {"n": 0}

    def loss_fn(*a, **k):
        loss, st = real(*a, **k)
        if when():
            calls["n"] += 1
            loss = loss * float("nan") if calls["n"] % 2 else _InfGrad.apply(loss)
        return loss, st

    monkeypatch.setattr(grpo, "ppo_clip_loss", loss_fn)
    return calls


RECIPES = ["bf16", "nvfp4"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_non_finite_steps_are_skipped_counted_and_touch_nothing(tmp_path, monkeypatch, recipe):
    cfg = load_config(QUICKSTART, CFG + [f"recipe.name={recipe}"])
    step = {"now": 1}
    calls = _poison(monkeypatch, lambda: step["now"] == 2)
    run_dir = create_run_dir(cfg, tmp_path / "run")
    driver.run(cfg, run_dir, on_step=lambda s, m: step.update(now=s + 1))
    assert calls["n"] == 2, "step 2's two optimizer steps: a NaN loss, then an Inf gradient"
    records = read_metrics(run_dir)
    assert [r["train/skipped_steps"] for r in records[1:]] == [0.0, 2.0, 0.0]
    one, two = (load_file(str(run_dir / "checkpoints" / f"step_00000{i}" / "state.safetensors")) for i in (1, 2))
    touched = [k for k in one if k.startswith(("model.", "optim.")) and not torch.equal(one[k], two[k])]
    assert not touched, f"a skipped step changed {touched[:3]}"
    assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in one), "AdamW state is in the comparison"
    saved = load_file(str(run_dir / "checkpoints" / "step_000003" / "state.safetensors"))
    assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point())


@pytest.mark.parametrize("recipe", RECIPES)
def test_k_non_finite_steps_in_a_row_stop_the_job(tmp_path, monkeypatch, capsys, recipe):
    _poison(monkeypatch, lambda: True)
    code = driver.main(QUICKSTART, out=str(tmp_path / "run"),
                       overrides=CFG + ["trainer.max_nonfinite_steps=2", f"recipe.name={recipe}"])
    assert code == 1
    err = capsys.readouterr().err
    assert "rl4bit train: error: 2 optimizer steps in a row had a non-finite loss or gradient" in err, err
    assert not (tmp_path / "run" / "checkpoints" / "latest.json").exists(), "no checkpoint of a poisoned state"


# --------------------------------------------------------------------------- out of GPU memory


@pytest.mark.parametrize("phase,cls,method,nth", [("train", Trainer, "train_step", 2),
                                                  ("sample", Sampler, "generate", 3),  # call 1: step 0's evaluation
                                                  ("sync", Trainer, "weight_tensors", 3)])  # call 1: before step 0
def test_out_of_memory_names_phase_step_and_settings_and_the_run_resumes(tmp_path, reference, monkeypatch, capsys,
                                                                          phase, cls, method, nth):
    """torch's out-of-memory error at step 2 (injected: CPU runs have no GPU allocator) stops the job with one
    line naming the phase, the step, the settings that shrink that phase with their values, and the resume
    command; the step-1 checkpoint is intact and the resumed run equals the uninterrupted one."""
    real, calls = getattr(cls, method), {"n": 0}

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == nth:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.18 GiB of which 38.19 MiB is free.")
        return real(self, *a, **k)

    monkeypatch.setattr(cls, method, failing)
    run_dir = tmp_path / "run"
    assert driver.main(QUICKSTART, out=str(run_dir), overrides=CFG) == 1
    err = capsys.readouterr().err
    assert (f"rl4bit train: error: the job ran out of GPU memory in its {phase} phase at step 2 "
            f"(CUDA out of memory. Tried to allocate 2.00 GiB). To fit: lower ") in err, err
    shrink = ("trainer.tokens_per_microbatch (now 4096: the same update in smaller micro-batches) or set "
              "trainer.recompute=true" if phase == "train" else "sampler.max_batch_size (now 64: the KV cache")
    assert shrink in err and "Continue from the last checkpoint (step 1): rl4bit train --resume" in err, err
    monkeypatch.setattr(cls, method, real)
    assert driver.main(None, resume=str(run_dir)) == 0
    _same_as(reference, run_dir)


# --------------------------------------------------------------------------- a sampler dying, as the driver sees it


@pytest.mark.parametrize("sync_call,sync_path", [("receive_bucket", "buckets"), ("apply_tensors", "auto")])
def test_sampler_deaths_mid_rollout_and_mid_sync_are_recovered(tmp_path, reference, monkeypatch, sync_call, sync_path):
    """The driver's recovery logic without Ray: a sampler call raises ActorDiedError (what `get` raises for a dead
    Ray actor) once mid-rollout (step 1) and once mid-sync (step 2), on either sync path. The restarted-sampler path
    of the real thing is tests/reliability/test_actor_faults.py; here the job must finish with every metric of the
    reference run."""
    from rl4bit.actors import ActorDiedError
    from rl4bit.sampler.actor import Sampler

    monkeypatch.setenv(WEIGHT_SYNC_ENV, sync_path)
    # the 2nd generate (step 1's rollouts); one bucket (or one direct update) a sync: the 3rd is step 2's
    plan = {"generate": 2, sync_call: 3}
    seen = dict.fromkeys(plan, 0)
    real = {name: getattr(Sampler, name) for name in plan}

    def dying(name):
        def call(self, *a, **k):
            seen[name] += 1
            if seen[name] == plan[name]:
                raise ActorDiedError("Sampler", f"injected: killed during {name}")
            return real[name](self, *a, **k)
        return call

    for name in plan:
        monkeypatch.setattr(Sampler, name, dying(name))
    cfg = load_config(QUICKSTART, CFG)
    run_dir = create_run_dir(cfg, tmp_path / "run")
    driver.run(cfg, run_dir)
    records = read_metrics(run_dir)
    assert [r["rollout/sampler_restarts"] for r in records[1:]] == [1.0, 2.0, 2.0]
    also = ("rollout/sampler_restarts",)
    assert learned(records, also) == learned(read_metrics(reference), also)


def test_a_full_disk_while_checkpointing_stops_with_one_line_and_the_run_resumes(tmp_path, reference, monkeypatch,
                                                                                 capsys):
    """ENOSPC while writing step 2's checkpoint (injected; seen for real on the GPU machine's /tmp, twenty-seventh
    session, as a raw traceback): one error line naming the step, the cause and the checkpoint still pointed to;
    no temporary copy left; the resumed run equals the uninterrupted one."""
    import errno

    import rl4bit.common.checkpoint as ck

    real, calls = ck._write, {"n": 0}

    def full(path, data):
        if path.name == "state.safetensors":
            calls["n"] += 1
            if calls["n"] == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(ck, "_write", full)
    run_dir = tmp_path / "run"
    assert driver.main(QUICKSTART, out=str(run_dir), overrides=CFG) == 1
    err = capsys.readouterr().err
    assert "rl4bit train: error: writing checkpoint step 2 (" in err and "No space left on device" in err, err
    assert f"{run_dir / 'checkpoints' / 'step_000001'} is still the latest checkpoint" in err, err
    assert f"rl4bit train --resume {run_dir}" in err and "Traceback" not in err, err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest.json", "step_000001"]
    monkeypatch.setattr(ck, "_write", real)
    assert driver.main(None, resume=str(run_dir)) == 0
    _same_as(reference, run_dir)


def test_ctrl_c_mid_run_says_where_to_continue_and_the_run_resumes(tmp_path, reference, monkeypatch, capsys):
    """Ctrl-C (KeyboardInterrupt, here raised in step 2's train call) ends with one line and the resume command,
    not a traceback; the step-1 checkpoint is intact and the resumed run equals the uninterrupted one."""
    real, calls = Trainer.train_step, {"n": 0}

    def interrupted(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    run_dir = tmp_path / "run"
    assert driver.main(QUICKSTART, out=str(run_dir), overrides=CFG) == 130
    err = capsys.readouterr().err
    hint = f"Continue from the last checkpoint (step 1): rl4bit train --resume {run_dir}"
    assert f"rl4bit train: interrupted. {hint}" in err
    monkeypatch.setattr(Trainer, "train_step", real)
    assert driver.main(None, resume=str(run_dir)) == 0
    _same_as(reference, run_dir)


def test_relative_reward_and_prompt_paths_are_stored_absolute(tmp_path, monkeypatch):
    """A run started with relative paths resumes from another working directory: config.yaml names the files."""
    work = tmp_path / "work"
    (work / "rw").mkdir(parents=True)
    (work / "rw" / "mine.py").write_text("from rl4bit.rewards import exact_match as mine\n")
    monkeypatch.chdir(work)
    run_dir = tmp_path / "run"
    cfg = SMALL + ["rl.steps=1", "run.warmup_sft_steps=0", "rewards.functions=[{fn: 'rw/mine.py:mine'}]"]
    assert driver.main(QUICKSTART, out=str(run_dir), overrides=cfg) == 0
    stored = load_config(run_dir / "config.yaml")
    assert stored.rewards.functions[0].fn == f"{work / 'rw' / 'mine.py'}:mine"
    monkeypatch.chdir(tmp_path)  # elsewhere: rw/mine.py is not here
    assert driver.main(None, resume=str(run_dir), overrides=["rl.steps=2"]) == 0
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
