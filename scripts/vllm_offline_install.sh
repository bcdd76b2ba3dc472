#!/usr/bin/env bash
# Install a vLLM wheelhouse (scripts/wheelhouse.py) on an offline GPU node, into a --target folder.
#   bash scripts/vllm_offline_install.sh WHEELHOUSE_DIR [TARGET=/tmp/site]
# Checks every wheel against SHA256SUMS, installs wheels/ (vLLM and what its offline path imports) and, from
# fallback/, only the distributions the node's Python lacks. Then: source TARGET/vllm_env.sh.
set -euo pipefail
house=$(cd "$1" && pwd); target=${2:-/tmp/site}
(cd "$house" && sha256sum --quiet -c SHA256SUMS) || { echo "wheelhouse: checksum mismatch in $house" >&2; exit 1; }
py=${PYTHON:-python3}
missing=()
for w in "$house"/fallback/*.whl; do
  [ -e "$w" ] || continue
  dist=$(basename "$w" | cut -d- -f1)
  "$py" -c "import importlib.metadata as m, sys; m.distribution(sys.argv[1])" "$dist" 2>/dev/null || missing+=("$w")
done
echo "wheelhouse: installing $(ls "$house"/wheels/*.whl | wc -l) wheels and ${#missing[@]} fallbacks the node lacks" \
     "${missing[*]##*/}" >&2
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
  "$house"/wheels/*.whl "${missing[@]}"
libs=$("$py" - <<'PY'
import glob, os, site
dirs = []
for root in site.getsitepackages() + [site.getusersitepackages()]:
    dirs += sorted(d for d in glob.glob(os.path.join(root, "nvidia", "*", "lib")) if os.path.isdir(d))
    dirs += sorted(d for d in glob.glob(os.path.join(root, "nvidia", "cu*", "lib")) if os.path.isdir(d))
print(":".join(dict.fromkeys(dirs)))
PY
)
cat > "$target/vllm_env.sh" <<ENV
export PYTHONPATH="$target\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
ENV
echo "wheelhouse: installed into $target; source $target/vllm_env.sh" >&2
