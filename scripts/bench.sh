#!/usr/bin/env bash
# Overhead benchmark (not a test). Prints, from one run of this script, the median wall
# time of each command without the library, under leaktrace, and under the peers that
# are installed — heaptrack, LeakSanitizer (gcc's liblsan preloaded), jemalloc with
# leak profiling of every allocation, valgrind memcheck — and the ratios to the plain run.
#
#   scripts/bench.sh [RUNS]      (default 5 runs per cell, interleaved; valgrind runs once)
#
# Peers come from Debian: apt-get install heaptrack liblsan0 libjemalloc2 valgrind
#
# Workloads:
#   malloc-1t / malloc-2t  bench/malloc_bench.c: 2 M malloc/free pairs, 16..4096 B,
#                          1000-block window, ~30-frame stacks, -O2 without frame pointers
#   sqlite3                bench/sqlite_workload.sql on an in-memory database (Debian sqlite3)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
cargo build --release --lib -q
LIB="$PWD/target/release/libleaktrace.so"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cc -O2 -fomit-frame-pointer -pthread -o "$WORK/malloc_bench" bench/malloc_bench.c

declare -a NAMES=("malloc-1t" "malloc-2t")
declare -a CMDS=("$WORK/malloc_bench 1" "$WORK/malloc_bench 2")
if command -v sqlite3 >/dev/null; then
    NAMES+=("sqlite3")
    CMDS+=("sqlite3 :memory: -init bench/sqlite_workload.sql .quit")
fi
TOOLS=("plain" "leaktrace")
LSAN=/usr/lib/x86_64-linux-gnu/liblsan.so.0
JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
if command -v heaptrack >/dev/null; then TOOLS+=("heaptrack"); fi
if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
if [ -e "$JEMALLOC" ]; then TOOLS+=("jemalloc-prof"); fi
if command -v valgrind >/dev/null; then TOOLS+=("valgrind"); fi

run_once() { # tool, command... -> seconds on stdout, or "fail" when the command failed
    local tool=$1; shift
    local start end rc=0
    start=$(date +%s%N)
    set +e
    case $tool in
        plain) "$@" >/dev/null 2>&1 ;;
        leaktrace) LD_PRELOAD="$LIB" LEAKTRACE_OUTPUT="$WORK" LEAKTRACE_SUMMARY=0 "$@" >/dev/null 2>&1 ;;
        heaptrack) heaptrack -o "$WORK/ht" "$@" >/dev/null 2>&1; rm -f "$WORK"/ht* ;;
        lsan) LD_PRELOAD="$LSAN" LSAN_OPTIONS=exitcode=0 "$@" >/dev/null 2>&1 ;;
        jemalloc-prof) LD_PRELOAD="$JEMALLOC" MALLOC_CONF="prof:true,prof_leak:true,lg_prof_sample:0,prof_final:true,prof_prefix:$WORK/jeprof" "$@" >/dev/null 2>&1; rm -f "$WORK"/jeprof* ;;
        valgrind) valgrind --leak-check=full --show-leak-kinds=all "$@" >/dev/null 2>&1 ;;
    esac
    rc=$?
    set -e
    end=$(date +%s%N)
    if [ "$rc" -ne 0 ]; then echo fail; return; fi
    echo "scale=4; ($end - $start) / 1000000000" | bc
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

declare -A SAMPLES
for ((r = 0; r < RUNS; r++)); do
    for i in "${!NAMES[@]}"; do
        for tool in "${TOOLS[@]}"; do
            if [ "$tool" = valgrind ] && [ "$r" -gt 0 ]; then continue; fi
            # shellcheck disable=SC2086
            t=$(run_once "$tool" ${CMDS[$i]})
            SAMPLES["$i,$tool"]+="$t "
        done
    done
done

printf '%-12s' "workload"
for tool in "${TOOLS[@]}"; do printf '%15s' "$tool"; done
printf '\n'
for i in "${!NAMES[@]}"; do
    base=$(echo "${SAMPLES["$i,plain"]}" | tr ' ' '\n' | grep . | median)
    printf '%-12s' "${NAMES[$i]}"
    for tool in "${TOOLS[@]}"; do
        m=$(echo "${SAMPLES["$i,$tool"]}" | tr ' ' '\n' | grep . | { grep -v fail || true; } | median)
        if [ -z "$m" ]; then
            printf '%15s' "failed"
        elif [ "$tool" = plain ]; then
            printf '%13ss' "$m"
        else
            printf '%8ss %5sx' "$m" "$(echo "scale=2; $m / $base" | bc)"
        fi
    done
    printf '\n'
done
echo "(median of $RUNS runs each, valgrind 1 run; $(nproc) cores; $(uname -m))"
