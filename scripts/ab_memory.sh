#!/usr/bin/env bash
# A/B of two builds of the library, time and peak RSS, interleaved with the plain run,
# medians of RUNS (default 5; the PyTorch job 3):
#   scripts/ab_memory.sh OLD.so NEW.so [RUNS]
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
run() {
    local lib=$1; shift
    /usr/bin/time -f "%e %M" -o "$work/t" env ${lib:+LD_PRELOAD=$lib} "$@" >/dev/null 2>&1 || true
    awk '{printf "%d %d", $1 * 1000, $2}' "$work/t"
}
echo "| workload | plain ms | A ms | B ms | plain KB | A KB | B KB |"
echo "|---|---|---|---|---|---|---|"
row() {
    local name=$1 runs=$2; shift 2
    local p=() a=() b=() pm=() am=() bm=() r
    for _ in $(seq "$runs"); do
        r=$(run "" "$@"); p+=("${r% *}"); pm+=("${r#* }")
        r=$(run "$OLD" "$@"); a+=("${r% *}"); am+=("${r#* }")
        r=$(run "$NEW" "$@"); b+=("${r% *}"); bm+=("${r#* }")
    done
    echo "| $name | $(med "${p[@]}") | $(med "${a[@]}") | $(med "${b[@]}") | $(med "${pm[@]}") | $(med "${am[@]}") | $(med "${bm[@]}") |"
}
row malloc-1t "$RUNS" "$work/malloc_bench" 1
row malloc-2t "$RUNS" "$work/malloc_bench" 2
row new-stacks "$RUNS" "$work/new_stacks"
row import-torch "$RUNS" "$PY" -c "import torch"
row python-alloc "$RUNS" "$PY" bench/python_alloc.py
row torch-job 3 "$PY" tests/fixtures/frameworks/torch_train.py train
# Training steps: the step time the script prints (ms), not the process's.
for model in small big; do
    p=() a=() b=()
    for _ in $(seq "$RUNS"); do
        p+=("$("$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
        a+=("$(LD_PRELOAD="$OLD" "$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
        b+=("$(LD_PRELOAD="$NEW" "$PY" bench/torch_steps.py 8 $model | awk '/^steps/ {print $2}')")
    done
    echo "| steps-$model (step ms) | $(med "${p[@]}") | $(med "${a[@]}") | $(med "${b[@]}") | | | |"
done
