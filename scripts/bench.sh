#!/usr/bin/env bash
# Overhead benchmark (not a test). Runs each workload without the library, under
# leaktrace and under the peers that are installed, interleaved, and prints for each
# the medians of: wall time, CPU time (user + system, the whole process tree), peak RSS
# (of the largest process, as /usr/bin/time reports it) and the size of the tool's own
# files: its output files, and for leaktrace also its stack tables' spill files (unnamed
# while it runs: each process's final report gives their size, `memory.tracer_files`);
# with ratios to the plain run (RSS and files: MiB added).
#
#   scripts/bench.sh [RUNS] [SET]   RUNS per cell, interleaved (default 5; valgrind runs once)
#   BENCH_FORMAT=md                 a Markdown table (the README's)
#   BENCH_ONLY=REGEX                only the workloads whose names match
#   BENCH_BASE=LIB                  also another build of the library (leaktrace-base), in
#                                   the same interleaved rounds: a change's A/B
#   BENCH_PEERS=0                   no peers: plain and leaktrace only
#
# SET cost (the README's table): what a CI machine pays, in CPU and memory as well as time.
#   bash-loop      bash, 300,000 iterations of arithmetic and a string assignment
#   malloc-1t/-2t  bench/malloc_bench.c (below)
#   true-x200      /bin/true 200 times from sh, the whole loop under LD_PRELOAD (each
#                  process starts the library and writes its exit report)
#   import-torch   python, a script of one line: import torch
#   pytorch        tests/fixtures/frameworks/torch_train.py train (forked DataLoader workers);
#                  a second row gives the peak RSS of its largest worker (issue 55 bounds
#                  each worker: scripts/peaks.py --watch, every 10 ms)
#   ddp-rank       a 2-rank DDP job on CPU (torchrun, gloo: tests/fixtures/frameworks/ddp_keep.py,
#                  40 steps): peak RSS of its largest process (a rank), files of the process
#                  with the most (each rank's own: the issue counts them per rank)
#   peers: memray run --native (Python workloads), heaptrack, LeakSanitizer (gcc's liblsan)
# SET malloc (default): the allocator hot path, against heaptrack, LeakSanitizer,
# jemalloc with leak profiling of every allocation, valgrind memcheck.
#   malloc-1t / malloc-2t  bench/malloc_bench.c: 2 M malloc/free pairs, 16..4096 B,
#                          1000-block window, ~30-frame stacks, -O2 without frame pointers
#   new-stacks             bench/new_stacks.c: 2^19 distinct ~40-frame call paths, one
#                          malloc/free each (every stack new, as in `import torch`)
#   sqlite3                bench/sqlite_workload.sql on an in-memory database (Debian sqlite3)
# SET frameworks: real ML programs, against heaptrack and LeakSanitizer.
#   pytorch                tests/fixtures/frameworks/torch_train.py train
#   caffe-time             caffe time, 50 iterations of the LeNet-style DummyData net
#                          (needs scripts/install_caffe.sh)
#   python-default         bench/python_alloc.py under Python's default allocator
#   python-malloc          the same under PYTHONMALLOC=malloc (every object a malloc)
# In this set leaktrace also runs with Python frames off (leaktrace-nopy:
# LEAKTRACE_PYTHON=0): the cost of Python frames is the difference.
#
# Peers: apt-get install heaptrack liblsan0 libjemalloc2 valgrind; pip install memray
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
SET=${2:-malloc}
FORMAT=${BENCH_FORMAT:-text}
# A run that takes longer than this is killed and shown as "hung".
LIMIT=${BENCH_TIMEOUT:-300}
cargo build --release --lib -q
LIB="$PWD/target/release/libleaktrace.so"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# ENVS: variables for the workload's program itself, set outside the tool so that each
# tool traces the program, not an `env` in front of it (heaptrack follows no exec).
declare -a NAMES=() CMDS=() ENVS=()
TOOLS=("plain" "leaktrace")
LSAN=/usr/lib/x86_64-linux-gnu/liblsan.so.0
JEMALLOC=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2
if command -v heaptrack >/dev/null; then TOOLS+=("heaptrack"); fi
# The interpreter itself, not a shim script that runs other programs first.
PY=$(python3 -c 'import sys; print(sys.executable)')
# Tools that do not apply to a workload: "WORKLOAD:TOOL" (heaptrack and memray follow
# no exec; memray runs Python only).
SKIP=" "
# Workloads whose files are counted per process (the largest), not summed.
PER_PROCESS=" "
# Workloads whose forked workers' peak RSS is watched too: "WORKLOAD:PROCESS-NAME".
WATCH=" "
case $SET in
cost)
    cc -O2 -fomit-frame-pointer -pthread -o "$WORK/malloc_bench" bench/malloc_bench.c
    NAMES+=("bash-loop" "malloc-1t" "malloc-2t" "true-x200")
    CMDS+=("bash $WORK/loop.sh" "$WORK/malloc_bench 1" "$WORK/malloc_bench 2" "sh $WORK/true200.sh")
    ENVS+=("" "" "" "")
    printf 'i=0; s=""\nwhile [ $i -lt 300000 ]; do i=$((i+1)); s="x$i"; done\n' >"$WORK/loop.sh"
    printf 'for i in $(seq 200); do /bin/true; done\n' >"$WORK/true200.sh"
    SKIP+="true-x200:heaptrack "
    if "$PY" -c 'import torch' 2>/dev/null; then
        NAMES+=("import-torch" "pytorch")
        CMDS+=("$PY $WORK/import_torch.py" "$PY tests/fixtures/frameworks/torch_train.py train")
        echo "import torch" >"$WORK/import_torch.py"
        ENVS+=("" "")
        WATCH+=" pytorch:pt_data_worker "
        if [ -x "$(dirname "$PY")/torchrun" ]; then
            # In a directory of its own: each rank writes a file there.
            mkdir -p "$WORK/ddp"
            printf 'cd %s && exec %s --nproc_per_node 2 %s 40\n' "$WORK/ddp" "$(dirname "$PY")/torchrun" "$PWD/tests/fixtures/frameworks/ddp_keep.py" >"$WORK/ddp.sh"
            NAMES+=("ddp-rank")
            CMDS+=("sh $WORK/ddp.sh")
            ENVS+=("")
            # memray and heaptrack follow no exec (the ranks are started so); under
            # LeakSanitizer the PyTorch rows take 15-20x or hang.
            SKIP+="ddp-rank:memray ddp-rank:heaptrack ddp-rank:lsan "
            PER_PROCESS+=" ddp-rank "
        fi
    fi
    if "$PY" -c 'import memray' 2>/dev/null; then TOOLS+=("memray"); fi
    for n in "${NAMES[@]}"; do
        case $n in import-torch | pytorch) ;; *) SKIP+="$n:memray " ;; esac
    done
    if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
    ;;
malloc)
    cc -O2 -fomit-frame-pointer -pthread -o "$WORK/malloc_bench" bench/malloc_bench.c
    cc -O2 -fomit-frame-pointer -o "$WORK/new_stacks" bench/new_stacks.c
    NAMES+=("malloc-1t" "malloc-2t" "new-stacks")
    CMDS+=("$WORK/malloc_bench 1" "$WORK/malloc_bench 2" "$WORK/new_stacks")
    ENVS+=("" "" "")
    if command -v sqlite3 >/dev/null; then
        NAMES+=("sqlite3")
        CMDS+=("sqlite3 :memory: -init bench/sqlite_workload.sql .quit")
        ENVS+=("")
    fi
    if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
    if [ -e "$JEMALLOC" ]; then TOOLS+=("jemalloc-prof"); fi
    if command -v valgrind >/dev/null; then TOOLS+=("valgrind"); fi
    ;;
frameworks)
    if "$PY" -c 'import torch' 2>/dev/null; then
        NAMES+=("pytorch")
        CMDS+=("$PY tests/fixtures/frameworks/torch_train.py train")
        ENVS+=("")
    fi
    CAFFE=/var/cache/leaktrace/caffe
    if [ -x "$CAFFE/usr/bin/caffe" ]; then
        NAMES+=("caffe-time")
        CMDS+=("$CAFFE/usr/bin/caffe time -model tests/fixtures/frameworks/caffe/lenet_dummy.prototxt -iterations 50")
        ENVS+=("LD_LIBRARY_PATH=$(scripts/install_caffe.sh "$CAFFE" | tail -n 1)")
    fi
    NAMES+=("python-default" "python-malloc")
    CMDS+=("$PY bench/python_alloc.py" "$PY bench/python_alloc.py")
    ENVS+=("" "PYTHONMALLOC=malloc")
    TOOLS=("plain" "leaktrace" "leaktrace-nopy" "${TOOLS[@]:2}")
    if [ -e "$LSAN" ]; then TOOLS+=("lsan"); fi
    ;;
*) echo "unknown set $SET: cost, malloc or frameworks" >&2; exit 2 ;;
esac

# Leaktrace's files in DIR, from each process's final report (`memory.tracer_files`, its
# stack tables' spill files): "sum", the spill files of every process traced; "max", the
# most that one process has, its report and its spill files.
tracer_files() {
    "$PY" - "$1" "$2" <<'PY'
import json, pathlib, sys
each = []
for f in pathlib.Path(sys.argv[1]).rglob("leaktrace.*.json"):
    try:
        each.append((f.stat().st_size, json.loads(f.read_text()).get("memory", {}).get("tracer_files", 0)))
    except (OSError, ValueError):
        pass
if sys.argv[2] == "max":
    print(max((report + spill for report, spill in each), default=0))
else:
    print(sum(spill for _, spill in each))
PY
}

run_once() { # tool, VAR=value list, per-process files (1/0), watched process name or "", command...
    # -> "wall cpu rss_kib files_bytes workers_peak_kib", "fail" or "hung"
    local tool=$1 vars=$2 per_process=$3 watched=$4; shift 4
    # shellcheck disable=SC2086
    if [ -n "$vars" ]; then export $vars; fi
    local out="$WORK/out" rc=0 watcher=""
    rm -rf "$out" && mkdir -p "$out"
    echo "0 0" >"$WORK/workers"
    if [ -n "$watched" ]; then
        # This subshell's tree: the tool, the program and its workers (and the watcher).
        # Read here: in the command put in the background it would be that command's.
        local me=$BASHPID
        "$PY" scripts/peaks.py --watch "$me" "$watched" "$WORK/workers" &
        watcher=$!
    fi
    local -a pre=(/usr/bin/time -o "$WORK/time" -f "%e %U %S %M" timeout -k 10 "$LIMIT")
    set +e
    case $tool in
        plain) "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        leaktrace) LD_PRELOAD="$LIB" LEAKTRACE_OUTPUT="$out" LEAKTRACE_SUMMARY=0 "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        leaktrace-base) LD_PRELOAD="$BENCH_BASE" LEAKTRACE_OUTPUT="$out" LEAKTRACE_SUMMARY=0 "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        leaktrace-nopy) LD_PRELOAD="$LIB" LEAKTRACE_PYTHON=0 LEAKTRACE_OUTPUT="$out" LEAKTRACE_SUMMARY=0 "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        heaptrack) "${pre[@]}" heaptrack -o "$out/ht" "$@" >/dev/null 2>&1 ;;
        memray)
            # `python -c CODE` or `python SCRIPT ARGS`, as memray run takes them.
            local py=$1; shift
            "${pre[@]}" "$py" -m memray run --native --follow-fork -q -f -o "$out/memray.bin" "$@" >/dev/null 2>&1 ;;
        lsan) LD_PRELOAD="$LSAN" LSAN_OPTIONS=exitcode=0 "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        jemalloc-prof) LD_PRELOAD="$JEMALLOC" MALLOC_CONF="prof:true,prof_leak:true,lg_prof_sample:0,prof_final:true,prof_prefix:$out/jeprof" "${pre[@]}" "$@" >/dev/null 2>&1 ;;
        valgrind) "${pre[@]}" valgrind --leak-check=full --show-leak-kinds=all "$@" >/dev/null 2>&1 ;;
    esac
    rc=$?
    if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null; fi
    set -e
    local workers
    workers=$(cut -d' ' -f1 "$WORK/workers")
    # (heaptrack's wrapper script does not pass timeout's 124 on.)
    local t
    t=$(tail -n 1 "$WORK/time" 2>/dev/null || true)
    local wall=${t%% *}
    if [ "$rc" -eq 124 ] || [ "${wall%%.*}" -ge "$LIMIT" ] 2>/dev/null; then echo hung; return; fi
    if [ "$rc" -ne 0 ] || [ -z "$t" ]; then echo fail; return; fi
    local files
    files=$(du -sb "$out" | cut -f1)
    case $tool in
        leaktrace*)
            if [ "$per_process" = 1 ]; then
                files=$(tracer_files "$out" max)
            else
                files=$((files + $(tracer_files "$out" sum)))
            fi
            ;;
    esac
    # shellcheck disable=SC2086
    set -- $t
    echo "$1 $(echo "$2 + $3" | bc | sed 's/^\./0./') $4 $files $workers"
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# The process name whose peak RSS is watched in WORKLOAD ("" for none).
watched_name() {
    local w
    for w in $WATCH; do
        if [ "${w%%:*}" = "$1" ]; then echo "${w#*:}"; return; fi
    done
}

if [ "${BENCH_PEERS:-1}" = 0 ]; then
    keep=()
    for t in "${TOOLS[@]}"; do case $t in plain | leaktrace*) keep+=("$t") ;; esac; done
    TOOLS=("${keep[@]}")
fi
if [ -n "${BENCH_BASE:-}" ]; then
    [ -e "$BENCH_BASE" ] || { echo "BENCH_BASE=$BENCH_BASE: no such file (a libleaktrace.so to compare with)" >&2; exit 2; }
    TOOLS=("${TOOLS[0]}" "${TOOLS[1]}" "leaktrace-base" "${TOOLS[@]:2}")
fi

declare -A SAMPLES
for ((r = 0; r < RUNS; r++)); do
    for i in "${!NAMES[@]}"; do
        if [ -n "${BENCH_ONLY:-}" ] && ! [[ ${NAMES[$i]} =~ $BENCH_ONLY ]]; then continue; fi
        for tool in "${TOOLS[@]}"; do
            if [ "$tool" = valgrind ] && [ "$r" -gt 0 ]; then continue; fi
            case $SKIP in *" ${NAMES[$i]}:$tool "*) continue ;; esac
            per=0
            case $PER_PROCESS in *" ${NAMES[$i]} "*) per=1 ;; esac
            watched=$(watched_name "${NAMES[$i]}")
            # shellcheck disable=SC2086
            t=$(run_once "$tool" "${ENVS[$i]}" "$per" "$watched" ${CMDS[$i]})
            SAMPLES["$i,$tool"]+="${t// /,};"
        done
    done
done

# The median of field F (1 wall, 2 CPU, 3 RSS KiB, 4 files, 5 largest watched worker's
# peak RSS KiB) of a cell's good samples.
field() { echo "$1" | tr ';' '\n' | { grep -v -e '^$' -e fail -e hung || true; } | cut -d, -f"$2" | median; }
mib() { echo "scale=1; $1 / 1048576" | bc | sed 's/^\./0./'; }

if [ "$FORMAT" = md ]; then
    echo "| workload | tool | wall | CPU time | peak RSS | its files |"
    echo "|---|---|---|---|---|---|"
else
    printf '%-14s %-15s %-16s %-16s %-20s %s\n' workload tool wall "CPU time" "peak RSS" "its files"
fi
for i in "${!NAMES[@]}"; do
    plain="${SAMPLES["$i,plain"]:-}"
    [ -n "$plain" ] || continue
    bw=$(field "$plain" 1)
    bc_=$(field "$plain" 2)
    br=$(field "$plain" 3)
    for tool in "${TOOLS[@]}"; do
        all="${SAMPLES["$i,$tool"]:-}"
        [ -n "$all" ] || continue
        w=$(field "$all" 1)
        if [ -z "$w" ]; then
            if echo "$all" | grep -q hung; then cells=("hung" "" "" ""); else cells=("failed" "" "" ""); fi
        elif [ "$tool" = plain ]; then
            cells=("${w}s" "${bc_}s" "$(mib $((br * 1024))) MiB" "")
        else
            c=$(field "$all" 2)
            rss=$(field "$all" 3)
            files=$(field "$all" 4)
            cells=("${w}s $(echo "scale=2; $w / $bw" | bc)x" "${c}s $(echo "scale=2; $c / $bc_" | bc)x"
                "$(mib $((rss * 1024))) MiB (+$(mib $(((rss - br) * 1024))))" "$(mib "$files") MiB")
        fi
        if [ "$FORMAT" = md ]; then
            echo "| ${NAMES[$i]} | $tool | ${cells[0]} | ${cells[1]} | ${cells[2]} | ${cells[3]} |"
        else
            printf '%-14s %-15s %-16s %-16s %-20s %s\n' "${NAMES[$i]}" "$tool" "${cells[@]}"
        fi
    done
    # The same runs' largest worker, by its peak RSS alone.
    [ -n "$(watched_name "${NAMES[$i]}")" ] || continue
    bwk=$(field "$plain" 5)
    for tool in "${TOOLS[@]}"; do
        all="${SAMPLES["$i,$tool"]:-}"
        wk=$(field "$all" 5)
        if [ -z "$wk" ] || [ "$wk" = 0 ] || [ -z "$bwk" ] || [ "$bwk" = 0 ]; then continue; fi
        if [ "$tool" = plain ]; then rss="$(mib $((wk * 1024))) MiB"; else rss="$(mib $((wk * 1024))) MiB (+$(mib $(((wk - bwk) * 1024))))"; fi
        if [ "$FORMAT" = md ]; then
            echo "| ${NAMES[$i]}, largest worker | $tool | – | – | $rss | – |"
        else
            printf '%-14s %-15s %-16s %-16s %-20s %s\n' "${NAMES[$i]}-worker" "$tool" "-" "-" "$rss" "-"
        fi
    done
done
echo "(medians of $RUNS interleaved runs, valgrind 1 run; $(nproc) cores; $(uname -m); $(date -u +%Y-%m-%d))"
