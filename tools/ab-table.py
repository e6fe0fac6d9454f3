#!/usr/bin/env python3
"""Same-run A/B table of `mla-bench --format csv` files: one column per form.

    tools/ab-table.py DIR BASE FORM [FORM ...]

Reads DIR/ab-RUN-FORM.csv (any RUN; several runs of each form, interleaved by the caller)
and prints, per (cache, heads, tokens) row, BASE's time and each form's time and speed-up
(BASE / FORM), both at the GPU's default occupancy (`backend_us`) and under SM120's
(`backend_us_sm120`, when the runs had `--sm120-occupancy`). Each time is the minimum over
the runs of that form's medians: the spread between runs of one binary is noise. A row that
any run of a form got wrong (`ok` false) is marked WRONG. Last: each form's geomean, min and
max speed-up, and the spread of BASE between its own runs (median and largest |ln(a/b)|).
"""
import csv
import glob
import math
import os
import statistics
import sys


def load(path):
    rows = {}
    for r in csv.DictReader(open(path)):
        rows.setdefault((r["cache"], int(r["heads"]), int(r["tokens"])), r)
    return rows


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    d, base, forms = sys.argv[1], sys.argv[2], sys.argv[3:]
    runs = {}
    for f in [base] + forms:
        files = sorted(glob.glob(os.path.join(d, f"ab-*-{f}.csv")))
        if not files:
            sys.exit(f"no {d}/ab-*-{f}.csv")
        runs[f] = [load(p) for p in files]

    def best(f, k, col):
        v = [float(r[k][col]) for r in runs[f] if k in r and r[k].get(col)]
        return min(v) if v else None

    sm120 = any(r.get("backend_us_sm120") for run in runs[base] for r in run.values())
    head = f"{'cache':11s} {'H':>4s} {'T':>4s} {'kernel':14s} {base:>9s}"
    for f in forms:
        head += f" {f:>16s}"
    if sm120:
        head += "   SM120: " + " ".join(f"{f:>7s}" for f in forms)
    print(head)
    ratios = {f: [] for f in forms}
    for k in sorted(runs[base][0]):
        b = best(base, k, "backend_us")
        line = f"{k[0]:11s} {k[1]:4d} {k[2]:4d} {runs[base][0][k]['backend'][:14]:14s} {b:9.2f}"
        tail = []
        for f in forms:
            v = best(f, k, "backend_us")
            if v is None or b is None:
                line += f" {'-':>16s}"
                continue
            wrong = any(r[k]["ok"] != "true" for r in runs[f] if k in r)
            ratios[f].append(b / v)
            line += f" {v:9.2f} {b / v:5.3f}" + ("!" if wrong else " ")
            if sm120:
                b2, v2 = best(base, k, "backend_us_sm120"), best(f, k, "backend_us_sm120")
                tail.append(f"{b2 / v2:7.3f}" if b2 and v2 else f"{'-':>7s}")
            if wrong:
                tail.append("WRONG")
        print(line + ("   SM120: " + " ".join(tail) if tail else ""))
    for f in forms:
        r = ratios[f]
        # rows whose backend ran another kernel (label) than BASE's: where the form applies
        keys = [k for k in runs[base][0] if k in runs[f][0]]
        other = [k for k in keys if runs[f][0][k]["backend"] != runs[base][0][k]["backend"]]
        if r:
            g = math.exp(sum(map(math.log, r)) / len(r))
            print(f"{f}: geomean {g:.3f}, min {min(r):.3f}, max {max(r):.3f} over {len(r)} rows; "
                  f"another kernel than {base}'s on {len(other)} of {len(keys)} rows")
            if other:
                ro = [best(base, k, "backend_us") / best(f, k, "backend_us") for k in other]
                g = math.exp(sum(map(math.log, ro)) / len(ro))
                print(f"{f} where it ran another kernel: geomean {g:.3f}, min {min(ro):.3f}, "
                      f"max {max(ro):.3f}")
            else:
                print(f"WARNING: {f} ran {base}'s kernel on every row (an A/A comparison: is the "
                      f"switch applied by the benchmark?)")
    if len(runs[base]) > 1:
        spread = []
        for k in runs[base][0]:
            v = [float(r[k]["backend_us"]) for r in runs[base] if k in r]
            spread += [abs(math.log(a / c)) for i, a in enumerate(v) for c in v[i + 1:]]
        if spread:
            print(f"{base} between its runs: median |ln(a/b)| {statistics.median(spread):.4f}, "
                  f"largest {max(spread):.4f}")


if __name__ == "__main__":
    main()
