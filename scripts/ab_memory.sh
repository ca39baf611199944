#!/usr/bin/env bash
# A/B of two builds of the library: wall time, CPU time (user + system) and peak RSS,
# interleaved with the plain run, medians of RUNS (default 5; the PyTorch job 3):
#   scripts/ab_memory.sh OLD.so NEW.so [RUNS]
# A_ENV / B_ENV: variables for A's and B's runs only (e.g. B_ENV=LEAKTRACE_PYTHON_SAMPLE=0
# to measure one setting against another with the same library twice). ROWS: a
# space-separated subset of the rows below (default: all).
# Rows: bench/malloc_bench.c with 1 and 2 threads, bench/new_stacks.c (every stack new),
# `python3 -c "import torch"`, the in-process step time of bench/torch_steps.py (small
# and big model), bench/python_alloc.py, tests/fixtures/frameworks/torch_train.py train.
# Each process runs under /usr/bin/time: wall ms and the peak RSS (KB) of the largest
# process. PYTHON picks the interpreter (default: python3 on PATH, with torch).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(realpath "$1"); NEW=$(realpath "$2"); RUNS=${3:-5}
PY=${PYTHON:-$(command -v python3)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -fomit-frame-pointer -pthread bench/malloc_bench.c -o "$work/malloc_bench"
cc -O2 -fomit-frame-pointer -o "$work/new_stacks" bench/new_stacks.c
export LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0
med() { printf "%s\n" "$@" | sort -n | sed -n "$(( ($# + 1) / 2 ))p"; }
# run LIB CMD...: "ms kb" of one run (LIB empty: plain).
# run LIB ENV CMD...: "wall_ms cpu_ms kb" of one run (LIB empty: plain).
run() {
    local lib=$1 extra=$2; shift 2
    # shellcheck disable=SC2086
    /usr/bin/time -f "%e %U %S %M" -o "$work/t" env ${lib:+LD_PRELOAD=$lib} $extra "$@" >/dev/null 2>&1 || true
    awk '{printf "%d %d %d", $1 * 1000, ($2 + $3) * 1000, $4}' "$work/t"
}
wanted() { [ -z "${ROWS:-}" ] || [[ " $ROWS " == *" $1 "* ]]; }
echo "| workload | plain ms | A ms | B ms | plain CPU ms | A CPU ms | B CPU ms | plain KB | A KB | B KB |"
echo "|---|---|---|---|---|---|---|---|---|---|"
row() {
    local name=$1 runs=$2; shift 2
    wanted "$name" || return 0
    local p=() a=() b=() pc=() ac=() bc=() pm=() am=() bm=() r
    for _ in $(seq "$runs"); do
        read -r w c m <<<"$(run "" "" "$@")"; p+=("$w"); pc+=("$c"); pm+=("$m")
        read -r w c m <<<"$(run "$OLD" "${A_ENV:-}" "$@")"; a+=("$w"); ac+=("$c"); am+=("$m")
        read -r w c m <<<"$(run "$NEW" "${B_ENV:-}" "$@")"; b+=("$w"); bc+=("$c"); bm+=("$m")
    done
    echo "| $name | $(med "${p[@]}") | $(med "${a[@]}") | $(med "${b[@]}") | $(med "${pc[@]}") | $(med "${ac[@]}") | $(med "${bc[@]}") | $(med "${pm[@]}") | $(med "${am[@]}") | $(med "${bm[@]}") |"
}
row malloc-1t "$RUNS" "$work/malloc_bench" 1
row malloc-2t "$RUNS" "$work/malloc_bench" 2
row new-stacks "$RUNS" "$work/new_stacks"
row import-torch "$RUNS" "$PY" -c "import torch"
row python-alloc "$RUNS" "$PY" bench/python_alloc.py
row torch-job 3 "$PY" tests/fixtures/frameworks/torch_train.py train
# Training steps: the step time the script prints (ms), not the process's.
for model in small big; do
    wanted "steps-$model" || continue
    p=() a=() b=()
    for _ in $(seq "$RUNS"); do
        p+=("$("$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
        # shellcheck disable=SC2086
        a+=("$(env LD_PRELOAD="$OLD" ${A_ENV:-} "$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
        # shellcheck disable=SC2086
        b+=("$(env LD_PRELOAD="$NEW" ${B_ENV:-} "$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
    done
    echo "| steps-$model (step ms) | $(med "${p[@]}") | $(med "${a[@]}") | $(med "${b[@]}") | | | | | | |"
done
