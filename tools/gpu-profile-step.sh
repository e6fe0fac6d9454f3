#!/usr/bin/env bash
# Where the time of one true-width decode step goes, kernel by kernel: Nsight Compute times
# every launch of a few eager mla-model-bench steps (duration only, so the replay is cheap)
# and the table sums them per kernel name, largest first. The evidence behind "what bounds
# the row" in benches/NOTES.md, beside tools/gpu-ncu.sh's per-kernel detail.
#
#   tools/gpu-profile-step.sh BIN_DIR [mla-model-bench args...]
#   e.g. tools/gpu-profile-step.sh .gpu-bin --shape glm5 --weights fp8 --context 4096 --batch 32
#
# Writes $OUT/profile-<args>.csv and prints the table of the first whole step (from one
# embedding gather to the next: the cache fill before it is left out).
set -u
cd "$(dirname "$0")/.."
BIN=${1:-target/gpu}
shift
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
tag=$(echo "$*" | tr -c 'a-z0-9' '_' | tr -s '_')
csv=$OUTD/profile-$tag.csv
# Steps 2, warm-up 0, kernels only (no cuBLAS-only rerun), so the window holds whole steps.
timeout 240 "$NCU" --metrics gpu__time_duration.sum --csv --print-units base \
    --launch-count "${COUNT:-1500}" \
    "$BIN/mla-model-bench" --steps 2 --warmup 0 --no-baseline "$@" >"$csv" 2>"$csv.err"
python3 - "$csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
ki, mi, vi = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
seq = [(r[ki].split("(")[0].strip(), float(r[vi].replace(",", "")) / 1e3)
       for r in rows[1:] if r[mi] == "gpu__time_duration.sum"]
starts = [i for i, (k, _) in enumerate(seq) if k.startswith("embedding")]
if len(starts) < 2:
    sys.exit(f"no whole step in the {len(seq)} launches profiled (raise COUNT)")
step = seq[starts[0]:starts[1]]
t = collections.defaultdict(float); n = collections.Counter()
for k, v in step:
    t[k] += v
    n[k] += 1
total = sum(t.values())
print(f"one step: {len(step)} launches, {total:.0f} us of kernel time")
print("| kernel | launches | us | % |")
print("|---|---|---|---|")
for k, v in sorted(t.items(), key=lambda kv: -kv[1])[:18]:
    print(f"| {k[:70]} | {n[k]} | {v:.0f} | {100 * v / total:.1f} |")
PY
