#!/usr/bin/env python3
"""The CUDA checks that need a real GPU (CI has none; tests/cuda.rs runs the same fixture
programs against stub libraries). Run on a machine with one NVIDIA GPU, the CUDA toolkit
and PyTorch, from the repository root, with a built library:

    python3 scripts/gpu_check.py target/release/libleaktrace.so [OUTDIR]
    python3 scripts/gpu_check.py --compare OLD.so NEW.so   # timing only, see compare()
    GPU_CHECK_ONLY=growth python3 scripts/gpu_check.py LIB  # only torch_growth_cases()
    GPU_CHECK_ONLY=frameworks python3 scripts/gpu_check.py LIB  # torch_cases(), other_frameworks()

Each case runs a program plain and under the library: the exit status and stdout must be
the same, and the report must hold the planted device leaks with their API, kind, size
and the program's own frame, and nothing the program freed. The fixtures are built here
three ways: linked to the real libcudart.so (PLT), linked by nvcc to the static cudart
(every driver call goes through cuGetProcAddress), and a program that dlopens libcuda.
PyTorch is run with each of its CUDA allocators, JAX and CuPy once each, and the planted
leaks are compared with compute-sanitizer's leak check. Prints one line per check and
`gpu_check: N passed, M failed`; exits 1 if any failed."""
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "cuda")
LIB = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] != "--compare" else os.path.join(ROOT, "target/release/libleaktrace.so")
OUT = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="gpu-check-")
PASSED, FAILED = [], []
TIMES = {}


def check(name, ok, detail=""):
    (PASSED if ok else FAILED).append(name)
    print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail and not ok else ""), flush=True)
    return ok


def cuda_home():
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def build(dirname):
    cuda = cuda_home()
    lib64 = os.path.join(cuda, "lib64")
    cmds = {
        "runtime_dyn": ["c++", "-O2", "-g", "-fomit-frame-pointer", "-pthread", "-o", f"{dirname}/runtime_dyn", f"{FIX}/runtime_app.cpp",
                        f"-L{lib64}", "-lcudart", f"-Wl,-rpath,{lib64}"],
        "runtime_static": [os.path.join(cuda, "bin", "nvcc"), "-O2", "-g", "-Xcompiler", "-fomit-frame-pointer,-pthread", "-o",
                           f"{dirname}/runtime_static", f"{FIX}/runtime_app.cpp"],
        "driver": ["cc", "-O2", "-g", "-fomit-frame-pointer", "-o", f"{dirname}/driver", f"{FIX}/driver_app.c", "-ldl"],
    }
    built = {}
    for name, cmd in cmds.items():
        r = subprocess.run(cmd, capture_output=True, text=True)
        if check(f"build {name}", r.returncode == 0, r.stderr[-2000:]):
            built[name] = f"{dirname}/{name}"
    return built


def load(path):
    with open(path) as f:
        r = json.load(f)
    frames = r.get("frames")
    if frames is not None:
        for g in r.get("leaks", []):
            g["stack"] = [frames[i] for i in g.get("stack") or []]
    return r


def env_for(lib, out, extra=None):
    """A run's environment (with `extra`): plain where `lib` is None, else under `lib`
    with its reports in `out` and no exit summary."""
    env = dict(os.environ, **(extra or {}))
    env.pop("LD_PRELOAD", None)
    if lib:
        env.update(LD_PRELOAD=os.path.abspath(lib), LEAKTRACE_OUTPUT=out, LEAKTRACE_SUMMARY="0")
    return env


def train_seconds(stderr):
    """The training time `gpu_torch.py` prints on stderr (`train_s <seconds>`), if any."""
    return next((float(line.split()[1]) for line in stderr.splitlines() if line.startswith("train_s ")), None)


def run(tag, argv, env=None, timeout=600, compare=True):
    """Plain, then traced (traced only where `compare` is false: its exit status must be
    0). Returns (plain, traced, [reports]) or None after a failed check."""
    t = time.perf_counter()
    if compare:
        plain = subprocess.run(argv, capture_output=True, text=True, env=env_for(None, None, env), timeout=timeout)
    else:
        plain = subprocess.CompletedProcess(argv, 0, None, "")
    TIMES.setdefault(tag, {})["plain"] = time.perf_counter() - t
    out = os.path.join(OUT, tag)
    os.makedirs(out, exist_ok=True)
    t = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(LIB, out, env))
    stdout, stderr = child.communicate(timeout=timeout)
    traced = subprocess.CompletedProcess(argv, child.returncode, stdout, stderr)
    TIMES[tag]["leaktrace"] = time.perf_counter() - t
    for name, proc in (("plain", plain), ("leaktrace", traced)):
        if (seconds := train_seconds(proc.stderr)) is not None:
            TIMES[tag][f"train_s {name}"] = seconds
    with open(os.path.join(out, "stderr.txt"), "w") as f:
        f.write(traced.stderr)
    ok = check(f"{tag}: exit status {plain.returncode} unchanged", plain.returncode == traced.returncode,
               f"plain {plain.returncode}, traced {traced.returncode}; stderr: {traced.stderr[-1500:]}")
    if compare:
        ok &= check(f"{tag}: stdout unchanged", plain.stdout == traced.stdout, f"plain:\n{plain.stdout}\ntraced:\n{traced.stdout}")
    # The program's own report first (JAX runs ptxas, each child writes its own).
    reports = sorted((load(p) for p in glob.glob(os.path.join(out, "leaktrace.*.json"))), key=lambda r: r["pid"] != child.pid)
    ok &= check(f"{tag}: a report of the program's own process", reports and reports[0]["pid"] == child.pid,
                f"{len(reports)} reports; stderr: {traced.stderr[-1500:]}")
    print(f"     stdout: {traced.stdout.strip()[:300]!r}")
    if reports:
        d = reports[0]["diagnostics"]
        print(f"     events {d['events']}, buffer_full_waits {d['buffer_full_waits']}, unknown_frees {d['unknown_frees']}, "
              f"cuda_untracked_copies {d['cuda_untracked_copies']}, other processes' reports {len(reports) - 1}")
    return (plain, traced, reports) if ok else None


def summary(r, kind, field):
    return r["summary"][kind][field]


def innermost_named(g):
    return [f.get("function") for f in g["stack"]]


def groups(r, function=None, api=None, kind=None):
    out = []
    for g in r["leaks"]:
        if function and function not in innermost_named(g):
            continue
        if api and g.get("api") != api:
            continue
        if kind and g["kind"] != kind:
            continue
        out.append(g)
    return out


def expect_one(tag, r, function, api, kind, size, device=0):
    """One group from `function` with this API (any API where `api` is None, as with the
    static cudart, whose runtime calls reach the library as driver calls), kind and size."""
    gs = [g for g in groups(r, function, api) if api or (g["bytes"], g["kind"]) == (size, kind)]
    desc = f"{tag}: {function} -> {api or 'any API'} {kind} {size} B"
    if not check(desc, len(gs) == 1, f"{len(gs)} groups: {[(g.get('api'), g['kind'], g['bytes']) for g in groups(r, function)]}"):
        return
    g = gs[0]
    check(desc + " (kind, bytes, blocks, device)", (g["kind"], g["bytes"], g["blocks"], g.get("device")) == (kind, size, 1, device),
          f"{g['kind']} {g['bytes']} B {g['blocks']} blocks device {g.get('device')}")


def non_host(r):
    return [g for g in r["leaks"] if g["kind"] != "host"]


def show(r, limit=12):
    for g in non_host(r)[:limit]:
        names = [n for n in innermost_named(g) if n][:4]
        print(f"     {g['kind']:<11} {g.get('api', ''):<22} {g['bytes']:>12} B {g['blocks']:>4} blk"
              f" cached_by={g.get('cached_by')} reach={list((g.get('reachability') or {}).keys())} {names}")
    for kind in ("device", "pinned", "managed", "reservation", "mapping"):
        s = r["summary"].get(kind)
        if s and s["total_allocs"]:
            print(f"     summary.{kind}: allocs {s['total_allocs']} frees {s['total_frees']} live {s['live_blocks']} blocks {s['live_bytes']} B")


def accounting(tag, r):
    bad = []
    for kind in ("host", "device", "pinned", "managed", "reservation", "mapping"):
        s = r["summary"][kind]
        if s["total_allocs"] - s["total_frees"] != s["live_blocks"]:
            bad.append(kind)
    check(f"{tag}: allocs - frees = live for every kind", not bad, str(bad))


def fixture_cases(built):
    for prog in ("runtime_dyn", "runtime_static"):
        if prog not in built:
            continue

        def expect(tag, r, function, api, kind, size, device=0, static=prog == "runtime_static"):
            expect_one(tag, r, function, None if static and api.startswith("cuda") else api, kind, size, device)
        res = run(f"{prog}-gpu", [built[prog], "gpu"])
        if res:
            plain, _, (r, *_) = res
            tag = f"{prog}-gpu"
            pitch = 10240
            expect(tag, r, "leak_device", "cudaMalloc", "device", 1 << 20)
            expect(tag, r, "leak_pinned", "cudaMallocHost", "pinned", 4096)
            expect(tag, r, "leak_host_alloc", "cudaHostAlloc", "pinned", 2048)
            expect(tag, r, "leak_managed", "cudaMallocManaged", "managed", 8192)
            expect(tag, r, "leak_pitch", "cudaMallocPitch", "device", pitch)
            expect(tag, r, "leak_3d", "cudaMalloc3D", "device", 4096)
            expect(tag, r, "leak_registration", "cudaHostRegister", "pinned", 16384)
            expect(tag, r, "leak_async", "cudaMallocAsync", "device", 3000)
            expect(tag, r, "leak_async_ptsz", "cudaMallocAsync", "device", 3500)
            expect(tag, r, "leak_via_entry_point", "cuMemAlloc", "device", 7000)
            expect(tag, r, "leak_via_entry_point", "cuMemAllocAsync", "device", 7500)
            expect(tag, r, "leak_kept_in_heap", "cudaMalloc", "device", 65536)
            expect(tag, r, "leak_dropped", "cudaMalloc", "device", 32768)
            for f in ("balanced", "failures"):
                gs = [g for g in non_host(r) if f in innermost_named(g)]
                check(f"{tag}: nothing reported from {f}()", not gs, str([(g.get('api'), g['bytes']) for g in gs]))
            cached = [g for g in non_host(r) if g.get("cached_by")]
            check(f"{tag}: the caching allocator's segment is cached, not leaked",
                  [g["bytes"] for g in cached] == [2 << 20], str([(g["bytes"], g["cached_by"]) for g in cached]))
            check(f"{tag}: balanced() counted once per call", summary(r, "device", "total_frees") == 100,
                  f"device frees {summary(r, 'device', 'total_frees')}")
            check(f"{tag}: no unknown frees", r["diagnostics"]["unknown_frees"] == 0, str(r["diagnostics"]))
            accounting(tag, r)
            show(r, 20)
        res = run(f"{prog}-gpureset", [built[prog], "gpureset"])
        if res:
            r = res[2][0]
            tag = f"{prog}-gpureset"
            check(f"{tag}: cudaDeviceReset freed leak_device and leak_pinned",
                  not [g for g in non_host(r) if {"leak_device", "leak_pinned"} & set(innermost_named(g))], str([g["api"] for g in non_host(r)]))
            expect(tag, r, "leak_dropped", "cudaMalloc", "device", 32768)
            accounting(tag, r)
    if "driver" in built:
        res = run("driver-gpu", [built["driver"], "gpu", "0"])
        if res:
            r = res[2][0]
            tag = "driver-gpu"
            expect_one(tag, r, "leak_v2", "cuMemAlloc", "device", 4000)
            expect_one(tag, r, "leak_per_thread_stream", "cuMemAllocAsync", "device", 6000)
            expect_one(tag, r, "leak_pinned", "cuMemAllocHost", "pinned", 1500)
            expect_one(tag, r, "leak_vmm", "cuMemAddressReserve", "reservation", 8 << 20, None)
            expect_one(tag, r, "leak_vmm", "cuMemCreate", "device", 2 << 20)
            expect_one(tag, r, "leak_vmm", "cuMemMap", "mapping", 2 << 20)
            gs = [g for g in non_host(r) if "balanced" in innermost_named(g)]
            check(f"{tag}: nothing reported from balanced()", not gs, str(gs))
            accounting(tag, r)
            show(r)
        res = run("driver-reset", [built["driver"], "reset", "0"])
        if res:
            r = res[2][0]
            tag = "driver-reset"
            check(f"{tag}: cuCtxDestroy and cuDevicePrimaryCtxReset freed 8 of 9",
                  (summary(r, "device", "total_allocs"), summary(r, "device", "total_frees"), summary(r, "device", "live_bytes")) == (9, 8, 3333),
                  str(r["summary"]["device"]))


def sanitizer_case(built):
    """compute-sanitizer's leak check on the same program: the device leaks it lists."""
    cs = shutil.which("compute-sanitizer") or os.path.join(cuda_home(), "bin", "compute-sanitizer")
    if "runtime_dyn" not in built or not os.path.exists(cs):
        print("     compute-sanitizer: not run")
        return
    t = time.perf_counter()
    r = subprocess.run([cs, "--leak-check", "full", built["runtime_dyn"], "gpu"], capture_output=True, text=True, timeout=300)
    TIMES.setdefault("runtime_dyn-gpu", {})["compute-sanitizer"] = time.perf_counter() - t
    leaked = [line for line in r.stdout.splitlines() if "Leaked" in line]
    summary_lines = [line for line in r.stdout.splitlines() if "LEAK SUMMARY" in line]
    print(f"     compute-sanitizer: {len(leaked)} leaked allocations; {summary_lines}")
    for line in leaked[:20]:
        print(f"       {line.strip()}")
    # The same PyTorch job as torch-native, for time.
    argv = [cs, "--leak-check", "full", sys.executable, os.path.join(ROOT, "scripts", "gpu_torch.py"), "300"]
    t = time.perf_counter()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        TIMES.setdefault("torch-native", {})["compute-sanitizer"] = time.perf_counter() - t
        print(f"     compute-sanitizer on the PyTorch job: exit {r.returncode}; "
              f"{[line for line in r.stdout.splitlines() if 'SUMMARY' in line]} {r.stderr.strip().splitlines()[-1:]}")
    except subprocess.TimeoutExpired:
        print("     compute-sanitizer on the PyTorch job: over 300 s")
        TIMES.setdefault("torch-native", {})["compute-sanitizer"] = float("inf")


def torch_cases():
    py = sys.executable
    script = os.path.join(ROOT, "scripts", "gpu_torch.py")
    configs = [
        ("torch-native", {}),
        ("torch-expandable", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        ("torch-async", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}),
        ("torch-nocache", {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}),
    ]
    for tag, env in configs:
        res = run(tag, [py, script, "300", "plant"], env)
        if not res:
            continue
        _, traced, (r, *_) = res
        planted = [g for g in groups(r, api="cudaMalloc", kind="device") if g["bytes"] == 5 << 20 and g["blocks"] == 5]
        check(f"{tag}: the planted 5 x 1 MiB cudaMalloc is one leak group", len(planted) == 1,
              str([(g.get("api"), g["bytes"], g["blocks"]) for g in non_host(r)]))
        if planted:
            names = " ".join(n or "" for n in innermost_named(planted[0]))
            check(f"{tag}: its stack goes through ctypes", "ffi_call" in names or "ctypes" in names, names[:400])
            line = script_line(script, "rc = rt.cudaMalloc(")
            check(f"{tag}: its stack holds the Python line gpu_torch.py:{line} in plant_device_leak",
                  any(f.get("python") and (f.get("file") or "").endswith("gpu_torch.py") and f.get("line") == line
                      and f.get("function") == "plant_device_leak" for f in planted[0]["stack"]),
                  str([(f.get("function"), f.get("line")) for f in planted[0]["stack"] if f.get("python")]))
            check(f"{tag}: it is not called cached", not planted[0].get("cached_by"), str(planted[0].get("cached_by")))
        others = [g for g in non_host(r) if not g.get("cached_by") and g not in planted and g["kind"] in ("device", "managed")]
        print(f"     device groups neither planted nor cached: {[(g.get('api'), g['bytes'], g['blocks']) for g in others][:10]}")
        check(f"{tag}: device allocations recorded", summary(r, "device", "total_allocs") >= 6, str(r["summary"]["device"]))
        accounting(tag, r)
        show(r)


def script_line(path, marker):
    """The number of the first line of `path` that holds `marker`."""
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


def torch_growth_cases(seconds=15):
    """A CUDA tensor leak that only growth shows: a forward hook keeps a copy of each
    activation on the GPU (freed when the training function returns), with PyTorch's
    caching allocator and with its cudaMallocAsync backend, snapshots every 500 ms.
    `leaktrace check --fail-on-growth` must name the hook's line first: with the async
    backend its growth holds the tensors' device bytes; with the caching allocator the
    growing segment says whose cache it is and how to see the line. The same loop
    without the hook must pass."""
    py, script = sys.executable, os.path.join(ROOT, "scripts", "gpu_torch.py")
    cli = os.path.join(os.path.dirname(LIB), "leaktrace")
    line = script_line(script, "cache.append(output.detach().clone())  # LEAK")
    want = f"gpu_torch.py:{line} [python]"
    for tag, env in (("native", {}), ("async", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})):
        for mode in ("hook", "clean"):
            name = f"torch-{mode}-{tag}"
            if not run(name, [py, script, mode, str(seconds)], dict(env, LEAKTRACE_INTERVAL_MS="500"), compare=False):
                continue
            c = subprocess.run([cli, "check", "--fail-on-growth", "--min-bytes", "65536", os.path.join(OUT, name)],
                               capture_output=True, text=True)
            blocks = c.stdout.split("\nGrowing: ")[1:]
            for b in blocks[:6]:
                print("     Growing: " + " | ".join(b.strip().splitlines()[:4])[:400])
            if mode == "clean":
                check(f"{name}: check --fail-on-growth --min-bytes 65536 passes (no growth, no leak)", c.returncode == 0, c.stdout[-3000:])
                continue
            check(f"{name}: check --fail-on-growth fails with 23", c.returncode == 23, c.stdout[-3000:])
            first = blocks[0].splitlines() if blocks else []
            check(f"{name}: the first growth is the hook's line {want}", len(first) > 1 and want in first[1], c.stdout[-3000:])
            if tag == "async":
                # Each tensor is its own cudaMallocAsync: the line holds the device bytes
                # (1,500 steps of 64 KiB in 15 s).
                grown = int(first[0].split()[0]) if first else 0
                check(f"{name}: the line's growth counts the tensors' device memory (>= 32 MiB)", grown >= 32 << 20, str(grown))
            else:
                # The caching allocator's segments come from whichever allocation found
                # the cache empty (the autograd thread's, often): the growing segment
                # stack says so and how to see the line.
                check(f"{name}: a growing cudaMalloc segment is marked as PyTorch's cache, with the way to its line",
                      any(b.split(":\n")[0].endswith("from cudaMalloc (device)") and "held by PyTorch CUDACachingAllocator" in b
                          and "backend:cudaMallocAsync" in b for b in blocks), c.stdout[-3000:])


def torch_timing(rounds=3):
    """The PyTorch job (native allocator) plain and traced in turn: medians of the
    300 training steps' time (inside the process) and of the whole process."""
    py, script = sys.executable, os.path.join(ROOT, "scripts", "gpu_torch.py")
    got = {"plain": [], "leaktrace": []}
    out = tempfile.mkdtemp(prefix="timing-")
    for _ in range(rounds):
        for name in got:
            env = env_for(LIB if name == "leaktrace" else None, out)
            t = time.perf_counter()
            r = subprocess.run([py, script, "300"], capture_output=True, text=True, env=env, timeout=300)
            wall = time.perf_counter() - t
            steps = train_seconds(r.stderr)
            got[name].append((float("nan") if steps is None else steps, wall))
    med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in got.items()}
    print(f"torch timing, medians of {rounds}: 300 steps {med['plain'][0]:.2f} s plain, {med['leaktrace'][0]:.2f} s traced "
          f"({med['leaktrace'][0] / med['plain'][0]:.2f}x); whole process {med['plain'][1]:.2f} s plain, "
          f"{med['leaktrace'][1]:.2f} s traced ({med['leaktrace'][1] / med['plain'][1]:.2f}x)")


def other_frameworks():
    cases = [
        ("cupy", "import cupy as cp\na = cp.ones(1 << 22, dtype=cp.float32)\nb = a * 2\nprint(float(b.sum()))\n"),
        ("jax", "import jax.numpy as jnp\nx = jnp.ones((1024, 1024))\nprint(float((x @ x).sum()))\n"),
    ]
    for tag, code in cases:
        probe = subprocess.run([sys.executable, "-c", f"import {tag}"], capture_output=True)
        if probe.returncode != 0:
            print(f"     {tag}: not installed, skipped")
            continue
        res = run(tag, [sys.executable, "-c", code])
        if res:
            r = res[2][0]
            got = sum(summary(r, k, "total_allocs") for k in ("device", "mapping", "reservation"))
            check(f"{tag}: device memory recorded", got > 0, str(r["summary"]))
            if tag == "jax":
                # XLA's allocator maps its whole pool (75% of the GPU) with cuMemCreate +
                # cuMemMap into one reservation, and gives it back at exit.
                peak = summary(r, "mapping", "peak_live_bytes")
                check(f"{tag}: the pool XLA maps is seen ({peak >> 30} GiB) and released at exit",
                      peak >= 1 << 30 and summary(r, "mapping", "live_blocks") == 0 and summary(r, "reservation", "live_blocks") == 0,
                      str({k: r["summary"][k] for k in ("mapping", "reservation")}))
            accounting(tag, r)
            show(r)


def compare(libs, rounds=3):
    """Times two builds of the library against each other, in alternating runs: JAX's
    `x @ x` (16 threads allocating: the collector's throughput shows) and the PyTorch
    job's 300 steps. Prints medians and the full-ring waits of each."""
    jax_code = "import jax.numpy as jnp\nx = jnp.ones((1024, 1024))\nprint(float((x @ x).sum()))\n"
    workloads = [("jax", [sys.executable, "-c", jax_code]), ("torch", [sys.executable, os.path.join(ROOT, "scripts", "gpu_torch.py"), "300"])]
    for name, argv in workloads:
        got = {lib: [] for lib in ["plain"] + libs}
        for _ in range(rounds):
            for lib in got:
                out = tempfile.mkdtemp(prefix="compare-")
                env = env_for(None if lib == "plain" else lib, out)
                t = time.perf_counter()
                rc = subprocess.run(argv, capture_output=True, env=env, timeout=600).returncode
                wall = time.perf_counter() - t
                if rc != 0:
                    print(f"{name}: exit status {rc} under {lib}: not a valid timing")
                waits = [json.load(open(p))["diagnostics"]["buffer_full_waits"] for p in glob.glob(os.path.join(out, "leaktrace.python*.json"))]
                got[lib].append((wall, sum(waits)))
                shutil.rmtree(out, ignore_errors=True)
        for lib, runs in got.items():
            print(f"{name:<6} {os.path.basename(lib):<28} wall median {statistics.median(w for w, _ in runs):6.2f} s "
                  f"(runs {' '.join(f'{w:.2f}' for w, _ in runs)}), full-ring waits median {statistics.median(n for _, n in runs):.0f}")


def run_all():
    with tempfile.TemporaryDirectory() as d:
        built = build(d)
        fixture_cases(built)
        torch_cases()
        torch_growth_cases()
        sanitizer_case(built)
        other_frameworks()
        torch_timing()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":
        compare(sys.argv[2:])
        return
    print(f"library {LIB}; reports under {OUT}")
    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    only = os.environ.get("GPU_CHECK_ONLY")
    if only == "growth":
        torch_growth_cases()
    elif only == "frameworks":
        torch_cases()
        other_frameworks()
    else:
        run_all()
    print("wall seconds, plain vs under the library:")
    for tag, t in TIMES.items():
        print(f"  {tag:<22} " + "  ".join(f"{k} {v:.2f}" for k, v in t.items()))
    print(f"gpu_check: {len(PASSED)} passed, {len(FAILED)} failed")
    for f in FAILED:
        print(f"  failed: {f}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
