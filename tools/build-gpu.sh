#!/usr/bin/env bash
# Build the binaries that tools/gpu-check.sh runs on a GPU machine (which has no cargo),
# stripped, into target/gpu/: mla-check (kernel and whole-model conformance), mla-run and
# mla-bench; mla-serve for tools/serve-gpu.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --profile gpu --bin mla-check --bin mla-run --bin mla-bench --bin mla-model-bench --bin mla-serve
ls -la target/gpu/mla-check target/gpu/mla-run target/gpu/mla-bench target/gpu/mla-model-bench target/gpu/mla-serve
