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
cases="global_data:2001 global_bss:2002 tls_static:2003 thread_register:2004 thread_stack:2005 tsd_main_low_key:2006 tsd_main_high_key:2007 unaligned:2008 pointer_to_self:2009 interior:2010 cycle:2011 tree:2012 tree:2112 stale_stack:2013 dlopen_tls:2014 joined_thread:2016 freed:2015"
# LeakSanitizer's and valgrind's lines for blocks of one size (they add up blocks of one
# stack: N bytes in K objects counts when N = size x K).
lsan_parse='
import re, sys
size, kinds = int(sys.argv[1]), set()
for m in re.finditer(r"^(Direct|Indirect) leak of (\d+) byte\(s\) in (\d+) object", sys.stdin.read(), re.M):
    if int(m.group(2)) == size * int(m.group(3)):
        kinds.add("definite" if m.group(1) == "Direct" else "indirect")
print(", ".join(sorted(kinds)) or "not a leak")
'
vg_parse='
import re, sys
size, kinds = int(sys.argv[1]), set()
num = lambda t: int(t.replace(",", ""))
for m in re.finditer(r"== ([\d,]+)(?: \(([\d,]+) direct, [\d,]+ indirect\))? bytes in ([\d,]+) blocks are ([a-z ]+?) in loss", sys.stdin.read()):
    total, direct, blocks, kind = m.group(1), m.group(2), num(m.group(3)), m.group(4)
    if num(direct or total) == size * blocks:
        kinds.add(kind)
print(", ".join(sorted(kinds)) or "-")
'
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
        theirs=$(LD_PRELOAD="$lsan" "$work/cases" "$c" "$work/plugin.so" 2>&1 >/dev/null | python3 -c "$lsan_parse" "$size")
    fi
    vg="n/a"
    if command -v valgrind >/dev/null; then
        vg=$(valgrind --leak-check=full --show-leak-kinds=all "$work/cases" "$c" "$work/plugin.so" 2>&1 >/dev/null | python3 -c "$vg_parse" "$size")
    fi
    echo "| $c | $size | $ours | $theirs | $vg |"
done
