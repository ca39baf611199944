#!/usr/bin/env bash
# Builds the leaktrace wheel (the command with its library built in), tagged
# manylinux_2_35_x86_64 (the library needs glibc >= 2.35), into DIR (default dist/).
# maturin comes from PyPI into a throwaway virtual environment. Install the result with
# `python3 -m pip install DIR/leaktrace-*.whl`: that machine needs no Rust toolchain.
# (`python3 -m pip install .` builds and installs in one step, with a local tag.)
#   scripts/build_wheel.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools/venv"
"$tools/venv/bin/python" -m pip install -q "maturin>=1.5,<2"
"$tools/venv/bin/maturin" build --release --out "$out"
ls -l "$out"/leaktrace-*.whl
