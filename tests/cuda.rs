//! CUDA memory in the same report, tested without a GPU: none exists on the build
//! machines, so these tests build stub `libcudart.so.12` and `libcuda.so.1`
//! (`tests/fixtures/cuda/stub_*.c`: versioned symbols as the real ones have, host memory
//! behind the pointers, the real error codes) and programs that reach them every way real
//! programs do: through the PLT, through dlopen + dlsym, through `cuGetProcAddress` and
//! through `cudaGetDriverEntryPoint`. One test runs the real `libcudart.so.12` from PyPI
//! (`nvidia-cuda-runtime-cu12`), which finds no driver here.
mod common;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/cuda").join(name)
}

/// Runs a build command (the fixture build script, or the compiler).
fn cc(args: &[&str]) {
    let o = Command::new(args[0]).args(&args[1..]).timed_output().expect("cc/c++ must be installed");
    assert!(o.status.success(), "{args:?} failed:\n{}", String::from_utf8_lossy(&o.stderr));
}

/// The two stub libraries and the two test programs, built once per test process.
struct Build {
    stubs: PathBuf,
    runtime_app: PathBuf,
    driver_app: PathBuf,
}

fn build() -> &'static Build {
    static BUILD: OnceLock<Build> = OnceLock::new();
    BUILD.get_or_init(|| {
        let dir = fresh_dir("cuda-build");
        cc(&["sh", fixture("build.sh").to_str().unwrap(), dir.to_str().unwrap()]);
        Build { runtime_app: dir.join("runtime_app"), driver_app: dir.join("driver_app"), stubs: dir }
    })
}

fn app(bin: &Path, mode: &str) -> Command {
    let mut c = Command::new(bin);
    c.arg(mode).env("LD_LIBRARY_PATH", &build().stubs).env("LEAKTRACE_SUMMARY_TOP", "100");
    c
}

/// Runs `mode` plain and traced; the program's output must be the same.
fn traced(bin: &Path, mode: &str) -> (Run, Value) {
    let plain = run_plain(app(bin, mode));
    let run = run_traced(app(bin, mode), &format!("cuda-{mode}"));
    assert_eq!(run.code(), Some(0), "{mode}: exit status; stdout:\n{}\nstderr:\n{}", run.stdout(), run.stderr());
    assert_eq!(run.stdout(), String::from_utf8_lossy(&plain.stdout), "{mode}: output must be unchanged");
    let r = run.report();
    (run, r)
}

fn summary(r: &Value, kind: &str, field: &str) -> u64 {
    r["summary"][kind][field].as_u64().unwrap_or_else(|| panic!("summary.{kind}.{field}"))
}

/// The groups whose innermost frame is `function`.
fn allocated_in<'a>(r: &'a Value, function: &str) -> Vec<&'a Value> {
    r["leaks"].as_array().unwrap().iter().filter(|g| g["stack"][0]["function"] == function).collect()
}

fn expect(r: &Value, function: &str, api: &str, kind: &str, bytes: u64, device: Option<u64>) {
    let gs: Vec<_> = allocated_in(r, function).into_iter().filter(|g| g["api"] == api).collect();
    assert_eq!(gs.len(), 1, "{function}/{api}: {:#?}", allocated_in(r, function));
    let g = gs[0];
    assert_eq!((g["kind"].as_str(), g["bytes"].as_u64(), g["blocks"].as_u64()), (Some(kind), Some(bytes), Some(1)), "{function}: {g:#}");
    assert_eq!(g["device"].as_u64(), device, "{function}: device");
    assert!(g["stack"][0]["file"].as_str().unwrap().contains("fixtures/cuda/"), "{function}: the program's own frame first");
}

fn no_cuda_groups_in(r: &Value, function: &str) {
    let gs: Vec<_> = r["leaks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["kind"] != "host")
        .filter(|g| g["stack"].as_array().unwrap().iter().any(|f| f["function"] == function))
        .collect();
    assert!(gs.is_empty(), "{function} freed everything it allocated: {gs:#?}");
}

fn accounting_is_consistent(r: &Value) {
    for kind in ["host", "device", "pinned", "managed", "reservation", "mapping"] {
        assert_eq!(summary(r, kind, "total_allocs") - summary(r, kind, "total_frees"), summary(r, kind, "live_blocks"), "{kind}");
        let groups: u64 = r["leaks"].as_array().unwrap().iter().filter(|g| g["kind"] == kind).map(|g| g["bytes"].as_u64().unwrap()).sum();
        assert_eq!(groups, summary(r, kind, "live_bytes"), "{kind}: groups add up to the summary");
    }
}

#[test]
fn runtime_api_through_the_plt_every_leak_once_with_its_api_and_device() {
    let (run, r) = traced(&build().runtime_app, "leaks");
    expect(&r, "leak_device", "cudaMalloc", "device", 1 << 20, Some(0));
    expect(&r, "leak_pinned", "cudaMallocHost", "pinned", 4096, Some(0));
    expect(&r, "leak_host_alloc", "cudaHostAlloc", "pinned", 2048, Some(0));
    expect(&r, "leak_managed", "cudaMallocManaged", "managed", 8192, Some(0));
    expect(&r, "leak_pitch", "cudaMallocPitch", "device", 10240, Some(0));
    expect(&r, "leak_3d", "cudaMalloc3D", "device", 4096, Some(0));
    expect(&r, "leak_registration", "cudaHostRegister", "pinned", 16384, Some(0));
    expect(&r, "leak_async", "cudaMallocAsync", "device", 3000, Some(0));
    // The per-thread-stream entry point is the same API to the user.
    expect(&r, "leak_async_ptsz", "cudaMallocAsync", "device", 3500, Some(0));
    expect(&r, "leak_pool", "cudaMallocFromPoolAsync", "device", 5000, Some(0));
    expect(&r, "leak_on_device_1", "cudaMalloc", "device", 2048, Some(1));
    // Driver functions obtained from cudaGetDriverEntryPoint(ByVersion), the v2 and the
    // per-thread-stream one.
    expect(&r, "leak_via_entry_point", "cuMemAlloc", "device", 7000, Some(0));
    expect(&r, "leak_via_entry_point", "cuMemAllocAsync", "device", 7500, Some(0));
    no_cuda_groups_in(&r, "balanced");
    no_cuda_groups_in(&r, "failures");
    // One event per allocation: the driver calls the runtime makes are not counted again.
    // balanced(): 50 x (cudaMalloc + cudaMallocAsync) device, 50 managed, 50 + 50 pinned.
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (100 + 9, 100));
    assert_eq!((summary(&r, "managed", "total_allocs"), summary(&r, "managed", "total_frees")), (51, 50));
    assert_eq!((summary(&r, "pinned", "total_allocs"), summary(&r, "pinned", "total_frees")), (103, 100));
    assert_eq!(summary(&r, "device", "live_bytes"), (1 << 20) + 10240 + 4096 + 3000 + 3500 + 5000 + 2048 + 7000 + 7500);
    accounting_is_consistent(&r);
    // Failed calls returned their real error codes (the output is unchanged) and left
    // nothing behind: no unknown frees, no extra blocks.
    assert!(run.stdout().contains("huge cudaMalloc: 2\nzero cudaMalloc: 1\nbogus cudaFree: 1\n"), "{}", run.stdout());
    assert_eq!(r["diagnostics"]["unknown_frees"], 0);
    let err = run.stderr();
    assert!(err.contains("allocated from cudaMalloc (device, device 1):"), "{err}");
    assert!(err.contains(" in leak_on_device_1 "), "{err}");
}

#[test]
fn a_program_that_frees_everything_shows_no_device_leak() {
    let (run, r) = traced(&build().runtime_app, "clean");
    for kind in ["device", "pinned", "managed"] {
        assert_eq!(summary(&r, kind, "live_blocks"), 0, "{kind}");
    }
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (100, 100));
    assert_eq!(summary(&r, "pinned", "total_allocs"), 100);
    assert!(r["leaks"].as_array().unwrap().iter().all(|g| g["kind"] == "host"));
    assert!(!run.stderr().contains("(device"), "{}", run.stderr());
    accounting_is_consistent(&r);
}

/// A thread that keeps replacing a device block in a global while main returns: the
/// block it frees while the final report is written is freed, not leaked (before its
/// release was published after tracking stopped, 3 of 3 runs reported it).
#[test]
fn a_device_block_another_thread_frees_while_the_process_exits_is_not_a_leak() {
    for _ in 0..5 {
        let (run, r) = traced(&build().runtime_app, "exitrace");
        assert_eq!(r["summary"]["device"]["reachability"]["definite"]["bytes"], 0, "{:#}\n{}", r["summary"]["device"], run.stderr());
        assert!(!run.stderr().contains("(device"), "{}", run.stderr());
        assert_eq!(r["diagnostics"]["unknown_frees"], 0);
    }
}

#[test]
fn a_device_reset_frees_the_context_bound_memory_of_that_device() {
    let (_, r) = traced(&build().runtime_app, "reset");
    // leak_device and leak_pinned (device 0) went with cudaDeviceReset; pool memory and
    // device 1 stayed; leak_dropped came after the reset.
    assert!(allocated_in(&r, "leak_device").is_empty() && allocated_in(&r, "leak_pinned").is_empty(), "{:#}", r["leaks"]);
    expect(&r, "leak_pool", "cudaMallocFromPoolAsync", "device", 5000, Some(0));
    expect(&r, "leak_on_device_1", "cudaMalloc", "device", 2048, Some(1));
    expect(&r, "leak_dropped", "cudaMalloc", "device", 32768, Some(0));
    assert_eq!(summary(&r, "device", "total_frees"), 1);
    assert_eq!(summary(&r, "pinned", "live_blocks"), 0);
    accounting_is_consistent(&r);
}

#[test]
fn context_destroy_and_primary_reset_through_the_driver() {
    let (_, r) = traced(&build().driver_app, "reset");
    // 5 blocks on device 1 went with cuCtxDestroy_v2, 3 on device 0 with
    // cuDevicePrimaryCtxReset_v2; the one allocated afterwards stays.
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (9, 8));
    assert_eq!(summary(&r, "device", "live_bytes"), 3333);
    expect(&r, "destroy_and_reset", "cuMemAlloc", "device", 3333, Some(0));
}

fn driver_leaks(mode: &str) {
    let (run, r) = traced(&build().driver_app, mode);
    expect(&r, "leak_v2", "cuMemAlloc", "device", 4000, Some(0));
    expect(&r, "leak_per_thread_stream", "cuMemAllocAsync", "device", 6000, Some(0));
    expect(&r, "leak_pinned", "cuMemAllocHost", "pinned", 1500, Some(0));
    no_cuda_groups_in(&r, "balanced");
    // The v1 request got the v1 function, untouched: no v2 wrapper wrote into its slot.
    assert!(run.stdout().contains("v1 canaries intact, pointer 32-bit"), "{}", run.stdout());
    no_cuda_groups_in(&r, "v1_still_v1");
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (80 + 2, 80));
    accounting_is_consistent(&r);
}

#[test]
fn driver_functions_found_with_dlsym_are_tracked() {
    driver_leaks("dlsym");
}

#[test]
fn driver_functions_found_with_cu_get_proc_address_are_tracked() {
    driver_leaks("getproc");
}

#[test]
fn virtual_memory_management_handles_reservations_and_mappings() {
    let (_, r) = traced(&build().driver_app, "vmm");
    expect(&r, "leak_vmm", "cuMemAddressReserve", "reservation", 8 << 20, None);
    // The handle's device comes from its allocation properties (device 1).
    expect(&r, "leak_vmm", "cuMemCreate", "device", 2 << 20, Some(1));
    let maps: Vec<_> = allocated_in(&r, "leak_vmm").into_iter().filter(|g| g["api"] == "cuMemMap").collect();
    assert_eq!((maps.len(), maps[0]["kind"].as_str(), maps[0]["bytes"].as_u64()), (1, Some("mapping"), Some(2 << 20)));
    assert_eq!((summary(&r, "mapping", "total_allocs"), summary(&r, "mapping", "total_frees")), (2, 1));
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (2, 1));
    accounting_is_consistent(&r);
}

#[test]
fn memory_held_by_a_caching_allocator_is_cached_not_leaked() {
    let (run, r) = traced(&build().runtime_app, "cached");
    let cached: Vec<_> = r["leaks"].as_array().unwrap().iter().filter(|g| !g["cached_by"].is_null()).collect();
    assert!(cached.iter().all(|g| g["cached_by"] == "PyTorch CUDACachingAllocator" && g["kind"] == "device"), "{cached:#?}");
    assert_eq!(cached.iter().map(|g| g["bytes"].as_u64().unwrap()).sum::<u64>(), 22 << 20);
    assert_eq!(cached.iter().map(|g| g["blocks"].as_u64().unwrap()).sum::<u64>(), 2);
    expect(&r, "leak_dropped", "cudaMalloc", "device", 32768, Some(0));
    assert_eq!(r["summary"]["cached"]["bytes"], 22 << 20);
    // The memory by part says it per device (stub CUDA library: device 0).
    let devices = r["memory"]["devices"].as_array().expect("memory.devices");
    assert_eq!(devices.len(), 1, "{devices:?}");
    assert_eq!(devices[0]["cached"], 22 << 20);
    assert_eq!(devices[0]["live"], r["summary"]["device"]["live_bytes"]);
    let err = run.stderr();
    assert!(!err.contains("grow_segment"), "{err}");
    assert!(err.contains(" in leak_dropped "), "{err}");
    assert!(err.contains(&format!("{} byte(s) held by caching allocators not counted", 22 << 20)), "{err}");
}

#[test]
fn device_pointers_kept_in_host_memory_are_reachable_dropped_ones_definite() {
    let (_, r) = traced(&build().runtime_app, "scan");
    let verdict = |f: &str| allocated_in(&r, f).into_iter().find(|g| g["kind"] == "device").unwrap()["reachability"].clone();
    assert_eq!(verdict("leak_kept_in_heap")["reachable"]["bytes"], 65536, "a heap struct reachable from a global holds it");
    assert_eq!(verdict("leak_dropped")["definite"]["bytes"], 32768, "no host memory holds it");
    assert_eq!(r["summary"]["device"]["reachability"]["definite"]["bytes"], 32768);
}

/// On a real H100 PyTorch's thousands of small definite host leaks pushed every device
/// group out of the listed ones; the limit now counts host and CUDA groups apart.
#[test]
fn host_groups_do_not_crowd_device_groups_out_of_the_report() {
    let mut cmd = app(&build().runtime_app, "scan");
    cmd.env("LEAKTRACE_REPORT_GROUPS", "1");
    let r = run_traced(cmd, "cuda-groups-limit").report();
    let kinds: Vec<_> = r["leaks"].as_array().unwrap().iter().map(|g| g["kind"].as_str().unwrap().to_owned()).collect();
    assert_eq!(kinds.iter().filter(|k| *k == "host").count(), 1, "{kinds:?}");
    assert_eq!(kinds.iter().filter(|k| *k != "host").count(), 1, "{kinds:?}");
    expect(&r, "leak_dropped", "cudaMalloc", "device", 32768, Some(0));
    assert_eq!(r["summary"]["leak_groups"], 2);
    assert!(r["summary"]["omitted"]["groups"].as_u64().unwrap() >= 1, "the other groups are counted: {}", r["summary"]["omitted"]);
}

#[test]
fn the_library_links_no_cuda_library() {
    let out = Command::new("readelf").arg("-d").arg(lib_path()).timed_output().expect("readelf (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("NEEDED"), "{text}");
    assert!(!text.contains("libcuda") && !text.contains("libcudart"), "{text}");
}

/// The real libcudart.so.12 from PyPI (`nvidia-cuda-runtime-cu12`, installed by
/// scripts/setup.sh). Without a driver every call returns 35 (cudaErrorInsufficientDriver): the
/// same codes with and without the library, and nothing recorded.
#[test]
fn the_real_cudart_without_a_driver_passes_errors_through_and_records_nothing() {
    let out =
        Command::new(python()).args(["-c", "import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))"]).timed_output().unwrap();
    let libdir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !libdir.join("libcudart.so.12").exists() {
        skip::missing("the real libcudart.so.12", "python3 -m pip install nvidia-cuda-runtime-cu12");
        return;
    }
    let dir = fresh_dir("real-cudart");
    let bin = dir.join("runtime_app_real");
    let (src, bin_s, lib_s) = (fixture("runtime_app.cpp"), bin.to_str().unwrap().to_owned(), libdir.to_str().unwrap().to_owned());
    cc(&["c++", "-O2", "-g", "-o", &bin_s, src.to_str().unwrap(), &format!("-L{lib_s}"), "-l:libcudart.so.12", &format!("-Wl,-rpath,{lib_s}")]);
    let mut plain = Command::new(&bin);
    plain.arg("nodriver");
    let plain = run_plain(plain);
    let mut cmd = Command::new(&bin);
    cmd.arg("nodriver");
    let run = run_traced(cmd, "real-cudart");
    let expected = "cudaMalloc: 35\ncudaMallocHost: 35\ncudaFree: 35\n";
    assert_eq!(String::from_utf8_lossy(&plain.stdout), expected);
    assert_eq!(run.stdout(), expected, "stderr:\n{}", run.stderr());
    let r = run.report();
    for kind in ["device", "pinned", "managed"] {
        assert_eq!(summary(&r, kind, "total_allocs"), 0, "{kind}");
    }
}

/// A program with its own malloc (`own_malloc.c`'s allocator linked into the driver
/// program, as rustc links jemalloc): host allocations are not seen, as its one stderr
/// line says, but its CUDA memory still is — the same device leaks as without it.
#[test]
fn a_program_with_its_own_malloc_still_has_its_cuda_memory_tracked() {
    let dir = fresh_dir("cuda-own-malloc");
    let bin = dir.join("driver_app_own_malloc");
    let root = env!("CARGO_MANIFEST_DIR");
    cc(&[
        "cc",
        "-O2",
        "-g",
        "-DNO_MAIN",
        "-o",
        bin.to_str().unwrap(),
        &format!("{root}/tests/fixtures/cuda/driver_app.c"),
        &format!("{root}/tests/fixtures/own_malloc.c"),
        "-ldl",
    ]);
    let (run, r) = traced(&bin, "dlsym");
    let err = run.stderr();
    let line = host_tracking_lines(&err);
    assert_eq!(line.len(), 1, "{}", run.stderr());
    assert!(line[0].contains("its own malloc") && line[0].contains("CUDA allocations are still tracked"), "{line:?}");
    expect(&r, "leak_v2", "cuMemAlloc", "device", 4000, Some(0));
    expect(&r, "leak_pinned", "cuMemAllocHost", "pinned", 1500, Some(0));
    assert_eq!((summary(&r, "device", "total_allocs"), summary(&r, "device", "total_frees")), (80 + 2, 80));
}
