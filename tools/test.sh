#!/usr/bin/env bash
# The project's test command. On a fresh Debian/Ubuntu machine it first installs what the
# tests need and does not find:
#   - lavapipe (Mesa's Vulkan on the CPU), so the wgpu conformance tests really run;
#   - NVRTC 12.8 from PyPI (into target/nvrtc), so every emitted CUDA kernel is compiled
#     for sm_80, sm_89, sm_90 and sm_120 — no GPU needed;
#   - g++, so the tensor-core CUDA C runs on the CPU warp emulator (tests/mma_emulated.rs).
# Then it runs every test with all three required (SPARSE_MLA_REQUIRE=wgpu,nvrtc,g++): a missing
# piece fails the run instead of being skipped. Extra arguments go to `cargo test` (before
# its `--`), e.g. `tools/test.sh --test conformance`.
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
fi
# --nocapture: the log then shows each backend's conformance table, the NVRTC ptxas reports
# and any SKIPPED line, so a reader can see what really ran.
cargo test --release "$@" -- --nocapture
