#!/usr/bin/env bash
# What each part of the tracer costs the PyTorch job (not a test): runs
# tests/fixtures/frameworks/torch_train.py train plain and under leaktrace with its parts
# turned off one after another (Python frames, the exit scan, following forked
# children, periodic reports, then stacks cut to one frame), interleaved, and prints
# the median wall time of each and its ratio to plain.
#
#   scripts/bench_parts.sh [RUNS]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
PY=$(python3 -c 'import sys; print(sys.executable)')
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "bench_parts: torch is not installed for $PY (pip install torch)" >&2
    exit 1
fi
cargo build --release --lib -q
LIB="$PWD/target/release/libleaktrace.so"
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
JOB=(tests/fixtures/frameworks/torch_train.py train)
# label|environment (each row adds to the one before, except the last)
CONFIGS=(
    "plain|"
    "leaktrace (everything on)|LD_PRELOAD=$LIB"
    "  Python frames off|LD_PRELOAD=$LIB LEAKTRACE_PYTHON=0"
    "  + no exit scan|LD_PRELOAD=$LIB LEAKTRACE_PYTHON=0 LEAKTRACE_SCAN=0"
    "  + forked children not followed|LD_PRELOAD=$LIB LEAKTRACE_PYTHON=0 LEAKTRACE_SCAN=0 LEAKTRACE_FOLLOW_FORK=0"
    "  + no periodic reports|LD_PRELOAD=$LIB LEAKTRACE_PYTHON=0 LEAKTRACE_SCAN=0 LEAKTRACE_FOLLOW_FORK=0 LEAKTRACE_INTERVAL_MS=0"
    "  + stacks of one frame|LD_PRELOAD=$LIB LEAKTRACE_PYTHON=0 LEAKTRACE_SCAN=0 LEAKTRACE_FOLLOW_FORK=0 LEAKTRACE_INTERVAL_MS=0 LEAKTRACE_STACK_DEPTH=1"
    "Python frames on, scan, children and reports off|LD_PRELOAD=$LIB LEAKTRACE_SCAN=0 LEAKTRACE_FOLLOW_FORK=0 LEAKTRACE_INTERVAL_MS=0"
)
ms() { local s; s=$(date +%s%N); "$@" >/dev/null 2>&1 || true; echo $(( ($(date +%s%N) - s) / 1000000 )); }
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
declare -a times
for _ in $(seq "$RUNS"); do
    for i in "${!CONFIGS[@]}"; do
        read -ra envs <<< "${CONFIGS[$i]#*|}"
        times[i]+="$(ms env LEAKTRACE_SUMMARY=0 LEAKTRACE_OUTPUT="$OUT" "${envs[@]}" "$PY" "${JOB[@]}") "
    done
done
# shellcheck disable=SC2086
plain=$(median ${times[0]})
printf '%-50s %8s %7s\n' configuration ms ratio
for i in "${!CONFIGS[@]}"; do
    # shellcheck disable=SC2086
    m=$(median ${times[i]})
    printf '%-50s %8s %6.2fx\n' "${CONFIGS[$i]%%|*}" "$m" "$(echo "$m / $plain" | bc -l)"
done
printf '(median of %s interleaved runs; %s cores)\n' "$RUNS" "$(nproc)"
