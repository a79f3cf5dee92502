"""boo-driver: command parsing, a real measurement, CSV output and malformed commands."""

import csv
import dataclasses
import subprocess
import sys

import pytest
import torch

from boo_backend import benchmarking, driver
from boo_backend.cache import CompileCache
from boo_backend.compile import compile_mlir, parse_target
from boo_backend.config import BooError


def test_parse_flags_and_backends():
    cmd = driver.parse_command("layer_norm -X 64x32 -t bf16 -F 14 --backend eager,boo --iter 3 --warmup 1")
    assert (cmd.family, cmd.shape, cmd.dtype, cmd.flags, cmd.backends, cmd.iters, cmd.runs) == (
        "layer_norm", (64, 32), "bf16", 14, ["eager", "boo"], 3, 3)
    assert driver.parse_command("gelu --runs 5 --iter 20").runs == 5
    default = driver.parse_command("gelu")
    assert default.iters >= 20 and default.runs >= 3  # the minimum: 20 steps x 3 runs


def test_interleaved_rotates_the_order_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = benchmarking.interleaved(fns, steps=2, runs=2)
    assert calls == list("abc" "bca" "cab" "abc")
    assert {n: [len(run) for run in t] for n, t in times.items()} == {n: [2, 2] for n in "abc"}


def test_summary_is_min_median_of_run_medians_and_median_per_run_ratio():
    eager = [[10, 12, 11], [20, 22, 21], [10, 10, 10]]
    boo = [[5, 6, 7], [20, 30, 40], [4, 5, 6]]
    s = benchmarking.summarize(boo, eager)
    assert (s["min_ms"], s["median_ms"], s["run_medians_ms"]) == (4, 6, "6/30/5")
    assert s["run_spread_pct"] == pytest.approx(100 * (30 - 5) / 6)
    assert s["speedup_vs_eager"] == pytest.approx(11 / 6)  # per run: 11/6, 21/30, 10/5
    assert s["speedup_runs"] == "1.83/0.7/2"


def test_host_info_names_the_machine_and_versions():
    info = benchmarking.host_info()
    assert list(info) == benchmarking.HOST_COLUMNS
    assert info["cpu"] and info["cpu_count"] >= 1 and info["torch_threads"] >= 1
    assert info["torch_version"] == torch.__version__ and info["iree_runtime_version"] != "not installed"
    line = benchmarking.host_line(info)
    assert line.startswith("host: ") and info["cpu"] in line and "torch-mlir" in line


@pytest.mark.parametrize("text,message", [
    ("layer_nrom -X 8x8", "valid ops are"),
    ("gelu -F 4", "does not fit gelu"),
    ("gelu -X 8by8", "not like 8192x1024"),
    ("gelu -t f64", "use one of"),
    ("gelu --backend eager,tvm", "unknown backend"),
    ("gelu --bogus", "unrecognized arguments"),
    ("gelu --runs 0", "at least 1"),
])
def test_malformed_commands_are_clear_errors(text, message):
    with pytest.raises(BooError, match=message):
        driver.parse_command(text)


def test_commands_file_keeps_results_and_fails_on_bad_line(tmp_path):
    cmds = tmp_path / "cmds.txt"
    cmds.write_text("# two good commands and a bad one\n"
                    "gelu -X 16x16 -F 3 --backend eager,boo --iter 2 --warmup 1\n"
                    "gelu -X 16x16 -F 9\n"
                    "layer_norm -X 8x16 -F 15 --backend eager,boo-decomposed --iter 2 --warmup 1\n")
    out_csv = tmp_path / "r.csv"
    proc = subprocess.run([sys.executable, "-m", "boo_backend.driver", "--commands-file", str(cmds),
                           "--csv", str(out_csv)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "does not fit gelu" in proc.stderr
    rows = list(csv.DictReader(out_csv.open()))
    assert [(r["op"], r["backend"]) for r in rows] == [
        ("gelu", "eager"), ("gelu", "boo"), ("gelu_backward", "eager"), ("gelu_backward", "boo"),
        ("native_layer_norm", "eager"), ("native_layer_norm", "boo-decomposed"),
        ("native_layer_norm_backward", "eager"), ("native_layer_norm_backward", "boo-decomposed"),
    ]
    assert all(r["numerics"] == "ok" for r in rows), rows
    assert set(rows[0]) == set(driver.CSV_COLUMNS)
    host = benchmarking.host_info()
    for r in rows:  # every row says where it ran, and the min and the runs' medians
        assert {k: r[k] for k in ("cpu", "torch_version", "iree_compiler_version")} == {
            k: str(host[k]) for k in ("cpu", "torch_version", "iree_compiler_version")}
        assert float(r["min_ms"]) <= float(r["median_ms"]) and len(r["run_medians_ms"].split("/")) == 3
        assert r["speedup_vs_eager"] != ""  # eager's times come from the same interleaved runs
    assert "median ms" in proc.stdout and "vs eager" in proc.stdout  # the final table
    assert benchmarking.host_line(host) in proc.stdout


def test_optional_flags_are_dropped_when_the_compiler_rejects_them(tmp_path):
    target = dataclasses.replace(parse_target("llvm-cpu"), optional_flags=("--no-such-iree-flag",))
    text = (
        "func.func @main(%a: !torch.vtensor<[4],f32>) -> !torch.vtensor<[4],f32> {\n"
        "  %0 = torch.aten.neg %a : !torch.vtensor<[4],f32> -> !torch.vtensor<[4],f32>\n"
        "  return %0 : !torch.vtensor<[4],f32>\n}\n"
    )
    assert compile_mlir(text, target, CompileCache(tmp_path, enabled=False))


def test_a_backend_that_cannot_run_the_op_is_a_row_not_a_crash(monkeypatch):
    """On a GPU, eager cannot run an op with a CPU kernel only (the CPU flash attention): that
    backend gets an ERROR row, the others are timed, and the reference is computed on the CPU."""
    real = driver._callable

    def callable_(backend, op, args, kwargs):
        if backend == "eager":
            def fails(*tensors):
                raise NotImplementedError("Could not run 'aten::op' with arguments from the 'CUDA' backend.")
            return fails
        return real(backend, op, args, kwargs)

    monkeypatch.setattr(driver, "_callable", callable_)
    cmd = driver.parse_command("layer_norm -X 64x32 -F 1 --backend eager,boo --iter 2 --runs 1 --warmup 1")
    rows = driver.measure(cmd, torch.device("cpu"))
    by_backend = {r["backend"]: r for r in rows}
    assert by_backend["eager"]["numerics"].startswith("ERROR: Could not run 'aten::op'")
    assert by_backend["eager"]["median_ms"] == ""
    assert by_backend["boo"]["numerics"] == "ok" and by_backend["boo"]["median_ms"] > 0
    assert by_backend["boo"]["speedup_vs_eager"] == ""
