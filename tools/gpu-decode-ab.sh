#!/usr/bin/env bash
# A/B of the decode kernels on a GPU machine: mla-bench of the new binaries and of old ones
# in the same call (v7 = "current", v6 = "baseline" columns, each also under SM120's
# occupancy), then Nsight Compute's per-instruction warp-stall samples of the current split
# kernels on one shape, so the SASS lines a step waits on can be read off-line.
#
#   tools/gpu-decode-ab.sh NEW_BIN_DIR [OLD_BIN_DIR]
# env: AB_ARGS (mla-bench shape args), VARIANTS (mla-bench --variants, new binary only),
#      NCU_SHAPE (mla-bench args of the profiled shape; set and empty: no ncu), NCU_KERNEL (regex)
set -u
cd "$(dirname "$0")/.."
NEW=$1
OLD=${2:-}
OUTD=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUTD"
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
AB_ARGS=${AB_ARGS:---heads 16,128 --tokens 1,32,128 --cache bf16,fp8_ds_mla}
NCU_SHAPE=${NCU_SHAPE---heads 16 --tokens 128 --cache bf16}
NCU_KERNEL=${NCU_KERNEL:-sparse_mla_decode_split}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
var=()
[ -n "${VARIANTS:-}" ] && var=(--variants "$VARIANTS")
echo "== new: $NEW"
timeout ${AB_TIMEOUT:-150} "$NEW/mla-bench" $AB_ARGS --sm120-occupancy --no-peer --format csv "${var[@]}" \
    >"$OUTD/bench-new.csv" 2>"$OUTD/bench-new.err"; echo "rc $?"
if [ -n "${EXTRA_VARIANTS:-}" ]; then
    echo "== new, extra variants (own time limit: a hang here loses only these rows)"
    timeout 60 "$NEW/mla-bench" $AB_ARGS --no-peer --no-baseline --format csv --variants "$EXTRA_VARIANTS" \
        >"$OUTD/bench-extra.csv" 2>"$OUTD/bench-extra.err"; echo "rc $?"
fi
if [ -n "$OLD" ]; then
    echo "== old: $OLD"
    timeout 200 "$OLD/mla-bench" $AB_ARGS --sm120-occupancy --no-peer --format csv \
        >"$OUTD/bench-old.csv" 2>"$OUTD/bench-old.err"; echo "rc $?"
fi
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCU_SHAPE" ] && [ -n "$NCU" ]; then
    for k in v7 v6; do
        nb=(--no-baseline)
        rx="regex:${NCU_KERNEL}.*ws"
        [ $k = v6 ] && { nb=(); rx="regex:${NCU_KERNEL}.*mma"; }
        timeout 150 "$NCU" -k "$rx" --launch-skip 3 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SourceCounters --section Occupancy \
            --import-source no -f -o "/tmp/ncu-$k" \
            "$NEW/mla-bench" $NCU_SHAPE --reps 4 --warmup 1 --no-peer "${nb[@]}" >/tmp/ncu-$k.log 2>&1
        "$NCU" --import "/tmp/ncu-$k.ncu-rep" --page details >"$OUTD/ncu-$k-details.txt" 2>&1
        "$NCU" --import "/tmp/ncu-$k.ncu-rep" --page source --csv --print-source sass \
            >"/tmp/ncu-$k-sass.csv" 2>&1
        echo "ncu $k: $(wc -l </tmp/ncu-$k-sass.csv) sass lines"
    done
    tar -cJf "$OUTD/ncu-sass.tar.xz" -C /tmp ncu-v7-sass.csv ncu-v6-sass.csv ncu-v7.log ncu-v6.log 2>/dev/null
fi
echo "== summary (µs: current=v7, baseline=v6; _sm120 at SM120's occupancy)"
for f in "$OUTD"/bench-new.csv "$OUTD"/bench-old.csv "$OUTD"/bench-extra.csv; do
    [ -f "$f" ] || continue
    echo "-- $(basename "$f")"
    head -1 "$f" | cut -c1-400
    sed -n '2,$p' "$f" | cut -c1-400
done
