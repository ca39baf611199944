//! Real C and C++ programs under the real library: exact leaks per call site.
mod common;
use common::*;
use std::process::Command;

#[test]
fn planted_leaks_are_reported_exactly_with_their_functions() {
    let bin = build_fixture("leaks.c", &[]);
    let run = run_traced(Command::new(&bin), "leaks");
    assert_eq!(run.code(), Some(7), "exit status must be unchanged; stderr:\n{}", run.stderr());
    assert_eq!(run.stdout(), "leaks fixture done\n");
    let r = run.report();
    assert_eq!(r["schema"], "leaktrace-report/3");
    assert_eq!(r["reason"], "exit");
    assert_eq!(r["exe"].as_str().unwrap(), bin.to_str().unwrap());

    let expect = |func: &str, api: &str, bytes: u64, blocks: u64| {
        let gs: Vec<_> = groups_with(&r, func).into_iter().filter(|g| g["api"] == api).collect();
        assert_eq!((sum(&gs, "bytes"), sum(&gs, "blocks")), (bytes, blocks), "{func}/{api}: {gs:#?}");
        for g in &gs {
            assert_eq!(g["kind"], "host");
            let top = &g["stack"][0];
            assert_eq!(top["function"], func, "innermost frame of {func}: {top}");
            assert!(top["file"].as_str().unwrap().ends_with("leaks.c"));
            assert!(top["line"].as_u64().unwrap() > 0);
            assert_eq!(top["module"].as_str().unwrap(), bin.to_str().unwrap());
            assert!(top["offset"].as_u64().is_some());
        }
    };
    expect("leak_malloc_64", "malloc", 192, 3);
    expect("leak_calloc_160", "calloc", 160, 1);
    expect("leak_realloc_300", "realloc", 300, 1);
    expect("leak_memalign_trio", "posix_memalign", 256, 1);
    expect("leak_memalign_trio", "aligned_alloc", 128, 1);
    expect("leak_memalign_trio", "memalign", 512, 1);
    // strdup allocates inside libc: the innermost frame is strdup, then ours.
    let dup = groups_with(&r, "leak_strdup");
    assert_eq!((sum(&dup, "bytes"), sum(&dup, "blocks")), (6, 1));
    // Nothing from the churn that frees everything.
    assert!(groups_with(&r, "churn_and_free").is_empty());
    // Groups are sorted largest first.
    let bytes: Vec<u64> = r["leaks"].as_array().unwrap().iter().map(|g| g["bytes"].as_u64().unwrap()).collect();
    assert!(bytes.windows(2).all(|w| w[0] >= w[1]));
    // Accounting is self-consistent.
    assert_eq!(host(&r, "total_allocs") - host(&r, "total_frees"), host(&r, "live_blocks"));
    let live_sum: u64 = bytes.iter().sum();
    assert_eq!(live_sum, host(&r, "live_bytes"));
    assert!(host(&r, "peak_live_bytes") >= host(&r, "live_bytes"));
}

#[test]
fn the_exit_summary_reads_like_leak_sanitizer() {
    let bin = build_fixture("leaks.c", &[]);
    let run = run_traced(Command::new(&bin), "summary");
    let err = run.stderr();
    assert!(err.contains("==leaktrace: detected memory leaks"), "{err}");
    // The pointer scan (on by default) tells direct leaks from memory still reachable.
    assert!(err.contains("Direct leak of 512 byte(s) in 1 object(s) allocated from memalign (host):"), "{err}");
    assert!(err.contains(" in leak_memalign_trio "), "{err}");
    assert!(err.lines().any(|l| l.starts_with("SUMMARY: leaktrace: ") && l.contains(" allocation(s)") && l.ends_with('.')), "{err}");
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_SCAN", "0");
    let unscanned = run_traced(cmd, "noscan");
    assert!(unscanned.stderr().contains("Leak of 512 byte(s) in 1 object(s) allocated from memalign (host):"), "{}", unscanned.stderr());
    assert!(unscanned.report().get("scan").is_none(), "LEAKTRACE_SCAN=0: no scan section");
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_SUMMARY", "0");
    let quiet = run_traced(cmd, "quiet");
    assert_eq!(quiet.stderr(), "", "LEAKTRACE_SUMMARY=0 silences it");
    assert_eq!(quiet.reports().len(), 1);
}

#[test]
fn a_program_that_frees_everything_has_no_leak_of_its_own() {
    let bin = build_fixture("clean.c", &[]);
    let run = run_traced(Command::new(&bin), "clean");
    assert_eq!(run.code(), Some(0));
    let r = run.report();
    let own: Vec<_> =
        r["leaks"].as_array().unwrap().iter().filter(|g| g["stack"].as_array().unwrap().iter().any(|f| f["module"].as_str() == bin.to_str())).collect();
    assert!(own.is_empty(), "{own:#?}");
    assert!(host(&r, "total_allocs") >= 9000, "every entry point was seen");
    assert_eq!(host(&r, "total_allocs") - host(&r, "total_frees"), host(&r, "live_blocks"));
}

#[test]
fn cxx_new_reaches_malloc_and_static_destructors_are_not_leaks() {
    let bin = build_fixture("cxx_leaks.cpp", &[]);
    let run = run_traced(Command::new(&bin), "cxx");
    assert_eq!(run.code(), Some(0));
    assert_eq!(run.stdout(), "cxx fixture 1000\n");
    let r = run.report();
    let widget = groups_with(&r, "app::make_widget_leak");
    assert_eq!((sum(&widget, "bytes"), sum(&widget, "blocks")), (24 + 400, 2), "{widget:#?}");
    let array = groups_with(&r, "app::make_array_leak");
    assert_eq!((sum(&array, "bytes"), sum(&array, "blocks")), (200, 1));
    // new goes through libstdc++'s operator new into malloc.
    let top = &array[0]["stack"][0];
    assert!(top["function"].as_str().unwrap().starts_with("operator new"), "{top}");
    assert!(top["module"].as_str().unwrap().contains("libstdc++"), "{top}");
    assert_eq!(array[0]["api"], "malloc");
    // The global map was destroyed at exit before the final report.
    assert!(groups_with(&r, "main").iter().all(|g| g["stack"].as_array().unwrap().iter().all(|f| !f["function"].as_str().unwrap_or("").contains("_Rb_tree"))));
}

#[test]
fn edge_cases_behave_exactly_as_without_the_library() {
    let bin = build_fixture("edge.c", &[]);
    let plain = run_plain(Command::new(&bin));
    let traced = run_traced(Command::new(&bin), "edge");
    assert!(plain.status.success());
    assert_eq!(traced.stdout(), String::from_utf8_lossy(&plain.stdout), "stderr: {}", traced.stderr());
    assert_eq!(traced.code(), plain.status.code());
    let r = traced.report();
    assert!(groups_with(&r, "main").is_empty(), "the edge fixture frees everything: {:#?}", r["leaks"]);
}

#[test]
fn the_malloc_family_looked_up_on_the_c_librarys_handle_is_tracked() {
    let bin = build_fixture("dlsym_malloc.c", &[]);
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_SUMMARY", "0");
    let run = run_traced(cmd, "dlsym-malloc");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let r = run.report();
    let sizes: Vec<(String, u64)> = r["leaks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| (4201..=4209).contains(&g["bytes"].as_u64().unwrap()))
        .map(|g| (g["api"].as_str().unwrap().to_string(), g["bytes"].as_u64().unwrap()))
        .collect();
    let dlvsym = [("malloc", 4207), ("calloc", 4208), ("malloc", 4209)];
    for want in [("malloc", 4201), ("calloc", 4202), ("realloc", 4203), ("reallocarray", 4204), ("malloc", 4205)].into_iter().chain(dlvsym) {
        assert!(sizes.contains(&(want.0.to_string(), want.1)), "{want:?} missing from {sizes:?}");
    }
    assert!(!sizes.iter().any(|s| s.1 == 4206), "freed through the looked-up free: {sizes:?}");
}

#[test]
fn ctypes_malloc_from_libc_by_name_and_by_find_library_is_tracked() {
    let script = "import ctypes, ctypes.util\n\
        a = ctypes.CDLL('libc.so.6'); a.malloc.restype = ctypes.c_void_p\n\
        kept = [a.malloc(1000003) for _ in range(3)]\n\
        b = ctypes.CDLL(ctypes.util.find_library('c')); b.calloc.restype = ctypes.c_void_p\n\
        kept.append(b.calloc(1, 777001))\n\
        print('ok')\n";
    let mut cmd = Command::new(python());
    cmd.args(["-c", script]).env("LEAKTRACE_SUMMARY", "0");
    let run = run_traced(cmd, "ctypes-libc");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let r = run.report();
    let find = |bytes: u64| {
        r["leaks"].as_array().unwrap().iter().find(|g| g["bytes"] == bytes).map(|g| (g["api"].as_str().unwrap().to_string(), g["blocks"].as_u64().unwrap()))
    };
    assert_eq!(find(3 * 1000003), Some(("malloc".to_string(), 3)));
    assert_eq!(find(777001), Some(("calloc".to_string(), 1)));
}

/// The built-in suppressions in the library: LeakSanitizer's exit status is not given
/// for the 24 bytes PyTorch's libtorch_cuda.so leaks on its own (a stand-in library of
/// the same file name, loaded as `import torch` loads it), and is given with
/// `LEAKTRACE_DEFAULT_SUPPRESSIONS=0`; the report keeps the group either way.
#[test]
fn the_library_suppresses_pytorchs_own_leak_by_default() {
    let lib = build_fixture("CachingHostAllocator.cpp", &["-shared", "-fPIC"]);
    for (defaults, want) in [(None, 0), (Some("0"), 42)] {
        let mut cmd = Command::new(python());
        cmd.args(["-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])"]).arg(&lib).env("LEAKTRACE_EXIT_CODE", "42");
        if let Some(v) = defaults {
            cmd.env("LEAKTRACE_DEFAULT_SUPPRESSIONS", v);
        }
        let run = run_traced(cmd, "builtin-supp");
        assert_eq!(run.code(), Some(want), "{}", run.stderr());
        let err = run.stderr();
        assert_eq!(err.contains("^_GLOBAL__sub_I_CachingHostAllocator.cpp$"), defaults.is_none(), "{err}");
        assert!(run.report()["leaks"].as_array().unwrap().iter().any(|g| g["bytes"] == 24));
    }
}

#[test]
fn leaktrace_exit_code_makes_a_leaking_process_fail_unless_it_failed_already() {
    let bin = build_fixture("exit_code.c", &[]);
    let supp = fresh_dir("exit-code").join("supp");
    std::fs::write(&supp, "leak:leak_once\n").unwrap();
    for mode in ["return", "exit", "_exit", "quick_exit"] {
        for (status, leak, suppressed, want) in [(0, 1, false, 42), (3, 1, false, 3), (0, 0, false, 0), (0, 1, true, 0)] {
            let mut cmd = Command::new(&bin);
            cmd.args([mode, &status.to_string(), &leak.to_string()]).env("LEAKTRACE_EXIT_CODE", "42").env("LEAKTRACE_SUMMARY", "0");
            if suppressed {
                cmd.env("LEAKTRACE_SUPPRESSIONS", &supp);
            }
            let run = run_traced(cmd, "exit-code");
            assert_eq!(run.code(), Some(want), "{mode} {status} leak={leak} suppressed={suppressed}: {}", run.stderr());
            assert_eq!(run.report()["reason"], "exit");
        }
    }
    // Without the variable the program's own status stands.
    let run = run_traced(
        {
            let mut c = Command::new(&bin);
            c.args(["return", "0", "1"]);
            c
        },
        "exit-code-off",
    );
    assert_eq!(run.code(), Some(0));
}

/// The library of `writable_eh_frame.c`, its loader, and its `.eh_frame`'s address and
/// size (hexadecimal, as `readelf -SW` prints them); `None` when the test is skipped.
fn writable_eh_frame_fixture() -> Option<(std::path::PathBuf, std::path::PathBuf, String, String)> {
    let lib = build_fixture("writable_eh_frame.c", &["-shared", "-fPIC", "-Wl,-z,relro,-z,now"]);
    let main = build_fixture("writable_eh_frame_main.c", &[]);
    let Ok(out) = Command::new("readelf").arg("-SW").arg(&lib).output() else {
        skip::missing("readelf", "apt-get install binutils");
        return None;
    };
    // `[15] .eh_frame PROGBITS ADDR OFF SIZE ES FLG ...`
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = text.lines().find(|l| l.contains(" .eh_frame ")).unwrap_or_default().split_whitespace().collect();
    let at = fields.iter().position(|f| *f == ".eh_frame").expect("the library has an .eh_frame section");
    let (addr, size, flags) = (fields[at + 2], fields[at + 4], fields[at + 6]);
    if !flags.contains('W') {
        skip::not_here(&format!("this toolchain put .eh_frame in a read-only segment ({flags})"));
        return None;
    }
    Some((lib, main, addr.to_string(), size.to_string()))
}

/// A library that keeps its `.eh_frame` in a writable segment under RELRO, as CUDA's
/// `libnvrtc.so` does (the unwinder cannot give those pages back once read: 3.6 MB of
/// `import torch`'s peak): its frames unwind as any other's, read from a view of the
/// library's file, and the program's own pages of the section stay untouched.
#[test]
fn a_librarys_writable_unwind_tables_are_read_from_its_file_not_from_the_programs_pages() {
    let Some((lib, main, addr, size)) = writable_eh_frame_fixture() else { return };
    let mut cmd = Command::new(&main);
    cmd.arg(&lib).arg(&addr).arg(&size);
    let run = run_traced(cmd, "writable-eh-frame");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    // Pages wholly inside the section, dropped by the program before the calls; the
    // plain program maps none of them again.
    let line = run.stdout();
    let (present, pages) = line.trim().strip_prefix("eh_frame pages present: ").and_then(|s| s.split_once(" of ")).expect(&line);
    assert!(pages.parse::<u32>().unwrap() >= 8, "{line}");
    assert_eq!(present, "0", "the program's pages of the library's .eh_frame were read: {line}");
    // Every frame unwound through the library: the leak's stack, innermost first.
    let r = run.report();
    let lost = groups_with(&r, "lost_in_writable_eh_frame");
    assert_eq!((sum(&lost, "bytes"), sum(&lost, "blocks")), (4321, 1), "{lost:#?}");
    let names: Vec<&str> = lost[0]["stack"].as_array().unwrap().iter().filter_map(|f| f["function"].as_str()).collect();
    assert_eq!(names[..4], ["leaf", "lost_in_writable_eh_frame", "call_all", "main"], "{names:?}");
    // The 2,048 blocks the library keeps are reachable through its `kept` array.
    let reach = &r["summary"]["host"]["reachability"];
    assert_eq!((reach["definite"]["blocks"].as_u64(), reach["indirect"]["blocks"].as_u64()), (Some(1), Some(0)), "{reach:#}");
    assert!(reach["reachable"]["blocks"].as_u64().unwrap() >= 2048, "{reach:#}");
    let plain = run_plain({
        let mut c = Command::new(&main);
        c.arg(&lib).arg(&addr).arg(&size);
        c
    });
    assert_eq!(String::from_utf8_lossy(&plain.stdout), line, "the same pages as without the library");
}

/// A library loaded by a relative path (`dlopen("./libx.so")`, `ctypes.CDLL("./libx.so")`)
/// keeps that name in the loader, relative to a directory the program may leave: its
/// frames are named from the file it mapped, wherever the program went since.
#[test]
fn a_library_loaded_by_a_relative_path_has_its_frames_named() {
    let Some((lib, main, addr, size)) = writable_eh_frame_fixture() else { return };
    let relative = format!("./{}", lib.file_name().unwrap().to_string_lossy());
    let mut cmd = Command::new(&main);
    cmd.current_dir(lib.parent().unwrap()).arg(&relative).arg(&addr).arg(&size).arg("/");
    let run = run_traced(cmd, "relative-dlopen");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let r = run.report();
    let lost = groups_with(&r, "lost_in_writable_eh_frame");
    assert_eq!((sum(&lost, "bytes"), sum(&lost, "blocks")), (4321, 1), "{lost:#?}");
    let stack = lost[0]["stack"].as_array().unwrap();
    let names: Vec<&str> = stack.iter().filter_map(|f| f["function"].as_str()).collect();
    assert_eq!(names[..4], ["leaf", "lost_in_writable_eh_frame", "call_all", "main"], "{names:?}");
    let real = std::fs::canonicalize(&lib).unwrap();
    assert_eq!(stack[0]["module"].as_str(), real.to_str(), "{:#}", stack[0]);
    assert!(stack[0]["file"].as_str().unwrap().ends_with("writable_eh_frame.c"), "{:#}", stack[0]);
}

/// One function that calls an allocating function from 4,096 call sites, three rounds
/// over (a static initializer registering thousands of operators, generated code): the
/// unwinder's tree of paths has a node with 4,096 children there, found through its
/// index once the list is long (`hotpath::hit_tree`). The blocks lost in the last round,
/// whose captures the tree answers, each carry their own call site: four groups of one
/// block, whose `all_sites` frames lie in the order of their sites, equally far apart
/// (the four groups of 1,024 calls are the same code).
#[test]
fn captures_from_thousands_of_call_sites_in_one_function_keep_their_own_stacks() {
    let exe = build_fixture("many_call_sites.c", &[]);
    let run = run_traced(Command::new(&exe), "many-call-sites");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let r = run.report();
    let mut lost = groups_with(&r, "site_leaf");
    lost.sort_by_key(|g| g["bytes"].as_u64());
    let sizes: Vec<(u64, u64)> = lost.iter().map(|g| (g["bytes"].as_u64().unwrap(), g["blocks"].as_u64().unwrap())).collect();
    assert_eq!(sizes, [(107, 1), (1131, 1), (2155, 1), (3179, 1)], "{lost:#?}");
    let mut sites = Vec::new();
    for g in &lost {
        let stack = g["stack"].as_array().unwrap();
        let names: Vec<&str> = stack.iter().filter_map(|f| f["function"].as_str()).collect();
        assert_eq!(names[..3], ["site_leaf", "all_sites", "main"], "{names:?}");
        sites.push(stack[1]["offset"].as_u64().unwrap());
    }
    let apart: Vec<u64> = sites.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect();
    assert!(apart[0] > 0 && apart.iter().all(|&d| d == apart[0]), "call sites at {sites:x?}");
}
