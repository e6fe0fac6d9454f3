#!/usr/bin/env python3
"""Same-run table of mla-bench's --variants against its v7 column, from its CSVs.

    tools/variant-table.py RUN1.csv [RUN2.csv ...]

Each CSV is one `mla-bench --format csv --variants ...` run. Per (cache, H, T) row: the
first kernel of the row (mla-bench's v7 column, the current kernel) and every other kernel
of the row, each the minimum of its medians over the runs, default occupancy and SM120's
(us | us_sm120), and v7's time over the variant's: ABOVE 1 the variant is FASTER. A row
whose check failed in any run is marked `WRONG`.
"""
import csv
import sys
from collections import OrderedDict


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    best = OrderedDict()   # (cache, H, T) -> OrderedDict(kernel -> [us, us120, ok])
    for path in sys.argv[1:]:
        with open(path) as f:
            lines = [l for l in f if l.count(",") >= 10]
        for r in csv.DictReader(lines):
            try:
                key = (r["cache"], int(r["heads"]), int(r["tokens"]))
                us = float(r["us"])
            except (KeyError, ValueError):
                continue
            us120 = float(r["us_sm120"]) if r.get("us_sm120") else None
            row = best.setdefault(key, OrderedDict())
            cur = row.setdefault(r["kernel"], [us, us120, True])
            cur[0] = min(cur[0], us)
            if us120 is not None:
                cur[1] = us120 if cur[1] is None else min(cur[1], us120)
            cur[2] = cur[2] and r["ok"] == "true"
    if not best:
        sys.exit("variant-table: no rows in " + " ".join(sys.argv[1:]))
    short = lambda k: k.replace("sparse_mla_decode_split_", "")
    print(f"{'cache':<10} {'H':>3} {'T':>4}  {'v7 (us | sm120)':<40} variant: us | sm120, v7 / variant")
    for (cache, h, t), row in best.items():
        kernels = list(row.items())
        (k0, (u0, s0, ok0)), rest = kernels[0], kernels[1:]
        cell = lambda u, s: f"{u:.1f} | {s:.1f}" if s is not None else f"{u:.1f}"
        parts = []
        for k, (u, s, ok) in rest:
            ratio = f"{u0 / u:.3f}" + (f" | {s0 / s:.3f}" if s is not None and s0 else "")
            parts.append(f"{short(k)} {cell(u, s)} ({ratio}){'' if ok else ' WRONG'}")
        print(f"{cache:<10} {h:>3} {t:>4}  {short(k0) + ' ' + cell(u0, s0) + ('' if ok0 else ' WRONG'):<40} " + "; ".join(parts))


if __name__ == "__main__":
    main()
