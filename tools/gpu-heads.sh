#!/usr/bin/env bash
# One GPU call for the head-group forms (`GroupBy::Heads`, benches/NOTES.md v38, v40): bf16's
# wide-call kernel (v7 in 64-head blocks, four 16-head warp groups over one ring) and the
# forms beside it.
#   1. mla-check's decode cases with SPARSE_MLA_DECODE_KERNEL=wide (a wrong result or a hang
#      shows here first);
#   2. mla-bench with --variants beside v7 (its current column), RUNS rounds, both
#      occupancies, every row checked against float64;
#   3. compute-sanitizer memcheck / racecheck / synccheck on the decode cases with the wide
#      kernel forced (the cross-group release of the shared ring is what racecheck and
#      synccheck must pass);
#   4. with NCU=1, Nsight Compute at H 128 T 128 on v7 and the wide kernel (bf16), and on v7
#      and the 64-head form in rows (fp8_ds_mla: where its time goes, NOTES v40).
# Logs tarred into $OUT/heads.tar.xz; the summary and the table print last.
#
#   tools/gpu-heads.sh BIN_DIR
# env: BENCH_ARGS (mla-bench shapes; default H 32/64/128 x T 1/8/32/128, both caches),
#      VARIANTS (default 32x32x2w4h2,64x32x2w2h4,32x32x3w4h2: the last fits fp8 only, bf16
#      rows print why not), RUNS (2), NCU (0), SAN_TIMEOUT (100 s a tool), SAN_TOOLS,
#      DEADLINE (540 s from the start: no later part starts past it, so a call's limit
#      loses the tail, not the table)
set -u
cd "$(dirname "$0")/.."
START=$(date +%s)
late() { [ $(($(date +%s) - START)) -ge "${DEADLINE:-540}" ]; }
BIN=$1
RESULT=${OUT:-$PWD/gpu-logs}
L=$(mktemp -d)
mkdir -p "$RESULT"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
for f in "$BIN"/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x "$BIN"/mla-bench "$BIN"/mla-check
. tools/gpu-lib.sh
S=$L/summary.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >"$S"
SPARSE_MLA_DECODE_KERNEL=wide timeout 150 "$BIN/mla-check" --backend cuda --case decode/ \
    >"$L/check-heads.txt" 2>&1
echo "mla-check decode, wide forced: rc $? $(tail -1 "$L/check-heads.txt")" >>"$S"
B=${BENCH_ARGS:---heads 32,64,128 --tokens 1,8,32,128 --cache bf16,fp8_ds_mla}
V=${VARIANTS:-32x32x2w4h2,64x32x2w2h4,32x32x3w4h2}
for r in $(seq 1 "${RUNS:-2}"); do
    if late; then echo "DEADLINE: mla-bench rounds $r.. skipped" >>"$S"; break; fi
    timeout 280 "$BIN/mla-bench" $B --variants "$V" --sm120-occupancy --no-peer --no-baseline \
        --format csv >"$L/bench-$r.csv" 2>"$L/bench-$r.err"
    echo "mla-bench round $r: rc $? $(grep -c ',true,' "$L/bench-$r.csv") rows right, $(grep -c ',false,' "$L/bench-$r.csv") wrong" >>"$S"
done
for tool in ${SAN_TOOLS-memcheck racecheck synccheck}; do
    if late; then echo "DEADLINE: sanitizer $tool skipped" >>"$S"; continue; fi
    r=$(SPARSE_MLA_DECODE_KERNEL=wide san_decode "$BIN" "$tool" "$L/san-$tool.txt")
    echo "sanitizer $tool (decode cases, wide forced): $r" >>"$S"
done
if [ "${NCU:-0}" = 1 ] && NCUB=$(cuda_tool ncu) && [ -n "$NCUB" ]; then
    metrics=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
    metrics+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
    metrics+=,"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
    # label, the split kernel's name (its own regex: mla-bench times v7's column first), cache,
    # variant: v7 and the wide kernel for bf16; v7 and the 64-head form in rows for fp8
    for row in "v7-bf16 bf16_d576_ws2w8r_h32n32 bf16 -" "wide-bf16 bf16_d576_ws2w8h4r_h64n32 bf16 -" \
        "v7-fp8 fp8_ds_mla_d576_ws2w8r_h32n32 fp8_ds_mla -" \
        "h4r-fp8 fp8_ds_mla_d576_ws2w8h4r_h64n32 fp8_ds_mla 64x32x2w2h4r"; do
        set -- $row
        if late; then echo "DEADLINE: ncu $1 skipped" >>"$S"; continue; fi
        var=()
        [ "$4" != - ] && var=(--variants "$4")
        timeout 150 "$NCUB" -k "regex:split_$2\$" --launch-skip 3 --launch-count 1 --csv \
            --metrics "$metrics" "$BIN/mla-bench" --heads 128 --tokens 128 --cache "$3" "${var[@]}" \
            --reps 4 --warmup 1 --no-peer --no-baseline >"$L/ncu-$1.csv" 2>&1
        echo "ncu $1: rc $? $(grep -c '^"' "$L/ncu-$1.csv") CSV lines" >>"$S"
    done
fi
python3 tools/variant-table.py "$L"/bench-*.csv >"$L/table.txt" 2>&1
tar -cJf "$RESULT/heads.tar.xz" -C "$L" .
cp "$L/table.txt" "$RESULT/heads-table.txt"
cat "$S"
cat "$L/table.txt"
