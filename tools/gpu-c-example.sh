#!/usr/bin/env bash
# On a GPU machine with nvcc and gcc (no cargo, no wheel needed): build examples/c/decode.c
# against the checked-in cuda/ folder (the header and the generated .cu files), compile the
# kernels it lists to cubins for this GPU's architecture, and run it — every case checked
# against its float64 reference. The C part of tools/gpu-integrate.sh, for a kernel change
# that does not need the Python wheel. Logs under $OUT (or ./gpu-logs).
#
#   tools/gpu-c-example.sh           (env: ARCH, default the GPU's own, e.g. sm_90)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
LOGS=${OUT:-$ROOT/gpu-logs}
mkdir -p "$LOGS"
NVCC=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
[ -n "$NVCC" ] || { echo "nvcc not found" >&2; exit 1; }
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
ARCH=${ARCH:-sm_$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
BUILD=$(mktemp -d)
(
    set -e
    cd "$BUILD"
    gcc -O2 -std=c99 -Wall -I "$ROOT/cuda" -I "$CUDA_HOME/include" "$ROOT/examples/c/decode.c" \
        -o decode -L "$CUDA_HOME/lib64/stubs" -L "$CUDA_HOME/lib64" -lcuda -lm
    ./decode --list | sort -u >kernels.txt
    mkdir -p build
    xargs -P "$(nproc)" -I{} "$NVCC" -cubin -arch="$ARCH" -o build/{}.cubin "$ROOT/cuda/{}.cu" <kernels.txt
    echo "built $(ls build | wc -l) cubins for $ARCH"
) >"$LOGS/c-build.txt" 2>&1 || { tail -20 "$LOGS/c-build.txt"; echo "C build failed"; exit 1; }
(cd "$BUILD" && timeout 60 ./decode build) >"$LOGS/c-run.txt" 2>&1
rc=$?
tail -1 "$LOGS/c-build.txt"
cat "$LOGS/c-run.txt"
exit $rc
