"""Config loading: good configs round-trip, each kind of bad input gets its specific error."""

from pathlib import Path

import pytest
import yaml

from rl4bit.config import ConfigError, JobConfig, dump_yaml, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    again = load_config(write(tmp_path, dump_yaml(cfg)))
    assert again == cfg


def test_there_is_a_quickstart_config():
    assert REPO / "configs" / "quickstart.yaml" in CONFIGS


def test_defaults_validate():
    assert load_config(None) == JobConfig()


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(None, ["trainer.lr=1e-6", "sampler.backend=embedded", "rl.samples_per_prompt=4",
                             'sampler.stop=["\\n"]'])
    assert cfg.trainer.lr == 1e-6 and cfg.rl.samples_per_prompt == 4 and cfg.sampler.stop == ["\n"]


def test_derived_batch_sizes():
    cfg = load_config(None, ["rl.prompts_per_step=3", "rl.samples_per_prompt=5"])
    assert cfg.derived()["rollouts_per_step"] == 15


@pytest.mark.parametrize(
    "text, needles",
    [
        ("trainer:\n  lrr: 1.0\n", ["trainer.lrr", "did you mean 'lr'"]),
        ("trainr:\n  lr: 1.0\n", ["trainr", "did you mean 'trainer'"]),
        ("trainer:\n  lr: fast\n", ["trainer.lr", "expected a number", "'fast'"]),
        ("trainer:\n  lr: .nan\n", ["trainer.lr", "nan", "not a finite number"]),
        ("rewards:\n  timeout_s: .inf\n", ["rewards.timeout_s", "inf", "not a finite number"]),
        ("rl:\n  clip_eps: nan\n", ["rl.clip_eps", "not a finite number"]),
        ("run:\n  warmup_batch_size: 0\n", ["run.warmup_batch_size", "0", ">= 1"]),
        ("run:\n  cpu_threads: -1\n", ["run.cpu_threads", "-1", ">= 0"]),
        ("run:\n  warmup_lr: -1\n", ["run.warmup_lr", "-1", "> 0"]),
        ("trainer:\n  device: 'cuda:x'\n", ["trainer.device", "cuda:x", "cuda:N"]),
        ("rl:\n  samples_per_prompt: 0\n", ["rl.samples_per_prompt", "0", "> 0"]),
        ("rl:\n  samples_per_prompt: 5000\n", ["rl.samples_per_prompt", "5000", "4096"]),
        ("rl:\n  samples_per_prompt: 2.5\n", ["rl.samples_per_prompt", "expected an integer"]),
        ("recipe:\n  name: nvfp3\n", ["recipe", "nvfp3", "nvfp4"]),
        ("sampler:\n  backend: vlm\n", ["sampler.backend", "'vlm'", "did you mean 'vllm'"]),
        ("sampler:\n  top_p: 1.5\n", ["sampler.top_p", "1.5"]),
        ("sampler:\n  kv_cache_gib: 0\n", ["sampler.kv_cache_gib", "must be > 0", "gpu_memory_utilization"]),
        ("sampler:\n  temperature: 0.001\n", ["sampler.temperature", "0.001", ">= 0.01"]),
        ("sampler:\n  backend: vllm\n  temperature: 0.7\n  top_p: 0.9\n",
         ["sampler.temperature", "vLLM", "temperature 1", "(got 0.7)"]),
        ("model:\n  hidden_size: 48\n", ["model.hidden_size", "48", "multiple of 32"]),
        ("model:\n  path: ' '\n", ["model.path", "empty"]),
        ("rewards:\n  functions:\n    - fn: no_colon\n", ["rewards.functions[0].fn", "no_colon"]),
        ("rewards:\n  functions: []\n", ["rewards.functions", "at least one"]),
        ("rl:\n  tis_cap: 0.5\n", ["rl.tis_cap", "0.5"]),
        ("data:\n  task: file\n", ["data.train_file", "required"]),
        ("data:\n  train_file: p.jsonl\n", ["data.train_file", "'p.jsonl'", "'arithmetic'", "data.task: file"]),
        ("data:\n  eval_file: e.jsonl\n", ["data.eval_file", "'e.jsonl'", "data.task: file"]),
        ("data:\n  digits: 4\n", ["data.digits", "4", "1 to 3", "data.task: file"]),
        ("data:\n  seed: -1\n", ["data.seed", "-1", "[0, 2**63 - 1]"]),
        ("run:\n  seed: -1\n", ["run.seed", "-1", "[0, 2**63 - 1]"]),
        ("run:\n  seed: 9223372036854775808\n", ["run.seed", "9223372036854775808", "[0, 2**63 - 1]"]),
        ("recipe:\n  seed: 9223372036854775808\n", ["recipe.seed", "[0, 2**63 - 1]"]),
        ("run:\n  tensorboard: 1\n", ["run.tensorboard", "true or false"]),
        ("sampler:\n  max_new_tokens: 300\n", ["sampler.max_new_tokens", "max_seq_len"]),
        ("model:\n  invariant_kernels: true\nsampler:\n  backend: vllm\n", ["model.invariant_kernels", "embedded"]),
        ("- a\n- b\n", ["top level must be a mapping"]),
        ("trainer: [1, 2]\n", ["trainer", "expected a mapping"]),
        ("trainer:\n  lr: [1\n", ["not valid YAML"]),
    ],
)
def test_bad_configs_name_the_key_and_the_fix(tmp_path, text, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("item, needle", [("trainer.lr", "key.path=value"), ("trainer..lr=1", "empty key"),
                                          ("rl.steps.x=1", "rl.steps: expected an integer")])
def test_bad_overrides(item, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [item])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_dump_is_plain_yaml():
    data = yaml.safe_load(dump_yaml(JobConfig()))
    assert set(data) == {"model", "recipe", "sampler", "trainer", "rl", "rewards", "data", "ray", "parity", "run"}



def test_prompt_files_need_task_file():
    """A train_file with the default task trained on 2-digit sums without a word; task: file still loads it."""
    with pytest.raises(ConfigError, match=r"data\.train_file: 'p\.jsonl' is set but data\.task is 'arithmetic'"):
        load_config(None, ["data.train_file=p.jsonl"])
    cfg = load_config(None, ["data.task=file", "data.train_file=p.jsonl", "data.eval_file=e.jsonl"])
    assert (cfg.data.train_file, cfg.data.eval_file) == ("p.jsonl", "e.jsonl")


def test_seed_bounds():
    """Negative seeds crashed at step 1 (derive_seed); the ends of the Philox key range still load."""
    for key in ("run.seed", "data.seed", "recipe.seed"):
        assert load_config(None, [f"{key}=0", f"{key}={2**63 - 1}"]) is not None
    with pytest.raises(ConfigError, match=r"run\.seed: -3 must be in \[0, 2\*\*63 - 1\]"):
        load_config(None, ["run.seed=-3"])


def test_digits_bound_matches_the_task():
    from rl4bit.config import MAX_DIGITS

    assert load_config(None, [f"data.digits={MAX_DIGITS}"]).data.digits == MAX_DIGITS
    with pytest.raises(ConfigError, match=r"data\.digits: 5 is above 3"):
        load_config(None, ["data.digits=5"])
