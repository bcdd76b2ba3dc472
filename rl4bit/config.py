"""The job configuration: one tree of typed dataclasses, loaded from YAML.

Every field has a docstring (the string under it). `load_config(path,
overrides)` maps a YAML file plus `-o key.path=value` overrides onto `JobConfig`
and validates it: an unknown key, a wrong type or an impossible value raises
`ConfigError` naming the key path, the value and the valid choices (or the
closest known key). `rl4bit config CFG` prints the resolved tree.

One batch vocabulary: `rl.prompts_per_step` prompts are sampled each step,
`rl.samples_per_prompt` completions per prompt (a GRPO group), and the trainer
packs them into micro-batches of at most `trainer.tokens_per_microbatch`
tokens. Everything else (rollouts per step, ...) is derived: `derived()`.

The recipe section (`RecipeConfig`) lives beside the code that applies it, in
`rl4bit.trainer.recipe`; it is part of this tree all the same.

Leaves out: environment-variable interpolation and config inheritance; a job
is one file plus overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from rl4bit.common.config import ConfigError, positive
from rl4bit.sampler.config import SamplerConfig
from rl4bit.sampler.types import MAX_N, MAX_SEED
from rl4bit.trainer.config import ModelConfig, RLConfig, TrainerConfig
from rl4bit.trainer.recipe import RecipeConfig


@dataclass
class RewardConfig:
    """One reward function and its weight."""

    fn: str = "rl4bit.rewards:exact_match"
    """`pkg.module:function` or `path/to/file.py:function`; called as fn(prompt, completion, **sample) -> float."""
    weight: float = 1.0
    """Weight of this reward in the sum."""


@dataclass
class RewardsConfig:
    """How completions are scored."""

    functions: list[RewardConfig] = field(default_factory=lambda: [RewardConfig()])
    """The rewards summed (with weights) into one scalar per completion."""
    timeout_s: float = 10.0
    """Per-call timeout; a reward past it counts as an error."""
    max_error_fraction: float = 0.1
    """The job fails when more than this fraction of a step's samples fail to score."""
    workers: int = 1
    """Reward worker processes."""
    memory_mb: int = 2048
    """Memory (MiB) a reward worker may add after start-up, imports included (resource.setrlimit RLIMIT_DATA);
    0 = no limit."""
    cpu_s: Optional[float] = None
    """CPU seconds one reward call may use (soft RLIMIT_CPU; past it the worker is killed and restarted, the
    sample masked); None = 2 x timeout_s; 0 = no limit."""

    def validate(self, path: str) -> None:
        if not self.functions:
            raise ConfigError(f"{path}.functions: empty; give at least one reward, e.g. rl4bit.rewards:exact_match")
        for i, r in enumerate(self.functions):
            if ":" not in r.fn:
                raise ConfigError(f"{path}.functions[{i}].fn: {r.fn!r} must be 'pkg.module:function' or "
                                  "'path/file.py:function'")
        if self.timeout_s <= 0:
            raise ConfigError(f"{path}.timeout_s: {self.timeout_s} must be > 0")
        if not 0 <= self.max_error_fraction <= 1:
            raise ConfigError(f"{path}.max_error_fraction: {self.max_error_fraction} must be in [0, 1]")
        positive(self, path, "workers")
        if self.memory_mb < 0:
            raise ConfigError(f"{path}.memory_mb: {self.memory_mb} must be >= 0 (0 = no limit)")
        if self.cpu_s is not None and self.cpu_s < 0:
            raise ConfigError(f"{path}.cpu_s: {self.cpu_s} must be >= 0 or null (null = 2 x timeout_s)")


MAX_DIGITS = 3
"""Largest `data.digits`: 10**6 operand pairs take about 0.4 GB and 2 s to build; 4 digits would be 10**8."""


@dataclass
class DataConfig:
    """Where prompts come from."""

    task: Literal["arithmetic", "file"] = "arithmetic"
    """`arithmetic`: the built-in seeded synthetic task. `file`: prompts from `train_file`/`eval_file`."""
    train_file: Optional[str] = None
    """JSONL or Parquet with `prompt`, optional `answer` and extra fields (task: file)."""
    eval_file: Optional[str] = None
    """Held-out prompts in the same format (task: file); without it the eval split is carved from train_file
    (`eval_fraction`)."""
    warmup_file: Optional[str] = None
    """Prompts with answers for the supervised warm start (task: file, run.warmup_sft_steps > 0 and
    run.warmup_prompts: held_out), in the same format; RL never samples them."""
    warmup_fraction: float = 0.5
    """Arithmetic task with run.warmup_prompts: held_out: this fraction of the train sums (seeded permutation) is
    the warm start's, and RL trains on the rest."""
    digits: int = 2
    """Arithmetic task: operand digits, 1 to `MAX_DIGITS` (the task enumerates all 10**(2*digits) operand pairs)."""
    eval_size: int = 64
    """Prompts in the evaluation split (at most)."""
    eval_fraction: float = 0.1
    """task: file without `eval_file`: this fraction of the train file's prompts (at least 1, at most
    `eval_size`) is held out as the eval split, picked by a permutation seeded by `seed`, and RL never trains on
    them (said in the log). 0: no eval split, no evaluation."""
    eval_every: int = 5
    """Evaluate every this many steps (and before the first step)."""
    seed: int = 0
    """Seed of the task generator and the prompt order, 0 to 2**63 - 1."""
    chat_template: bool = False
    """Send each prompt as one user turn of the tokenizer's chat template (`apply_chat_template` with the
    generation prompt added) instead of as raw text: for instruct checkpoints (`model.path`), whose tokenizer
    must carry a template. Rewards still receive the prompt as written in the data."""

    def validate(self, path: str) -> None:
        if self.task == "file" and not self.train_file:
            raise ConfigError(f"{path}.train_file: required when {path}.task is 'file'")
        for name in ("train_file", "eval_file", "warmup_file"):
            if self.task == "arithmetic" and getattr(self, name):  # would train on the built-in sums, silently
                raise ConfigError(f"{path}.{name}: {getattr(self, name)!r} is set but {path}.task is 'arithmetic', "
                                  f"which ignores prompt files; set {path}.task: file to use it, or remove it")
        positive(self, path, "digits", "eval_size", "eval_every")
        if not 0 < self.warmup_fraction < 1:
            raise ConfigError(f"{path}.warmup_fraction: {self.warmup_fraction} must be in (0, 1)")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"{path}.eval_fraction: {self.eval_fraction} must be in [0, 1) (0: no eval split)")
        if self.digits > MAX_DIGITS:
            raise ConfigError(f"{path}.digits: {self.digits} is above {MAX_DIGITS}: the arithmetic task holds all "
                              f"10**(2*digits) operand pairs in memory (10**{2 * self.digits} here); use 1 to "
                              f"{MAX_DIGITS}, or harder prompts from a file ({path}.task: file)")
        _check_seed(self.seed, f"{path}.seed")


@dataclass
class RayConfig:
    """Where the actors run."""

    mode: Literal["auto", "ray", "local"] = "auto"
    """`ray`: actors on a Ray cluster; `local`: the same classes in-process (pdb works); `auto`: ray when installed."""
    address: Optional[str] = None
    """An existing cluster's address; None starts a private local one bound to 127.0.0.1, no dashboard."""
    temp_dir: Optional[str] = None
    """Ray's temp/session files; None puts them under the run directory."""
    num_cpus: Optional[int] = None
    """CPUs the private local cluster may use (None: all)."""
    sampler_restarts: int = 3
    """How often Ray may restart dead Sampler actors in one job (each restart re-sends the current weights and
    redoes the step's rollouts); 0 = a dead sampler stops the job."""

    def validate(self, path: str) -> None:
        if self.sampler_restarts < 0:
            raise ConfigError(f"{path}.sampler_restarts: {self.sampler_restarts} must be >= 0 (0 = no restarts)")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"{path}.num_cpus: {self.num_cpus} must be >= 1 or null (all CPUs)")


@dataclass
class ParityConfig:
    """Live reward tracking against a reference run."""

    reference: Optional[str] = None
    """A finished run dir (same config, mxfp8) to log `parity/reward_gap` against."""
    threshold: float = 0.02
    """The parity margin (reward and accuracy units): `rl4bit parity` says parity holds when the 90% interval of a
    difference lies inside +/-threshold; a live run flags divergence when its trailing reward gap exceeds it."""


@dataclass
class RunConfig:
    """Run bookkeeping."""

    name: str = "rl4bit"
    """Run name; the default run dir is runs/<name>-<timestamp>."""
    seed: int = 0
    """Global seed (model init, sampling, stochastic rounding), 0 to 2**63 - 1."""
    checkpoint_every: int = 10
    """Save the full training state every this many steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (oldest removed first)."""
    warmup_sft_steps: int = 0
    """Supervised warm-start steps (prompt -> answer) before RL: a quickstart device that stands in for a
    pretrained model; 0 (off) unless the config asks. Cached: the same model, prompts, settings and seed reuse
    the weights of an earlier run (`rl4bit.trainer.warmstart`)."""
    warmup_prompts: Literal["held_out", "train"] = "held_out"
    """What the warm start trains on: `held_out`, prompts RL never samples (arithmetic: data.warmup_fraction of
    the sums; file: data.warmup_file); `train`, RL's own train prompts, whose answers it then memorises (groups
    agree, zero reward spread: little left to learn)."""
    warmup_lr: float = 3e-3
    """Learning rate of the supervised warm start."""
    tensorboard: bool = True
    """Also write TensorBoard event files."""
    warmup_batch_size: int = 64
    """Prompts (with their answers) per step of the supervised warm start."""
    cpu_threads: int = 0
    """torch intra-op threads in every process of the job (0 = torch's default); tiny models on a shared CPU run
    fastest with 1."""
    samples_every: int = 5
    """Keep the completions of `samples_prompts` prompts every this many RL steps in samples.jsonl (with their
    rewards, advantages and sampler logprobs; `rl4bit inspect RUN --samples`) and TensorBoard; 0 = never."""
    samples_prompts: int = 2
    """Prompts (each with all its samples_per_prompt completions) kept a time in samples.jsonl."""
    progress: bool = True
    """Show the live `rich` progress display (off in tests and non-interactive logs)."""

    def validate(self, path: str) -> None:
        for name, low in (("checkpoint_every", 0), ("warmup_sft_steps", 0), ("cpu_threads", 0),
                          ("keep_checkpoints", 1), ("warmup_batch_size", 1), ("samples_every", 0),
                          ("samples_prompts", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{path}.{name}: {getattr(self, name)} must be >= {low}")
        positive(self, path, "warmup_lr")
        _check_seed(self.seed, f"{path}.seed")


@dataclass
class JobConfig:
    """A whole rl4bit job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    """The numerics recipe (bf16, mxfp8, nvfp4) and its ablation switches."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Rollout engines."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimizer and micro-batching."""
    rl: RLConfig = field(default_factory=RLConfig)
    """Algorithm and batch vocabulary."""
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    """Reward functions."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Actor placement."""
    parity: ParityConfig = field(default_factory=ParityConfig)
    """Live parity tracking."""
    run: RunConfig = field(default_factory=RunConfig)
    """Bookkeeping."""

    def derived(self) -> dict[str, Any]:
        """Quantities derived from the batch vocabulary, printed with the config."""
        return {
            "rollouts_per_step": self.rl.prompts_per_step * self.rl.samples_per_prompt,
            "max_tokens_per_rollout": self.model.max_seq_len,
            "optimizer_steps_per_rl_step": self.rl.ppo_epochs,
        }


# --------------------------------------------------------------------------- loading


def trainer_args(cfg: JobConfig, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """`Trainer`'s keyword arguments: its own sections of `cfg` and the values it takes from the others."""
    return dict(model=cfg.model, trainer=cfg.trainer, recipe=cfg.recipe, rl=cfg.rl, seed=cfg.run.seed,
                temperature=cfg.sampler.temperature, bitwise_sampler=cfg.sampler.backend == "embedded",
                cpu_threads=cfg.run.cpu_threads, rank=rank, world=world)


def warm_start_args(cfg: JobConfig) -> dict[str, Any]:
    """`Trainer.warm_start`'s keyword arguments (`run.warmup_*`, `run.seed`, `data.chat_template`)."""
    run = cfg.run
    return dict(steps=run.warmup_sft_steps, lr=run.warmup_lr, batch_size=run.warmup_batch_size, seed=run.seed,
                chat=cfg.data.chat_template)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML job (or the defaults when path is None), apply `key.path=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        apply_override(raw, item)
    cfg = from_dict(JobConfig, raw, "")
    validate(cfg)
    return cfg


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in a raw dict; the value is parsed as YAML (so 1e-6, true, [1, 2] work)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value, e.g. trainer.lr=1e-6")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment in {key!r}")
    node = raw
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node = nxt
    try:
        node[parts[-1]] = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from None


def from_dict(cls: type, raw: Any, path: str) -> Any:
    """Build dataclass `cls` from a raw mapping, checking keys and types recursively."""
    where = path or "<top level>"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {type(raw).__name__} {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"{key_path}: unknown key; {hint}valid keys: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, key_path)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}{hint}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):  # NaN passes every `v <= 0` check; Inf turns limits off
            raise ConfigError(f"{path}: {value!r} is not a finite number; give a finite value")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"config field {path} has an unsupported type {tp}")  # a bug in this file, not user input


def validate(cfg: JobConfig) -> None:
    """Run each section's `validate(path)` and the cross-section checks."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        check = getattr(section, "validate", None)
        if check is None:
            continue
        try:
            check(f.name) if _takes_path(check) else check()
        except ConfigError:
            raise
        except ValueError as e:  # sections defined outside this file raise plain ValueError
            raise ConfigError(f"{f.name}: {e}") from None
    if cfg.rl.samples_per_prompt > MAX_N:
        raise ConfigError(f"rl.samples_per_prompt: {cfg.rl.samples_per_prompt} is above the sampler's {MAX_N} "
                          "samples a request; use a smaller group")
    if cfg.sampler.max_new_tokens >= cfg.model.max_seq_len:
        raise ConfigError(
            f"sampler.max_new_tokens: {cfg.sampler.max_new_tokens} leaves no room for the prompt within "
            f"model.max_seq_len={cfg.model.max_seq_len}"
        )
    if cfg.trainer.tokens_per_microbatch <= cfg.sampler.max_new_tokens:
        # a rollout is its prompt (>= 1 token) + up to max_new_tokens; one that does not fit a micro-batch is
        # trained alone, one sequence a forward (tens of times slower), so it is refused rather than run
        raise ConfigError(
            f"trainer.tokens_per_microbatch: {cfg.trainer.tokens_per_microbatch} is smaller than one rollout (a "
            f"prompt of >= 1 token + sampler.max_new_tokens={cfg.sampler.max_new_tokens}); set it to at least "
            f"model.max_seq_len={cfg.model.max_seq_len} (the longest rollout), e.g. "
            f"-o trainer.tokens_per_microbatch={max(cfg.model.max_seq_len, 4096)}")
    if (cfg.run.warmup_sft_steps and cfg.run.warmup_prompts == "held_out" and cfg.data.task == "file"
            and not cfg.data.warmup_file):
        raise ConfigError(
            "run.warmup_sft_steps: a warm start on held-out prompts needs data.warmup_file (prompts with answers RL "
            "does not train on); set it, or run.warmup_sft_steps: 0 (a pretrained model.path needs none), or "
            "run.warmup_prompts: train to warm-start on RL's own prompts (their answers are then memorised)")
    if cfg.rl.samples_per_prompt == 1:
        raise ConfigError("rl.samples_per_prompt: 1 gives every GRPO group zero reward spread (no learning signal); "
                          "use >= 2")
    if cfg.model.invariant_kernels and cfg.sampler.backend != "embedded":
        raise ConfigError(
            f"model.invariant_kernels: needs sampler.backend: embedded (the {cfg.sampler.backend} backend keeps its "
            "own kernels, so trainer and sampler could not agree bitwise); set it to false or use the embedded sampler"
        )
    _check_seed(cfg.recipe.seed, "recipe.seed")  # the recipe refuses < 0 itself; the upper bound is shared
    if cfg.model.num_experts % cfg.trainer.expert_parallel:
        raise ConfigError(
            f"trainer.expert_parallel: {cfg.trainer.expert_parallel} does not divide "
            f"model.num_experts={cfg.model.num_experts}"
        )


def _takes_path(fn: Any) -> bool:
    import inspect

    return len(inspect.signature(fn).parameters) >= 1


def _check_seed(seed: int, path: str) -> None:
    # Seeds become Philox keys (`kernels.philox.derive_seed`), which refuse negatives (at the first RL step, after
    # the warm start) and fold keys to 63 bits (so larger seeds would repeat smaller ones' random bits).
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{path}: {seed} must be in [0, 2**63 - 1]; seeds key the Philox random streams, which take "
                          "non-negative 63-bit keys")


def absolute_reward_spec(spec: str) -> str:
    """A file-path reward (`path/file.py:function`) with its path made absolute from the working directory; a
    module reward (`pkg.module:function`) as it is."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"{Path(target).expanduser().resolve()}:{name}"
    return spec


def anchored(cfg: JobConfig) -> JobConfig:
    """`cfg` with its relative reward files, prompt files and parity.reference made absolute from the working
    directory, so a run dir's config.yaml names the same files from wherever `--resume` runs. model.path is kept
    as written: a checkpoint records it among its job's settings, and a relative one lets a project (its models
    and runs together) move."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser().resolve())

    fns = [dataclasses.replace(r, fn=absolute_reward_spec(r.fn)) for r in cfg.rewards.functions]
    data = dataclasses.replace(cfg.data, train_file=absolute(cfg.data.train_file),
                               eval_file=absolute(cfg.data.eval_file))
    return dataclasses.replace(cfg, rewards=dataclasses.replace(cfg.rewards, functions=fns), data=data,
                               parity=dataclasses.replace(cfg.parity, reference=absolute(cfg.parity.reference)))


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (what `rl4bit config` prints and run dirs store)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
