#!/usr/bin/env bash
# One GPU call for programmatic dependent launch (every kernel waits for its predecessor and
# lets its successor launch early): the whole CUDA conformance suite with it on, two
# sanitizers over the suite including the model cases, mla-run on the fixtures, then
# PDL on/off in the same binary (mla-bench decode rows, mla-model-bench steps) and the
# decode A/B against older binaries. Logs tarred into $OUT/pdl.tar.xz.
#   tools/gpu-pdl.sh NEW_BIN_DIR [OLD_BIN_DIR]
# env: DECODE_ARGS (mla-bench shapes), MODEL_ARGS (mla-model-bench args)
set -u
cd "$(dirname "$0")/.."
NEW=$1
OLD=${2:-}
RESULT=${OUT:-$PWD/gpu-logs}
L=/tmp/pdl-logs
rm -rf "$L"; mkdir -p "$L" "$RESULT"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
S=$L/summary.txt
: >"$S"
timeout 200 "$NEW/mla-check" --backend cuda >"$L/check.txt" 2>&1
echo "mla-check cuda (PDL on): rc $? $(tail -1 "$L/check.txt")" >>"$S"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck synccheck; do
    timeout ${SAN_TIMEOUT:-120} "$SAN" --tool $tool --error-exitcode 7 --print-limit 20 \
        "$NEW/mla-check" --backend cuda >"$L/san-$tool.txt" 2>&1
    echo "sanitizer $tool (whole suite, model cases too): rc $? $(grep -hoE 'ERROR SUMMARY: .*' "$L/san-$tool.txt" | tail -1); $(grep -E '[0-9]+ passed' "$L/san-$tool.txt" | tail -1)" >>"$S"
done
for m in glm_moe_dsa-tiny deepseek_v32-tiny-fp8; do
    for kv in bf16 fp8; do
        r=$(timeout 60 "$NEW/mla-run" --device cuda --model "$SPARSE_MLA_FIXTURES/$m" --kv-cache $kv -n 24 2>>"$L/run.err" | tail -1)
        echo "mla-run $m kv=$kv: $r" | cut -c1-200 >>"$S"
    done
done
D=${DECODE_ARGS:---heads 8,16,64,128 --tokens 1,8,32 --cache bf16,fp8_ds_mla}
timeout 120 "$NEW/mla-bench" $D --no-peer --format csv >"$L/decode-pdl.csv" 2>"$L/decode-pdl.err"
SPARSE_MLA_PDL=0 timeout 120 "$NEW/mla-bench" $D --no-peer --format csv >"$L/decode-nopdl.csv" 2>"$L/decode-nopdl.err"
M=${MODEL_ARGS:---shape glm5,deepseek-v32 --weights fp8 --context 4096 --batch 1,8 --no-baseline --gemm auto}
timeout 150 "$NEW/mla-model-bench" $M >"$L/model-pdl.txt" 2>"$L/model-pdl.err"
SPARSE_MLA_PDL=0 timeout 150 "$NEW/mla-model-bench" $M >"$L/model-nopdl.txt" 2>"$L/model-nopdl.err"
if [ -n "$OLD" ]; then
    AB_ARGS=${AB_ARGS:---heads 16,128 --tokens 1,32,128 --cache bf16,fp8_ds_mla} NCU_SHAPE= OUT=$L/ab \
        tools/gpu-decode-ab.sh "$NEW" "$OLD" >"$L/ab.txt" 2>&1
fi
tar -cJf "$RESULT/pdl.tar.xz" -C /tmp pdl-logs 2>/dev/null
cat "$S"
echo "-- model steps, PDL on then off"
grep -E "ms|step" "$L/model-pdl.txt" | head -30
grep -E "ms|step" "$L/model-nopdl.txt" | head -30
