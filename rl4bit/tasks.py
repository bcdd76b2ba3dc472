"""Prompt sources: the built-in arithmetic task and prompt files (JSONL or Parquet).

A *sample* is a dict with `prompt` (str), optional `answer` (str) and any
extra fields; every field except `prompt` reaches the reward functions as
`**sample` (fields named `completion`, `completions` or `prompts` are refused:
those are the reward signatures' own arguments).

- `arithmetic_task(digits, eval_size, seed)`: every `a+b=` with operands
  below 10**digits; a seeded permutation puts `eval_size` of them in the eval
  split and the rest in the train split, so the splits are disjoint by
  construction. The answer is the decimal sum. All pairs are built in memory,
  so digits stops at `config.MAX_DIGITS`.
- `load_prompt_file(path)`: JSONL (one UTF-8 JSON object a line) or Parquet
  (needs pyarrow); a malformed line, bytes that are not UTF-8, a file the
  reader fails on or one without prompts raise `PromptFileError` naming the
  file (and the line where there is one).
- `PromptStream`: the train order. Epoch e visits the train split in a
  permutation seeded by (seed, e); its position (epoch, index) is plain data,
  stored in checkpoints so a resumed run draws the same prompts.

Samples hold the prompt as written; `data.chat_template` wraps it in the
tokenizer's chat template later, when it is tokenized (`rl4bit.trainer.tokenizer`).

Leaves out: other operations than +.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

from rl4bit.config import MAX_DIGITS, ConfigError, DataConfig

RESERVED_FIELDS = ("completion", "completions", "prompts")
"""Argument names of the reward signatures (`rl4bit.rewards`), so no prompt-file field may take them."""


class PromptFileError(ConfigError):
    """A prompt file that cannot be read; the message names the file and line."""


def arithmetic_task(digits: int, eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval) samples of `a+b=` with a, b < 10**digits; disjoint splits."""
    if not 1 <= digits <= MAX_DIGITS:  # the same bound as DataConfig, for callers that skip load_config
        raise ConfigError(f"data.digits: {digits} must be 1 to {MAX_DIGITS} (all 10**(2*digits) pairs are built in "
                          "memory)")
    n = 10**digits
    pairs = [(a, b) for a in range(n) for b in range(n)]
    if eval_size >= len(pairs):
        raise ConfigError(f"data.eval_size: {eval_size} leaves no training prompts out of {len(pairs)} "
                          f"{digits}-digit sums; lower it or raise data.digits")
    random.Random(seed).shuffle(pairs)
    samples = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return samples[eval_size:], samples[:eval_size]


def load_prompt_file(path: str | Path) -> list[dict]:
    """Samples from a .jsonl/.json-lines or .parquet file; each needs a string `prompt`."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ModuleNotFoundError:
            raise PromptFileError(f"{path}: reading Parquet needs pyarrow; `pip install pyarrow` or convert the file "
                                  "to JSONL") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError, ...) share no base class but Exception
            raise PromptFileError(f"{path}: cannot be read as Parquet ({type(e).__name__}: {e}); check the file or "
                                  f"convert it to JSONL") from e
        for i, row in enumerate(rows):
            _check_row(row, f"{path}: row {i}")
        return _nonempty(rows, path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise PromptFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    samples = []
    # newline=None splits lines as text-mode open() does (\n, \r\n and \r), so line numbers match an editor's
    for lineno, line in enumerate(io.StringIO(_decode(data, path), newline=None), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); each line must be "
                                  "one JSON object") from None
        _check_row(row, f"{path}:{lineno}")
        samples.append(row)
    return _nonempty(samples, path)


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        before = data[: e.start].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # valid up to e.start
        lineno, col = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise PromptFileError(f"{path}:{lineno}: not UTF-8 (byte 0x{data[e.start]:02x} at column {col}); save the "
                              f"file as UTF-8") from None


def _nonempty(samples: list[dict], path: Path) -> list[dict]:
    if not samples:  # an empty train split would leave the prompt stream nothing to draw
        raise PromptFileError(f"{path}: no prompts (the file has no rows); give at least one row with a 'prompt'")
    return samples


def _check_row(row, where: str) -> None:
    if not isinstance(row, dict):
        raise PromptFileError(f"{where}: expected a JSON object with a 'prompt' field, got {type(row).__name__}")
    if not isinstance(row.get("prompt"), str):
        raise PromptFileError(f"{where}: missing a string 'prompt' field (keys: {', '.join(map(str, row)) or 'none'})")
    taken = [k for k in RESERVED_FIELDS if k in row]
    if taken:  # a reward would get two values for it and mask every sample
        raise PromptFileError(f"{where}: the field {taken[0]!r} is reserved (rewards receive the model's output and "
                              f"the prompts under the names {', '.join(RESERVED_FIELDS)}); rename it, e.g. to "
                              f"'reference'")
    if "answer" in row and row["answer"] is not None:
        row["answer"] = str(row["answer"])


def load_task(data: DataConfig, quiet: bool = False) -> tuple[list[dict], list[dict]]:
    """(train, eval) samples for the data config. A prompt file without `eval_file` gives up a held-out eval split
    (`split_eval`), said on stderr unless `quiet`."""
    if data.task == "arithmetic":
        return arithmetic_task(data.digits, data.eval_size, data.seed)
    train = load_prompt_file(data.train_file)
    if data.eval_file:
        return train, load_prompt_file(data.eval_file)[: data.eval_size]
    train, evals = split_eval(train, data.eval_fraction, data.eval_size, data.seed)
    if not quiet:
        import sys

        print(f"data: no data.eval_file, so {len(evals)} of the {len(train) + len(evals)} prompts of "
              f"{data.train_file} are held out as the eval split (data.eval_fraction={data.eval_fraction}, at most "
              f"data.eval_size={data.eval_size}); RL trains on the other {len(train)}"
              if evals else "data: no data.eval_file and data.eval_fraction=0: this job has no evaluation",
              file=sys.stderr)
    return train, evals


def warmup_split(train: list[dict], data: DataConfig, run) -> tuple[list[dict], list[dict]]:
    """(RL's train prompts, the warm start's prompts) under `run.warmup_prompts` (see RunConfig); the warm start's
    are [] when run.warmup_sft_steps is 0. held_out: arithmetic splits the train sums by data.warmup_fraction,
    a prompt file reads data.warmup_file; train: both are the train split."""
    if not run.warmup_sft_steps:
        return train, []
    if run.warmup_prompts == "train":
        return train, train
    if data.task == "file":
        return train, load_prompt_file(data.warmup_file)
    order = list(range(len(train)))
    random.Random(data.seed * 1_000_003 + 29).shuffle(order)
    k = min(len(train) - 1, max(1, round(data.warmup_fraction * len(train))))
    held = set(order[:k])
    return [s for i, s in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


def split_eval(samples: list[dict], fraction: float, most: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, eval): round(fraction x len) samples (at least 1 when fraction > 0, at most `most`, and never all
    of them) picked by a permutation seeded by `seed` as the eval split; train keeps the rest in file order."""
    if fraction <= 0 or len(samples) < 2:
        return samples, []
    k = min(most, len(samples) - 1, max(1, round(fraction * len(samples))))
    order = list(range(len(samples)))
    random.Random(seed * 1_000_003 + 17).shuffle(order)
    held = set(order[:k])
    return ([s for i, s in enumerate(samples) if i not in held], [samples[i] for i in sorted(held)])


def check_prompt_lengths(train: list[dict], evals: list[dict], count_tokens, max_seq_len: int) -> str | None:
    """ConfigError when no train prompt fits the context (each rollout would fail: a job that learns nothing);
    else a warning line naming how many prompts (train and eval) cannot run, or None. `count_tokens(texts)`: the
    prompts' token counts under the job's tokenizer (one batched call). A prompt runs when 1 <= tokens <
    max_seq_len."""
    def bad(samples):
        counts = count_tokens([s["prompt"] for s in samples]) if samples else []
        return [(i, n) for i, n in enumerate(counts) if n == 0 or n >= max_seq_len]

    bad_train, bad_eval = bad(train), bad(evals)
    if train and len(bad_train) == len(train):
        i, n = bad_train[0]
        raise ConfigError(f"data: none of the {len(train)} train prompts fits model.max_seq_len={max_seq_len} "
                          f"(prompt {i} has {n} tokens; a prompt needs 1 to {max_seq_len - 1}); raise "
                          f"model.max_seq_len or shorten the prompts")
    if bad_train or bad_eval:
        return (f"rl4bit: {len(bad_train)} of {len(train)} train and {len(bad_eval)} of {len(evals)} eval prompts "
                f"are empty or do not fit model.max_seq_len={max_seq_len}: their rollouts fail (counted in "
                f"rollout/errors)")
    return None


def check_batch_fits(cfg, train: list[dict], prompt_tokens: list[int], source: str) -> None:
    """ConfigError, naming the fix, when the job's batch vocabulary does not fit its train prompts: more prompts a
    step than the train split holds (every step would repeat prompts within itself), or a micro-batch smaller than
    the longest rollout (the longest train prompt that fits + sampler.max_new_tokens, capped at
    model.max_seq_len), which would be trained one sequence a forward. `prompt_tokens`: the train prompts' token
    counts; `source`: where the train split came from, for the message."""
    n = len(train)
    if cfg.rl.prompts_per_step > n:
        raise ConfigError(f"rl.prompts_per_step: {cfg.rl.prompts_per_step} is larger than the {n} train prompts of "
                          f"{source}; lower it to at most {n} (-o rl.prompts_per_step={n}) or add prompts")
    fitting = [t for t in prompt_tokens if 0 < t < cfg.model.max_seq_len]
    if not fitting:
        return  # check_prompt_lengths names that problem
    longest = min(cfg.model.max_seq_len, max(fitting) + cfg.sampler.max_new_tokens)
    if cfg.trainer.tokens_per_microbatch < longest:
        raise ConfigError(f"trainer.tokens_per_microbatch: {cfg.trainer.tokens_per_microbatch} is smaller than one "
                          f"rollout ({longest} tokens: the longest train prompt, {max(fitting)} tokens, + "
                          f"sampler.max_new_tokens={cfg.sampler.max_new_tokens}, at most model.max_seq_len="
                          f"{cfg.model.max_seq_len}); set -o trainer.tokens_per_microbatch={max(longest, 4096)} or "
                          f"more (micro-batches are packed up to it)")


@dataclass
class PromptStream:
    """Draws train prompts in seeded per-epoch permutations; (epoch, index) is its whole state."""

    samples: list[dict]
    seed: int
    epoch: int = 0
    index: int = 0

    def next(self, k: int) -> list[dict]:
        out = []
        while len(out) < k:
            order = self._order()
            take = min(k - len(out), len(order) - self.index)
            out += [self.samples[j] for j in order[self.index : self.index + take]]
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def _order(self) -> list[int]:
        cached = getattr(self, "_cache", None)
        if cached is None or cached[0] != self.epoch:
            order = list(range(len(self.samples)))
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            self._cache = (self.epoch, order)
        return self._cache[1]

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
