"""``benchmarks/gpu_layer.py`` (issue 40): without a GPU it says so and writes nothing; its CPU smoke run
(``--allow-cpu``) exercises every code path and writes a well-formed record; the verdict function separates a lab
layer at 0.5 of the grouped row's speed from one at 0.83; on a CUDA machine the tiny preset runs for real.
Chapter 08's loader returns None for a record nobody made."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from script_loader import load_script

from labbook import records

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_layer.py"
ROW_KEYS = {"median_ms", "spread_ms", "times_ms", "peak_mib", "tflops"}
ENTRY_KEYS = {"shape", "dtype", "flops_per_step", "lab_layer", "rows", "skipped", "parity", "grouped_ms", "lab_ms",
              "lab_over_grouped", "verdict"}


def _module():
    return load_script(SCRIPT, "gpu_layer_bench")


def _run(*args, hide_gpu=False, timeout=120):
    env = dict(os.environ)
    if hide_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # so the no-GPU path runs on a GPU machine too
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def _check_record(rec: dict, device: str, dtypes: set) -> None:
    mod_rows = ("dense, same FLOPs", "grouped GEMM, pre-grouped (limit)", "lab FMoETransformerMLP",
                "ModernMoE grouped (no biases)")
    assert rec["benchmark"] == "gpu_layer" and rec["device"].startswith(device)
    assert {"torch", "cuda", "fastmoe"} <= set(rec["versions"]) and rec["versions"]["torch"] == torch.__version__
    assert rec["timing"]["rounds"] >= 1 and isinstance(rec["code"], dict)
    assert {e["dtype"] for e in rec["results"]} == dtypes and len(rec["results"]) == 2 * len(dtypes)
    for e in rec["results"]:
        assert ENTRY_KEYS <= set(e), ENTRY_KEYS - set(e)
        for name in mod_rows:
            assert name in e["rows"], (name, e["skipped"])
        for name, row in e["rows"].items():
            assert ROW_KEYS <= set(row), (name, ROW_KEYS - set(row))
            assert len(row["times_ms"]) == rec["timing"]["rounds"]
            assert all(math.isfinite(t) and t > 0 for t in row["times_ms"]), (name, row["times_ms"])
            lo, hi = row["spread_ms"]
            assert 0 < lo <= row["median_ms"] <= hi and math.isfinite(row["peak_mib"]) and row["peak_mib"] >= 0
        v = e["verdict"]
        assert v["speed"] == pytest.approx(e["grouped_ms"] / e["lab_ms"]) and v["met"] == (v["speed"] >= 0.8)
        assert e["lab_over_grouped"] == pytest.approx(1 / v["speed"])
        if not rec["versions"]["fastmoe"]["available"]:
            assert e["parity"]["max_abs_diff"] is None and "fastmoe not importable" in e["parity"]["why"]
            assert "real fastmoe" in e["skipped"] and "real fastmoe" not in e["rows"]
        elif device == "cuda" and "real fastmoe" in e["rows"]:
            assert math.isfinite(e["parity"]["max_abs_diff"])
    assert rec["summary"]["met"] + rec["summary"]["NOT met"] == len(rec["results"])


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "gpu.json"
    proc = _run("--out", str(out), hide_gpu=True)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"no CUDA GPU visible (torch {torch.__version__}, cuda available: "
                                                   "False): nothing to measure; the record ")
    assert lines[0].endswith(f"{out} is left as is") and not out.exists() and not list(tmp_path.iterdir())
    default = records.path("gpu_layer.json")
    before = default.stat().st_mtime_ns if default.exists() else None
    proc = _run(hide_gpu=True)
    assert proc.returncode == 0 and "the record benchmarks/results/gpu_layer.json is left as is" in proc.stdout
    assert (default.stat().st_mtime_ns if default.exists() else None) == before


def test_the_cpu_needs_allow_cpu():
    proc = _run("--device", "cpu", "--preset", "tiny")
    assert proc.returncode == 2 and "--allow-cpu" in proc.stderr


def test_cpu_smoke_run_writes_a_well_formed_record(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run("--allow-cpu", "--device", "cpu", "--preset", "tiny", "--rounds", "2", "--warmup", "1",
                "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the CPU smoke run times fp32 only" in proc.stdout and f"wrote {out}" in proc.stdout
    rec = json.loads(out.read_text())
    assert rec["smoke"] is True and rec["timing"]["clock"].startswith("time.perf_counter") and rec["gpu"] is None
    _check_record(rec, "cpu", {"fp32"})
    assert all(e["lab_layer"]["backend_argument"] in ("auto", None) for e in rec["results"])


def test_verdict_negative_control():
    verdict = _module().verdict
    slow = verdict(grouped_ms=1.0, lab_ms=2.0)
    assert slow["met"] is False and slow["verdict"] == "NOT met" and slow["speed"] == pytest.approx(0.5)
    assert slow["lab_over_grouped"] == pytest.approx(2.0)
    close = verdict(grouped_ms=1.0, lab_ms=1.2)
    assert close["met"] is True and close["verdict"] == "met" and close["speed"] == pytest.approx(1 / 1.2)
    assert verdict(1.0, 1.25)["met"] is True and verdict(1.0, 1.26)["met"] is False  # the 0.8 edge
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lab_ms"):
            verdict(1.0, bad)


def test_records_load_optional_returns_none_when_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RESULTS", tmp_path)
    assert records.load_optional("gpu_layer.json") is None
    (tmp_path / "gpu_layer.json").write_text(json.dumps({"benchmark": "gpu_layer"}))
    assert records.load_optional("gpu_layer.json") == {"benchmark": "gpu_layer"}
    with pytest.raises(ValueError, match="file name"):
        records.load_optional("../gpu_layer.json")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_layer.py measures one)")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
                    reason="torch._grouped_mm (the limit row) needs an sm90+ GPU")
def test_tiny_preset_on_cuda(tmp_path):
    out = tmp_path / "tiny.json"
    proc = _run("--preset", "tiny", "--rounds", "3", "--warmup", "2", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["smoke"] is False and rec["timing"]["clock"] == "CUDA events" and rec["gpu"]
    _check_record(rec, "cuda", {"bf16", "fp32"})
