#!/usr/bin/env bash
# One GPU call for the large-batch decode kernel (two warp groups, `DecodeConfig::tensor_core_batch`):
# the CUDA conformance suite with the backend's own choice and with the batch kernel forced
# (model cases too), compute-sanitizer memcheck / racecheck / synccheck on the decode cases with
# it forced, the random-launch stress run with it forced, then mla-bench of the H <= 16 rows
# with v7 (current), v6 (baseline) and the backend's kernel (the batch kernel on large batches)
# side by side, each also at SM120's occupancy. Logs tarred into $OUT/batch.tar.xz; the summary prints last.
#   tools/gpu-batch.sh BIN_DIR
# env: BENCH_ARGS (mla-bench shapes), STRESS (launches, default 300)
set -u
cd "$(dirname "$0")/.."
BIN=$1
RESULT=${OUT:-$PWD/gpu-logs}
L=/tmp/batch-logs
rm -rf "$L"; mkdir -p "$L" "$RESULT"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
S=$L/summary.txt
: >"$S"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >>"$S"
B=${BENCH_ARGS:---heads 8,16 --tokens 1,8,32,64,128 --cache bf16,fp8_ds_mla}
timeout 240 "$BIN/mla-bench" $B --sm120-occupancy --no-peer --format csv \
    >"$L/bench.csv" 2>"$L/bench.err"
echo "mla-bench: rc $?" >>"$S"
timeout 200 "$BIN/mla-check" --backend cuda >"$L/check.txt" 2>&1
echo "mla-check cuda (backend's choice): rc $? $(tail -1 "$L/check.txt")" >>"$S"
export SPARSE_MLA_DECODE_KERNEL=batch
timeout 200 "$BIN/mla-check" --backend cuda >"$L/check-batch.txt" 2>&1
echo "mla-check cuda (batch kernel forced, model cases too): rc $? $(tail -1 "$L/check-batch.txt")" >>"$S"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
# synccheck tracks a limited number of mbarriers (cuda::barrier) per launch: raise it
for run in "memcheck" "racecheck" "synccheck" "synccheck --num-cuda-barriers ${SYNC_BARRIERS:-65536}"; do
    tool=${run%% *}; extra=${run#"$tool"}
    log="$L/san-$tool$(echo $extra | tr -dc 0-9).txt"
    timeout ${SAN_TIMEOUT:-100} "$SAN" --tool $run --error-exitcode 7 --print-limit 20 \
        "$BIN/mla-check" --backend cuda --case decode/ --no-model >"$log" 2>&1
    echo "sanitizer $run (decode cases, batch kernel): rc $? $(grep -hoE '(ERROR|RACECHECK) SUMMARY: .*' "$log" | tail -1); $(grep -E '[0-9]+ passed' "$log" | tail -1)" >>"$S"
done
timeout 120 "$BIN/mla-check" --backend cuda --stress "${STRESS:-300}" >"$L/stress.txt" 2>&1
echo "stress (batch kernel): rc $? $(tail -2 "$L/stress.txt" | tr '\n' ' ')" >>"$S"
unset SPARSE_MLA_DECODE_KERNEL
tar -cJf "$RESULT/batch.tar.xz" -C /tmp batch-logs
cp "$L/bench.csv" "$RESULT/" 2>/dev/null
echo "== summary"
cat "$S"
echo "== bench (µs; us_sm120 = carve-out 44 %)"
cut -d, -f1-3,5-9,11,15-18 "$L/bench.csv"
