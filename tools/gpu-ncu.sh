#!/usr/bin/env bash
# Nsight Compute on the kernels that bound the true-width decode step (the evidence behind
# benches/NOTES.md's "what bounds each row"): the dense FP8 and bf16 GEMVs at batch 1, the
# grouped FP8 expert GEMV at batch 8, the lightning indexer's scores and top-k at 32 K context.
# Each is profiled a few launches deep inside one mla-model-bench step (steps 1, warm-up 1),
# with the speed-of-light, occupancy and warp-state sections.
#
#   tools/gpu-ncu.sh BIN_DIR            (writes $OUT/ncu.txt, prints a summary)
set -u
cd "$(dirname "$0")/.."
BIN=${1:-target/gpu}
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu not found"; exit 1; }
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
: >"$OUTD/ncu.txt"
prof() { # label, kernel regex, bench args...
    local label=$1 re=$2
    shift 2
    echo "######## $label ($re)" >>"$OUTD/ncu.txt"
    timeout 150 "$NCU" -k "regex:$re" --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        "$BIN/mla-model-bench" --steps 1 --warmup 1 --no-baseline "$@" \
        >>"$OUTD/ncu.txt" 2>&1 || echo "(exit $?)" >>"$OUTD/ncu.txt"
}
prof "GLM-5 FP8 dense GEMV, batch 1" '^linear_xf32_wfp8' --shape glm5 --weights fp8 --context 4096 --batch 1
prof "GLM-5 bf16 dense GEMV, batch 1" '^linear_xf32_wbf16' --shape glm5 --weights bf16 --context 4096 --batch 1
prof "GLM-5 FP8 experts, batch 8" '^grouped_linear_xf32_wfp8_experts' --shape glm5 --weights fp8 --context 4096 --batch 8
prof "GLM-5 indexer scores, 32K" '^indexer_scores' --shape glm5 --weights fp8 --context 32768 --batch 1
prof "GLM-5 top-k, 32K" '^topk_positions' --shape glm5 --weights fp8 --context 32768 --batch 1
# One line per kernel: name, duration, DRAM throughput, compute (SM) throughput, issue slots busy.
awk '
/^######## / { label = $0; sub(/^######## /, "", label); next }
/^  [a-zA-Z_0-9]+.*\(\d*/ && /Context/ { kname = $1 }
/^  [a-z_0-9]+ \(/ { kname = $1 }
/Duration/ && $NF ~ /[0-9]/ { dur = $(NF-1) " " $NF }
/DRAM Throughput/ { dram = $NF }
/Compute \(SM\) Throughput/ { sm = $NF }
/Issue Slots Busy/ { issue = $NF }
/Achieved Occupancy/ { occ = $NF
    printf "%-36s %-48s dur %-12s DRAM %5s %%  SM %5s %%  issue %5s %%  occupancy %5s %%\n", label, substr(kname, 1, 48), dur, dram, sm, issue, occ }
' "$OUTD/ncu.txt"
