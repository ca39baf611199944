#!/usr/bin/env bash
# A reproducer of a lost free under load (found and fixed 2026-11-29: glibc freeing a dead
# thread's TLS block on a thread of the library's, see docs/design.md "Releases on threads
# that record nothing"):
# runs tests/fixtures/frameworks/keras_fit.py (TensorFlow) RUNS times under the library
# beside two busy loops and prints, per process report, total_allocs - total_frees -
# live_blocks (0 when every event was applied once and in order) and buffer_full_waits.
#   scripts/identity_under_load.sh [LIB] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
LIB=$(realpath "${1:-target/release/libleaktrace.so}"); RUNS=${2:-8}
PY=${PYTHON:-python3}
yes > /dev/null & y1=$!
yes > /dev/null & y2=$!
trap 'kill $y1 $y2 2>/dev/null || true' EXIT
for _ in $(seq "$RUNS"); do
    d=$(mktemp -d)
    LD_PRELOAD=$LIB LEAKTRACE_OUTPUT=$d LEAKTRACE_SUMMARY=0 "$PY" tests/fixtures/frameworks/keras_fit.py >/dev/null 2>&1 || true
    python3 - "$d" <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*.json"):
    r = json.load(open(f))
    h = r["summary"]["host"]
    print(r["exe"].split("/")[-1], r["reason"], "off by", h["total_allocs"] - h["total_frees"] - h["live_blocks"],
          "buffer_full_waits", r["diagnostics"]["buffer_full_waits"], "lib frees", r["diagnostics"].get("frees_on_library_threads"), "dropped", r["diagnostics"].get("releases_dropped"))
PY
    rm -rf "$d"
done
