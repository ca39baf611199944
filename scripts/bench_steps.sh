#!/usr/bin/env bash
# Steady-state overhead on PyTorch training loops (not a test): bench/torch_steps.py
# times rounds of training steps inside the process, after `import torch` and a warm-up
# round, so the one-off costs (import, exit report) are left out; a small model (~1,200
# allocations a step) and a bigger one (~38,000). Runs each plain, under leaktrace
# (Python frames on, the default) and under leaktrace with LEAKTRACE_PYTHON=0,
# interleaved, and prints the median of each and the ratios.
#
#   scripts/bench_steps.sh [RUNS]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
PY=$(python3 -c 'import sys; print(sys.executable)')
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "bench_steps: torch is not installed for $PY (pip install torch)" >&2
    exit 1
fi
cargo build --release --lib -q
LIB="$PWD/target/release/libleaktrace.so"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
printf 'workload                   plain   leaktrace         frames off\n'
for model in small big; do
    plain=() traced=() nopy=()
    for _ in $(seq "$RUNS"); do
        # `steps<N>_ms <ms>`: N, the steps of a round, is the model's own.
        line=$("$PY" bench/torch_steps.py 8 "$model" | awk '/^steps/ {print $1, $2}')
        plain+=("${line#* }")
        traced+=("$(LEAKTRACE_SUMMARY=0 LEAKTRACE_OUTPUT="$OUT" LD_PRELOAD="$LIB" "$PY" bench/torch_steps.py 8 "$model" | awk '/^steps/ {print $2}')")
        nopy+=("$(LEAKTRACE_PYTHON=0 LEAKTRACE_SUMMARY=0 LEAKTRACE_OUTPUT="$OUT" LD_PRELOAD="$LIB" "$PY" bench/torch_steps.py 8 "$model" | awk '/^steps/ {print $2}')")
    done
    p=$(median "${plain[@]}")
    t=$(median "${traced[@]}")
    n=$(median "${nopy[@]}")
    steps=${line%% *}
    steps=${steps//[!0-9]/}
    printf 'torch-steps %-5s (%2s)  %7.1fms  %7.1fms %.2fx  %7.1fms %.2fx\n' "$model" "$steps" "$p" "$t" "$(echo "$t / $p" | bc -l)" "$n" "$(echo "$n / $p" | bc -l)"
done
printf '(median of %s interleaved runs, each the median of 8 rounds; %s cores)\n' "$RUNS" "$(nproc)"
