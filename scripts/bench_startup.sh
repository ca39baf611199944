#!/bin/sh
# Start-up cost of the library on a process that does nothing (issue 55's third
# target): /bin/true plain, under an empty preloaded library, under leaktrace disabled
# and recording (its exit report written to tmpfs and to the report directory's disk),
# interleaved round by round.
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
set -- "plain:PLAIN=1" "empty preload:LD_PRELOAD=$work/empty.so" "leaktrace disabled:LD_PRELOAD=$lib LEAKTRACE_DISABLE=1" \
    "leaktrace, report tmpfs:LD_PRELOAD=$lib LEAKTRACE_OUTPUT=$shm" "leaktrace, report disk:LD_PRELOAD=$lib LEAKTRACE_OUTPUT=$disk"
if [ -n "$base" ]; then
    set -- "$@" "base, report tmpfs:LD_PRELOAD=$base LEAKTRACE_OUTPUT=$shm" "base, report disk:LD_PRELOAD=$base LEAKTRACE_OUTPUT=$disk"
fi
"$work/spawn_bench" "$rounds" /bin/true "$@"
rm -rf "$shm"
