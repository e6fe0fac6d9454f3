#!/usr/bin/env bash
# The project's test command. On a fresh Debian/Ubuntu machine it first installs what the
# tests need and does not find:
#   - lavapipe (Mesa's Vulkan on the CPU), so the wgpu conformance tests really run;
#   - NVRTC 12.8 from PyPI (into target/nvrtc), so every emitted CUDA kernel is compiled
#     for sm_80, sm_89, sm_90 and sm_120 — no GPU needed;
#   - g++, so the tensor-core CUDA C runs on the CPU warp emulator (tests/mma_emulated.rs).
#   - maturin from PyPI (into target/py-tools) and CUDA's C headers (nvidia-cuda-runtime-cu12,
#     into target/cuda-headers), for the integration checks after the cargo tests.
# Then it runs every test with all three required (SPARSE_MLA_REQUIRE=wgpu,nvrtc,g++): a missing
# piece fails the run instead of being skipped. Extra arguments go to `cargo test` (before
# its `--`), e.g. `tools/test.sh --test conformance`; without any, the Python wheel builds in
# the background meanwhile (see below) and is installed and checked at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1; then
    echo "== installing lavapipe (mesa-vulkan-drivers, libvulkan1)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
fi

if ! command -v g++ >/dev/null 2>&1; then
    echo "== installing g++ (runs the tensor-core CUDA C on the CPU warp emulator)"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi

NVRTC_DIR=${SPARSE_MLA_NVRTC_DIR:-$PWD/target/nvrtc}
NVRTC_LIB=$NVRTC_DIR/nvidia/cuda_nvrtc/lib
if [ ! -e "$NVRTC_LIB/libnvrtc.so.12" ]; then
    echo "== installing NVRTC 12.8 from PyPI into $NVRTC_DIR"
    if ! python3 -m pip --version >/dev/null 2>&1; then
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    fi
    python3 -m pip install --quiet --disable-pip-version-check --target "$NVRTC_DIR" "nvidia-cuda-nvrtc-cu12==12.8.*"
fi
export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export SPARSE_MLA_REQUIRE=${SPARSE_MLA_REQUIRE:-wgpu,nvrtc,g++}

if cargo fmt --version >/dev/null 2>&1; then
    cargo fmt --check
    (cd python && cargo fmt --check)
fi
# every deliberate bug of the mutation run still finds the code it breaks (the run itself
# takes an hour: tools/mutate.sh, not CI)
tools/mutate.sh --check

# The Python wheel (python/, a cargo workspace of its own) builds in the background, at the
# lowest priority, while the tests run: it takes the cores they leave idle (their serial
# stretches, lavapipe's waits) instead of ~220 s of its own at the end.
# It cannot reuse the main build's crates: pyo3's macros turn on syn's `visit-mut`, so every
# crate downstream of a derive (serde, thiserror... nearly all) hashes differently, and the
# features the main crate's dev-dependencies turn on differ too. It builds the main crate
# without its default features (no wgpu, naga, tokenizers or CLI: 47 crates, not 190). It has a
# target directory of its own (target/wheel), where it neither waits for the main build's
# lock on target/ nor changes a crate the main build uses.
WHEEL_PID=
if [ $# -eq 0 ]; then
    # The test binaries first, alone: with the wheel's compile beside it the main build took
    # 574-597 s against ~410 s alone (CI runs 47-48: nice does not keep the wheel's LLVM
    # threads off the shared caches), and the wheel now needs too little to wait for.
    cargo test --release --no-run
    PY_TOOLS=$PWD/target/py-tools
    if [ ! -x "$PY_TOOLS/bin/maturin" ]; then
        echo "== installing maturin from PyPI into $PY_TOOLS"
        python3 -m pip install --quiet --disable-pip-version-check --target "$PY_TOOLS" "maturin>=1.5,<2"
    fi
    mkdir -p target
    rm -rf target/wheels target/py-site
    echo "== the sparse_mla wheel (python/) builds in the background: target/wheel-build.log"
    # set -m: maturin, cargo and its rustc are a process group of their own ($WHEEL_PID),
    # ended as one if this script stops early. Same session: a new one (setsid) would be a
    # scheduler autogroup of its own, as heavy as the tests' whatever its nice value.
    set -m
    (cd python && exec nice -n 19 env CARGO_TARGET_DIR=../target/wheel \
        "$PY_TOOLS/bin/maturin" build --release --strip -i python3 --out ../target/wheels) \
        > target/wheel-build.log 2>&1 &
    WHEEL_PID=$!
    set +m
    WHEEL_T0=$(date +%s)
    trap '[ -z "$WHEEL_PID" ] || kill -- -"$WHEEL_PID" 2>/dev/null || true' EXIT
fi

# --nocapture: the log then shows each backend's conformance table, the NVRTC ptxas reports
# and any SKIPPED line, so a reader can see what really ran.
cargo test --release "$@" -- --nocapture

# Integration (skipped when arguments pick a subset of the cargo tests): the C example compiles
# against cuda/sparse_mla.h and CUDA's own cuda.h; the Python wheel builds (its own cargo
# workspace, python/), installs, imports and checks its arguments and the no-GPU error.
if [ $# -eq 0 ]; then
    HDR_DIR=$PWD/target/cuda-headers
    if [ ! -e "$HDR_DIR/nvidia/cuda_runtime/include/cuda.h" ]; then
        echo "== installing CUDA's C headers (nvidia-cuda-runtime-cu12) from PyPI into $HDR_DIR"
        python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$HDR_DIR" "nvidia-cuda-runtime-cu12==12.8.*"
    fi
    echo "== examples/c/decode.c against cuda/sparse_mla.h (compile only: no GPU here)"
    cc -std=c99 -Wall -Wextra -Werror -I cuda -I "$HDR_DIR/nvidia/cuda_runtime/include" \
        -c examples/c/decode.c -o target/decode-example.o

    echo "== the sparse_mla wheel (python/)"
    t0=$(date +%s)
    wheel_rc=0
    wait "$WHEEL_PID" || wheel_rc=$?
    WHEEL_PID=
    cat target/wheel-build.log
    echo "== wheel build: exit $wheel_rc, $(( $(stat -c %Y target/wheel-build.log) - WHEEL_T0 )) s in the background, $(( $(date +%s) - t0 )) s waited for after the tests"
    [ "$wheel_rc" = 0 ]
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-index \
        --target target/py-site target/wheels/sparse_mla-*.whl
    (cd target && PYTHONPATH=$PWD/py-site python3 ../python/tests/test_no_gpu.py)
    echo "== wheel built, installed and checked in $(( $(date +%s) - t0 )) s after the tests"
fi
