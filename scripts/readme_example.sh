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
(cd "$work" && "$OLDPWD/target/release/leaktrace" run --fail-on-leak --top 3 --output reports -- ./planted_leaks 2>&1 >/dev/null || true) |
    sed -E -e "s#$work#/tmp/demo#g" -e "s#$PWD/##g" \
        -e 's/0x[0-9a-f]+/0x…/g' -e 's/pid [0-9]+/pid N/g' -e 's/\.[0-9]+\.[0-9a-f]+\.json/.N.json/g' \
        -e 's#\(/lib/x86_64-linux-gnu/#(/lib/#g'
