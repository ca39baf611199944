//! Verdicts that do not flicker: the same program, run 20 times with stdout a file, a
//! pipe and a terminal, gets the same definite / indirect / reachable split every time.
//! A CI verdict must not depend on timing or on where stdout goes.
mod common;
use common::*;
use std::collections::BTreeMap;
use std::process::{Command, Stdio};

const RUNS: usize = 20;

/// (innermost function of the group's stack, definite, indirect, reachable) for every
/// group of the report of the process named `exe_name`. The C library's stdio buffers
/// are sized by what stdout is (1 KiB on a terminal, 4 KiB otherwise): their reachable
/// bytes are counted as 1 each, so that only verdicts are compared.
fn split(dir: &std::path::Path, exe_name: &str) -> BTreeMap<String, (u64, u64, u64)> {
    let reports = reports_in(dir);
    let r = reports
        .iter()
        .find(|r| r["exe"].as_str().and_then(|e| e.rsplit('/').next()).is_some_and(|n| n.starts_with(exe_name)))
        .unwrap_or_else(|| panic!("no report of {exe_name} in {}", dir.display()));
    let mut out = BTreeMap::new();
    for g in r["leaks"].as_array().unwrap() {
        let name = g["stack"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|f| f["function"].as_str().filter(|n| !n.starts_with("malloc") && !n.starts_with("calloc")))
            .unwrap_or("?")
            .to_string();
        let get = |k: &str| g["reachability"][k]["bytes"].as_u64().unwrap_or(0);
        let stdio = name.starts_with("_IO_");
        let e = out.entry(name).or_insert((0, 0, 0));
        e.0 += get("definite");
        e.1 += get("indirect");
        e.2 += if stdio { u64::from(get("reachable") > 0) } else { get("reachable") };
    }
    out
}

#[derive(Clone, Copy, Debug)]
enum Stdout {
    File,
    Pipe,
    Terminal,
}

fn run_once(bin: &std::path::Path, args: &[String], how: Stdout) -> std::path::PathBuf {
    let dir = fresh_dir("verdicts");
    let mut cmd = match how {
        // util-linux's script gives the program a pseudo-terminal as stdout.
        Stdout::Terminal => {
            let line = std::iter::once(bin.to_string_lossy().into_owned()).chain(args.iter().cloned()).collect::<Vec<_>>().join(" ");
            let mut c = Command::new("script");
            c.args(["-qec", &line, "/dev/null"]);
            c
        }
        _ => {
            let mut c = Command::new(bin);
            c.args(args);
            c
        }
    };
    cmd.env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &dir).env("LEAKTRACE_SUMMARY", "0").env("LEAKTRACE_SCAN", "1");
    match how {
        Stdout::File => {
            let f = std::fs::File::create(dir.join("stdout.txt")).unwrap();
            cmd.stdout(Stdio::from(f));
            let status = wait_within(cmd.stderr(Stdio::piped()).spawn().unwrap()).status;
            assert!(status.success());
        }
        Stdout::Pipe | Stdout::Terminal => {
            let out = cmd.timed_output().unwrap();
            assert!(out.status.success(), "{how:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    dir
}

fn stable(bin: &std::path::Path, args: &[String], exe_name: &str) -> BTreeMap<String, (u64, u64, u64)> {
    let have_script = Command::new("script").arg("--version").stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    let mut modes = vec![Stdout::File, Stdout::Pipe];
    if have_script {
        modes.push(Stdout::Terminal);
    } else {
        assert!(std::env::var_os("CI").is_none(), "script (util-linux) missing");
        eprintln!("SKIPPED the terminal case: script (apt-get install bsdutils) missing");
    }
    let first = split(&run_once(bin, args, Stdout::File), exe_name);
    for how in modes {
        for i in 0..RUNS {
            let got = split(&run_once(bin, args, how), exe_name);
            assert_eq!(got, first, "run {i} with stdout a {how:?} differs from the first run");
        }
    }
    first
}

#[test]
fn the_known_answers_fixture_gets_one_split_whatever_stdout_is() {
    let bin = build_fixture("reach.c", &[]);
    let split = stable(&bin, &["thread".to_string()], "reach");
    assert_eq!(split.get("leak_dropped").map(|s| s.0), Some(1007), "{split:?}");
    assert_eq!(split.get("keep_in_global").map(|s| (s.0, s.2)), Some((0, 1001)), "{split:?}");
}

#[test]
fn a_dlclosed_plugins_leak_is_definite_whatever_stdout_is() {
    let plugin = build_fixture("plugin.c", &["-shared", "-fPIC"]);
    let bin = build_fixture("dlclose_print.c", &[]);
    let split = stable(&bin, &[plugin.to_string_lossy().into_owned()], "dlclose_print");
    assert_eq!(split.get("plugin_leak"), Some(&(777, 0, 0)), "{split:?}");
}
