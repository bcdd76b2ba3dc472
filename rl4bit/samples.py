"""What the model writes: `samples.jsonl` in the run dir, and `rl4bit inspect RUN --samples`.

Every `run.samples_every` RL steps the driver keeps the first `run.samples_prompts`
prompts of the step with ALL their completions (the GRPO group): one JSON line

    {"step", "policy_version", "mismatch/k3", "mismatch/max_abs",
     "prompts": [{"prompt", "answer", "completions": [{"text", "reward", "advantage",
                  "finish_reason", "token_ids", "sampler_logprobs"}]}]}

reward is null where scoring failed. Per-token mismatch is given as the
sampler's logprob of every token beside the step's trainer-vs-sampler mismatch
(k3 summed over tokens / tokens, and the largest per-token gap); the trainer's
own per-token logprobs are not returned by its train step, so the per-token gap
itself is not recorded. Lines are appended and fsynced like metrics.jsonl; a
resume drops the records past its checkpoint (`truncate`, atomic rewrite). The
same record goes to TensorBoard as a markdown text summary (`as_markdown`).

`print_latest(run_dir)` prints the last record (what `inspect --samples` shows).

Leaves out: choosing which prompts to keep (the first of the step; the step's
prompts are a seeded draw already), evaluation completions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl4bit.common.atomic import atomic_write_text

FILE = "samples.jsonl"


def sample_record(step: int, prompts: list[dict], rollouts, totals, advantages, group: int, k: int,
                  metrics: dict) -> dict:
    """The record of one step: its first `k` prompts, each with its `group` completions."""
    out = []
    for p in range(min(k, len(prompts))):
        comps = []
        for j in range(p * group, (p + 1) * group):
            r = rollouts[j]
            comps.append({"text": r.text, "reward": totals[j], "advantage": float(advantages[j]),
                          "finish_reason": r.finish_reason, "token_ids": list(r.completion_ids),
                          "sampler_logprobs": [float(x) for x in r.logprobs]})
        out.append({"prompt": prompts[p]["prompt"], "answer": prompts[p].get("answer"), "completions": comps})
    return {"step": step, "policy_version": min(r.policy_version for r in rollouts),
            "mismatch/k3": metrics.get("mismatch/k3"), "mismatch/max_abs": metrics.get("mismatch/max_abs"),
            "prompts": out}


def append(run_dir: str | Path, record: dict) -> None:
    path = Path(run_dir) / FILE
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read(run_dir: str | Path) -> list[dict]:
    """The whole records of RUN_DIR/samples.jsonl (a last line cut short by a crash is skipped)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and type(r.get("step")) is int:
            records.append(r)
    return records


def truncate(run_dir: str | Path, step: int) -> None:
    """Keep only the records of steps <= `step` (a resume from the checkpoint at `step`)."""
    path = Path(run_dir) / FILE
    if path.is_file():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in read(run_dir) if r["step"] <= step))


def as_markdown(record: dict) -> str:
    """A record as a markdown table per prompt (TensorBoard's text plugin renders it)."""
    parts = [f"step {record['step']}, policy v{record['policy_version']}, mismatch/k3 {record['mismatch/k3']}"]
    for p in record["prompts"]:
        parts.append(f"\n**prompt** `{p['prompt']}` (answer `{p.get('answer')}`)\n\n"
                     "| completion | reward | advantage | finish | tokens |\n|---|---|---|---|---|")
        for c in p["completions"]:
            text = c["text"].replace("|", "\\|").replace("\n", "\\n")
            parts.append(f"| `{text}` | {c['reward']} | {c['advantage']:+.3f} | {c['finish_reason']} | "
                         f"{len(c['token_ids'])} |")
    return "\n".join(parts)


def print_latest(run_dir: str | Path) -> int:
    """Print the latest samples.jsonl record of a run dir; FileNotFoundError naming the fix when there is none."""
    from rich.console import Console
    from rich.table import Table

    run_dir = Path(run_dir)
    records = read(run_dir)
    if not records:
        raise FileNotFoundError(f"{run_dir / FILE}: no samples yet; pass a run dir that `rl4bit train` wrote "
                                f"(it keeps samples every run.samples_every steps; 0 turns them off)")
    r = records[-1]
    console = Console(width=140)
    console.print(f"{run_dir / FILE}: step {r['step']}, policy v{r['policy_version']}, mismatch/k3 "
                  f"{r['mismatch/k3']}, mismatch/max_abs {r['mismatch/max_abs']}")
    for p in r["prompts"]:
        table = Table(title=f"prompt {p['prompt']!r}  answer {p.get('answer')!r}")
        for col, just in (("completion", "left"), ("reward", "right"), ("advantage", "right"), ("finish", "left"),
                          ("tokens", "right"), ("mean sampler logprob", "right")):
            table.add_column(col, justify=just)
        for c in p["completions"]:
            lp = c["sampler_logprobs"]
            table.add_row(repr(c["text"]), "error" if c["reward"] is None else f"{c['reward']:.3f}",
                          f"{c['advantage']:+.3f}", c["finish_reason"], str(len(c["token_ids"])),
                          f"{sum(lp) / len(lp):.3f}" if lp else "")
        console.print(table)
    return 0
