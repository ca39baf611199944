#!/usr/bin/env bash
# Instructions executed by a command under two builds of the library (callgrind), for
# changes too small for wall or CPU time on a shared machine (5-10% from run to run).
# Prints the process's total (which still varies by a few percent: the collector
# thread's share depends on how the threads were scheduled) and the capture's inclusive
# count (`unwind::capture_stack_id`, which does not).
#   scripts/bench_instructions.sh OLD.so NEW.so COMMAND...
# Both builds must honour LEAKTRACE_TEST_UNDER_CALLGRIND (from the commit that added
# this script on; an older one stays off under valgrind and counts nothing of its own).
set -euo pipefail
OLD=$(realpath "$1"); NEW=$(realpath "$2"); shift 2
command -v valgrind >/dev/null || { echo "valgrind not installed (apt-get install valgrind)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "| build | instructions | in capture_stack_id |"
echo "|---|---|---|"
for t in old new; do
    case $t in old) L=$OLD ;; new) L=$NEW ;; esac
    LEAKTRACE_TEST_UNDER_CALLGRIND=1 LD_PRELOAD=$L LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0 \
        valgrind --tool=callgrind --callgrind-out-file="$work/$t.out" "$@" >/dev/null 2>"$work/$t.err" ||
        { echo "$t: valgrind failed:" >&2; tail -5 "$work/$t.err" >&2; exit 1; }
    # Annotated from the scratch directory: from inside the source tree callgrind_annotate
    # shortens the paths of some entries and splits a function's inclusive count.
    total=$(cd "$work" && callgrind_annotate "$t.out" | awk '/PROGRAM TOTALS/ {print $1}')
    capture=$(cd "$work" && callgrind_annotate --inclusive=yes "$t.out" | awk '/unwind.rs:leaktrace::hotpath::unwind::capture_stack_id \[/ && !done {print $1; done = 1}')
    echo "| $t | $total | ${capture:-0} |"
done
echo "(callgrind: $*)"
