#!/usr/bin/env python3
"""Side-by-side table of `ncu --csv --metrics ...` runs, one column per form.

    tools/ncu-table.py DIR FORM [FORM ...]

Reads DIR/ncu-FORM.csv (ncu's details page as CSV: one row per kernel launch and metric)
and prints each metric's value per form: the kernel time, instructions, issue activity,
DRAM throughput, then the stall reasons per issued instruction
(`smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio`), largest first by the
first form. With several profiled launches of a form, their mean. The kernel each form
profiled is named first, with a warning where every form profiled the same one: such a table
compares a kernel with itself (benches/NOTES.md v34, v35).
"""
import csv
import os
import re
import sys

STALL = re.compile(r"smsp__average_warps_issue_stalled_(.+)_per_issue_active\.ratio")


def load(path):
    """The metrics' means, and the profiled kernels' names."""
    vals, kernels = {}, set()
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own notes are not CSV
    for r in csv.DictReader(lines):
        if r.get("Kernel Name"):
            kernels.add(r["Kernel Name"].split("(")[0])
        name, v = r.get("Metric Name"), r.get("Metric Value", "").replace(",", "")
        try:
            vals.setdefault(name, []).append(float(v))
        except ValueError:
            continue
    return {k: sum(v) / len(v) for k, v in vals.items()}, kernels


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    d, forms = sys.argv[1], sys.argv[2:]
    runs, kernels = {}, {}
    for f in forms:
        p = os.path.join(d, f"ncu-{f}.csv")
        runs[f], kernels[f] = load(p) if os.path.exists(p) else ({}, set())
        if not runs[f]:
            print(f"(no metrics for {f}: see {p})")
        print(f"{f}: {', '.join(sorted(kernels[f])) or '-'}")
    named = [frozenset(k) for k in kernels.values() if k]
    if len(named) > 1 and len(set(named)) == 1:
        print("WARNING: every form profiled the same kernel: this table compares it with itself")
    first = runs[forms[0]]
    head = [m for m in sorted({m for r in runs.values() for m in r}) if not STALL.match(m)]
    stalls = sorted(
        {m for r in runs.values() for m in r if STALL.match(m)},
        key=lambda m: -first.get(m, 0.0),
    )
    print(f"{'metric':52s}" + "".join(f" {f:>14s}" for f in forms))
    for m in head + stalls:
        label = STALL.match(m).group(1) if STALL.match(m) else m
        if STALL.match(m) and max(r.get(m, 0.0) for r in runs.values()) < 0.05:
            continue
        print(f"{label[:52]:52s}" + "".join(
            f" {runs[f][m]:14.6g}" if m in runs[f] else f" {'-':>14s}" for f in forms))


if __name__ == "__main__":
    main()
