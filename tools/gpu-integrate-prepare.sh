#!/usr/bin/env bash
# Here (with cargo, no GPU): the folder tools/gpu-integrate.sh takes to the GPU machine —
# the sparse_mla wheel built from this checkout, the exported cuda/ folder, the examples and
# the PyTorch GPU tests.
#
#   tools/gpu-integrate-prepare.sh [DIR]      (default .gpu-integrate; carry it to the GPU)
#
# maturin comes from target/py-tools (tools/test.sh installs it there) or PATH.
set -eu
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-integrate}
MATURIN=$(ls "${PY_TOOLS:-target/py-tools}"/bin/maturin 2>/dev/null || command -v maturin || true)
if [ -z "$MATURIN" ]; then
    echo "maturin not found: run tools/test.sh once (it installs it into target/py-tools), or pip install maturin" >&2
    exit 1
fi
rm -rf "$DIR"
mkdir -p "$DIR/wheels" "$DIR/tests" "$DIR/examples" "$DIR/tools"
(cd python && CARGO_TARGET_DIR=../target "$MATURIN" build --release --strip \
    -i python3 --out "../$DIR/wheels")
cp -r cuda "$DIR/cuda"
cp -r examples/c examples/pytorch_decode.py "$DIR/examples/"
cp python/tests/test_gpu.py "$DIR/tests/"
cp tools/gpu-integrate.sh "$DIR/tools/"
echo "prepared $DIR: $(ls "$DIR/wheels")"
