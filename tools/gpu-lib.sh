# Shell functions shared by the GPU scripts (sourced, not run).

# `cuda_tool NAME`: the path of a CUDA tool (ncu, compute-sanitizer) on PATH or under
# /usr/local/cuda*/bin; nothing, with a message on stderr, where there is none.
cuda_tool() {
    local p
    p=$(command -v "$1" || ls /usr/local/cuda*/bin/"$1" 2>/dev/null | head -1)
    [ -n "$p" ] || echo "$1 not found (on PATH or under /usr/local/cuda*/bin)" >&2
    echo "$p"
}

# `san_decode BIN TOOL LOG`: compute-sanitizer's TOOL (memcheck, racecheck, synccheck) over
# mla-check's decode cases on CUDA, with the flags each tool needs here; its report into LOG.
# Prints "rc N <the tool's summary line>"; returns the sanitizer's exit status (7: reports).
# The kernel and switches come from the caller's environment (SPARSE_MLA_DECODE_KERNEL, ...).
san_decode() {
    local bin=$1 tool=$2 log=$3 san rc
    san=$(cuda_tool compute-sanitizer)
    [ -n "$san" ] || { echo "rc 127 (no compute-sanitizer)"; return 127; }
    local extra=()
    [ "$tool" = racecheck ] && extra=(--racecheck-report all)
    # synccheck tracks a limited number of mbarriers per launch: raise it
    [ "$tool" = synccheck ] && extra=(--num-cuda-barriers 65536)
    timeout "${SAN_TIMEOUT:-100}" "$san" --tool "$tool" "${extra[@]}" --error-exitcode 7 \
        --print-limit 20 "$bin/mla-check" --backend cuda --case decode/ --no-model >"$log" 2>&1
    rc=$?
    echo "rc $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    return $rc
}
