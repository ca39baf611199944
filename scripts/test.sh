#!/usr/bin/env bash
# Runs every test: unit tests, then the integration tests that run real C, C++ and
# Python programs under the freshly built preload library, and the leaktrace command.
# cargo test alone never rebuilds a cdylib that no test links, hence the build first.
set -euo pipefail
cd "$(dirname "$0")/.."
# The preload library, the leaktrace command and the shared crate.
cargo build --release --workspace
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --release --workspace --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
# One closing line over every test binary.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
exit "$status"
