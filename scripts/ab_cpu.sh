#!/usr/bin/env bash
# A/B of two builds of the library on any command, interleaved: the medians of RUNS of
# wall time, CPU time (user + system) and peak RSS, without the library, under OLD.so
# and under NEW.so (`/usr/bin/time`).
#   scripts/ab_cpu.sh OLD.so NEW.so RUNS COMMAND...
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "$2"); RUNS=$3; shift 3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0
declare -A W C M
for _ in $(seq "$RUNS"); do
    for t in plain old new; do
        case $t in plain) P= ;; old) P=$OLD ;; new) P=$NEW ;; esac
        LD_PRELOAD=$P /usr/bin/time -o "$work/time" -f "%e %U %S %M" "$@" >/dev/null 2>&1
        read -r w u s m <"$work/time"
        W[$t]+="$w "; C[$t]+="$(echo "$u + $s" | bc) "; M[$t]+="$m "
        rm -rf "$work/reports"
    done
done
med() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo "| build | wall | CPU | peak RSS |"
echo "|---|---|---|---|"
for t in plain old new; do
    echo "| $t | $(echo "${W[$t]}" | med) s | $(echo "${C[$t]}" | med) s | $(echo "${M[$t]}" | med) KiB |"
done
echo "(medians of $RUNS interleaved runs: $*)"
