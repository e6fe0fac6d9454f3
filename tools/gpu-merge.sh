#!/usr/bin/env bash
# The merged decode kernel (split and combine in one cooperative launch) on a GPU machine,
# in two parts that each fit one device call:
#   PART=1  correctness (mla-check with the backend's choice, the decode cases with the merge
#           off, with v6 forced and merged wherever the form can run), then the A/B: mla-bench
#           of the backend's kernels merged and as two launches (--no-merge), same binary, run
#           merged / split / merged wherever it can (SPARSE_MLA_MERGE=all) / merged
#   PART=2  split sweeps merged and not (T 1-4), per-kernel durations (ncu) merged and
#           split, compute-sanitizer (memcheck, racecheck, synccheck) on the decode cases
#           with v6 forced (merged where it fits), a stress run
# Prints a summary last (the A/B as a table of backend µs per row).
#
#   PART=1 tools/gpu-merge.sh BIN_DIR     (env: AB_ARGS, OUT; PART=2: SWEEP, SWEEP_MODES,
#                                          KT_MODES, SAN_KERNELS, STRESS_N)
set -u
cd "$(dirname "$0")/.."
BIN=$1
PART=${PART:-1}
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
sum="$OUTD/summary.txt"
: >"$sum"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >>"$sum"
AB_ARGS=${AB_ARGS:---heads 8,16,32,64,128 --tokens 1,2,4,8,16,32 --cache bf16}
if [ "$PART" = 1 ]; then
    timeout 150 "$BIN/mla-check" --backend cuda >"$OUTD/check-auto.txt" 2>&1
    echo "check auto (merged where it fits): rc $? $(tail -1 "$OUTD/check-auto.txt"); merged cases: $(grep -c ' merged ' "$OUTD/check-auto.txt")" >>"$sum"
    SPARSE_MLA_MERGE=0 timeout 80 "$BIN/mla-check" --backend cuda --case decode/ >"$OUTD/check-nomerge.txt" 2>&1
    echo "check decode, merge off: rc $? $(tail -1 "$OUTD/check-nomerge.txt"); merged cases: $(grep -c ' merged ' "$OUTD/check-nomerge.txt")" >>"$sum"
    SPARSE_MLA_DECODE_KERNEL=v6 timeout 80 "$BIN/mla-check" --backend cuda --case decode/ >"$OUTD/check-v6.txt" 2>&1
    echo "check decode, v6 forced: rc $? $(tail -1 "$OUTD/check-v6.txt"); merged cases: $(grep -c ' merged ' "$OUTD/check-v6.txt")" >>"$sum"
    SPARSE_MLA_MERGE=all timeout 80 "$BIN/mla-check" --backend cuda --case decode/ >"$OUTD/check-all.txt" 2>&1
    echo "check decode, merged wherever it can: rc $? $(tail -1 "$OUTD/check-all.txt"); merged cases: $(grep -c ' merged ' "$OUTD/check-all.txt")" >>"$sum"
    for run in merged-a split all merged-b; do
        extra=()
        [ $run = split ] && extra=(--no-merge)
        policy=1
        [ $run = all ] && policy=all
        SPARSE_MLA_MERGE=$policy timeout 110 "$BIN/mla-bench" $AB_ARGS --no-peer --no-baseline --sm120-occupancy --format csv "${extra[@]}" \
            >"$OUTD/bench-$run.csv" 2>"$OUTD/bench-$run.err"
        echo "bench $run: rc $? $(grep -c . "$OUTD/bench-$run.csv") lines" >>"$sum"
    done
    python3 - "$OUTD" >>"$sum" <<'PY'
import csv, sys, os
d = sys.argv[1]
def load(n):
    p = os.path.join(d, f"bench-{n}.csv")
    if not os.path.exists(p): return {}
    out = {}
    for r in csv.DictReader(open(p)):
        out[(r["cache"], int(r["heads"]), int(r["tokens"]))] = r
    return out
a, s, b, w = load("merged-a"), load("split"), load("merged-b"), load("all")
print("A/B, backend's kernel (µs): merged as the rule says (runs a, b) and wherever it can (all) against two launches; SM120 occupancy likewise")
print(f"{'cache':6} {'H':>4} {'T':>4}  {'kernel':22} {'split':>8} {'merged a':>8} {'merged b':>8} {'x':>6} {'all':>8} {'x all':>6}   {'split120':>8} {'merged120':>9} {'x120':>6} {'all120':>8} {'x all120':>8}")
for k in sorted(s):
    rs, ra, rb, rw = s[k], a.get(k), b.get(k), w.get(k, {})
    if not ra or not rb: continue
    f = lambda r, c: float(r[c]) if r.get(c) else float('nan')
    m = min(f(ra, "backend_us"), f(rb, "backend_us"))
    m120 = min(f(ra, "backend_us_sm120"), f(rb, "backend_us_sm120"))
    print(f"{k[0]:6} {k[1]:>4} {k[2]:>4}  {ra['backend']:22} {f(rs,'backend_us'):8.2f} {f(ra,'backend_us'):8.2f} {f(rb,'backend_us'):8.2f} {f(rs,'backend_us')/m:6.3f} {f(rw,'backend_us'):8.2f} {f(rs,'backend_us')/f(rw,'backend_us'):6.3f}   {f(rs,'backend_us_sm120'):8.2f} {m120:9.2f} {f(rs,'backend_us_sm120')/m120:6.3f} {f(rw,'backend_us_sm120'):8.2f} {f(rs,'backend_us_sm120')/f(rw,'backend_us_sm120'):8.3f}")
bad = [l for n in ("merged-a", "split", "all", "merged-b") if os.path.exists(os.path.join(d, f"bench-{n}.csv")) for l in open(os.path.join(d, f"bench-{n}.csv")) if ",false," in l] if a else []
print(f"bench rows failing their check: {len(bad)}")
PY
else
    # the parts in order of use; each skipped once the call nears its 600 s
    left() { [ $SECONDS -lt ${1:-480} ]; }
    for mode in ${SWEEP_MODES-merged split}; do
        extra=""
        [ $mode = split ] && extra="--no-merge"
        timeout 90 "$BIN/mla-bench" --heads 8,16,128 --tokens 1,2,4 --cache bf16 --no-peer --no-baseline \
            --sweep-splits ${SWEEP:-8,16,24,32,48,64} $extra >"$OUTD/sweep-$mode.txt" 2>&1
        echo "sweep $mode (µs by splits; m: merged): rc $?" >>"$sum"
        grep '^sweep' "$OUTD/sweep-$mode.txt" >>"$sum"
    done
    for mode in ${KT_MODES-merged split}; do
        left 420 || break
        extra=""
        [ $mode = split ] && extra="--no-merge"
        SHAPES="--heads 8 --tokens 1 --cache bf16 --no-baseline $extra;--heads 16 --tokens 1 --cache bf16 --no-baseline $extra;--heads 16 --tokens 4 --cache bf16 --no-baseline $extra" \
            OUT="$OUTD/kt-$mode" timeout 100 tools/gpu-kernel-times.sh "$BIN" >"$OUTD/kt-$mode.txt" 2>&1
        echo "kernel times $mode:" >>"$sum"
        grep -E '^==|  sparse' "$OUTD/kt-$mode.txt" | head -20 >>"$sum"
    done
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for k in ${SAN_KERNELS:-v6}; do
    for tool in memcheck racecheck synccheck; do
        left 470 || { echo "sanitizer $tool ($k): skipped (time)" >>"$sum"; continue; }
        extra=""
        [ "$tool" = racecheck ] && extra="--racecheck-report all"
        [ "$tool" = synccheck ] && extra="--num-cuda-barriers 65536"
        SPARSE_MLA_DECODE_KERNEL=$k timeout 110 "$SAN" --tool $tool $extra --error-exitcode 7 --print-limit 20 \
            "$BIN/mla-check" --backend cuda --case decode/ --no-model >"$OUTD/san-$tool-$k.txt" 2>&1
        echo "sanitizer $tool ($k forced, merged where it fits): rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUTD/san-$tool-$k.txt" | tail -1); merged cases: $(grep -c ' merged ' "$OUTD/san-$tool-$k.txt"); $(grep -E '[0-9]+ passed' "$OUTD/san-$tool-$k.txt" | tail -1)" >>"$sum"
    done
    done
    if left 540; then
        timeout 50 "$BIN/mla-check" --backend cuda --stress ${STRESS_N:-500} --watchdog 30 >"$OUTD/stress.txt" 2>&1
        echo "stress: rc $? $(grep '^stress' "$OUTD/stress.txt" | tail -1)" >>"$sum"
    fi
fi
tar -cJf "$OUTD/logs.tar.xz" -C "$OUTD" $(cd "$OUTD" && ls *.txt *.csv *.err 2>/dev/null | grep -v summary) 2>/dev/null
cat "$sum"
