//! Skips that say so. libtest has no skipped state: a test that returns early reports
//! `ok`. A test that cannot run its assertions calls one of these instead and returns;
//! the line goes to `LEAKTRACE_SKIP_LOG` (set by scripts/test.sh), which rewrites the
//! test's `ok` into `skipped: REASON`, counts it in its closing line
//! (`tests: N passed, M failed, K skipped`) and lists every skip after it.
//!
//! Two kinds of reason:
//! - `missing`: something `scripts/setup.sh` installs (a Debian or Python package). Under
//!   CI (`CI` set), where setup has run, that is a failure, not a skip.
//! - `not_here`: something no setup can give (no root, a page the kernel gave away):
//!   a skip everywhere.
#![allow(dead_code)]
use std::io::Write;

fn test_name() -> String {
    // libtest runs each test on a thread named after it.
    std::thread::current().name().unwrap_or("?").to_string()
}

fn record(reason: &str) {
    let exe = std::env::current_exe().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_default();
    let reason = reason.replace(['\n', '\t'], " ");
    eprintln!("SKIPPED {}: {reason}", test_name());
    if let Some(log) = std::env::var_os("LEAKTRACE_SKIP_LOG") {
        // One write of one line, appended: tests of several binaries share the file.
        let line = format!("{exe}\t{}\t{reason}\n", test_name());
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// Skips the calling test for want of `what`, which `scripts/setup.sh` installs
/// (`how` says how). Under CI a failure instead: setup ran there, so it must be present.
pub fn missing(what: &str, how: &str) {
    assert!(std::env::var_os("CI").is_none(), "{what} is missing ({how}); under CI, scripts/setup.sh installs it");
    record(&format!("{what} is missing ({how})"));
}

/// Skips the calling test for a reason no setup can change on this machine.
pub fn not_here(reason: &str) {
    record(reason);
}
