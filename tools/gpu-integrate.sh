#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, PyTorch and nvcc (no cargo, no network): the integration
# checks of issue #12 from a folder prepared elsewhere (tools/gpu-integrate-prepare.sh):
#   DIR/wheels/*.whl        the sparse_mla wheel (maturin build --release --strip)
#   DIR/cuda/               the exported cuda/ folder (header + .cu)
#   DIR/examples/           examples/c/decode.c, examples/pytorch_decode.py
#   DIR/tests/test_gpu.py   python/tests/test_gpu.py
# Runs: the wheel's GPU tests (float64 references, CUDA graphs, torch.compile), the PyTorch
# example, and the C example built with nvcc from cuda/ only. Logs under $OUT (or DIR/logs);
# the PyTorch test table is printed last.
#
#   bash tools/gpu-integrate.sh DIR
set -u
DIR=$(cd "${1:-.gpu-integrate}" && pwd)
LOGS=${OUT:-$DIR/logs}
mkdir -p "$LOGS"
SITE=$(mktemp -d)
export PYTHONUNBUFFERED=1 SPARSE_MLA_CACHE_DIR=${SPARSE_MLA_CACHE_DIR:-/tmp/sparse-mla-nvrtc}
status=0

{
    date -u
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
    python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    nvcc --version 2>&1 | tail -1
} | tee "$LOGS/env.txt"

echo "== install the wheel (no index, no deps) into $SITE"
python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$DIR"/wheels/*.whl || { echo "FAILED: pip install"; exit 1; }
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import sparse_mla; print("nvrtc", sparse_mla.nvrtc_version(), "| unavailable:", sparse_mla.unavailable())' 2>&1 | tee "$LOGS/import.txt"
if ! python3 -c 'import sparse_mla, sys; sys.exit(0 if sparse_mla.unavailable() is None else 1)'; then
    # the package's own NVRTC search failed: say so, then point at any libnvrtc by hand
    echo "NOTE: sparse_mla found no NVRTC by itself; linking one by hand" | tee -a "$LOGS/import.txt"
    found=$(ls /usr/local/cuda*/lib64/libnvrtc.so* 2>/dev/null | grep -v builtins | head -1)
    [ -n "$found" ] && export SPARSE_MLA_NVRTC=$found
fi

echo "== C example: nvcc builds cuda/ kernels (background)"
CBUILD=$(mktemp -d)
NVCC=$(command -v nvcc)
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
(
    set -e
    cd "$CBUILD"
    gcc -O2 -std=c99 -Wall -I "$DIR/cuda" -I "$CUDA_HOME/include" "$DIR/examples/c/decode.c" -o decode \
        -L "$CUDA_HOME/lib64/stubs" -L "$CUDA_HOME/lib64" -lcuda -lm
    ./decode --list | sort -u >kernels.txt
    mkdir -p build
    xargs -P 8 -I{} "$NVCC" -cubin -arch=sm_90 -o build/{}.cubin "$DIR/cuda/{}.cu" <kernels.txt
    echo "built $(ls build | wc -l) cubins"
) >"$LOGS/c-build.txt" 2>&1 &
CPID=$!

echo "== PyTorch tests (python/tests/test_gpu.py)"
timeout ${TEST_TIMEOUT:-165} python3 "$DIR/tests/test_gpu.py" >"$LOGS/test_gpu.txt" 2>&1
rc=$?; [ $rc = 0 ] || { status=1; echo "test_gpu.py: rc $rc"; }

echo "== examples/pytorch_decode.py"
timeout 25 python3 "$DIR/examples/pytorch_decode.py" >"$LOGS/example.txt" 2>&1 || { status=1; echo "pytorch_decode.py failed"; }

echo "== C example run"
timeout 60 tail --pid=$CPID -f /dev/null
wait $CPID || { status=1; echo "C build failed"; }
if [ -x "$CBUILD/decode" ] && [ -d "$CBUILD/build" ]; then
    (cd "$CBUILD" && timeout 25 ./decode build) >"$LOGS/c-run.txt" 2>&1 || { status=1; echo "C example failed"; }
fi

tar -czf "$LOGS/integrate-logs.tar.gz" -C "$LOGS" --exclude integrate-logs.tar.gz . 2>/dev/null
echo "---- C build"; tail -5 "$LOGS/c-build.txt"
echo "---- C example"; cat "$LOGS/c-run.txt" 2>/dev/null
echo "---- PyTorch example"; tail -5 "$LOGS/example.txt"
echo "---- PyTorch tests"; grep -vE "^\s*$" "$LOGS/test_gpu.txt" | tail -80
exit $status
