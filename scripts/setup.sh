#!/usr/bin/env bash
# Set up rl4bit in ./.venv (or $RL4BIT_VENV): the one environment the README's commands use.
#
# - The venv sees the system site-packages, so a machine that already has torch
#   (the GPU image: torch 2.11 + triton 3.6) keeps its own build.
# - Where no torch is importable it installs the CPU build torch==2.13.0
#   (on local disk here), never an unpinned `torch` (a multi-GB CUDA build).
# - Then an editable install of rl4bit with the test and triton extras; it is
#   redone only when pyproject.toml changes (hash kept in the venv).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
venv=${RL4BIT_VENV:-.venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv --system-site-packages "$venv"
fi
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0 (CPU build)" >&2
  "$venv/bin/pip" install -q torch==2.13.0
fi
stamp="$venv/.rl4bit-installed"
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "setup: installing rl4bit (editable) with extras test,triton" >&2
  "$venv/bin/pip" install -q -e ".[test,triton]" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  echo "$want" > "$stamp"
fi
