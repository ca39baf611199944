#!/bin/sh
# Start-up cost of the library (issue 55's third target): /bin/true, which does
# nothing, then short real programs that allocate and leave blocks for the exit report
# (git --version, sort of 1,000 lines), each plain, under an empty preloaded library,
# under leaktrace disabled and recording (its exit report written to tmpfs), interleaved
# round by round; then the cost of a fork in a traced program (scripts/fork_bench.c).
#   scripts/bench_startup.sh [ROUNDS] [LIB] [BASE_LIB]
# BASE_LIB (optional): a second build of the library, measured in the same rounds.
set -eu
rounds=${1:-2000}
root=$(cd "$(dirname "$0")/.." && pwd)
lib=${2:-$root/target/release/libleaktrace.so}
base=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -o "$work/spawn_bench" "$root/scripts/spawn_bench.c"
echo 'void leaktrace_bench_empty(void) {}' > "$work/empty.c"
cc -shared -fPIC -o "$work/empty.so" "$work/empty.c"
shm=/dev/shm/leaktrace-bench-$$
disk=$work/reports
mkdir -p "$shm" "$disk"
seq 1000 | sort -R > "$work/lines"
bench() {
    n=$1
    shift
    set -- "plain:PLAIN=1" "empty preload:LD_PRELOAD=$work/empty.so" "leaktrace disabled:LD_PRELOAD=$lib LEAKTRACE_DISABLE=1" \
        "leaktrace, report tmpfs:LD_PRELOAD=$lib LEAKTRACE_OUTPUT=$shm LEAKTRACE_SUMMARY=0" "leaktrace, report disk:LD_PRELOAD=$lib LEAKTRACE_OUTPUT=$disk LEAKTRACE_SUMMARY=0" \
        ${base:+"base, report tmpfs:LD_PRELOAD=$base LEAKTRACE_OUTPUT=$shm LEAKTRACE_SUMMARY=0"} "$@"
    "$work/spawn_bench" "$n" "$@"
    rm -rf "$shm"/* "$disk"/*
}
echo "== /bin/true"
bench "$rounds" -- /bin/true
# Real programs take longer: a quarter of the rounds.
short=$((rounds / 4 > 20 ? rounds / 4 : 20))
if command -v git >/dev/null; then
    echo "== git --version"
    bench "$short" -- git --version
fi
echo "== sort -n (1,000 lines)"
bench "$short" -- sort -n "$work/lines"
# A fork in a traced process (scripts/fork_bench.c): the child's adoption of the
# parent's state, and its exit report or the traced program it executes. Five rounds,
# the builds interleaved, each 100 forks; the mean ms of one fork..wait.
cc -O2 -o "$work/fork_bench" "$root/scripts/fork_bench.c"
for mode in 0 1; do
    [ "$mode" = 0 ] && echo "== fork, the child _exits (its exit report)" || echo "== fork, the child executes /bin/true"
    for i in 1 2 3 4 5; do
        echo "plain $("$work/fork_bench" 100 "$mode")"
        echo "leaktrace $(LD_PRELOAD=$lib LEAKTRACE_OUTPUT=$shm LEAKTRACE_SUMMARY=0 "$work/fork_bench" 100 "$mode")"
        [ -n "$base" ] && echo "base $(LD_PRELOAD=$base LEAKTRACE_OUTPUT=$shm LEAKTRACE_SUMMARY=0 "$work/fork_bench" 100 "$mode")"
        rm -rf "${shm:?}"/*
    done | awk '{v[$1] = v[$1] " " $2} END {for (k in v) print k ":" v[k] " ms"}' | sort
done
rm -rf "$shm"
