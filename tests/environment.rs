//! Real interpreters, other allocators, bad configuration and the exported symbol list.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

#[test]
fn python_runs_unchanged_and_gets_a_report() {
    let script = "import json, collections\n\
        data = [{'k': i, 'v': str(i) * 10} for i in range(20000)]\n\
        c = collections.Counter(len(d['v']) for d in data)\n\
        print(json.dumps(sorted(c.items())))\n\
        import sys; sys.exit(3)\n";
    let mut plain = Command::new(python());
    plain.args(["-c", script]);
    let plain = run_plain(plain);
    let mut traced = Command::new(python());
    traced.args(["-c", script]).env("PYTHONMALLOC", "malloc");
    let run = run_traced(traced, "python");
    assert_eq!(run.code(), Some(3));
    assert_eq!(run.code(), plain.status.code());
    assert_eq!(run.stdout(), String::from_utf8_lossy(&plain.stdout));
    let r = run.report();
    assert!(r["exe"].as_str().unwrap().contains("python"));
    assert_eq!(r["argv"][1], "-c");
    assert!(host(&r, "total_allocs") > 20000, "PYTHONMALLOC=malloc sends objects to malloc");
    assert_eq!(host(&r, "total_allocs") - host(&r, "total_frees"), host(&r, "live_blocks"));
    // Python's frames are symbolized from its own module.
    let any_py_function =
        r["leaks"].as_array().unwrap().iter().any(|g| {
            g["stack"].as_array().unwrap().iter().any(|f| f["function"].as_str().map(|n| n.starts_with("Py") || n.starts_with("_Py")).unwrap_or(false))
        });
    assert!(any_py_function, "python frames are named");
}

/// A C program that loads libpython itself (`dlopen`, then `dlsym(handle,
/// "Py_Initialize")`, as plugin hosts embed Python): the library's start saw no Python,
/// yet a leak made by the script is named at its Python line, and the interpreter's
/// arenas are scan roots (its live objects keep nothing "leaked").
#[test]
fn python_embedded_through_dlopen_gets_python_frames() {
    let probe = Command::new(python())
        .args(["-c", "import os, sys, sysconfig; print(os.path.join(sysconfig.get_config_var('LIBDIR'), sysconfig.get_config_var('INSTSONAME') or '')); print(sys.base_prefix)"])
        .output()
        .expect("python3 must be installed");
    let text = String::from_utf8_lossy(&probe.stdout).into_owned();
    let mut lines = text.lines();
    let (libpython, prefix) = (PathBuf::from(lines.next().unwrap_or("")), lines.next().unwrap_or("").to_string());
    if !libpython.is_file() {
        // pyenv builds without --enable-shared have none; Debian's python3 has it.
        skip::not_here(&format!("no shared libpython for {} at {} (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)", python().display(), libpython.display()));
        return;
    }
    let bin = build_fixture("embed_dlopen.c", &[]);
    let dir = fresh_dir("embed-script");
    let script = dir.join("embedded_leak.py");
    std::fs::write(
        &script,
        "import ctypes\nlibc = ctypes.CDLL('libc.so.6')\nlibc.malloc.restype = ctypes.c_void_p\nkept = [bytearray(200) for _ in range(1000)]\n\ndef stage(n):\n    return libc.malloc(n)\n\nfor _ in range(8):\n    stage(4096)\nprint('embedded done')\n",
    )
    .unwrap();
    let mut cmd = Command::new(&bin);
    cmd.arg(&libpython).arg(&script).env("PYTHONHOME", &prefix).env_remove("PYTHONPATH");
    let run = run_traced(cmd, "embed");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    assert_eq!(run.stdout(), "embedded done\n");
    let r = run.report();
    let at_stage = |f: &serde_json::Value| {
        f["python"] == true && f["function"] == "stage" && f["line"] == 7 && f["file"].as_str().is_some_and(|p| p.ends_with("embedded_leak.py"))
    };
    let groups: Vec<&serde_json::Value> = r["leaks"].as_array().unwrap().iter().filter(|g| g["stack"].as_array().unwrap().iter().any(at_stage)).collect();
    assert!(!groups.is_empty(), "no leak at embedded_leak.py:7 in stage among {} groups; stderr:\n{}", r["leaks"].as_array().unwrap().len(), run.stderr());
    let definite: u64 = groups.iter().map(|g| g["reachability"]["definite"]["bytes"].as_u64().unwrap()).sum();
    // The last buffer's address may stay in a dead slot of a live frame (a conservative
    // scan counts it); the earlier ones cannot.
    assert!((6 * 4096..=8 * 4096).contains(&definite), "{definite} bytes definite at the script's line");
    let leaked = r["summary"]["host"]["reachability"]["definite"]["bytes"].as_u64().unwrap()
        + r["summary"]["host"]["reachability"]["indirect"]["bytes"].as_u64().unwrap();
    assert!(leaked < definite + (64 << 10), "{leaked} bytes leaked in all: the interpreter's own memory is not (its arenas are roots)");
}

#[test]
fn exec_d_children_inherit_the_library_and_get_their_own_report() {
    let bin = build_fixture("leaks.c", &[]);
    let script = format!("import subprocess, sys\nr = subprocess.run([{:?}])\nprint('child exit', r.returncode)\n", bin.to_str().unwrap());
    let mut cmd = Command::new(python());
    cmd.args(["-c", &script]);
    let run = run_traced(cmd, "exec");
    assert_eq!(run.stdout(), "leaks fixture done\nchild exit 7\n");
    let reports = run.reports();
    assert_eq!(reports.len(), 2, "python and the exec'd fixture");
    let fixture = reports.iter().find(|r| r["exe"].as_str() == bin.to_str()).expect("fixture report");
    assert_eq!(sum(&groups_with(fixture, "leak_malloc_64"), "bytes"), 192);
}

#[test]
fn with_jemalloc_after_us_allocations_are_tracked_through_it() {
    if !Path::new(JEMALLOC).exists() {
        skip::missing(JEMALLOC, "apt-get install libjemalloc2");
        return;
    }
    let bin = build_fixture("leaks.c", &[]);
    let dir = fresh_dir("jemalloc-after");
    let out = Command::new(&bin).env("LD_PRELOAD", format!("{}:{JEMALLOC}", lib_path().display())).env("LEAKTRACE_OUTPUT", &dir).timed_output().unwrap();
    assert_eq!(out.status.code(), Some(7));
    let r = &reports_in(&dir)[0];
    assert_eq!(r["diagnostics"]["host_tracking"], "active");
    assert_eq!(sum(&groups_with(r, "leak_malloc_64"), "bytes"), 192);
    assert_eq!(sum(&groups_with(r, "leak_memalign_trio"), "bytes"), 256 + 128 + 512);
}

#[test]
fn with_jemalloc_before_us_the_program_runs_and_we_say_why_nothing_is_seen() {
    if !Path::new(JEMALLOC).exists() {
        skip::missing(JEMALLOC, "apt-get install libjemalloc2");
        return;
    }
    let bin = build_fixture("leaks.c", &[]);
    let dir = fresh_dir("jemalloc-before");
    let out = Command::new(&bin).env("LD_PRELOAD", format!("{JEMALLOC}:{}", lib_path().display())).env("LEAKTRACE_OUTPUT", &dir).timed_output().unwrap();
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "leaks fixture done\n");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines = host_tracking_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("libjemalloc.so.2") && lines[0].contains("first in LD_PRELOAD"));
    let r = &reports_in(&dir)[0];
    assert!(r["diagnostics"]["host_tracking"].as_str().unwrap().starts_with("inactive"));
}

/// An executable with its own malloc (rustc with jemalloc linked in, Chromium's
/// PartitionAlloc), nothing else preloaded: one true line — the program's own malloc,
/// CUDA still tracked — not the advice to reorder LD_PRELOAD that it got before.
#[test]
fn an_executable_with_its_own_malloc_is_told_so_truly() {
    let bin = build_fixture("own_malloc.c", &[]);
    let run = run_traced(Command::new(&bin), "own-malloc");
    assert_eq!(run.code(), Some(0));
    assert_eq!(run.stdout(), "own malloc\n");
    let err = run.stderr();
    let lines = host_tracking_lines(&err);
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("the program has its own malloc") && lines[0].contains("CUDA allocations are still tracked"), "{err}");
    assert!(!lines[0].contains("LD_PRELOAD"), "{err}");
    assert!(run.report()["diagnostics"]["host_tracking"].as_str().unwrap().starts_with("inactive"));
}

#[test]
fn an_interposer_that_finds_malloc_with_dlvsym_works_before_and_after_us() {
    let shim = build_fixture("vsym_interposer.c", &["-shared", "-fPIC"]);
    let bin = build_fixture("leaks.c", &[]);
    for (order, tag) in
        [(format!("{}:{}", shim.display(), lib_path().display()), "vsym-before"), (format!("{}:{}", lib_path().display(), shim.display()), "vsym-after")]
    {
        let dir = fresh_dir(tag);
        let out = Command::new(&bin).env("LD_PRELOAD", &order).env("LEAKTRACE_OUTPUT", &dir).env("LEAKTRACE_SUMMARY", "0").timed_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(7), "{order}: {err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "leaks fixture done\n");
        let calls: u64 =
            err.lines().find_map(|l| l.strip_prefix("interposer: ")?.strip_suffix(" mallocs")?.parse().ok()).unwrap_or_else(|| panic!("{order}: {err}"));
        assert!(calls > 0, "{order}: {err}");
        // Before us, its malloc calls ours: the start-up check must not say otherwise.
        assert!(!err.contains("not seen"), "{order}: {err}");
        let r = &reports_in(&dir)[0];
        assert_eq!(r["diagnostics"]["host_tracking"], "active", "{order}");
        assert_eq!(sum(&groups_with(r, "leak_malloc_64"), "bytes"), 192, "{order}");
    }
}

#[test]
fn malformed_settings_get_one_line_each_and_the_program_runs_unchanged() {
    let bin = build_fixture("leaks.c", &[]);
    for (var, value) in [
        ("LEAKTRACE_INTERVAL_MS", "abc"),
        ("LEAKTRACE_INTERVAL_MS", "-1"),
        ("LEAKTRACE_INTERVAL_MS", "99999999999999999999999"),
        ("LEAKTRACE_STACK_DEPTH", ""),
        ("LEAKTRACE_STACK_DEPTH", "0"),
        ("LEAKTRACE_SUMMARY", "loud"),
        ("LEAKTRACE_SNAPSHOT_SIGNAL", "KILL"),
        ("LEAKTRACE_FOLLOW_FORK", "2"),
    ] {
        let mut cmd = Command::new(&bin);
        cmd.env(var, value).env("LEAKTRACE_SUMMARY", if var == "LEAKTRACE_SUMMARY" { value } else { "0" });
        let run = run_traced(cmd, "badenv");
        assert_eq!(run.code(), Some(7), "{var}={value}");
        assert_eq!(run.stdout(), "leaks fixture done\n");
        let warnings: Vec<_> = run.stderr().lines().filter(|l| l.starts_with(&format!("leaktrace: {var}="))).map(str::to_owned).collect();
        assert_eq!(warnings.len(), 1, "{var}={value:?}: {}", run.stderr());
        assert_eq!(run.reports().len(), 1, "{var}={value:?}: defaults still produce a report");
    }
}

#[test]
fn unwritable_output_directory_falls_back_with_one_line() {
    let bin = build_fixture("leaks.c", &[]);
    let work = fresh_dir("fallback");
    // A path under a regular file can never be created, even by root.
    let blocker = work.join("file");
    std::fs::write(&blocker, b"").unwrap();
    let out = Command::new(&bin)
        .current_dir(&work)
        .env("LD_PRELOAD", lib_path())
        .env("LEAKTRACE_OUTPUT", blocker.join("reports"))
        .env("LEAKTRACE_SUMMARY", "0")
        .timed_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("is unusable") && err.contains(work.to_str().unwrap()), "{err}");
    assert_eq!(reports_in(&work).len(), 1, "the report landed in the working directory");
}

#[test]
fn missing_output_directory_is_created() {
    let bin = build_fixture("leaks.c", &[]);
    let work = fresh_dir("mkdir");
    let target = work.join("a/b/c");
    let out = Command::new(&bin).env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &target).env("LEAKTRACE_SUMMARY", "0").timed_output().unwrap();
    assert_eq!(out.status.code(), Some(7));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let reports = reports_in(&target);
    assert_eq!(reports.len(), 1);
    let name = std::fs::read_dir(&target).unwrap().next().unwrap().unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(name.metadata().unwrap().permissions().mode() & 0o777, 0o600, "reports are private");
}

#[test]
fn disabled_library_records_and_writes_nothing() {
    let bin = build_fixture("leaks.c", &[]);
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_DISABLE", "1");
    let run = run_traced(cmd, "disabled");
    assert_eq!(run.code(), Some(7));
    assert_eq!(run.stderr(), "");
    assert!(run.reports().is_empty());
}

#[test]
fn exported_symbols_are_exactly_the_documented_list() {
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(lib_path()).timed_output().expect("nm (binutils)");
    let text = String::from_utf8_lossy(&out.stdout);
    let mut exported: Vec<&str> = text
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (_, kind, name) = (it.next()?, it.next()?, it.next()?);
            (kind == "T" || kind == "W").then_some(name)
        })
        .filter(|n| !n.starts_with("rust_") && !n.starts_with("__rust") && !n.starts_with("_ZN"))
        .collect();
    exported.sort();
    let documented = std::fs::read_to_string(root().join("src/interpose/mod.rs")).unwrap();
    let list_start = documented.find("pub const EXPORTED: &[&str] = &[").unwrap();
    let list_end = list_start + documented[list_start..].find("];").unwrap();
    let mut expected: Vec<String> = documented[list_start..list_end].split('"').skip(1).step_by(2).map(String::from).collect();
    expected.push("dlsym".into());
    expected.push("dlvsym".into());
    // The CUDA families: every `(name::NAME, name::substitute)` row of their WRAPPED tables.
    for family in ["cuda_runtime.rs", "cuda_driver.rs"] {
        let text = std::fs::read_to_string(root().join("src/interpose").join(family)).unwrap();
        let table = &text[text.find("pub const WRAPPED").unwrap()..];
        let rows: Vec<String> = table.lines().filter_map(|l| l.trim().strip_prefix('(')?.split("::NAME").next().map(String::from)).collect();
        assert!(rows.len() > 10, "{family}: {rows:?}");
        expected.extend(rows);
    }
    let optional = ["free_sized", "free_aligned_sized"];
    exported.retain(|n| !optional.contains(n));
    expected.sort();
    let exported: Vec<String> = exported.into_iter().map(String::from).collect();
    assert_eq!(exported, expected);
}

#[test]
fn exec_under_the_same_pid_gets_a_second_report_file() {
    let bin = build_fixture("leaks.c", &[]);
    // Exec only once this image's first periodic report is on disk.
    let script = format!(
        "import os, time, glob\nd = os.environ['LEAKTRACE_OUTPUT']\nt = time.time()\n\
         while not glob.glob(d + '/leaktrace.*.json') and time.time() - t < 20: time.sleep(0.02)\n\
         os.execv({0:?}, [{0:?}])\n",
        bin.to_str().unwrap()
    );
    let mut cmd = Command::new(python());
    cmd.args(["-c", &script]).env("LEAKTRACE_INTERVAL_MS", "50").env("LEAKTRACE_SUMMARY", "0");
    let run = run_traced(cmd, "execv");
    assert_eq!(run.code(), Some(7));
    let reports = run.reports();
    assert_eq!(reports.len(), 2, "python's last periodic report and the fixture's final one");
    assert_eq!(reports[0]["pid"], reports[1]["pid"], "same pid across exec");
    let reasons: Vec<&str> = reports.iter().map(|r| r["reason"].as_str().unwrap()).collect();
    assert!(reasons.contains(&"periodic") && reasons.contains(&"exit"), "{reasons:?}");
}

#[test]
fn stack_depth_is_configurable() {
    let bin = build_fixture("leaks.c", &[]);
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_STACK_DEPTH", "2");
    let run = run_traced(cmd, "depth");
    let r = run.report();
    assert_eq!(r["config"]["stack_depth"], 2);
    for g in r["leaks"].as_array().unwrap() {
        let mut ips: Vec<&str> = g["stack"].as_array().unwrap().iter().map(|f| f["ip"].as_str().unwrap()).collect();
        ips.dedup();
        assert!(ips.len() <= 2, "{g:#}");
    }
    assert_eq!(sum(&groups_with(&r, "leak_malloc_64"), "bytes"), 192);
}

#[test]
fn suppressions_file_filters_the_exit_summary() {
    let bin = build_fixture("leaks.c", &[]);
    let dir = fresh_dir("supp-lib");
    let supp = dir.join("lsan.supp");
    std::fs::write(&supp, "# LeakSanitizer format\nleak:leak_memalign_trio\nleak:^leak_strdup$\n").unwrap();
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_SUPPRESSIONS", &supp);
    let run = run_traced(cmd, "supp-lib");
    let err = run.stderr();
    // No frame of a suppressed group; the patterns appear in LSan's table only.
    assert!(!err.contains("in leak_memalign_trio") && !err.contains("in leak_strdup"), "{err}");
    assert!(err.contains("Suppressions used:") && err.contains(" leak_memalign_trio\n") && err.contains(" ^leak_strdup$\n"), "{err}");
    assert!(err.contains("in leak_malloc_64"), "{err}");
    assert!(err.contains("group(s) suppressed)."), "{err}");
    // The report keeps everything: suppressions are a view, not data loss.
    assert_eq!(sum(&groups_with(&run.report(), "leak_memalign_trio"), "bytes"), 896);
    let mut bad = Command::new(&bin);
    bad.env("LEAKTRACE_SUPPRESSIONS", dir.join("missing.supp"));
    let run = run_traced(bad, "supp-missing");
    assert_eq!(run.code(), Some(7));
    assert_eq!(run.stderr().lines().filter(|l| l.contains("cannot read suppressions file")).count(), 1);
}

#[test]
fn a_suppressed_leak_hides_the_indirect_leaks_that_hang_from_it_as_in_lsan() {
    let bin = build_fixture("suppressed_tree.c", &[]);
    let dir = fresh_dir("supp-tree");
    let supp = dir.join("lsan.supp");
    std::fs::write(&supp, "leak:make_root\nleak:never_matches\n").unwrap();
    let mut cmd = Command::new(&bin);
    cmd.env("LEAKTRACE_SUPPRESSIONS", &supp);
    let run = run_traced(cmd, "supp-tree");
    let err = run.stderr();
    // The root (16 bytes) and its 7 nodes (7 x 64) are suppressed; leak_other's block
    // and the node it holds stay.
    assert!(err.contains("Suppressions used:\n  count      bytes template\n      8        464 make_root\n"), "{err}");
    assert!(!err.contains("never_matches"), "only patterns that matched are listed: {err}");
    assert!(err.contains("SUMMARY: leaktrace: 104 byte(s) leaked in 2 allocation(s) (1 group(s) suppressed"), "{err}");
    assert!(err.contains("in leak_other"), "{err}");
    // The command applies the same rules to the report.
    let report_dir = run.dir.clone();
    let out =
        Command::new(lib_path().parent().unwrap().join("leaktrace")).args(["report", "--suppressions"]).arg(&supp).arg(&report_dir).timed_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("      8        464 make_root"), "{text}");
    assert!(text.contains("SUMMARY: leaktrace: 104 byte(s) leaked in 2 allocation(s) (1 group(s), 464 byte(s) suppressed"), "{text}");
}

#[test]
fn a_full_output_disk_gets_one_line_and_the_report_lands_in_tmp() {
    let bin = build_fixture("leaks.c", &[]);
    let dir = fresh_dir("fulldisk");
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    // A 64 KiB tmpfs (root is needed: .ci/run runs as root), filled to the brim.
    let ok = Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(&mnt).status().unwrap();
    assert!(ok.success(), "mounting a tmpfs needs root");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _guard = Unmount(mnt.clone());
    let _ = Command::new("dd").arg("if=/dev/zero").arg(format!("of={}", mnt.join("fill").display())).args(["bs=4k", "count=100"]).timed_output();
    let out = Command::new(&bin).env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &mnt).env("LEAKTRACE_SUMMARY", "0").timed_output().unwrap();
    assert_eq!(out.status.code(), Some(7), "the program runs on unchanged");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "leaks fixture done\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("cannot write report") && err.contains("trying /tmp"), "{err}");
    // Nothing half-written is left on the full disk; the report is whole in /tmp.
    let names: Vec<String> = std::fs::read_dir(&mnt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(names, vec!["fill".to_string()], "{names:?}");
    let fallback: Vec<_> = std::fs::read_dir("/tmp")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with("leaktrace.leaks-") && n.ends_with(".json") && std::fs::metadata(p).unwrap().modified().unwrap().elapsed().unwrap().as_secs() < 60
        })
        .collect();
    assert!(!fallback.is_empty(), "report written to /tmp");
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&fallback[0]).unwrap()).unwrap();
    assert_eq!(r["reason"], "exit");
    for f in fallback {
        let _ = std::fs::remove_file(f);
    }
}

#[test]
fn python_keeps_its_own_sigint_handling() {
    // CPython installs KeyboardInterrupt only if SIGINT is at its default when it starts:
    // the library must not have taken it.
    let script = "import signal, os, time\n\
        print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n\
        try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(2)\n    print('no interrupt')\n\
        except KeyboardInterrupt:\n    print('KeyboardInterrupt')\n";
    let mut cmd = Command::new(python());
    cmd.args(["-c", script]);
    let run = run_traced(cmd, "sigint");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    assert_eq!(run.stdout(), "True\nKeyboardInterrupt\n");
}

#[test]
fn unshare_of_a_user_namespace_still_works() {
    // The kernel refuses unshare(CLONE_NEWUSER) to a multi-threaded process; the
    // collector thread steps aside for it. `unshare -r` is util-linux's.
    let mut cmd = Command::new("unshare");
    cmd.args(["-r", "id", "-u"]);
    let mut plain = Command::new("unshare");
    plain.args(["-r", "id", "-u"]);
    let plain = run_plain(plain);
    assert!(plain.status.success(), "unshare -r must work on this machine without the library");
    let run = run_traced(cmd, "unshare");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    assert_eq!(run.stdout(), "0\n", "root inside the new user namespace");
    assert_eq!(run.reports().len(), 1, "the exec'd id wrote its report");
}

/// Someone who can write to the output directory plants symlinks where the library will
/// write: at the report's own name (found once the first report is there) and at the
/// temp names it will use next (they are predictable: pid and a counter). Nothing is
/// ever written through a symlink: the victims keep their contents, the report name
/// becomes a real file again, and a temp name that is taken costs one line and a
/// fallback, never a lost report.
#[test]
fn planted_symlinks_are_never_followed() {
    let dir = fresh_dir("symlinks");
    let victims = fresh_dir("symlink-victims");
    let script = format!(
        r#"
import glob, os, time
d, v = {d:?}, {v:?}
open(v + "/victim", "w").write("precious")
t = time.time()
while not glob.glob(d + "/leaktrace.*.json") and time.time() - t < 20:
    time.sleep(0.01)
report = glob.glob(d + "/leaktrace.*.json")[0]
name = os.path.basename(report)
os.remove(report)
os.symlink(v + "/victim", report)
for n in range(64):
    tmp = "%s/.%s.%d.%d.tmp" % (d, name, os.getpid(), n)
    if not os.path.lexists(tmp):
        os.symlink(v + "/victim", tmp)
keep = [bytearray(1000) for _ in range(1000)]
time.sleep(0.5)
print(name)
"#,
        d = dir.to_str().unwrap(),
        v = victims.to_str().unwrap()
    );
    let mut cmd = Command::new(python());
    cmd.args(["-c", &script]).env("LEAKTRACE_INTERVAL_MS", "50").env("LEAKTRACE_OUTPUT", &dir).env("LD_PRELOAD", lib_path());
    let out = cmd.timed_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    assert_eq!(std::fs::read_to_string(victims.join("victim")).unwrap(), "precious", "written through a symlink");
    let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    // The final report is whole: in its own place (the planted link replaced), or, when
    // every temp name there was taken, in /tmp after one line saying so.
    let here = dir.join(&name);
    let report = if std::fs::symlink_metadata(&here).map(|m| m.file_type().is_file()).unwrap_or(false) {
        here
    } else {
        assert_eq!(stderr.lines().filter(|l| l.contains("cannot write report")).count(), 1, "{stderr}");
        PathBuf::from("/tmp").join(&name)
    };
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["reason"], "exit");
    if report.starts_with("/tmp") {
        let _ = std::fs::remove_file(&report);
    }
}

/// The library brings no shared library of its own beyond the C library: its unwinder
/// (which catches its own panics) is GCC's static one (`build.rs`). A process that does
/// not use `libgcc_s` itself did map, relocate and start it for us: its constructor's
/// `CPUID`s trap to the hypervisor, a fifth of the library's start-up on a virtual
/// machine (issue 55).
#[test]
fn a_program_that_does_not_use_libgcc_s_does_not_load_it_for_us() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let eh = Command::new(&cc).arg("-print-file-name=libgcc_eh.a").output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    if !Path::new(&eh).is_absolute() {
        skip::not_here(&format!("{cc} has no static unwinder (libgcc_eh.a): the library links libgcc_s"));
        return;
    }
    // `cat` links the C library only.
    let plain = run_plain({
        let mut c = Command::new("cat");
        c.arg("/proc/self/maps");
        c
    });
    assert!(!String::from_utf8_lossy(&plain.stdout).contains("libgcc_s"), "cat maps libgcc_s by itself here");
    let mut cmd = Command::new("cat");
    cmd.arg("/proc/self/maps");
    let run = run_traced(cmd, "no_libgcc_s");
    assert_eq!(run.code(), Some(0), "{}", run.stderr());
    let maps = run.stdout();
    assert!(maps.contains("libleaktrace"), "the library is loaded: {maps}");
    assert!(!maps.contains("libgcc_s"), "libgcc_s loaded for the library:\n{maps}");
}

/// Every function of the library that a process doing nothing runs (its constructor
/// and its exit report, `/bin/true`) is in the start-up list that the linker wrapper
/// lays out first (`build/startup_functions.txt`, `scripts/leaktrace-link-gcc`): one the
/// list lacks lies elsewhere in the library's 2 MiB of code, a page fault of its own at
/// every process's start. The list went stale twice as the start-up code changed (10
/// faults in the library's code instead of 4 for `/bin/true`, ~30 µs of issue 55's
/// 300); this says so when it happens, and what to run. callgrind names what ran. The
/// list is a compiler's and a kernel's (the compiler's inlining decides which functions
/// run as functions, the kernel's features which fallbacks run), so the check runs with
/// the compiler and kernel that made it.
#[test]
fn the_start_up_list_holds_every_function_a_process_that_does_nothing_runs() {
    let list_path = root().join("build/startup_functions.txt");
    let list = std::fs::read_to_string(&list_path).unwrap();
    let made_with = list.lines().next().and_then(|l| l.strip_prefix("# ")).unwrap_or("").to_string();
    let output =
        |cmd: &str, args: &[&str]| Command::new(cmd).args(args).output().map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string()).unwrap_or_default();
    let here = format!("{}; {}", output("rustc", &["--version"]), output("uname", &["-sr"]));
    if made_with != here {
        skip::not_here(&format!("the start-up list was made with {made_with:?}, this is {here:?}: other functions run"));
        return;
    }
    if Command::new("valgrind").arg("--version").output().is_err() {
        skip::missing("valgrind", "apt-get install valgrind");
        return;
    }
    let listed: std::collections::HashSet<&str> = list.lines().filter(|l| !l.starts_with('#')).map(|l| l.split('\t').next().unwrap_or("")).collect();
    let dir = fresh_dir("startup-list");
    let out = dir.join("true.cg");
    let status = Command::new("valgrind")
        .args(["--tool=callgrind", &format!("--callgrind-out-file={}", out.display()), "/bin/true"])
        .env("LD_PRELOAD", lib_path())
        .env("LEAKTRACE_TEST_UNDER_CALLGRIND", "1")
        .env("LEAKTRACE_OUTPUT", &dir)
        .env("LEAKTRACE_SUMMARY", "0")
        .output()
        .expect("valgrind runs");
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let ran = library_functions_run(&std::fs::read_to_string(&out).unwrap(), "libleaktrace.so");
    assert!(ran.len() > 50, "callgrind saw {} functions of the library run: {ran:?}", ran.len());
    let missing: Vec<&String> = ran.iter().filter(|f| !listed.contains(startup_list_name(f).as_str())).collect();
    assert!(
        missing.is_empty(),
        "{} of the {} functions /bin/true runs in the library are not in {}: run scripts/startup_functions.sh, then rebuild\n{missing:#?}",
        missing.len(),
        ran.len(),
        list_path.display()
    );
}

/// The names of the functions of `module` that ran, from a callgrind output file: `ob=`
/// lines set the object of the `fn=` lines that follow; a name is given once with its
/// `(id)` and referred to by the id alone after, in `fn=`, `cfn=`, `ob=` or `cob=` lines.
fn library_functions_run(callgrind: &str, module: &str) -> std::collections::BTreeSet<String> {
    let mut objects = std::collections::HashMap::new();
    let mut functions = std::collections::HashMap::new();
    let (mut current, mut out) = (String::new(), std::collections::BTreeSet::new());
    for line in callgrind.lines() {
        let Some((key, rest)) = line.split_once('=') else { continue };
        let Some(rest) = rest.strip_prefix('(') else { continue };
        let Some((id, name)) = rest.split_once(')') else { continue };
        let name = name.trim_start();
        let table = match key {
            "ob" | "cob" => &mut objects,
            "fn" | "cfn" => &mut functions,
            _ => continue,
        };
        if !name.is_empty() {
            table.insert(id.to_string(), name.to_string());
        }
        let named = table.get(id).cloned().unwrap_or_default();
        match key {
            "ob" => current = named,
            "fn" if current.ends_with(module) && !named.starts_with("0x") => {
                out.insert(named);
            }
            _ => {}
        }
    }
    out
}

/// A demangled name as the start-up list writes it: no legacy hash, crate hash,
/// ThinLTO suffix or callgrind's recursion depth.
fn startup_list_name(name: &str) -> String {
    let mut n = name.to_string();
    if let Some(i) = n.rfind('\'').filter(|&i| n[i + 1..].chars().all(|c| c.is_ascii_digit()) && i + 1 < n.len()) {
        n.truncate(i);
    }
    if let Some(i) = n.find(".llvm.") {
        n.truncate(i);
    }
    if let Some(i) = n.rfind("::h").filter(|&i| n.len() - i == 19 && n[i + 3..].chars().all(|c| c.is_ascii_hexdigit())) {
        n.truncate(i);
    }
    // Crate hashes: `[0123456789abcdef]`.
    while let Some(i) = n.find('[').filter(|&i| n.len() >= i + 18 && n.as_bytes()[i + 17] == b']' && n[i + 1..i + 17].chars().all(|c| c.is_ascii_hexdigit())) {
        n.replace_range(i..i + 18, "");
    }
    n
}
