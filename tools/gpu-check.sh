#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with binaries built elsewhere (`tools/build-gpu.sh`
# makes them): run the conformance suite (kernels and whole-model cases) on CUDA and on wgpu
# over Vulkan, mla-run on the tiny fixtures (bf16 and FP8 weights, bf16 and fp8 caches; and
# --tp 2 / 4 against the unsharded run's ids), then
# the four compute-sanitizer tools over the kernel suite, a kernel-cache corruption check,
# the 10^4-launch stress run, the server load run (tools/serve-gpu.sh, when mla-serve was
# built), the benchmarks when they exist, and print the tables last.
#
#   tools/gpu-check.sh [BIN_DIR]        (default target/gpu)
#
# SECTIONS picks parts (default all): check vulkan run sanitize cache stress serve bench
# (e.g. SECTIONS="check stress"); NO_BENCH / NO_MODEL_BENCH skip a benchmark;
# STRESS_N sets the stress launches (10000); SAN_TIMEOUT the seconds per sanitizer (150);
# SAN_TOOLS the sanitizer tools (memcheck racecheck synccheck initcheck).
#
# Vulkan needs a loader: if `ldconfig -p` has no libvulkan, the script unpacks the Debian
# packages in .gl/ (libvulkan1, libglvnd, ...) when they are there.
# Logs go to $OUT (or ./gpu-logs) as gpu-check.tar.gz.
set -u
cd "$(dirname "$0")/.."
BIN=${1:-target/gpu}
LOGS=${OUT:-$PWD/gpu-logs}
mkdir -p "$LOGS/logs"
L=$LOGS/logs

if ! ldconfig -p | grep -q libvulkan.so.1 && ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
NV_ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$NV_ICD" ]; then
    export VK_DRIVER_FILES=$NV_ICD
fi
# NVRTC: the binaries look for libnvrtc.so / libnvrtc.so.12; a CUDA 13 machine may only have
# libnvrtc.so.13 (same entry points), so point a private libnvrtc.so at whatever exists.
if ! ldconfig -p | grep -qE "libnvrtc\.so(\.12)? "; then
    found=$(ls /usr/local/cuda*/lib64/libnvrtc.so* /usr/local/cuda*/targets/*/lib/libnvrtc.so* \
        /usr/lib/x86_64-linux-gnu/libnvrtc.so* 2>/dev/null | grep -v builtins | head -1)
    if [ -z "$found" ]; then
        found=$(python3 -c 'import nvidia.cuda_nvrtc, os; d=os.path.join(list(nvidia.cuda_nvrtc.__path__)[0], "lib"); print(os.path.join(d, sorted(f for f in os.listdir(d) if f.startswith("libnvrtc.so"))[0]))' 2>/dev/null)
    fi
    if [ -n "$found" ]; then
        mkdir -p /tmp/nvrtc-link
        ln -sf "$found" /tmp/nvrtc-link/libnvrtc.so
        export LD_LIBRARY_PATH=/tmp/nvrtc-link:$(dirname "$found"):${LD_LIBRARY_PATH:-}
    fi
fi
export SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
export SPARSE_MLA_FIXTURES=${SPARSE_MLA_FIXTURES:-$PWD/tests/fixtures}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1
    ldconfig -p | grep -E "libnvrtc|libcuda.so|libvulkan" 2>&1
} >"$L/env.txt" 2>&1

want() { case " ${SECTIONS:-all} " in *" all "* | *" $1 "*) return 0 ;; *) return 1 ;; esac; }
status=0
summary=$L/summary.txt
: >"$summary"
if want check; then
echo "== mla-check on CUDA"
"$BIN/mla-check" --backend cuda >"$L/cuda.txt" 2>"$L/cuda.err" || status=1
fi
if want vulkan; then
echo "== mla-check on wgpu (Vulkan)"
WGPU_BACKEND=vulkan "$BIN/mla-check" --backend wgpu >"$L/vulkan.txt" 2>"$L/vulkan.err" || status=1
fi

if want sanitize; then
    # Every kernel of the conformance suite (decode, cache write, block table, every model op)
    # under each tool; 0 reports required. The NVRTC cache is warm from the run above.
    SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    for tool in ${SAN_TOOLS:-memcheck racecheck synccheck initcheck}; do
        echo "== compute-sanitizer --tool $tool"
        extra=""
        [ "$tool" = memcheck ] && extra="--leak-check no"
        timeout ${SAN_TIMEOUT:-150} "$SAN" --tool $tool $extra --error-exitcode 7 --print-limit 20 \
            "$BIN/mla-check" --backend cuda --no-model >"$L/san-$tool.txt" 2>&1
        rc=$?
        errs=$(grep -hoE "(ERROR|RACECHECK) SUMMARY: .*" "$L/san-$tool.txt" | tail -1)
        case $rc in
            0) verdict="ok" ;;
            124) verdict="TIMEOUT after ${SAN_TIMEOUT:-150} s"; status=1 ;;
            *) verdict="FAIL (exit $rc)"; status=1 ;;
        esac
        cases=$(grep -E "[0-9]+ passed" "$L/san-$tool.txt" | tail -1)
        echo "sanitizer $tool: ${errs:-no summary}; suite: ${cases:-no result}; $verdict" >>"$summary"
    done
fi

if want cache; then
    # A damaged kernel cache must be noticed, named and rebuilt, never loaded.
    echo "== kernel cache corruption"
    n=0
    for f in "$SPARSE_MLA_CACHE_DIR"/*.cubin; do
        [ -f "$f" ] || continue
        case $((n % 3)) in
            0) truncate -s $(($(stat -c %s "$f") / 2)) "$f" ;;
            1) printf '\x55' | dd of="$f" bs=1 seek=$(($(stat -c %s "$f") - 64)) conv=notrunc status=none ;;
            2) : >"$f" ;;
        esac
        n=$((n + 1))
    done
    RUST_LOG=warn "$BIN/mla-check" --backend cuda --no-model >"$L/cache.txt" 2>"$L/cache.err"
    rc=$?
    warned=$(grep -c "is unusable" "$L/cache.err")
    [ $rc -eq 0 ] && [ "$warned" -gt 0 ] || status=1
    echo "kernel cache: $n entries damaged; the $warned the suite loads refused and rebuilt; suite exit $rc" >>"$summary"
fi

if want stress; then
    echo "== stress: ${STRESS_N:-10000} random launches"
    timeout 400 "$BIN/mla-check" --backend cuda --stress ${STRESS_N:-10000} --watchdog 30 \
        >"$L/stress.txt" 2>"$L/stress.err" || status=1
    grep "^stress" "$L/stress.txt" >>"$summary" || echo "stress: no result (exit, see stress.err)" >>"$summary"
fi

if want serve && [ -x "$BIN/mla-serve" ] && [ -f tools/serve-gpu.sh ]; then
    echo "== server load"
    timeout 150 bash tools/serve-gpu.sh "$BIN" >"$L/serve.txt" 2>"$L/serve.err" || status=1
fi

if want run; then
echo "== mla-run on the fixtures"
: >"$L/run.txt"
for dev in cuda wgpu; do
    for m in glm_moe_dsa-tiny deepseek_v32-tiny glm_moe_dsa-tiny-fp8 deepseek_v32-tiny-fp8; do
        for kv in bf16 fp8; do
            [ "$dev" = wgpu ] && [ "$kv" = fp8 ] && continue
            line=$(set -o pipefail; WGPU_BACKEND=vulkan "$BIN/mla-run" --device "$dev" --model "$SPARSE_MLA_FIXTURES/$m" \
                --kv-cache "$kv" -n 24 2>>"$L/run.err" | tail -1) || { status=1; line="FAILED"; }
            echo "$dev $m kv=$kv: $line" >>"$L/run.txt"
        done
    done
done

echo "== mla-run --bench"
: >"$L/run-bench.txt"
for m in glm_moe_dsa-tiny deepseek_v32-tiny; do
    for g in on off; do
        "$BIN/mla-run" --device cuda --model "$SPARSE_MLA_FIXTURES/$m" --bench -n 64 --cuda-graphs $g \
            >>"$L/run-bench.txt" 2>>"$L/run.err" || status=1
    done
    WGPU_BACKEND=vulkan "$BIN/mla-run" --device wgpu --model "$SPARSE_MLA_FIXTURES/$m" --bench -n 16 \
        >>"$L/run-bench.txt" 2>>"$L/run.err" || status=1
done

echo "== mla-run --tp (shards on the one GPU, docs/sharding.md)"
# A report, not a gate (the gate is mla-check's model/tp* cases): greedy ids can part at a
# near-tie, since the sharded sums round differently in f32.
ids() { grep -o '"id":[0-9]*' | cut -d: -f2; }
for m in glm_moe_dsa-tiny deepseek_v32-tiny; do
    args=(--device cuda --model "$SPARSE_MLA_FIXTURES/$m" --prompt-ids 5,17,3,99,250,8,1,42,7 -n 16 --output json)
    "$BIN/mla-run" "${args[@]}" 2>>"$L/run.err" | ids >"$L/tp-ids-1.txt" || status=1
    for tp in 2 4; do
        "$BIN/mla-run" "${args[@]}" --tp $tp 2>>"$L/run.err" | ids >"$L/tp-ids-$tp.txt" || status=1
        same=$(paste -d' ' "$L/tp-ids-1.txt" "$L/tp-ids-$tp.txt" | awk '$1 != $2 {print NR; exit}')
        n=$(wc -l <"$L/tp-ids-$tp.txt")
        what="all equal to the unsharded run"
        [ -n "$same" ] && what="the first to differ from the unsharded run is token $same"
        echo "cuda $m --tp $tp: $n ids, $what" >>"$L/run.txt"
    done
done
fi

for t in "$BIN"/gpu-test-*; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    SPARSE_MLA_REQUIRE=cuda "$t" --nocapture >"$L/$(basename "$t").txt" 2>&1 || status=1
done
if want bench && [ -x "$BIN/mla-model-bench" ] && [ -z "${NO_MODEL_BENCH:-}" ]; then
    echo "== mla-model-bench"
    "$BIN/mla-model-bench" ${MODEL_BENCH_ARGS:-} >"$L/model-bench.txt" 2>"$L/model-bench.err" || status=1
fi
if want bench && [ -x "$BIN/mla-bench" ] && [ -z "${NO_BENCH:-}" ]; then
    echo "== mla-bench"
    "$BIN/mla-bench" >"$L/bench.txt" 2>"$L/bench.err" || status=1
fi

tar -czf "$LOGS/gpu-check.tar.gz" -C "$LOGS" logs
cat "$L/env.txt"
for f in cuda vulkan; do
    [ -f "$L/$f.txt" ] || continue
    echo "---- $f"
    grep -E "^\||^SKIPPED|^FAILED|passed," "$L/$f.txt" | cut -c1-200
    tail -3 "$L/$f.err"
done
if [ -f "$L/run.txt" ]; then
    echo "---- mla-run"
    cut -c1-260 "$L/run.txt"
    cat "$L/run-bench.txt"
    tail -3 "$L/run.err"
fi
for t in "$L"/gpu-test-*.txt; do
    [ -f "$t" ] && { echo "---- $(basename "$t")"; grep -E "^test |test result|panicked" "$t" | tail -20; }
done
for t in "$L"/san-*.txt; do
    [ -f "$t" ] && { echo "---- $(basename "$t" .txt)"; grep -E "^=========|FAIL" "$t" | head -12; }
done
[ -f "$L/stress.err" ] && { echo "---- stress"; grep -E "FAIL|HANG|panicked" "$L/stress.err" | head -10; }
[ -f "$L/serve.txt" ] && { echo "---- serve"; tail -25 "$L/serve.txt"; tail -5 "$L/serve.err"; }
[ -f "$L/bench.txt" ] && { echo "---- bench"; cat "$L/bench.txt"; }
[ -f "$L/model-bench.txt" ] && { echo "---- model bench"; cat "$L/model-bench.txt"; tail -5 "$L/model-bench.err"; }
echo "---- summary"
cat "$summary"
exit $status
