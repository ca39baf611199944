//! The mechanisms of LeakSanitizer's and valgrind memcheck's own leak tests, one case
//! each (tests/fixtures/lsan_cases.c, our own code written from their descriptions),
//! with the verdict each must get. `scripts/compare_verdicts.sh` runs the same cases
//! under LeakSanitizer and valgrind and prints the three side by side
//! (docs/reliability.md).
mod common;
use common::*;
use std::process::Command;

/// (case, block size, expected verdict of every block of that size: "d"efinite,
/// "i"ndirect, "r"eachable).
const CASES: &[(&str, u64, &str)] = &[
    ("global_data", 2001, "r"),
    ("global_bss", 2002, "r"),
    ("tls_static", 2003, "r"),
    ("thread_register", 2004, "r"),
    ("thread_stack", 2005, "r"),
    ("tsd_main_low_key", 2006, "r"),
    ("tsd_main_high_key", 2007, "r"),
    // Only an unaligned copy of the pointer: LeakSanitizer and valgrind call it lost.
    ("unaligned", 2008, "d"),
    ("pointer_to_self", 2009, "d"),
    // An interior pointer keeps a block (LeakSanitizer; valgrind says "possibly lost").
    ("interior", 2010, "r"),
    ("cycle", 2011, "ii"),
    ("tree", 2012, "d"),
    ("tree", 2112, "ii"),
    ("stale_stack", 2013, "d"),
    ("dlopen_tls", 2014, "r"),
    ("joined_thread", 2016, "dddd"),
    ("freed", 2015, ""),
];

fn verdicts(r: &serde_json::Value, size: u64) -> String {
    let mut out = String::new();
    for g in r["leaks"].as_array().unwrap() {
        let reach = &g["reachability"];
        for (k, c) in [("definite", 'd'), ("indirect", 'i'), ("reachable", 'r')] {
            let (bytes, blocks) = (reach[k]["bytes"].as_u64().unwrap_or(0), reach[k]["blocks"].as_u64().unwrap_or(0));
            if blocks > 0 && bytes == size * blocks {
                out.extend(std::iter::repeat_n(c, blocks as usize));
            }
        }
    }
    let mut v: Vec<char> = out.chars().collect();
    v.sort_unstable();
    v.into_iter().collect()
}

#[test]
fn every_case_gets_the_verdict_of_the_leak_checkers_it_comes_from() {
    let bin = build_fixture("lsan_cases.c", &[]);
    let plugin = build_fixture("tls_keep_plugin.c", &["-shared", "-fPIC"]);
    let mut wrong = Vec::new();
    for &(case, size, want) in CASES {
        let mut cmd = Command::new(&bin);
        cmd.arg(case).arg(&plugin).env("LEAKTRACE_SCAN", "1").env("LEAKTRACE_SUMMARY", "0");
        let run = run_traced(cmd, "upstream");
        assert_eq!(run.code(), Some(0), "{case}: {}", run.stderr());
        assert_eq!(run.stdout(), "done\n");
        let got = verdicts(&run.report(), size);
        if got != want {
            wrong.push(format!("{case} ({size} bytes): got {got:?}, want {want:?}"));
        }
    }
    assert!(wrong.is_empty(), "{} of {} cases differ:\n{}", wrong.len(), CASES.len(), wrong.join("\n"));
}
