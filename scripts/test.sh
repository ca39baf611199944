#!/usr/bin/env bash
# The test command: installs what the tests need (scripts/setup.sh; --no-setup or
# LEAKTRACE_SETUP=0 leaves the machine as it is), builds everything and runs every test:
# unit tests, then the integration tests that run real C, C++ and Python programs under
# the freshly built preload library, and the leaktrace command. cargo test alone never
# rebuilds a cdylib that no test links, hence the build first.
#
# A test that cannot run its assertions here is counted as skipped, with its reason
# (tests/common/skip.rs); under CI a skip for something setup installs is a failure.
# The last lines: `tests: N passed, M failed, K skipped`, then each skipped test.
#
#   scripts/test.sh [--no-setup] [cargo test arguments, e.g. a test name filter]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--no-setup" ]; then
    export LEAKTRACE_SETUP=0
    shift
fi
scripts/setup.sh
# The preload library, the leaktrace command and the shared crate.
cargo build --release --workspace
log=$(mktemp)
skips=$(mktemp)
scratch="target/release/test-scratch target/release/cli-scratch"
cleanup() {
    rm -f "$log" "$skips"
    # Every test's programs, reports and builds live here; failures name their paths,
    # so LEAKTRACE_KEEP_SCRATCH=1 keeps them for a look.
    [ "${LEAKTRACE_KEEP_SCRATCH:-0}" = 1 ] || rm -rf $scratch
}
trap cleanup EXIT
rm -rf $scratch
export LEAKTRACE_SKIP_LOG="$skips"
status=0
# libtest prints `ok` for a test that returned early: the ones that recorded a skip are
# shown as `skipped: REASON` instead (the skip is written before the test returns).
cargo test --release --workspace --no-fail-fast "$@" 2>&1 | awk -v skips="$skips" '
    /^ +Running / { bin = $0; sub(/.*\//, "", bin); sub(/\).*/, "", bin) }
    /^test .* \.\.\. ok$/ {
        name = $2
        while ((getline line < skips) > 0) {
            split(line, f, "\t")
            reason[f[1] "\t" f[2]] = f[3]
        }
        close(skips)
        if ((bin "\t" name) in reason) {
            sub(/ ok$/, " skipped: " reason[bin "\t" name])
        }
    }
    { print; fflush() }' | tee "$log" || status=$?
# One closing line over every test binary, then what did not run and why.
awk -v skips="$skips" '
    /^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i } }
    END {
        while ((getline line < skips) > 0) {
            split(line, a, "\t")
            if (!((a[1] "\t" a[2]) in seen)) { seen[a[1] "\t" a[2]] = 1; k++; list[k] = "  skipped " a[2] " (" a[1] "): " a[3] }
        }
        printf "tests: %d passed, %d failed, %d skipped\n", p - k, f, k
        for (i = 1; i <= k; i++) print list[i]
    }' "$log"
exit "$status"
