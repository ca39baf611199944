#!/usr/bin/env bash
# Prints the example output shown in README.md ("Try it"): `leaktrace run --fail-on-leak`
# on examples/planted_leaks.c, with addresses, pids and this checkout's path replaced by
# stable placeholders. A test (cli/tests) checks that README.md shows exactly this.
#   scripts/readme_example.sh   (after cargo build --release --workspace)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -g -o "$work/planted_leaks" examples/planted_leaks.c
# Address-space randomization off (setarch -R), so that the output is the same on every
# run: the scan is conservative, and with some layouts a stale word in the uninitialized
# part of stdout's buffer (a freed chunk's link, which glibc's safe-linking scrambles into
# what looks like a heap address) lands in one of the lost structs and keeps it and the
# structs its stale `weights` field points to "reachable" (5-6 of the 100, in ~1 run of
# 12 with randomization on).
norandom=()
if setarch "$(uname -m)" -R true 2>/dev/null; then norandom=(setarch "$(uname -m)" -R); fi
(cd "$work" && "${norandom[@]}" "$OLDPWD/target/release/leaktrace" run --fail-on-leak --top 3 --output reports -- ./planted_leaks 2>&1 >/dev/null || true) |
    sed -E -e "s#$work#/tmp/demo#g" -e "s#$PWD/##g" \
        -e 's/0x[0-9a-f]+/0x…/g' -e 's/pid [0-9]+/pid N/g' -e 's/\.[0-9]+\.[0-9a-f]+\.json/.N.json/g' \
        -e 's#\(/lib/x86_64-linux-gnu/#(/lib/#g'
