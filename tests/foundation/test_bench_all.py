"""`rl4bit bench all` / `bench step` on the CPU: the sections run, the summary states each figure beside its baseline,
and a section that cannot run is reported without stopping the others."""

import json

import pytest

from rl4bit.bench import all as bench_all
from rl4bit.cli import main


def test_bench_all_runs_sections_and_reports_missing_ones(tmp_path, capsys, monkeypatch):
    # a section whose module is missing here (as `sync` is without Ray) is reported, the others run
    monkeypatch.setattr(bench_all, "SECTIONS", (*bench_all.SECTIONS, "nonexistent"))
    res = bench_all.run(device="cpu", quick=True, out=str(tmp_path), sections=("step", "nonexistent"))
    assert res["sections"]["step"]["ok"]
    assert not res["sections"]["nonexistent"]["ok"]
    figures = {row[0]: row for row in res["summary"]}
    step = figures["RL step step s (nvfp4)"]
    assert step[4] == ">= 1.3" and step[3] > 0
    for phase in ("sample", "score", "train", "sync"):
        assert f"RL step {phase} s (nvfp4)" in figures
    assert figures["[nonexistent]"][1] == "not run"
    saved = json.loads((tmp_path / "bench_all.json").read_text())
    assert saved["sections"]["step"]["result"]["rows"][0]["recipe"] == "nvfp4"
    out = capsys.readouterr().out
    assert "rl4bit bench all" in out and "bf16/nvfp4" in out and "is temporary" not in out
    for recipe in ("nvfp4", "bf16"):  # --out keeps each job's run dir, where its printed "run dir:" line points
        kept = list((tmp_path / "step" / "runs").glob(f"{recipe}-*/metrics.jsonl"))
        assert len(kept) == 1 and kept[0].read_text().strip(), recipe
        assert f"run dir: {kept[0].parent}" in out, recipe


def test_bench_cli_rejects_arguments_a_bench_does_not_take(capsys):
    assert main(["bench", "kernels", "some.yaml", "--device", "cpu", "--quick"]) == 2
    assert "takes no config" in capsys.readouterr().err
    assert main(["bench", "rollout", "--decode", "--device", "cpu", "--quick"]) == 2
    assert "takes no decode argument (only `bench gemm --decode`)" in capsys.readouterr().err


def test_bench_gemm_decode_flag_reaches_the_bench(monkeypatch):
    import rl4bit.bench.gemm as bg

    seen = {}

    def run(device="cuda", quick=False, out=None, decode_only=False):  # bench_gemm.run's signature, timing nothing
        seen.update(device=device, decode_only=decode_only)

    monkeypatch.setattr(bg, "run", run)
    assert main(["bench", "gemm", "--decode", "--device", "cpu"]) == 0
    assert seen["decode_only"] is True and seen["device"] == "cpu"


def test_bench_all_rejects_unknown_sections():
    with pytest.raises(ValueError, match="unknown section.*'stp'.*choose from"):
        bench_all.run(device="cpu", quick=True, sections="stp,rollout")


def test_bench_cli_names_a_bad_batches_list(capsys):
    assert main(["bench", "rollout", "--batches", "1,x", "--device", "cpu", "--quick"]) == 2
    assert "--batches '1,x'" in capsys.readouterr().err


def test_bench_all_summarizes_the_gemm_section(tmp_path):
    """`bench_gemm.run` returns its rows as a list: each becomes a summary row beside its baseline, and the CPU's
    reference-path rows carry no GPU target and name no cuBLAS baseline."""
    res = bench_all.run(device="cpu", quick=True, out=str(tmp_path), sections=("gemm",))
    assert res["sections"]["gemm"]["ok"]
    rows = [r for r in res["summary"] if r[0].startswith("gemm ")]
    assert len(rows) == len(res["sections"]["gemm"]["result"]) > 0
    decode = [r for r in rows if r[0].startswith("gemm decode nvfp4")]
    assert decode and all("HBM floor" in r[2] and r[4] is None and r[3] > 0 for r in decode)
    assert not any("cuBLAS" in r[2] for r in rows)
    assert json.loads((tmp_path / "bench_all.json").read_text())["summary"]


def test_gemm_summary_rows_of_a_gpu_run_carry_the_targets():
    gpu = dict(case="decode nvfp4", device="cuda", shape="dense M=1 K=4096 N=14336", us=21.0, us_with_quantize=23.0,
               baseline="cuBLAS bf16 F.linear", baseline_us=42.2, speedup=42.2 / 21.0, floor_us=13.7,
               of_hbm=13.7 / 21.0)
    train = dict(case="nvfp4 fwd", shape="gate_up: 256 rows", us=10.0, baseline="bf16 torch.bmm (fwd)", baseline_us=5.0,
                 speedup=0.5)
    assert bench_all._rows_gemm([gpu, train]) == [
        ("gemm decode nvfp4 dense M=1 K=4096 N=14336", "21.0 µs",
         "cuBLAS bf16 F.linear 42.2 µs; HBM floor 13.7 µs (65%)", 42.2 / 21.0, ">= 3.5x, >= 85% HBM"),
        ("gemm nvfp4 fwd gate_up: 256 rows", "10.0 µs", "bf16 torch.bmm (fwd) 5.0 µs", 0.5, None)]


def test_bench_all_reports_a_summary_that_cannot_be_built(tmp_path, monkeypatch):
    """A section whose summary raises is one 'no summary' row; the table and the JSON still come out."""
    monkeypatch.setattr(bench_all, "_call", lambda *a, **k: {"ok": True, "seconds": 0.0, "result": {"rows": []}})
    monkeypatch.setitem(bench_all.SUMMARY, "step", lambda res: res["no such field"])
    res = bench_all.run(device="cpu", quick=True, out=str(tmp_path), sections=("step",))
    assert ("[step]", "no summary", "KeyError: 'no such field'", None, None) in [tuple(r) for r in res["summary"]]
    assert (tmp_path / "bench_all.json").is_file()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("what", ["rollout", "sync", "train", "comm", "step"])
def test_bench_cli_refuses_cuda_where_there_is_none(what, capsys):
    """`--device cuda` on a CPU-only machine: one line naming the fix, before any bench builds a model."""
    assert main(["bench", what, "--device", "cuda", "--quick"]) == 2
    assert "--device cuda: CUDA is not available here" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cpu:0"])
def test_bench_cli_refuses_a_device_name_it_does_not_know(device, capsys):
    assert main(["bench", "rollout", "--device", device, "--quick"]) == 2
    assert f"--device {device!r}: choose cpu, cuda, cuda:N or auto" in capsys.readouterr().err
