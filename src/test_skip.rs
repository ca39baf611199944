//! Tests only: a skip that says so (as tests/common/skip.rs `not_here`). libtest has no
//! skipped state, so the line goes to `LEAKTRACE_SKIP_LOG`, which scripts/test.sh reads
//! and counts as skipped instead of the `ok` libtest prints for an early return.

/// Records that the calling test cannot run its assertions here, and why; the caller
/// returns at once.
pub fn skip_not_here(reason: &str) {
    use std::io::Write;
    let name = std::thread::current().name().unwrap_or("?").to_string();
    let exe = std::env::current_exe().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())).unwrap_or_default();
    eprintln!("SKIPPED {name}: {reason}");
    if let Some(log) = std::env::var_os("LEAKTRACE_SKIP_LOG") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(log) {
            let _ = f.write_all(format!("{exe}\t{name}\t{reason}\n").as_bytes());
        }
    }
}
