#!/usr/bin/env bash
# Same-binary A/B of a kernel switch on a GPU machine (an environment variable such as
# SPARSE_MLA_ROW_SOFTMAX or SPARSE_MLA_FP8_VALUES): mla-bench with the variable unset ("off")
# and at each value, RUNS rounds with the order rotated each round, then the gate of each
# value (mla-check's decode cases with the kernel forced, compute-sanitizer on them), then
# the same-run table (tools/ab-table.py: minimum of each form's medians, speed-up against
# off, both occupancies). Logs and CSVs go to $OUT (or gpu-logs) as one tar; the table last.
#
#   tools/gpu-env-ab.sh BIN_DIR VAR VALUE [VALUE ...]
# env: AB_ARGS (mla-bench shape args), RUNS (3), GATE_KERNELS (v7: SPARSE_MLA_DECODE_KERNEL
#      values the gate forces, empty for none), SAN_TOOLS (memcheck racecheck synccheck),
#      BENCH_TIMEOUT (150 s a run), SAN_TIMEOUT (100 s a tool), AB_DEADLINE (seconds from the
#      start after which no further bench round or gate starts: the table is still made
#      from the rounds that ran, so a call's time limit loses the tail, not the result),
#      NCU_SHAPE (mla-bench shape args: each form's v7 kernel profiled once under ncu, its
#      time, instructions, issue activity and stall reasons side by side, tools/ncu-table.py;
#      mla-bench's v7 column runs first and takes the form, so launch 4 is the form's kernel),
#      NCU_KERNEL (ncu's kernel-name regex, default `_ws`: the warp-specialised kernels)
set -u
cd "$(dirname "$0")/.."
. tools/gpu-lib.sh
[ $# -ge 3 ] || { sed -n 2,13p "$0"; exit 2; }
BIN=$1 VAR=$2
shift 2
VALUES=("$@")
OUTD=${OUT:-$PWD/gpu-logs}
W=$(mktemp -d)
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
AB_ARGS=${AB_ARGS:---heads 8,16,32,64,128 --tokens 1,8,32,128 --cache bf16,fp8_ds_mla}
for f in "$BIN"/*.xz; do [ -f "$f" ] && xz -d -f "$f"; done
chmod +x "$BIN"/mla-bench "$BIN"/mla-check
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
# `form NAME CMD...`: CMD with VAR unset (off) or at NAME
form() { local v=$1; shift; if [ "$v" = off ]; then env -u "$VAR" "$@"; else env "$VAR=$v" "$@"; fi; }
forms=(off "${VALUES[@]}")
# warm the NVRTC cache of every form, untimed
for v in "${forms[@]}"; do form "$v" timeout 120 "$BIN/mla-bench" $AB_ARGS --no-peer --reps 3 >/dev/null 2>&1; done
# `ab_run FORM CSV ERR` for ab_rounds: the binary with VAR unset (off) or at FORM
ab_run() {
    form "$1" timeout "${BENCH_TIMEOUT:-150}" "$BIN/mla-bench" $AB_ARGS --sm120-occupancy --no-peer \
        --format csv >"$2" 2>"$3"
}
ab_rounds "${RUNS:-3}" "$W" "${forms[@]}"
NCU=
[ -n "${NCU_SHAPE:-}" ] && NCU=$(cuda_tool ncu)
if [ -n "$NCU" ]; then
    metrics=gpu__time_duration.sum,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
    metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
    metrics+=,"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
    for v in "${forms[@]}"; do
        if ab_late; then echo "AB_DEADLINE: ncu of $VAR=$v skipped"; continue; fi
        # launch 4 of the kernel: past the warm-up, the L2 flushed before it like every rep
        form "$v" timeout 150 "$NCU" -k "regex:${NCU_KERNEL:-_ws}" --launch-skip 3 --launch-count 1 --csv \
            --metrics "$metrics" "$BIN/mla-bench" $NCU_SHAPE --reps 4 --warmup 1 --no-peer --no-baseline \
            >"$W/ncu-$v.csv" 2>&1
        echo "ncu $VAR=$v: rc $? $(grep -c '^"' "$W/ncu-$v.csv") CSV lines"
    done
fi
for v in "${VALUES[@]}"; do
    for k in ${GATE_KERNELS-v7}; do
        if ab_late; then echo "AB_DEADLINE: gate $VAR=$v $k skipped"; continue; fi
        form "$v" env SPARSE_MLA_DECODE_KERNEL=$k timeout 150 "$BIN/mla-check" --backend cuda --case decode/ \
            >"$W/check-$v-$k.txt" 2>&1
        echo "gate $VAR=$v $k: mla-check rc $? $(tail -1 "$W/check-$v-$k.txt")"
        for tool in ${SAN_TOOLS-memcheck racecheck synccheck}; do
            # (a subshell: form's `env` cannot run a shell function)
            r=$(export "$VAR=$v" SPARSE_MLA_DECODE_KERNEL=$k; san_decode "$BIN" "$tool" "$W/san-$tool-$v-$k.txt")
            echo "gate $VAR=$v $k: $tool $r"
        done
    done
done
mkdir -p "$OUTD"
[ -n "$NCU" ] && python3 tools/ncu-table.py "$W" "${forms[@]}" | tee "$W/ncu-table.txt"
python3 tools/ab-table.py "$W" off "${VALUES[@]}" | tee "$W/table.txt"
tar -cJf "$OUTD/env-ab.tar.xz" -C "$W" .
cp "$W/table.txt" "$OUTD/env-ab-table.txt"
