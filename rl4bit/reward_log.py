"""Reward failures, written down: `logs/rewards.log` in the run dir and the metrics that count them.

`RewardLog(run_dir).write(step, phase, scores)` appends one line per step (or
evaluation) that had failures, counting them by kind (`reward_pool.ERROR_KINDS`:
raised, timeout, type, nonfinite, died), then one line per failed sample: its
kind, the message (naming the reward), the line of the user's reward file that
raised, and the prompt. It returns the count line (None when nothing failed) so
the driver can print it. `failure_metrics(scores, prefix)` gives the counts as
metrics (`reward_errors/<kind>` for training steps, `eval/reward_errors/<kind>`
for evaluations).

The log is appended to (a line at a time, flushed), as logs are; the metrics in
metrics.jsonl are the record a resume relies on. Leaves out: rotation (a run's
log grows with its failures; a step holds at most prompts_per_step x
samples_per_prompt of them).
"""

from __future__ import annotations

from pathlib import Path

from rl4bit.reward_pool import ERROR_KINDS, Scores, count_line

LOG = "rewards.log"


def failure_metrics(scores: Scores, prefix: str) -> dict[str, float]:
    """`{prefix}/<kind>`: how many samples failed to score in each way (every kind, 0 included)."""
    kinds = scores.kinds
    return {f"{prefix}/{k}": float(kinds[k]) for k in ERROR_KINDS}


class RewardLog:
    """Appends reward failures to RUN_DIR/logs/rewards.log."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / "logs" / LOG

    def write(self, step: int, phase: str, scores: Scores) -> str | None:
        """Log the failures of one scoring call (`phase`: "train" or "eval"); the count line, or None if none."""
        if not scores.failures:
            return None
        total = len(scores.totals) or len(scores.failures)
        head = (f"step {step} {phase}: {len(scores.failures)} of {total} samples failed to score "
                f"({count_line(scores.kinds)})")
        lines = [head]
        for f in scores.failures:
            where = f" at {f.where}" if f.where else ""
            lines.append(f"  [{f.kind}] sample {f.index}: {f.message}{where} (prompt {f.prompt!r})")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as out:
            out.write("\n".join(lines) + "\n")
            out.flush()
        return f"{head}; see {self.path}"
