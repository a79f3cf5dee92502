"""scripts/gpu_check.sh without a device: it parses, its quick mode runs in seconds with this
interpreter (no venv, no install) and says the device checks did not run, and its summary
(bench/gpu_summary.py) reads boo-driver's CSV, pytest's JUnit XML and the zoo step."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from boo_backend.driver import CSV_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SUMMARY = ROOT / "bench" / "gpu_summary.py"


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "set -euo pipefail" in SCRIPT.read_text()


def test_quick_mode_runs_without_a_device(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), BOO_GPU_CHECK_PYTHON=sys.executable)
    venv_before = (ROOT / ".venv-gpu").exists()
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-only"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    expected = "no GPU: device checks not run" if not _has_gpu() else "--cpu-only: device checks not run"
    assert last.endswith(expected), proc.stdout
    assert "no venv, no install" in proc.stdout and (ROOT / ".venv-gpu").exists() == venv_before
    info = json.loads((tmp_path / "env.json").read_text())
    assert info["torch"] and info["target"] == ("no GPU" if not info["gpu"] else info["target"])
    summary = (tmp_path / "summary.txt").read_text()
    assert "verdict: device checks not run" in summary and "tests (pytest -m gpu): 0 passed, 0 failed" in summary
    stages = list(csv.DictReader((tmp_path / "stages.tsv").open(), delimiter="\t"))
    assert [(s["stage"], s["rc"]) for s in stages] == [("setup", "0"), ("env", "0"), ("pytest_gpu", "0")]


def _has_gpu():
    import torch

    return torch.cuda.is_available()


def _driver_row(op, backend, median_ms, gb_per_s, copy_pct, speedup, numerics="ok"):
    row = dict.fromkeys(CSV_COLUMNS, "")
    return row | {"op": op, "shape": "32768x4096", "dtype": "bf16", "flags": 15, "backend": backend,
                  "median_ms": median_ms, "gb_per_s": gb_per_s, "copy_pct": copy_pct,
                  "speedup_vs_eager": speedup, "numerics": numerics}


def _results(tmp_path, device, boo_gbps, zoo_err=2e-6, failed_test=False):
    """A results directory as a GPU run leaves it: one driver CSV, the tests, the zoo step."""
    with (tmp_path / "driver_1.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        w.writerow(_driver_row("native_layer_norm", "eager", 0.2, 2400.0, 60.0, 1.0))
        w.writerow(_driver_row("native_layer_norm", "boo", 0.1, boo_gbps, 100 * boo_gbps / 4000, 2.0))
        w.writerow(_driver_row("_scaled_dot_product_flash_attention_for_cpu", "boo", 1.0, 100.0, 2.5, 1.1))
    failure = '<failure message="boom"/>' if failed_test else ""
    (tmp_path / "pytest_gpu.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu_run" name="test_a"/>'
        f'<testcase classname="tests.test_gpu_run" name="test_b">{failure}</testcase>'
        '<testcase classname="tests.test_gpu_run" name="test_c"><skipped message="no transformers"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "zoo.json").write_text(json.dumps({
        "model": "gpt2", "device": device, "eager_ms": 6.0, "boo_ms": 3.0, "speedup_vs_eager": 2.0,
        "max_rel_err": zoo_err, "islands": 0}))
    (tmp_path / "env.json").write_text(json.dumps({"device": device, "target": "cuda:sm_89", "torch": "2.13.0",
                                                   "cuda": "12.8", "hip": None, "gpu": True}))
    (tmp_path / "stages.tsv").write_text("stage\trc\tseconds\tlog\nenv\t0\t3\tenv.log\ndriver_1\t0\t40\tdriver_1.log\n")


def _summary(tmp_path):
    proc = subprocess.run([sys.executable, str(SUMMARY), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (tmp_path / "summary.txt").read_text().strip() == proc.stdout.strip()
    return proc


def _cells(text, op, backend):
    (line,) = [ln for ln in text.splitlines() if ln.startswith(op + " ") and f" {backend} " in ln]
    return line.split()


def test_summary_meets_the_targets_on_an_h200(tmp_path):
    _results(tmp_path, "NVIDIA H200", boo_gbps=3600.0)
    proc = _summary(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "nominal HBM 4.8 TB/s" in out
    # op shape dtype backend median GB/s %HBM copyGB/s vs-eager check verdict
    assert _cells(out, "native_layer_norm", "boo")[4:] == ["0.1", "3600.0", "75", "4000", "2.0", "ok", "ok"]
    assert _cells(out, "native_layer_norm", "eager")[-1] == "-"  # only boo's rows are judged
    assert _cells(out, "_scaled_dot_product_flash_attention_for_cpu", "boo")[-2:] == ["n/a", "(compute-bound)"]
    assert "tests (pytest -m gpu): 2 passed, 0 failed, 1 skipped -> ok" in out
    assert "skipped x1: no transformers" in out
    assert "boo matches eager" in out and "verdict: issue 12 targets met" in out


def test_summary_marks_what_misses(tmp_path):
    _results(tmp_path, "NVIDIA H200", boo_gbps=2000.0, zoo_err=0.5, failed_test=True)
    proc = _summary(tmp_path)
    assert proc.returncode == 1
    out = proc.stdout
    assert _cells(out, "native_layer_norm", "boo")[6:8] == ["42", "4000"] and "below 60%" in out
    assert "FAILED tests.test_gpu_run::test_b" in out and "NOT matching" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("verdict: NOT met") and "1 boo driver rows" in verdict and "gpu tests" in verdict


@pytest.mark.parametrize("device,peak", [("NVIDIA H100 80GB HBM3", "3.35"), ("NVIDIA A100-SXM4-80GB", "2.04"),
                                         ("NVIDIA A100-SXM4-40GB", "1.56"), ("AMD Instinct MI300X", "5.3")])
def test_summary_knows_nominal_peaks(tmp_path, device, peak):
    _results(tmp_path, device, boo_gbps=1000.0)
    assert f"nominal HBM {peak} TB/s" in _summary(tmp_path).stdout


def test_summary_without_a_known_peak_judges_against_the_copy(tmp_path):
    _results(tmp_path, "NVIDIA GeForce RTX 4090", boo_gbps=3000.0)  # 75% of the 4000 GB/s copy
    proc = _summary(tmp_path)
    assert "HBM peak unknown" in proc.stdout and proc.returncode == 0, proc.stdout
    assert _cells(proc.stdout, "native_layer_norm", "boo")[6] == "unknown"
