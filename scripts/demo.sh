#!/usr/bin/env bash
# Builds the library and the bundled example with planted leaks, runs the example under
# leaktrace, and prints the leak summary (stderr) and where the JSON report went.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --lib
mkdir -p target/demo
cc -O2 -g -o target/demo/planted_leaks examples/planted_leaks.c
LD_PRELOAD="$PWD/target/release/libleaktrace.so" LEAKTRACE_OUTPUT="$PWD/target/demo" ./target/demo/planted_leaks
