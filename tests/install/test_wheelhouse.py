"""`rl4bit wheelhouse`: pruning a wheel, the torch pin check, and the node-side install.sh run for real
(pip --no-index into a target folder) on a wheelhouse of small wheels built here."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from rl4bit import wheelhouse as wh


def make_wheel(folder: Path, name: str, files: dict[str, bytes], requires: list[str] = ()) -> Path:
    """A minimal valid wheel `name-1.0-py3-none-any.whl` holding `files`, with METADATA and a hashed RECORD."""
    dist = f"{name}-1.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = dict(files)
    files[f"{dist}/METADATA"] = meta.encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{dist}/RECORD"] = ("\n".join(record + [f"{dist}/RECORD,,"]) + "\n").encode()
    out = folder / f"{name}-1.0-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


def test_drop_members_removes_files_and_their_record_lines(tmp_path):
    w = make_wheel(tmp_path / "in", "fakevllm", {"fakevllm/__init__.py": b"X = 1\n",
                                                 "fakevllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 64,
                                                 "fakevllm/_C.cpython-313-x86_64-linux-gnu.so": b"\0" * 8})
    out = tmp_path / "out" / w.name
    out.parent.mkdir()
    dropped = wh.drop_members(w, [r"_vllm_fa2_C\.abi3\.so$", r"\.cpython-3(?!12-)\d+-x86_64-linux-gnu\.so$"], out)
    assert sorted(dropped) == ["fakevllm/_C.cpython-313-x86_64-linux-gnu.so",
                               "fakevllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        record = z.read("fakevllm-1.0.dist-info/RECORD").decode()
    assert "fakevllm/__init__.py" in names and not any(n.endswith(".so") for n in names)
    assert ".so" not in record and "fakevllm/__init__.py," in record
    target = tmp_path / "site"  # pip accepts the pruned wheel (RECORD consistent with its files)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(out)], check=True)
    assert (target / "fakevllm" / "__init__.py").read_text() == "X = 1\n"


def test_torch_pin_and_version_choice(tmp_path):
    w = make_wheel(tmp_path, "vllm", {"vllm/__init__.py": b""}, ["torch==2.11.0", "torchaudio==2.11.0",
                                                                 "numpy; extra == 'x'"])
    assert wh.torch_pin(w) == "2.11.0"
    assert wh.vllm_version("2.11.0+cu130", None) == "0.26.0"
    assert wh.vllm_version("2.99.0", "1.0.0") == "1.0.0"
    with pytest.raises(wh.WheelhouseError, match="no vLLM release known for torch 2.99.0.*--vllm"):
        wh.vllm_version("2.99.0", None)
    with pytest.raises(wh.WheelhouseError, match="byte count"):
        wh.parse_size("55 MB")
    assert wh.parse_size("55m") == 55 << 20


def _house(tmp_path) -> Path:
    house = tmp_path / "house"
    make_wheel(house / "wheels", "rl4bitwhtesta", {"rl4bitwhtesta/__init__.py": b"A = 1\n"})
    make_wheel(house / "fallback", "rl4bitwhtestb", {"rl4bitwhtestb/__init__.py": b"B = 2\n"})  # the node lacks it
    make_wheel(house / "fallback", "pytest", {"pytest_fake_marker.py": b""})  # the node has pytest: skipped
    wh.write_sums(house)
    wh.write_install(house)
    return house


def test_install_sh_installs_wheels_and_only_missing_fallbacks(tmp_path):
    house = _house(tmp_path)
    target = tmp_path / "site"
    r = subprocess.run(["bash", str(house / "install.sh"), str(target)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr
    assert (target / "rl4bitwhtesta").is_dir() and (target / "rl4bitwhtestb").is_dir()
    assert not (target / "pytest_fake_marker.py").exists()
    env = (target / "vllm_env.sh").read_text()
    assert f'PYTHONPATH="{target}' in env and "VLLM_USE_FLASHINFER_SAMPLER=0" in env


def test_install_sh_refuses_a_damaged_wheel(tmp_path):
    house = _house(tmp_path)
    w = next((house / "wheels").glob("*.whl"))
    w.write_bytes(w.read_bytes() + b"x")
    target = tmp_path / "site"
    r = subprocess.run(["bash", str(house / "install.sh"), str(target)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert r.returncode != 0 and "checksum mismatch" in r.stderr
    assert not target.exists()


def test_split_parts_reassemble_to_the_checksummed_tar(tmp_path):
    house = _house(tmp_path)
    parts = wh.split(house, 1500)
    assert len(parts) > 1 and all(p.stat().st_size == 1500 for p in parts[:-1])
    whole = b"".join(p.read_bytes() for p in parts)
    digest, name = (tmp_path / "house.tar.sha256").read_text().split()
    assert name == "house.tar" and hashlib.sha256(whole).hexdigest() == digest
