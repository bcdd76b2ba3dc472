"""Sampler-vs-trainer logprob mismatch of the bench-step job, per step, with the direct and the bucketed weight sync.

    source scripts/device_env.sh && python3 -P scripts/mismatch_bisect.py [--recipe bf16] [--steps 2] [--new-tokens 64]

Runs `rl4bit bench step`'s job (local mode, decode-heavy) once with the direct
in-process sync and once with `RL4BIT_WEIGHT_SYNC=buckets`, and prints
`mismatch/k3` and `mismatch/max_abs` of every step. Step 1 samples with the
weights of the job's first sync, so a mismatch there that equals the later
steps' does not come from the sync path.
"""

import argparse
import os

from rl4bit import bench_step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-o", "--override", action="append", default=[])
    a = p.parse_args()
    for mode in ("auto", "buckets"):
        os.environ["RL4BIT_WEIGHT_SYNC"] = mode
        row = bench_step.run_job(bench_step.CONFIG, a.recipe,
                                 bench_step._overrides(False, "cuda", a.steps, a.new_tokens) + a.override)
        print(f"{a.recipe} sync={mode}: k3 {row['mismatch']['k3']}  max_abs {row['mismatch']['max_abs']}")


if __name__ == "__main__":
    main()
