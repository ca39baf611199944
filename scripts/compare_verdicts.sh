#!/usr/bin/env bash
# Runs the cases of tests/fixtures/lsan_cases.c (the mechanisms of LeakSanitizer's and
# valgrind memcheck's leak tests) under leaktrace, LeakSanitizer (gcc's liblsan,
# preloaded) and valgrind memcheck, and prints one Markdown table of their verdicts.
# Usage: scripts/compare_verdicts.sh   (after cargo build --release)
set -uo pipefail
cd "$(dirname "$0")/.."
lib=target/release/libleaktrace.so
[ -f "$lib" ] || { echo "build first: cargo build --release" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -g -fomit-frame-pointer -pthread tests/fixtures/lsan_cases.c -o "$work/cases" -ldl
cc -O2 -g -shared -fPIC tests/fixtures/tls_keep_plugin.c -o "$work/plugin.so"
lsan=$(cc -print-file-name=liblsan.so)
[ -f "$lsan" ] || lsan=""
cases="global_data:2001 global_bss:2002 tls_static:2003 thread_register:2004 thread_stack:2005 tsd_main_low_key:2006 tsd_main_high_key:2007 unaligned:2008 pointer_to_self:2009 interior:2010 cycle:2011 tree:2012 tree:2112 stale_stack:2013 dlopen_tls:2014 freed:2015"
echo "| case | block | leaktrace | LeakSanitizer | valgrind |"
echo "|---|---|---|---|---|"
for entry in $cases; do
    c=${entry%%:*}; size=${entry##*:}
    rm -rf "$work/out"
    LEAKTRACE_OUTPUT="$work/out" LEAKTRACE_SUMMARY=0 LD_PRELOAD="$PWD/$lib" "$work/cases" "$c" "$work/plugin.so" >/dev/null 2>&1
    ours=$(python3 - "$work/out" "$size" <<'PY'
import glob, json, sys
r = json.load(open(glob.glob(sys.argv[1] + "/leaktrace.cases.*.json")[0]))
size, out = int(sys.argv[2]), []
for g in r["leaks"]:
    for k in ("definite", "indirect", "reachable"):
        a = g["reachability"][k]
        if a["blocks"] and a["bytes"] == size * a["blocks"]:
            out += [k] * a["blocks"]
print(", ".join(sorted(out)) or "-")
PY
)
    theirs="n/a"
    if [ -n "$lsan" ]; then
        txt=$(LD_PRELOAD="$lsan" "$work/cases" "$c" "$work/plugin.so" 2>&1 >/dev/null)
        d=$(grep -c "^Direct leak of $size byte" <<<"$txt"); i=$(grep -c "^Indirect leak of $size byte" <<<"$txt")
        n=$(grep -E "^(Direct|Indirect) leak of [0-9]+ byte\(s\) in [0-9]+ object" <<<"$txt" | grep -E "of $((size * 2)) byte" -c)
        theirs=$( { [ "$d" -gt 0 ] && echo -n "definite "; [ "$i" -gt 0 ] || [ "$n" -gt 0 ] && echo -n "indirect"; } | sed 's/ $//')
        [ -n "$theirs" ] || theirs="not a leak"
    fi
    vg="n/a"
    if command -v valgrind >/dev/null; then
        sz=$(sed ':a;s/\B[0-9]\{3\}\>/,&/;ta' <<<"$size")
        vg=$(valgrind --leak-check=full --show-leak-kinds=all "$work/cases" "$c" "$work/plugin.so" 2>&1 >/dev/null \
            | grep -E "^==[0-9]+== ($sz|[0-9,]+ \($sz direct, [0-9,]+ indirect\)) bytes in [0-9]+ blocks are" | sed -E 's/.* blocks are ([a-z ]+) in loss.*/\1/' | sort | uniq | paste -sd, -)
        [ -n "$vg" ] || vg="-"
    fi
    echo "| $c | $size | $ours | $theirs | $vg |"
done
