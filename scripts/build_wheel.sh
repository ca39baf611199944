#!/usr/bin/env bash
# Builds the leaktrace wheel (the command with its library built in) into DIR
# (default dist/). Install it with `python3 -m pip install DIR/leaktrace-*.whl`: the
# machine that installs it needs no Rust toolchain.
#   scripts/build_wheel.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
python3 -m pip wheel --no-deps . -w "$out"
ls -l "$out"/leaktrace-*.whl
