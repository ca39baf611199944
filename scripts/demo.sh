#!/usr/bin/env bash
# Builds leaktrace (the library and the command) and the bundled example with planted
# leaks, runs the example the way users do — `leaktrace run --fail-on-leak` — and then
# renders its HTML report. Prints the summary and where the reports and the page went.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace
mkdir -p target/demo
cc -O2 -g -o target/demo/planted_leaks examples/planted_leaks.c
rm -rf target/demo/reports
status=0
(cd target/demo && ../release/leaktrace run --fail-on-leak --output reports -- ./planted_leaks) || status=$?
echo "leaktrace run exited with $status (23: leaks found, as --fail-on-leak asks)"
target/release/leaktrace report --format html target/demo/reports > target/demo/leaks.html
echo "HTML report: target/demo/leaks.html"
