#!/usr/bin/env bash
# How long `leaktrace report` takes, and how much memory, over the exit reports of a
# 256-rank PyTorch job (issue 54: at most 30 s and 2 GiB). One real 2-rank DDP job
# (tests/fixtures/frameworks/ddp_keep.py under torchrun, gloo on CPU) is run under
# leaktrace; its two ranks' final reports are copied into RANKS reports (rank, pid and
# host rewritten: 8 ranks per host), then read by `report` (text and json) and `check`.
#   scripts/bench_ranks.sh [RANKS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
RANKS=${1:-256}; STEPS=${2:-60}
PY=${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}
LT=$PWD/target/release/leaktrace
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
(cd "$work" && "$LT" run --output job -- "$(dirname "$PY")/torchrun" --nproc_per_node 2 "$OLDPWD/tests/fixtures/frameworks/ddp_keep.py" "$STEPS" >/dev/null 2>&1)
"$PY" - "$work/job" "$work/tree" "$RANKS" <<'PY'
import glob, json, os, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ranks = {}
for f in glob.glob(src + "/**/leaktrace.*.json", recursive=True):
    r = json.load(open(f))
    launch = r.get("launch", {})
    if "rank" in launch and not r.get("fork", {}).get("forked_from_pid") and r["reason"] == "exit":
        ranks[launch["rank"]] = r
assert set(ranks) == {0, 1}, ranks.keys()
sizes = [os.path.getsize(f) for f in glob.glob(src + "/**/leaktrace.*.json", recursive=True)]
print("rank report sizes: %s" % ", ".join("%.1f MiB" % (s / 2**20) for s in sorted(sizes)[-2:]))
for k in range(n):
    r = ranks[k % 2]
    r["launch"].update(rank=k, world_size=n, host="node%03d" % (k // 8))
    r["pid"] = 100000 + k
    d = os.path.join(dst, r["launch"]["host"], str(k))
    os.makedirs(d, exist_ok=True)
    json.dump(r, open(os.path.join(d, "leaktrace.python.%d.json" % r["pid"]), "w"))
PY
du -sh "$work/tree" | awk '{print "tree: " $1}'
for args in "report --format json" "report" "check"; do
    /usr/bin/time -f "leaktrace $args: %e s wall, %U s user, %S s sys, %M KiB peak RSS" "$LT" $args "$work/tree" >/dev/null 2>"$work/time" || true
    tail -1 "$work/time"
done
