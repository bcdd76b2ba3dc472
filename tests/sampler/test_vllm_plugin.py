"""The vLLM plugin's AMX tile permission request, on whatever host runs the tests (no vLLM needed).

On a host with AMX the request must be granted and visible through ARCH_GET_XCOMP_PERM, in a fresh process
(the permission is per process: why the plugin asks in every process vLLM starts); without AMX it must do
nothing and say so. The registration of the NVFP4 kernel itself is tested where vLLM is installed (tests/vllm:
an NVFP4 export loads and serves on the CPU platform). The AMX branch has not run on this project's machines
(no AMX)."""

from __future__ import annotations

import platform
import subprocess
import sys

from rl4bit.sampler import vllm_plugin


def test_amx_detection_reads_the_cpu_flags():
    if sys.platform == "linux" and platform.machine() == "x86_64":
        with open("/proc/cpuinfo") as f:
            assert vllm_plugin.cpu_has_amx() == ("amx_tile" in f.read().split())
    else:
        assert not vllm_plugin.cpu_has_amx()


def test_amx_request_in_a_fresh_process():
    code = "from rl4bit.sampler import vllm_plugin as p; print(p.request_amx_tiles(), p.amx_tiles_permitted())"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True).stdout
    has = str(vllm_plugin.cpu_has_amx())
    assert out.split() == [has, has]
