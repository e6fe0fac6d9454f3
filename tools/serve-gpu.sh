#!/usr/bin/env bash
# The mla-serve load run on a GPU machine, bounded to ~90 s in all:
#   tools/serve-gpu.sh BIN_DIR [DEVICE]
# BIN_DIR holds mla-serve (e.g. target/gpu/ from tools/build-gpu.sh); DEVICE defaults to cuda
# (cpu / wgpu work too, for a local dry run). For the tiny GLM-5 fixture, then (while time is
# left) the true-width GLM-5 stack with random FP8 weights (1 dense + 3 MoE layers): start the
# server, wait for /health, warm up (and check that a greedy answer is the same alone and in a
# batch of 8), run tools/serve_load.py at concurrency 1, 8 and 32, stop the server with
# SIGTERM. Prints a table last. Needs python3 (standard library only); loopback only.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${1:?usage: tools/serve-gpu.sh BIN_DIR [DEVICE]}
DEVICE=${2:-cuda}
BUDGET=${SERVE_GPU_BUDGET:-90}
PORT=${SERVE_GPU_PORT:-18431}
URL="http://127.0.0.1:$PORT"
LOG=$(mktemp -d)/serve
SERVE="$BIN/mla-serve"
[ -x "$SERVE" ] || { echo "serve-gpu: no executable $SERVE" >&2; exit 1; }
command -v python3 >/dev/null || { echo "serve-gpu: python3 is needed" >&2; exit 1; }

ROWS=()
SERVER_PID=
left() { echo $((BUDGET - SECONDS)); }

stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "serve-gpu: server $SERVER_PID ignored SIGTERM for 5 s: killing it" >&2
            kill -KILL "$SERVER_PID" 2>/dev/null
        fi
    fi
    wait "$SERVER_PID" 2>/dev/null
    echo "serve-gpu: server exit status $? ($1)"
    SERVER_PID=
}
trap 'stop_server "on exit"' EXIT

# start NAME WAIT_S ARGS...: the server in the background; 0 once /health answers.
start() {
    local name=$1 wait_s=$2
    shift 2
    "$SERVE" --device "$DEVICE" --port "$PORT" --max-batch 32 --max-seq-len 1024 --drain-timeout 5 "$@" \
        >"$LOG-$name.log" 2>&1 &
    SERVER_PID=$!
    if ! timeout $((wait_s + 5)) python3 tools/serve_load.py --url "$URL" --wait-health "$wait_s"; then
        echo "serve-gpu: $name: the server did not come up; its log:" >&2
        tail -n 30 "$LOG-$name.log" >&2
        stop_server "failed start"
        return 1
    fi
    echo "serve-gpu: $name: up after ${SECONDS} s of the run ($(grep -m1 'device' "$LOG-$name.log"))"
}

# load NAME CONCURRENCY REQUESTS TIME_LIMIT VOCAB: one bounded load run, a table row.
load() {
    local name=$1 c=$2 n=$3 limit=$4 vocab=$5 row rc
    row=$(timeout $((limit + 25)) python3 tools/serve_load.py --url "$URL" --row "$name" \
        --concurrency "$c" --requests "$n" --max-tokens 64 --prompt-tokens 32 --vocab "$vocab" \
        --time-limit "$limit" --timeout 20)
    rc=$?
    ROWS+=("${row:-| $name | $c | failed (rc $rc) | | | | | |}")
    kill -0 "$SERVER_PID" 2>/dev/null
}

# model NAME VOCAB LIMIT START_WAIT ARGS...: warm-up, check, three load levels.
model() {
    local name=$1 vocab=$2 limit=$3 wait_s=$4
    shift 4
    start "$name" "$wait_s" "$@" || return 1
    # Warm-up: compiles the kernels of the step shapes the runs use (NVRTC caches on disk).
    timeout 40 python3 tools/serve_load.py --url "$URL" --concurrency 32 --requests 32 --max-tokens 8 \
        --prompt-tokens 32 --vocab "$vocab" --time-limit 20 --timeout 30 >/dev/null \
        || echo "serve-gpu: $name: warm-up had failures"
    CHECK=$(timeout 30 python3 tools/serve_load.py --url "$URL" --check 8 --max-tokens 32 --vocab "$vocab" --timeout 20)
    echo "serve-gpu: $name: $CHECK"
    ROWS+=("| $name | $CHECK |")
    for c in 1 8 32; do
        if [ "$(left)" -lt $((limit + 8)) ]; then
            ROWS+=("| $name | $c | skipped: $(left) s left of the ${BUDGET} s budget | | | | | |")
            continue
        fi
        if ! load "$name" "$c" $((c * 8)) "$limit" "$vocab"; then
            echo "serve-gpu: $name: the server died at c=$c; its log:" >&2
            tail -n 30 "$LOG-$name.log" >&2
            stop_server "died"
            return 1
        fi
    done
    stop_server "$name done"
}

FIXTURE=tests/fixtures/glm_moe_dsa-tiny
if ! model tiny 384 7 25 --model "$FIXTURE"; then
    # A crash under CUDA graphs is worth one retry without them.
    if [ "$(left)" -gt 40 ]; then
        echo "serve-gpu: retrying the tiny model with --cuda-graphs off"
        model tiny-nographs 384 7 25 --model "$FIXTURE" --cuda-graphs off
    fi
fi
if [ "$(left)" -gt 45 ]; then
    model glm5-4layer-fp8 154880 6 30 --synthetic glm5 --synthetic-layers 1,3 --synthetic-weights fp8 \
        --max-step-tokens 1024 || true
else
    ROWS+=("| glm5-4layer-fp8 | skipped: $(left) s left of the ${BUDGET} s budget |")
fi

echo
echo "mla-serve on $DEVICE: 64 tokens per request, 32-token prompts, greedy; ${SECONDS} s in all"
echo "| model | concurrency | requests ok | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
echo "|---|---|---|---|---|---|---|---|"
for r in "${ROWS[@]}"; do echo "$r"; done
