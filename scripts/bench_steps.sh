#!/usr/bin/env bash
# Steady-state overhead on a PyTorch training loop (not a test): bench/torch_steps.py
# times rounds of 50 training steps inside the process, after `import torch` and a
# warm-up round, so the one-off costs (import, exit report) are left out. Runs it plain
# and under leaktrace, interleaved, and prints the median of each and the ratio.
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
plain=() traced=()
for _ in $(seq "$RUNS"); do
    plain+=("$("$PY" bench/torch_steps.py | awk '/^steps50_ms/ {print $2}')")
    traced+=("$(LEAKTRACE_SUMMARY=0 LEAKTRACE_OUTPUT="$OUT" LD_PRELOAD="$LIB" "$PY" bench/torch_steps.py | awk '/^steps50_ms/ {print $2}')")
done
median() { printf '%s\n' "$@" | sort -n | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
p=$(median "${plain[@]}")
t=$(median "${traced[@]}")
printf 'workload              plain   leaktrace\n'
printf 'torch-steps (50)  %7.1fms  %7.1fms  %.2fx\n' "$p" "$t" "$(echo "$t / $p" | bc -l)"
printf '(median of %s interleaved runs, each the median of 8 rounds of 50 steps; %s cores)\n' "$RUNS" "$(nproc)"
