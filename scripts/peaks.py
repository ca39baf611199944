#!/usr/bin/env python3
"""Peak RSS of every process of a command's tree: the command itself and each process it
forks (a PyTorch DataLoader's workers, torchrun's ranks), plain and under each build of
the library, interleaved run by run. `/usr/bin/time` gives one number for a tree; issue
55 sets a bound for each worker and each rank.

    scripts/peaks.py RUNS LIB [LIB...] -- COMMAND...
    scripts/peaks.py --watch PID NAME OUT   (for scripts/bench.sh)

Each process's `VmHWM` is read every 10 ms while it lives (the high-water mark only
rises, so the last read is its peak up to 10 ms before it ended). Prints, for plain and
each library, the medians over the runs of: the command's own peak, and the median and
largest peak of the other processes, grouped by their name (`comm`), in KiB.

`--watch PID NAME OUT` samples the tree of PID the same way, for the processes named
NAME, until PID ends or the watcher gets SIGTERM, then writes to OUT "LARGEST COUNT":
the largest of their peaks in KiB and how many there were (0 0 when none ran).
"""
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def tree(root):
    """The pids of `root` and its descendants now."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return fields["Name"].strip(), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def run_once(env_extra, command):
    env = dict(os.environ, **env_extra)
    with tempfile.TemporaryDirectory() as out:
        env.setdefault("LEAKTRACE_OUTPUT", out)
        env.setdefault("LEAKTRACE_SUMMARY", "0")
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen = {}
        while proc.poll() is None:
            for pid in tree(proc.pid):
                got = hwm(pid)
                if got:
                    seen[pid] = got
            time.sleep(0.01)
    root = seen.pop(proc.pid, ("", 0))[1]
    by_name = {}
    for name, peak in seen.values():
        by_name.setdefault(name, []).append(peak)
    return root, by_name


def watch(root, name, out):
    """`--watch`: see the module's text."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    seen = {}
    while not stop and os.path.exists(f"/proc/{root}"):
        for pid in tree(root):
            got = hwm(pid)
            if got and got[0] == name:
                seen[pid] = got[1]
        time.sleep(0.01)
    with open(out, "w") as f:
        f.write(f"{max(seen.values(), default=0)} {len(seen)}\n")


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["--watch"] and len(argv) == 4:
        return watch(int(argv[1]), argv[2], argv[3])
    if "--" not in argv or len(argv) < 3:
        sys.exit(__doc__)
    split = argv.index("--")
    runs, libs, command = int(argv[0]), argv[1:split], argv[split + 1 :]
    variants = [("plain", {})] + [(os.path.basename(lib), {"LD_PRELOAD": os.path.realpath(lib)}) for lib in libs]
    results = {name: [] for name, _ in variants}
    for _ in range(runs):
        for name, env in variants:
            results[name].append(run_once(env, command))
    print("| build | the command | other processes: median, largest (count) |")
    print("|---|---|---|")
    for name, _ in variants:
        roots = [r for r, _ in results[name]]
        names = sorted({n for _, by in results[name] for n in by})
        others = []
        for n in names:
            med = [statistics.median(by[n]) for _, by in results[name] if n in by]
            top = [max(by[n]) for _, by in results[name] if n in by]
            count = statistics.median([len(by.get(n, [])) for _, by in results[name]])
            others.append(f"{n} {statistics.median(med):,.0f}, {statistics.median(top):,.0f} ({count:g})")
        print(f"| {name} | {statistics.median(roots):,.0f} KiB | {'; '.join(others) or '-'} |")
    print(f"(medians of {runs} interleaved runs, peak RSS in KiB: {' '.join(command)})")


if __name__ == "__main__":
    main()
