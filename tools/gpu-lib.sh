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

# The A/B scripts' clock: `ab_late` is true once AB_DEADLINE (seconds, if set) has passed
# since this file was sourced, so a call's time limit loses the tail of a run, not its table.
AB_START=$(date +%s)
ab_late() { [ -n "${AB_DEADLINE:-}" ] && [ $(($(date +%s) - AB_START)) -ge "$AB_DEADLINE" ]; }

# `ab_rounds RUNS DIR LABEL...`: RUNS rounds of the caller's `ab_run LABEL CSV ERR` (one
# mla-bench --format csv run of that form into CSV, its stderr into ERR) for every label, the
# order rotated each round so no form always runs first; CSVs are DIR/ab-ROUND-LABEL.csv, as
# tools/ab-table.py reads them. A round runs whole or not at all (every form keeps as many
# runs as the others): none starts after AB_DEADLINE but the first.
ab_rounds() {
    local runs=$1 dir=$2 r i l
    shift 2
    local labels=("$@")
    local n=${#labels[@]}
    for r in $(seq 1 "$runs"); do
        if [ "$r" -gt 1 ] && ab_late; then echo "AB_DEADLINE: rounds $r.. skipped"; break; fi
        for i in $(seq 0 $((n - 1))); do
            l=${labels[$(( (i + r - 1) % n ))]}
            ab_run "$l" "$dir/ab-$r-$l.csv" "$dir/ab-$r-$l.err"
            echo "bench run $r $l: rc $? $(grep -c ',true,' "$dir/ab-$r-$l.csv") rows right, $(grep -c ',false,' "$dir/ab-$r-$l.csv") wrong"
        done
    done
}
