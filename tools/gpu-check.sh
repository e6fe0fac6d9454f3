#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, with binaries built elsewhere (`tools/build-gpu.sh`
# makes them): run the conformance suite (kernels and whole-model cases) on CUDA and on wgpu
# over Vulkan, mla-run on the tiny fixtures (bf16 and FP8 weights, bf16 and fp8 caches), then
# the GPU benchmark when it exists, and print the tables last.
#
#   tools/gpu-check.sh [BIN_DIR]        (default target/gpu)
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

status=0
echo "== mla-check on CUDA"
"$BIN/mla-check" --backend cuda >"$L/cuda.txt" 2>"$L/cuda.err" || status=1
echo "== mla-check on wgpu (Vulkan)"
WGPU_BACKEND=vulkan "$BIN/mla-check" --backend wgpu >"$L/vulkan.txt" 2>"$L/vulkan.err" || status=1

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

for t in "$BIN"/gpu-test-*; do
    [ -x "$t" ] || continue
    echo "== $(basename "$t")"
    SPARSE_MLA_REQUIRE=cuda "$t" --nocapture >"$L/$(basename "$t").txt" 2>&1 || status=1
done
if [ -x "$BIN/mla-model-bench" ] && [ -z "${NO_MODEL_BENCH:-}" ]; then
    echo "== mla-model-bench"
    "$BIN/mla-model-bench" ${MODEL_BENCH_ARGS:-} >"$L/model-bench.txt" 2>"$L/model-bench.err" || status=1
fi
if [ -x "$BIN/mla-bench" ] && [ -z "${NO_BENCH:-}" ]; then
    echo "== mla-bench"
    "$BIN/mla-bench" >"$L/bench.txt" 2>"$L/bench.err" || status=1
fi

tar -czf "$LOGS/gpu-check.tar.gz" -C "$LOGS" logs
cat "$L/env.txt"
for f in cuda vulkan; do
    echo "---- $f"
    grep -E "^\||^SKIPPED|^FAILED|passed," "$L/$f.txt" | cut -c1-200
    tail -3 "$L/$f.err"
done
echo "---- mla-run"
cut -c1-260 "$L/run.txt"
cat "$L/run-bench.txt"
tail -3 "$L/run.err"
for t in "$L"/gpu-test-*.txt; do
    [ -f "$t" ] && { echo "---- $(basename "$t")"; grep -E "^test |test result|panicked" "$t" | tail -20; }
done
[ -f "$L/bench.txt" ] && { echo "---- bench"; cat "$L/bench.txt"; }
[ -f "$L/model-bench.txt" ] && { echo "---- model bench"; cat "$L/model-bench.txt"; tail -5 "$L/model-bench.err"; }
exit $status
