#!/usr/bin/env bash
# A/B of two builds of the library on the hot path and on thread starts, interleaved,
# medians of RUNS (default 7) in ms:
#   scripts/ab.sh OLD.so NEW.so [RUNS]
# malloc-1t / malloc-2t: bench/malloc_bench.c with 1 and 2 threads; thread-churn:
# bench/thread_churn.c (20,000 thread starts).
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(realpath "$1"); NEW=$(realpath "$2"); RUNS=${3:-7}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -fomit-frame-pointer -pthread bench/malloc_bench.c -o "$work/malloc_bench"
cc -O2 -pthread bench/thread_churn.c -o "$work/thread_churn"
ms() { local s; s=$(date +%s%N); "$@" >/dev/null 2>&1; echo $(( ($(date +%s%N) - s) / 1000000 )); }
med() { printf "%s\n" "$@" | sort -n | sed -n "$(( ($# + 1) / 2 ))p"; }
export LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0
echo "| workload | plain | A (old) | B (new) |"
echo "|---|---|---|---|"
for w in "malloc-1t:$work/malloc_bench 1" "malloc-2t:$work/malloc_bench 2" "thread-churn:$work/thread_churn"; do
    name=${w%%:*}; cmd=${w#*:}
    p=(); a=(); b=()
    for _ in $(seq "$RUNS"); do
        # shellcheck disable=SC2086
        p+=("$(ms env -u LD_PRELOAD $cmd)"); a+=("$(ms env LD_PRELOAD="$OLD" $cmd)"); b+=("$(ms env LD_PRELOAD="$NEW" $cmd)")
    done
    echo "| $name | $(med "${p[@]}") | $(med "${a[@]}") | $(med "${b[@]}") |"
done
