#!/usr/bin/env bash
# Old-against-new A/B of whole binaries on a GPU machine (a change of the plan or of the
# kernels, where no switch selects the old behaviour): mla-bench of each binary directory,
# RUNS rounds with the order rotated each round, then the same-run table (tools/ab-table.py:
# minimum of each binary's medians, speed-up against the first, both occupancies). Every row
# is checked against float64 by mla-bench itself. CSVs go to $OUT (or gpu-logs) as one tar;
# the table last.
#
#   tools/gpu-bin-ab.sh BASE_DIR NEW_DIR [NEW_DIR ...]
# env: AB_ARGS (mla-bench shape args), RUNS (2), BENCH_TIMEOUT (150 s a run), AB_DEADLINE
#      (seconds from the start after which no further round starts: the table is made from
#      the rounds that ran)
set -u
cd "$(dirname "$0")/.."
. tools/gpu-lib.sh
[ $# -ge 2 ] || { sed -n 2,12p "$0"; exit 2; }
DIRS=("$@")
OUTD=${OUT:-$PWD/gpu-logs}
W=$(mktemp -d)
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
AB_ARGS=${AB_ARGS:---heads 8,16 --tokens 32,64,128,256 --cache bf16,fp8_ds_mla}
labels=()
declare -A DIR_OF
for d in "${DIRS[@]}"; do
    for f in "$d"/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
    chmod +x "$d"/mla-bench
    labels+=("$(basename "$d")")
    DIR_OF[$(basename "$d")]=$d
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
# warm each binary's NVRTC cache (its kernels may differ), untimed
for d in "${DIRS[@]}"; do timeout 150 "$d/mla-bench" $AB_ARGS --no-peer --reps 3 >/dev/null 2>&1; done
# `ab_run LABEL CSV ERR` for ab_rounds: the binary of that directory
ab_run() {
    timeout "${BENCH_TIMEOUT:-150}" "${DIR_OF[$1]}/mla-bench" $AB_ARGS --sm120-occupancy --no-peer \
        --format csv >"$2" 2>"$3"
}
ab_rounds "${RUNS:-2}" "$W" "${labels[@]}"
mkdir -p "$OUTD"
python3 tools/ab-table.py "$W" "${labels[@]}" | tee "$W/table.txt"
tar -cJf "$OUTD/bin-ab.tar.xz" -C "$W" .
cp "$W/table.txt" "$OUTD/bin-ab-table.txt"
