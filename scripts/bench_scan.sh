#!/usr/bin/env bash
# Reachability scan rate (not a test): a program with 1 GiB of live heap in 1 Mi blocks
# (all reachable through a list, so every byte is scanned) exits under leaktrace with
# LEAKTRACE_SCAN=1; prints the scan's own duration from the report and the rate.
#   scripts/bench_scan.sh [BLOCKS] [BLOCK_SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-1048576}
SIZE=${2:-1024}
cargo build --release --lib -q
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cc -O2 -o "$WORK/scan_bench" bench/scan_bench.c
start=$(date +%s%N)
LD_PRELOAD="$PWD/target/release/libleaktrace.so" LEAKTRACE_SCAN=1 LEAKTRACE_SUMMARY=0 \
    LEAKTRACE_OUTPUT="$WORK" "$WORK/scan_bench" "$N" "$SIZE"
end=$(date +%s%N)
python3 - "$WORK" "$start" "$end" <<'PY'
import glob, json, sys
r = json.load(open(glob.glob(sys.argv[1] + "/leaktrace.*.json")[0]))
s = r["scan"]
gib = s["heap_bytes"] / 2**30
blocks = r["summary"]["host"]["live_blocks"]
print(f"heap {gib:.2f} GiB in {blocks} blocks, roots {s['root_bytes']/2**20:.1f} MiB, "
      f"{s['threads_stopped']}/{s['threads']} thread(s) held")
print(f"scan {s['duration_ms']} ms -> {gib / max(s['duration_ms'], 1) * 1000:.2f} GiB/s on one core "
      f"(whole run {(int(sys.argv[3]) - int(sys.argv[2])) / 1e9:.1f} s)")
reach = r["summary"]["host"]["reachability"]
print("verdicts:", {k: v["blocks"] for k, v in reach.items()})
PY
