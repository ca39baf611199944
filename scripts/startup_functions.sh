#!/usr/bin/env bash
# Makes build/startup_functions.txt, the functions of the preload library that run at a
# short process's start and exit, in the order the linker wrapper
# (scripts/leaktrace-link-gcc) lays them out first: those callgrind sees run in
# `/bin/true`, `git --version` and `sort`, one a line: the name without crate or legacy
# hashes, a tab, and the legacy hash (empty for a name that has none), after a line that
# names the compiler and the kernel (`# rustc ...; Linux ...`). The wrapper takes
# the symbol with that hash, or, where no symbol has it (another compiler), every one
# of that name.
# Run, then rebuild, when tests/environment.rs says the list lacks a function `/bin/true`
# runs (most edits move the crate's inlining); a stale list only orders less.
#   scripts/startup_functions.sh [LIB]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
lib=$(realpath "${1:-$root/target/release/libleaktrace.so}")
command -v valgrind >/dev/null || { echo "valgrind not installed (apt-get install valgrind)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
seq 1000 | sort -R >"$work/lines"
i=0
for cmd in "/bin/true" "git --version" "sort -n $work/lines"; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    LEAKTRACE_TEST_UNDER_CALLGRIND=1 LEAKTRACE_OUTPUT="$work/reports" LEAKTRACE_SUMMARY=0 LD_PRELOAD="$lib" \
        valgrind --demangle=no --tool=callgrind --callgrind-out-file="$work/$i.cg" $cmd >/dev/null 2>&1 || true
done
# The C runtime's functions of the library run at every load and unload (`frame_dummy`
# from the initializers, `__do_global_dtors_aux` from the finalizers; one section of
# crtbeginS.o, which callgrind does not list): first, beside `_init`, not a page of
# their own at the end of the code.
{
printf 'frame_dummy\n__do_global_dtors_aux\n'
for f in "$work"/*.cg; do
    (cd "$work" && callgrind_annotate --threshold=100 "$f") | grep -F "$(basename "$lib")]" || true
done | sed -E 's/^ *[0-9,]+ \([ 0-9.]+%\)  //; s/ \[.*//; s/^[^:]*://' | grep -v '^0x'
} | awk '!seen[$0]++' |
    c++filt | sed -E "s/'[0-9]+$//; s/\.llvm\.[0-9]+$//" |
    sed -E 's/\[[0-9a-f]{16}\]//g; s/::h([0-9a-f]{16})$/\t\1/; /\t/!s/$/\t/' | awk '!seen[$0]++' \
    >"$work/list"
# The first line names the compiler and the kernel: the compiler's inlining and the
# kernel's features (a start-up step's fallback) decide which functions run, and the
# test that checks the list against a run (tests/environment.rs) runs with those.
{ echo "# $(rustc --version); $(uname -s) $(uname -r)"; cat "$work/list"; } >"$root/build/startup_functions.txt"
echo "$(wc -l <"$root/build/startup_functions.txt") functions in build/startup_functions.txt"
