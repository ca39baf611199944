#!/usr/bin/env bash
# Overhead benchmark (not a test). Prints, from one run of this script, the median wall
# time of each command without the library, under leaktrace, and under the peers that
# are installed, and the ratios to the plain run.
#
#   scripts/bench.sh [RUNS] [SET]   RUNS per cell, interleaved (default 5; valgrind runs once)
#
# SET malloc (default): the allocator hot path, against heaptrack, LeakSanitizer (gcc's
# liblsan preloaded), jemalloc with leak profiling of every allocation, valgrind memcheck.
#   malloc-1t / malloc-2t  bench/malloc_bench.c: 2 M malloc/free pairs, 16..4096 B,
#                          1000-block window, ~30-frame stacks, -O2 without frame pointers
#   new-stacks             bench/new_stacks.c: 2^19 distinct ~40-frame call paths, one
#                          malloc/free each (every stack new, as in `import torch`)
#   sqlite3                bench/sqlite_workload.sql on an in-memory database (Debian sqlite3)
# SET frameworks: real ML programs, against heaptrack and LeakSanitizer (jemalloc's
# profiler and valgrind are left out: valgrind takes minutes a run here, and a preloaded
# jemalloc replaces the allocator these programs are measured with).
#   pytorch                tests/fixtures/frameworks/torch_train.py train (import, 2 epochs,
#                          2 forked DataLoader workers)
#   caffe-time             caffe time, 50 iterations of the LeNet-style DummyData net
#                          (needs scripts/install_caffe.sh)
#   python-default         bench/python_alloc.py under Python's default allocator
#   python-malloc          the same under PYTHONMALLOC=malloc (every object a malloc)
# In this set leaktrace also runs with Python frames off (leaktrace-nopy:
# LEAKTRACE_PYTHON=0): the cost of Python frames is the difference.
#
# Peers come from Debian: apt-get install heaptrack liblsan0 libjemalloc2 valgrind
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
SET=${2:-malloc}
# A run that takes longer than this is killed and shown as "hung".
LIMIT=${BENCH_TIMEOUT:-300}
cargo build --release --lib -q
LIB="$PWD/target/release/libleaktrace.so"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# ENVS: variables for the workload's program itself, set outside the tool so that each
# tool traces the program, not an `env` in front of it (heaptrack follows no exec).
declare -a NAMES=() CMDS=() ENVS=()
TOOLS=("plain" "leaktrace")
LSAN=/usr/lib/x86_64-linux-gnu/liblsan.so.0
JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
if command -v heaptrack >/dev/null; then TOOLS+=("heaptrack"); fi
case $SET in
malloc)
    cc -O2 -fomit-frame-pointer -pthread -o "$WORK/malloc_bench" bench/malloc_bench.c
    cc -O2 -fomit-frame-pointer -o "$WORK/new_stacks" bench/new_stacks.c
    NAMES+=("malloc-1t" "malloc-2t" "new-stacks")
    CMDS+=("$WORK/malloc_bench 1" "$WORK/malloc_bench 2" "$WORK/new_stacks")
    ENVS+=("" "" "")
    if command -v sqlite3 >/dev/null; then
        NAMES+=("sqlite3")
        CMDS+=("sqlite3 :memory: -init bench/sqlite_workload.sql .quit")
        ENVS+=("")
    fi
    if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
    if [ -e "$JEMALLOC" ]; then TOOLS+=("jemalloc-prof"); fi
    if command -v valgrind >/dev/null; then TOOLS+=("valgrind"); fi
    ;;
frameworks)
    # The interpreter itself, not a shim script that runs other programs first.
    PY=$(python3 -c 'import sys; print(sys.executable)')
    if "$PY" -c 'import torch' 2>/dev/null; then
        NAMES+=("pytorch")
        CMDS+=("$PY tests/fixtures/frameworks/torch_train.py train")
        ENVS+=("")
    fi
    CAFFE=/var/cache/leaktrace/caffe
    if [ -x "$CAFFE/usr/bin/caffe" ]; then
        NAMES+=("caffe-time")
        CMDS+=("$CAFFE/usr/bin/caffe time -model tests/fixtures/frameworks/caffe/lenet_dummy.prototxt -iterations 50")
        ENVS+=("LD_LIBRARY_PATH=$(scripts/install_caffe.sh "$CAFFE" | tail -n 1)")
    fi
    NAMES+=("python-default" "python-malloc")
    CMDS+=("$PY bench/python_alloc.py" "$PY bench/python_alloc.py")
    ENVS+=("" "PYTHONMALLOC=malloc")
    TOOLS=("plain" "leaktrace" "leaktrace-nopy" "${TOOLS[@]:2}")
    if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
    ;;
*) echo "unknown set $SET: malloc or frameworks" >&2; exit 2 ;;
esac

run_once() { # tool, VAR=value list, command... -> seconds, "fail" or "hung"
    local tool=$1 vars=$2; shift 2
    # shellcheck disable=SC2086
    if [ -n "$vars" ]; then export $vars; fi
    local start end rc=0
    start=$(date +%s%N)
    set +e
    case $tool in
        plain) timeout -k 10 "$LIMIT" "$@" >/dev/null 2>&1 ;;
        leaktrace) LD_PRELOAD="$LIB" LEAKTRACE_OUTPUT="$WORK" LEAKTRACE_SUMMARY=0 timeout -k 10 "$LIMIT" "$@" >/dev/null 2>&1 ;;
        leaktrace-nopy) LD_PRELOAD="$LIB" LEAKTRACE_PYTHON=0 LEAKTRACE_OUTPUT="$WORK" LEAKTRACE_SUMMARY=0 timeout -k 10 "$LIMIT" "$@" >/dev/null 2>&1 ;;
        heaptrack) timeout -k 10 "$LIMIT" heaptrack -o "$WORK/ht" "$@" >/dev/null 2>&1; rm -f "$WORK"/ht* ;;
        lsan) LD_PRELOAD="$LSAN" LSAN_OPTIONS=exitcode=0 timeout -k 10 "$LIMIT" "$@" >/dev/null 2>&1 ;;
        jemalloc-prof) LD_PRELOAD="$JEMALLOC" MALLOC_CONF="prof:true,prof_leak:true,lg_prof_sample:0,prof_final:true,prof_prefix:$WORK/jeprof" timeout -k 10 "$LIMIT" "$@" >/dev/null 2>&1; rm -f "$WORK"/jeprof* ;;
        valgrind) timeout -k 10 "$LIMIT" valgrind --leak-check=full --show-leak-kinds=all "$@" >/dev/null 2>&1 ;;
    esac
    rc=$?
    set -e
    end=$(date +%s%N)
    # (heaptrack's wrapper script does not pass timeout's 124 on.)
    if [ "$rc" -eq 124 ] || [ $(((end - start) / 1000000000)) -ge "$LIMIT" ]; then echo hung; return; fi
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
            t=$(run_once "$tool" "${ENVS[$i]}" ${CMDS[$i]})
            SAMPLES["$i,$tool"]+="$t "
        done
    done
done

printf '%-14s' "workload"
for tool in "${TOOLS[@]}"; do printf '%15s' "$tool"; done
printf '\n'
for i in "${!NAMES[@]}"; do
    base=$(echo "${SAMPLES["$i,plain"]}" | tr ' ' '\n' | grep . | median)
    printf '%-14s' "${NAMES[$i]}"
    for tool in "${TOOLS[@]}"; do
        all=$(echo "${SAMPLES["$i,$tool"]}" | tr ' ' '\n' | grep .)
        m=$(echo "$all" | { grep -v -e fail -e hung || true; } | median)
        if [ -z "$m" ] && echo "$all" | grep -q hung; then
            printf '%15s' "hung"
        elif [ -z "$m" ]; then
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
