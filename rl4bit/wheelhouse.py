"""`rl4bit wheelhouse DIR`: vLLM and what its offline path imports, as wheels for an air-gapped GPU node.

    rl4bit wheelhouse /tmp/house --torch 2.11.0 --python 3.12 --arch sm_90 --split 55m
    # on the node (no network):  bash DIR/install.sh [TARGET]; source TARGET/vllm_env.sh

Picks the vLLM release whose `torch==` pin is the node's torch (`VLLM_FOR_TORCH`;
`--vllm` names another and is checked against its pin), downloads it and the
pinned wheels its offline `LLM` path needs (`OFFLINE_DEPS`) for the node's
Python and platform, plus small fallbacks that install only where the node
lacks them. `--arch` drops libraries that architecture never loads (FA2 on
sm_90, which runs FA3). Writes SHA256SUMS and install.sh; `--split` also
writes the wheelhouse as one tar in parts (for transfers with a size cap) and
its checksum. Leaves out: flashinfer (set VLLM_USE_FLASHINFER_SAMPLER=0) and
multimodal extras.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

VLLM_FOR_TORCH = {"2.11.0": "0.26.0"}
"""Node torch -> the vLLM release this project runs with it (vLLM 0.20.0-0.26.0 pin torch==2.11.0)."""

OFFLINE_DEPS = {
    "0.26.0": ["pydantic==2.12.5", "pydantic-core==2.41.5", "annotated-types==0.7.0", "typing-inspection==0.4.2",
               "msgspec==0.23.0", "pyzmq==27.3.0", "cbor2==6.3.0", "cachetools==8.0.3", "fastapi==0.136.3",
               "starlette==1.3.1", "openai==2.54.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1",
               "openai-harmony==0.0.8", "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1",
               "compressed-tensors==0.17.0", "loguru==0.7.3", "typing-extensions==4.16.0",
               "llguidance==1.6.1", "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10"],
}
"""vLLM version -> the wheels its offline `LLM` path imports beyond a CUDA PyTorch image (openai 3.x needs httpx2:
2.x is pinned). The structured-output backends load at `LLM` import (class annotations): llguidance 1.6.1 is the
newest this index holds (vLLM asks 1.7), xgrammar 0.2.7 the newest that takes vLLM's tvm-ffi 0.1.10 pin. Found by
importing vLLM 0.26 on an H100."""

FALLBACKS = ["blake3", "py-cpuinfo", "cloudpickle", "setproctitle", "einops", "prometheus-client",
             "python-json-logger", "ijson", "diskcache", "lark==1.2.2", "depyf==0.20.0", "astor", "dill", "watchfiles",
             "prometheus-fastapi-instrumentator", "psutil", "regex", "interegular", "outlines-core==0.2.14",
             "lm-format-enforcer==0.11.3"]
"""vLLM requirements a PyTorch image usually has; installed on the node only where it lacks them."""

UNUSED_ON = {
    "sm_90": [r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so$"],  # Hopper runs FA3
}
"""Architecture -> libraries in the vLLM wheel it never loads."""

ALWAYS_UNUSED = [r"vllm/vllm-rs$"]
"""The Rust front end binary: the offline `LLM` path never starts it."""

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]


INSTALL_SH = r"""#!/usr/bin/env bash
# Install this vLLM wheelhouse (written by `rl4bit wheelhouse`) on an offline GPU node, into a --target folder.
#   bash install.sh [TARGET=/tmp/site]
# Checks every wheel against SHA256SUMS, installs wheels/ (vLLM and what its offline path imports) and, from
# fallback/, only the distributions the node's Python lacks. Then: source TARGET/vllm_env.sh.
set -euo pipefail
house=$(cd "$(dirname "$0")" && pwd); target=${1:-/tmp/site}
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
"""
"""The node-side installer written as install.sh: checksums, wheels/, the fallbacks the node lacks, an env file."""


class WheelhouseError(ValueError):
    """A wheelhouse that cannot be built as asked (the message names the fix)."""


def vllm_version(torch_version: str, asked: str | None) -> str:
    base = torch_version.split("+")[0]
    if asked:
        return asked
    if base not in VLLM_FOR_TORCH:
        raise WheelhouseError(f"no vLLM release known for torch {base}: known {sorted(VLLM_FOR_TORCH)}; pass --vllm "
                              "VERSION (its torch pin is checked)")
    return VLLM_FOR_TORCH[base]


def torch_pin(wheel: Path) -> str | None:
    """The `torch==X` a wheel's metadata requires, or None."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            m = re.match(r"Requires-Dist: torch\s*==\s*([\w.+]+)\s*(;|$)", line)
            if m:
                return m.group(1)
    return None


def drop_members(wheel: Path, patterns: list[str], out: Path) -> list[str]:
    """Copy `wheel` to `out` without the members matching `patterns` (and their RECORD lines); returns them."""
    drop = re.compile("|".join(patterns)) if patterns else None
    dropped = []
    tmp = out.with_name(out.name + ".part")
    with zipfile.ZipFile(wheel) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zo:
        for info in zi.infolist():
            if drop is not None and drop.search(info.filename):
                dropped.append(info.filename)
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD") and drop is not None:
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not drop.search(line.split(b",", 1)[0].decode()))
            zo.writestr(info, data)
    tmp.replace(out)
    return dropped


def download(specs: list[str], dest: Path, python: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           python, "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS + ["any"]:
        cmd += ["--platform", p]
    r = subprocess.run(cmd + specs, capture_output=True, text=True)
    if r.returncode != 0:
        raise WheelhouseError(f"pip download failed for {specs}:\n{r.stderr.strip()[-2000:]}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_sums(house: Path) -> None:
    lines = [f"{sha256(p)}  {p.relative_to(house).as_posix()}" for p in sorted(house.glob("*/*.whl"))]
    (house / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def write_install(house: Path) -> None:
    (house / "install.sh").write_text(INSTALL_SH)


def split(house: Path, size: int) -> list[Path]:
    """The wheelhouse as `<house>.tar` in parts of `size` bytes (`<house>.tar.partNN`) and `<house>.tar.sha256`."""
    tar = house.with_name(house.name + ".tar")
    with tarfile.open(tar, "w") as t:
        t.add(house, arcname=house.name)
    parts = []
    with open(tar, "rb") as f:
        while chunk := f.read(size):
            parts.append(tar.with_name(f"{tar.name}.part{len(parts):02d}"))
            parts[-1].write_bytes(chunk)
    tar.with_name(tar.name + ".sha256").write_text(f"{sha256(tar)}  {tar.name}\n")
    tar.unlink()
    return parts


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", s.lower())
    if not m:
        raise WheelhouseError(f"--split {s!r}: use a byte count like 55m or 1g")
    return int(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]


def build(out: Path, torch_version: str, python: str, vllm: str | None = None, arch: str | None = None) -> dict:
    """Download and prune the wheelhouse into `out` (wheels/, fallback/, SHA256SUMS, install.sh); returns a summary."""
    version = vllm_version(torch_version, vllm)
    if version not in OFFLINE_DEPS:
        raise WheelhouseError(f"vLLM {version}: its offline dependency set is not known here (known: "
                              f"{sorted(OFFLINE_DEPS)}); add it to rl4bit.wheelhouse.OFFLINE_DEPS after checking")
    if arch is not None and arch not in UNUSED_ON:
        raise WheelhouseError(f"--arch {arch}: known {sorted(UNUSED_ON)}, or leave it out to keep every library")
    if out.exists() and any(out.iterdir()):
        raise WheelhouseError(f"{out} is not empty; give a new directory")
    raw = out / "raw"
    download([f"vllm=={version}"], raw, python)
    wheel = next(raw.glob("vllm-*.whl"))
    pin = torch_pin(wheel)
    if pin is not None and pin.split("+")[0] != torch_version.split("+")[0]:
        shutil.rmtree(out)
        raise WheelhouseError(f"vLLM {version} requires torch=={pin}, the node has {torch_version}; pick the vLLM "
                              f"release for that torch (known: {VLLM_FOR_TORCH})")
    (out / "wheels").mkdir()
    other_pythons = rf"\.cpython-3(?!{python.split('.')[1]}-)\d+-x86_64-linux-gnu\.so$"  # per-Python builds of others
    unused = ALWAYS_UNUSED + UNUSED_ON.get(arch, []) + [other_pythons]
    dropped = drop_members(wheel, unused, out / "wheels" / wheel.name)
    shutil.rmtree(raw)
    download(OFFLINE_DEPS[version], out / "wheels", python)
    download(FALLBACKS, out / "fallback", python)
    write_sums(out)
    write_install(out)
    size = sum(p.stat().st_size for p in out.glob("*/*.whl"))
    return dict(vllm=version, torch=torch_version, dropped=dropped, bytes=size)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rl4bit wheelhouse", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="new directory for the wheelhouse")
    ap.add_argument("--torch", required=True, help="the node's torch version, e.g. 2.11.0")
    ap.add_argument("--python", default="3.12", help="the node's Python (default 3.12)")
    ap.add_argument("--vllm", default=None, help="a vLLM version (default: the one for --torch)")
    ap.add_argument("--arch", default=None, help=f"GPU architecture, drops what it never loads: {sorted(UNUSED_ON)}")
    ap.add_argument("--split", default=None, help="also write a tar in parts of this size (e.g. 55m)")
    a = ap.parse_args(argv)
    try:
        part_size = parse_size(a.split) if a.split else None
        info = build(a.out, a.torch, a.python, a.vllm, a.arch)
    except WheelhouseError as err:
        print(f"rl4bit wheelhouse: {err}", file=sys.stderr)
        return 2
    print(f"vLLM {info['vllm']} for torch {info['torch']}: {info['bytes'] / 1e6:.0f} MB of wheels in {a.out}"
          + (f"; dropped {len(info['dropped'])} unused libraries ({', '.join(info['dropped'][:3])}"
             f"{', ...' if len(info['dropped']) > 3 else ''})" if info["dropped"] else ""))
    if part_size:
        parts = split(a.out, part_size)
        print(f"{len(parts)} parts: {parts[0].parent}/{parts[0].name[:-2]}NN (+ .sha256); on the node: cat the parts "
              f"in order, check the sha256, untar, then bash {a.out.name}/install.sh")
    print(f"on the node: bash {a.out}/install.sh /tmp/site && source /tmp/site/vllm_env.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
