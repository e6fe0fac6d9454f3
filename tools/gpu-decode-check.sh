#!/usr/bin/env bash
# The decode kernels' correctness gate on a GPU machine, for a kernel change: mla-check on
# CUDA with the backend's own choice (all cases), the decode cases again with each kernel
# version forced (v6, v7, the large-batch kernel, bf16's 64-head kernel for wide calls),
# compute-sanitizer (memcheck, racecheck, synccheck) on the decode cases with v7 and with the
# batch kernel forced (SAN_KERNELS="v7 batch wide" adds the 64-head kernel), and a stress run.
# Prints one line per part last.
#
#   tools/gpu-decode-check.sh BIN_DIR     (env: STRESS_N, SAN_TOOLS, SAN_KERNELS, SAN_TIMEOUT)
set -u
cd "$(dirname "$0")/.."
BIN=$1
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
sum="$OUTD/summary.txt"
: >"$sum"
line() { echo "$1: $(grep -E '^(passed|[0-9]+ of [0-9]+|all )' "$2" | tail -1) $(tail -1 "$2")" >>"$sum"; }
timeout 200 "$BIN/mla-check" --backend cuda >"$OUTD/check-auto.txt" 2>&1; echo "check auto: rc $? $(tail -1 "$OUTD/check-auto.txt")" >>"$sum"
for k in v6 v7 batch wide; do
    SPARSE_MLA_DECODE_KERNEL=$k timeout 100 "$BIN/mla-check" --backend cuda --case decode/ \
        >"$OUTD/check-$k.txt" 2>&1; echo "check decode $k: rc $? $(tail -1 "$OUTD/check-$k.txt")" >>"$sum"
done
. tools/gpu-lib.sh
for k in ${SAN_KERNELS:-v7 batch}; do
    for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
        log="$OUTD/san-$tool-$k.txt"
        r=$(SPARSE_MLA_DECODE_KERNEL=$k san_decode "$BIN" "$tool" "$log")
        echo "sanitizer $tool ($k, decode cases): $r; $(grep -E '[0-9]+ passed' "$log" | tail -1)" >>"$sum"
    done
done
timeout 200 "$BIN/mla-check" --backend cuda --stress ${STRESS_N:-3000} --watchdog 30 \
    >"$OUTD/stress.txt" 2>&1; echo "stress: rc $? $(grep '^stress' "$OUTD/stress.txt" | tail -1)" >>"$sum"
tar -cJf "$OUTD/logs.tar.xz" -C "$OUTD" $(cd "$OUTD" && ls *.txt | grep -v summary) 2>/dev/null
cat "$sum"
