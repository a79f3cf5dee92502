"""The one summary table of scripts/gpu_check.sh, built from whatever the run left in its
results directory:

    python bench/gpu_summary.py RESULTS_DIR [--no-device]

- `stages.tsv`: every stage the script ran (name, exit status, seconds, log file);
- `env.json`: the device and boo's IREE target for it (bench/gpu_probe.py env);
- `pytest_gpu.xml`: JUnit XML of `pytest -m gpu`;
- `zoo.json`: a zoo training step, eager against boo (bench/gpu_probe.py zoo);
- `driver_*.csv`: boo-driver's rows (boo_backend.driver.CSV_COLUMNS).

Issue 12's targets, marked per row: a bandwidth-bound composite run by boo reaches 60% of the
device's nominal HBM bandwidth (of the measured copy bandwidth where the device is not in
HBM_TB_PER_S), and boo's zoo step matches eager's. Prints the table (also to summary.txt)
and exits 1 when a stage failed, a test failed or a target was missed, 0 otherwise;
`--no-device`: the device checks were not run, so only a failed stage exits non-zero.
Needs only the standard library (no torch).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Nominal HBM bandwidth in TB/s: the first entry whose words all appear in the device name.
HBM_TB_PER_S = [
    (("H200",), 4.8),
    (("H100", "HBM3"), 3.35),  # SXM: "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 3.35),
    (("A100", "80GB"), 2.04),
    (("A100",), 1.56),  # 40GB
    (("MI300X",), 5.3),
    (("MI250X",), 3.2),
    (("L40S",), 0.864),
]
HBM_TARGET_PCT = 60.0
# Families whose time is compute, not memory traffic: no bandwidth target.
COMPUTE_BOUND = ("_scaled_dot_product",)
ZOO_REL_ERR = 1e-4  # as tests/test_zoo.py: the largest error within 1e-4 of the largest value


def hbm_tb_per_s(device: str) -> float | None:
    for words, peak in HBM_TB_PER_S:
        if all(w.lower() in device.lower() for w in words):
            return peak
    return None


def _table(heads: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Aligned columns: the first `left` left-aligned, the others right-aligned."""
    cells = [heads] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(heads))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _float(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def stages(results: Path) -> tuple[list[str], list[str]]:
    """Lines of the stage table and the names of stages that failed."""
    path = results / "stages.tsv"
    if not path.exists():
        return ["stages: none recorded"], []
    rows = list(csv.DictReader(path.open(), delimiter="\t"))
    failed = [r["stage"] for r in rows if r["rc"] not in ("0", "skipped")]
    cells = [[r["stage"], "ok" if r["rc"] == "0" else r["rc"] if r["rc"] == "skipped" else f"FAILED (rc {r['rc']})",
              r["seconds"], r["log"]] for r in rows]
    return [_table(["stage", "result", "s", "log"], cells)], failed


def tests(results: Path) -> tuple[list[str], bool]:
    """Counts from pytest's JUnit XML, the failed tests and the skip reasons; ok or not."""
    path = results / "pytest_gpu.xml"
    if not path.exists():
        return ["tests: not run (no pytest_gpu.xml)"], False
    cases = list(ET.parse(path).getroot().iter("testcase"))
    outcome = {"passed": [], "failed": [], "skipped": []}
    reasons: dict[str, int] = {}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"].append(name)
        elif (skip := case.find("skipped")) is not None:
            outcome["skipped"].append(name)
            reason = skip.get("message", "")
            reasons[reason] = reasons.get(reason, 0) + 1
        else:
            outcome["passed"].append(name)
    ok = bool(outcome["passed"]) and not outcome["failed"]
    verdict = "ok" if ok else "NOT ok" if outcome["failed"] else "none ran"
    lines = [f"tests (pytest -m gpu): {len(outcome['passed'])} passed, {len(outcome['failed'])} failed, "
             f"{len(outcome['skipped'])} skipped -> {verdict}"]
    lines += [f"  FAILED {n}" for n in outcome["failed"][:20]]
    if len(outcome["failed"]) > 20:
        lines.append(f"  ... and {len(outcome['failed']) - 20} more (see pytest_gpu.log)")
    lines += [f"  skipped x{n}: {r}" for r, n in sorted(reasons.items())]
    return lines, ok


def zoo(results: Path) -> tuple[list[str], bool]:
    path = results / "zoo.json"
    if not path.exists():
        return ["zoo step: not run (no zoo.json)"], False
    z = json.loads(path.read_text())
    ok = z["max_rel_err"] <= ZOO_REL_ERR and not z.get("islands")
    verdict = "boo matches eager" if ok else (
        f"NOT matching: eager islands {z['islands']}" if z.get("islands") else f"NOT matching (> {ZOO_REL_ERR:g})")
    cells = [[z["model"], z["device"], f"{z['eager_ms']:.3f}", f"{z['boo_ms']:.3f}", f"{z['speedup_vs_eager']:.2f}",
              f"{z['max_rel_err']:.1e}", verdict]]
    return [_table(["zoo step", "device", "eager ms", "boo ms", "boo x", "max rel err", "verdict"], cells, 2)], ok


def driver_rows(results: Path) -> list[dict]:
    rows = []
    for path in sorted(results.glob("driver_*.csv")):
        rows += list(csv.DictReader(path.open()))
    return rows


def driver(rows: list[dict], device: str) -> tuple[list[str], int]:
    """The driver table and how many boo rows missed a target (or computed wrong values);
    no rows at all count as one miss."""
    if not rows:
        return ["driver: no rows (no driver_*.csv)"], 1
    peak = hbm_tb_per_s(device)
    missed, cells = 0, []
    for r in rows:
        gbps, copy_pct = _float(r["gb_per_s"]), _float(r["copy_pct"])
        copy = gbps / copy_pct * 100 if gbps and copy_pct else None
        hbm = 100 * gbps / (peak * 1000) if gbps is not None and peak else None
        of_peak = hbm if peak else copy_pct  # what the target is judged against
        verdict = "-"
        if r["backend"] == "boo":
            if r["numerics"] != "ok":
                verdict = "WRONG values"
            elif r["op"].startswith(COMPUTE_BOUND):
                verdict = "n/a (compute-bound)"
            elif of_peak is None:
                verdict = "no figure"
            else:
                verdict = "ok" if of_peak >= HBM_TARGET_PCT else f"below {HBM_TARGET_PCT:g}%"
            missed += verdict not in ("ok", "n/a (compute-bound)")
        cells.append([r["op"], r["shape"], r["dtype"], r["backend"], r["median_ms"], r["gb_per_s"],
                      "unknown" if hbm is None else f"{hbm:.0f}", "-" if copy is None else f"{copy:.4g}",
                      r["speedup_vs_eager"] or "-", r["numerics"], verdict])
    basis = (f"{device}: nominal HBM {peak:g} TB/s" if peak else
             f"{device or 'device'}: HBM peak unknown, so the {HBM_TARGET_PCT:g}% target is judged against the measured copy")
    heads = ["op", "shape", "dtype", "backend", "median ms", "GB/s", "% HBM", "copy GB/s", "vs eager", "check", "verdict"]
    return [basis, _table(heads, cells, 4)], missed


def summarize(results: Path, no_device: bool = False) -> tuple[str, int]:
    env = json.loads((results / "env.json").read_text()) if (results / "env.json").exists() else {}
    device = env.get("device", "none")
    out = [f"device: {device}; target: {env.get('target', '?')}; torch {env.get('torch', '?')}, "
           f"CUDA {env.get('cuda') or '-'}, ROCm {env.get('hip') or '-'}"]
    stage_lines, failed = stages(results)
    test_lines, tests_ok = tests(results)
    zoo_lines, zoo_ok = zoo(results)
    driver_lines, missed = driver(driver_rows(results), device)
    out += ["", *stage_lines, "", *test_lines, "", *zoo_lines, "", *driver_lines, ""]
    problems = ([f"stages failed: {', '.join(failed)}"] if failed else []) + \
               ([] if tests_ok else ["gpu tests not all passed"]) + \
               ([] if zoo_ok else ["zoo step: boo does not match eager (or did not run)"]) + \
               ([f"{missed} boo driver rows missed their target (or none ran)"] if missed else [])
    if no_device:  # only the stages that ran count
        out.append("verdict: device checks not run" + (f"; stages failed: {', '.join(failed)}" if failed else ""))
        return "\n".join(out), 1 if failed else 0
    out.append("verdict: issue 12 targets met" if not problems else "verdict: NOT met: " + "; ".join(problems))
    return "\n".join(out), 1 if problems else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--no-device", action="store_true", help="the device checks were not run")
    ns = p.parse_args(argv)
    text, rc = summarize(ns.results, ns.no_device)
    (ns.results / "summary.txt").write_text(text + "\n")
    print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
