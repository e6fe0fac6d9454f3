#!/usr/bin/env bash
# Per-kernel GPU durations of the decode's launches at the GPU's own clocks (Nsight
# Compute, --clock-control none, no cache control: mla-bench flushes L2 itself), beside
# mla-bench's event time of the whole call, so a call's time splits into split kernel,
# combine kernel and what lies between them.
#
#   tools/gpu-kernel-times.sh BIN_DIR
# env: SHAPES (';'-separated mla-bench shape args), KT_KERNEL (ncu kernel regex)
set -u
cd "$(dirname "$0")/.."
BIN=$1
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
SHAPES=${SHAPES:---heads 16 --tokens 1 --cache bf16;--heads 128 --tokens 1 --cache bf16;--heads 16 --tokens 1 --cache fp8_ds_mla;--heads 16 --tokens 8 --cache bf16}
KT_KERNEL=${KT_KERNEL:-regex:sparse_mla_decode}
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
IFS=';' read -ra list <<<"$SHAPES"
i=0
for s in "${list[@]}"; do
    i=$((i + 1))
    timeout 120 "$NCU" --clock-control none --cache-control none -k "$KT_KERNEL" \
        --metrics gpu__time_duration.sum --print-units base --csv --page raw \
        "$BIN/mla-bench" $s --reps 20 --warmup 2 --no-peer --format csv \
        >"$OUTD/kt-$i.csv" 2>"$OUTD/kt-$i.err"
    echo "== $s (rc $?)"
    python3 - "$OUTD/kt-$i.csv" <<'PY'
import csv, sys, statistics, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
hdr = next((i for i, r in enumerate(rows) if 'Kernel Name' in r), None)
if hdr is None:
    print('  no ncu rows'); sys.exit()
h = rows[hdr]; k = h.index('Kernel Name'); d = h.index('gpu__time_duration.sum'); g = h.index('Grid Size')
by = collections.defaultdict(list)
for r in rows[hdr + 2:]:  # the row after the header holds the units (ns: --print-units base)
    if len(r) > d:
        try: by[(r[k], r[g])].append(float(r[d].replace(',', '')))
        except ValueError: pass
for (name, grid), v in by.items():
    print(f'  {name[:60]:60s} {grid:14s} n={len(v):3d} median {statistics.median(v)/1000:7.2f} us  min {min(v)/1000:7.2f}')
PY
    grep -v '^==\|^"' "$OUTD/kt-$i.csv" | grep -i "bf16\|fp8" | cut -c1-300 | head -4
done
