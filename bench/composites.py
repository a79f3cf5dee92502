"""Time every composite at realistic sizes three ways in one run: the boo composite, the
forced-decomposition path (BOO_FORCE_DECOMPOSE=all) and eager ATen; print the ratios and the
bandwidth against a plain copy. Uses boo's public driver API.

    python bench/composites.py [--iter 20] [--csv bench/composites.csv] [--dtypes f32,bf16]
"""

import argparse
import csv
import sys

import torch

from boo_backend import driver

# (driver op, -F bits, shapes): every shape has at least 1M elements.
OPS = [
    ("layer_norm", 1, ["8192x1024", "4096x4096"]), ("layer_norm", 14, ["8192x1024", "4096x4096"]),
    ("gelu", 1, ["8192x1024"]), ("gelu", 2, ["8192x1024"]),
    ("softmax", 1, ["8192x1024"]), ("softmax", 2, ["8192x1024"]),
    ("log_softmax", 1, ["8192x1024"]), ("log_softmax", 2, ["8192x1024"]),
    ("rms_norm", 1, ["8192x1024"]), ("rms_norm", 6, ["8192x1024"]),
    ("group_norm", 1, ["32x64x32x32"]), ("group_norm", 14, ["32x64x32x32"]),
    ("batch_norm", 1, ["32x64x32x32"]), ("batch_norm", 14, ["32x64x32x32"]),
    ("batch_norm_eval", 1, ["32x64x32x32"]),
    ("attention", 1, ["4x8x512x64"]), ("attention", 2, ["4x8x512x64"]),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iter", type=int, default=20)
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--csv", default=None)
    p.add_argument("--ops", default=None, help="comma list of driver ops (default: all)")
    args = p.parse_args(argv)
    wanted = None if args.ops is None else set(args.ops.split(","))
    commands = [
        f"{op} -X {size} -t {dtype} -F {flags} --backend eager,boo,boo-decomposed --iter {args.iter}"
        for dtype in args.dtypes.split(",") for op, flags, sizes in OPS for size in sizes
        if wanted is None or op in wanted
    ]
    rows = []
    for i, text in enumerate(commands, 1):
        print(f"[{i}/{len(commands)}] {text}", file=sys.stderr, flush=True)
        rows += driver.measure(driver.parse_command(text), torch.device("cpu"))
    from boo_backend.benchmarking import host_line

    print(host_line())
    print(driver.format_table(rows))
    print("\nratios (median time; higher is better for boo):")
    print(f"{'op':28} {'shape':10} {'dtype':5} {'vs decomposed':>14} {'vs eager':>9} {'% copy':>7}")
    key = lambda r: (r["op"], r["shape"], r["dtype"])  # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(key(r), {})[r["backend"]] = r
    for (op, shape, dtype), b in by.items():
        boo = b["boo"]["median_ms"]
        print(f"{op:28} {shape:10} {dtype:5} {b['boo-decomposed']['median_ms'] / boo:14.2f} "
              f"{b['eager']['median_ms'] / boo:9.2f} {b['boo']['copy_pct']:7.1f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=driver.CSV_COLUMNS)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
