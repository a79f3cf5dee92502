"""boo-driver: command parsing, a real measurement, CSV output and malformed commands."""

import csv
import dataclasses
import subprocess
import sys

import pytest

from boo_backend import driver
from boo_backend.cache import CompileCache
from boo_backend.compile import compile_mlir, parse_target
from boo_backend.config import BooError


def test_parse_flags_and_backends():
    cmd = driver.parse_command("layer_norm -X 64x32 -t bf16 -F 14 --backend eager,boo --iter 3 --warmup 1")
    assert (cmd.family, cmd.shape, cmd.dtype, cmd.flags, cmd.backends, cmd.iters) == (
        "layer_norm", (64, 32), "bf16", 14, ["eager", "boo"], 3)


@pytest.mark.parametrize("text,message", [
    ("layer_nrom -X 8x8", "valid ops are"),
    ("gelu -F 4", "does not fit gelu"),
    ("gelu -X 8by8", "not like 8192x1024"),
    ("gelu -t f64", "use one of"),
    ("gelu --backend eager,tvm", "unknown backend"),
    ("gelu --bogus", "unrecognized arguments"),
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
    assert "median ms" in proc.stdout and "vs eager" in proc.stdout  # the final table


def test_optional_flags_are_dropped_when_the_compiler_rejects_them(tmp_path):
    target = dataclasses.replace(parse_target("llvm-cpu"), optional_flags=("--no-such-iree-flag",))
    text = (
        "func.func @main(%a: !torch.vtensor<[4],f32>) -> !torch.vtensor<[4],f32> {\n"
        "  %0 = torch.aten.neg %a : !torch.vtensor<[4],f32> -> !torch.vtensor<[4],f32>\n"
        "  return %0 : !torch.vtensor<[4],f32>\n}\n"
    )
    assert compile_mlir(text, target, CompileCache(tmp_path, enabled=False))
