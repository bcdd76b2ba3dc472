# Source on the GPU image (torch/triton/transformers preinstalled, no network):
# makes `import rl4bit` work from this checkout without pip, by assembling
# the package-dir mapping of pyproject.toml with symlinks under /tmp/rl4bit-site.
# Usage: source scripts/device_env.sh
root=$(pwd)
site=/tmp/rl4bit-site
rm -rf "$site" && mkdir -p "$site/rl4bit"
for f in "$root"/rl4bit/*; do ln -s "$f" "$site/rl4bit/$(basename "$f")"; done
for d in kernels trainer sampler; do ln -s "$root/$d" "$site/rl4bit/$d"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
