#!/usr/bin/env bash
# One GPU call for the T = 1 work: correctness of the decode cases, the A/B of new and old
# binaries (tools/gpu-decode-ab.sh), per-kernel durations (tools/gpu-kernel-times.sh), a
# split sweep of the new binary, and everything tarred into $OUT/t1.tar.xz (a run returns
# at most 8 files).
#   tools/gpu-t1.sh NEW_BIN_DIR [OLD_BIN_DIR]
# env: SWEEP (split counts), SWEEP_ARGS (shapes of the sweep), plus those of the two tools.
set -u
cd "$(dirname "$0")/.."
NEW=$1
OLD=${2:-}
RESULT=${OUT:-$PWD/gpu-logs}
OUTD=/tmp/t1-logs
rm -rf "$OUTD"; mkdir -p "$OUTD" "$RESULT"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
echo "== mla-check --backend cuda --case decode/"
timeout 300 "$NEW/mla-check" --backend cuda --case decode/ >"$OUTD/check.txt" 2>&1; echo "rc $?"
grep -E "passed|FAIL|fail" "$OUTD/check.txt" | tail -4
echo "== the split sweep (new)"
timeout 150 "$NEW/mla-bench" ${SWEEP_ARGS:---heads 16,128 --tokens 1,8 --cache bf16,fp8_ds_mla} \
    --sweep-splits "${SWEEP:-8,16,24,32,48,64}" --no-peer --format csv >"$OUTD/sweep.csv" 2>"$OUTD/sweep.err"
echo "rc $?"; cut -d, -f1-7 "$OUTD/sweep.csv"
echo "== kernel durations (new)"
OUT=$OUTD tools/gpu-kernel-times.sh "$NEW" 2>&1 | grep -v "^bf16\|^fp8"
[ -n "$OLD" ] && { echo "== kernel durations (old)"; OUT=$OUTD/old tools/gpu-kernel-times.sh "$OLD" 2>&1 | grep -v "^bf16\|^fp8"; }
echo "== A/B"
OUT=$OUTD tools/gpu-decode-ab.sh "$NEW" $OLD 2>&1 | tail -40
tar -cJf "$RESULT/t1.tar.xz" -C "$OUTD" . 2>/dev/null
