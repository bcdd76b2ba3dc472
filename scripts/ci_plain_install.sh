#!/usr/bin/env bash
# Does a plain `pip install .` (no extras) run the quickstart? A fresh venv, the CPU torch, the package as a
# user installs it (not editable), then a short quickstart from outside the checkout. Used by CI.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
${PYTHON:-python3} -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
mkdir "$work/src"  # the checkout's files alone: an in-tree build/ left by an earlier install never leaks in
(cd "$root" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$work/src"
"$work/venv/bin/pip" install -q "$work/src" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
if "$work/venv/bin/python" -c "import triton" 2>/dev/null; then
  echo "ci_plain_install: triton is installed without the triton extra; the check would prove nothing" >&2; exit 1
fi
cd "$work"
"$work/venv/bin/rl4bit" train "$root/configs/quickstart.yaml" --out "$work/run" -o rl.steps=2 \
  -o run.warmup_sft_steps=10 -o data.eval_size=32 -o data.eval_every=1 -o run.progress=false
test -s "$work/run/metrics.jsonl" || { echo "ci_plain_install: the quickstart wrote no metrics" >&2; exit 1; }
echo "ci_plain_install: plain install ran the quickstart ($(wc -l < "$work/run/metrics.jsonl") metric lines)"
