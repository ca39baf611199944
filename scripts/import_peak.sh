#!/usr/bin/env bash
# Peak RSS of `python3 -c "import torch"` under each library (or `plain`), runs
# interleaved, median and range in KiB as /usr/bin/time gives it:
#   scripts/import_peak.sh RUNS LIB.so|plain ...
# PYTHON picks the interpreter (default: python3 on PATH, with torch). A quick A/B of
# one change; scripts/ab_memory.sh measures a whole round.
set -euo pipefail
runs=$1; shift
py=${PYTHON:-$(command -v python3)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0
declare -A peaks
for _ in $(seq "$runs"); do
    for lib in "$@"; do
        if [ "$lib" = plain ]; then
            /usr/bin/time -f "%M" -o "$work/t" "$py" -c "import torch" >/dev/null 2>&1 || true
        else
            /usr/bin/time -f "%M" -o "$work/t" env LD_PRELOAD="$(realpath "$lib")" "$py" -c "import torch" >/dev/null 2>&1 || true
        fi
        peaks[$lib]="${peaks[$lib]:-} $(cat "$work/t")"
    done
done
for lib in "$@"; do
    # shellcheck disable=SC2086
    printf "%s\n" ${peaks[$lib]} | sort -n | awk -v lib="$lib" '{v[NR] = $1} END {printf "%s: %d KiB (%d..%d)\n", lib, v[int((NR + 1) / 2)], v[1], v[NR]}'
done
