//! Stress under the real library: many threads, thread churn, fork storms, snapshot
//! signals in a tight loop. Every run is bounded by a timeout: a hang fails the test.
mod common;
use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `cmd` in a process group of its own; past `limit` the whole group is killed (a
/// hung forked child keeps the output pipes open, so killing the fixture alone would
/// leave the test waiting for end of file).
fn run_with_timeout(mut cmd: Command, limit: Duration) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn().unwrap();
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > limit {
            // SAFETY: the group is the child's own (process_group(0) above).
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            let out = child.wait_with_output().unwrap();
            panic!("hung for {limit:?}; stderr:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn threads_forks_and_snapshot_signals_lose_nothing_and_never_hang() {
    let bin = build_fixture("stress.c", &[]);
    for round in 0..3 {
        let dir = fresh_dir("stress");
        let mut cmd = Command::new(&bin);
        cmd.env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &dir).env("LEAKTRACE_INTERVAL_MS", "20").env("LEAKTRACE_SUMMARY", "0");
        let out = run_with_timeout(cmd, Duration::from_secs(120));
        assert!(out.status.success(), "round {round}: {:?}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(text.starts_with("children_ok=20 "), "{text}");
        let reports = reports_in(&dir);
        assert_eq!(reports.len(), 21, "the parent and each of the 20 children");
        let parent = reports.iter().find(|r| r["fork"]["forked_from_pid"].is_null()).unwrap();
        assert_eq!(parent["reason"], "exit");
        for r in &reports {
            assert_eq!(
                r["summary"]["host"]["total_allocs"].as_u64().unwrap() - r["summary"]["host"]["total_frees"].as_u64().unwrap(),
                r["summary"]["host"]["live_blocks"].as_u64().unwrap()
            );
        }
        for child in reports.iter().filter(|r| !r["fork"]["forked_from_pid"].is_null()) {
            assert_eq!(child["reason"], "exit");
            assert_eq!(child["fork"]["forked_from_pid"], parent["pid"]);
            let leak = groups_with(child, "child_leak");
            assert_eq!((sum(&leak, "bytes"), sum(&leak, "blocks")), (4242, 1), "{child:#}");
        }
        // Exact accounting against the fixture's own count: the workers' blocks still in
        // the shared slots, after 320,000 allocations freed by whichever thread replaced
        // them, and nothing else of theirs. (glibc keeps the TLS blocks of exited threads
        // in its stack cache; those allocations are inside pthread_create.)
        let field = |name: &str| -> u64 { text.split_whitespace().find_map(|kv| kv.strip_prefix(&format!("{name}="))).unwrap().parse().unwrap() };
        let own: Vec<_> = parent["leaks"].as_array().unwrap().iter().filter(|g| g["stack"][0]["function"] == "worker").collect();
        assert_eq!((sum(&own, "blocks"), sum(&own, "bytes")), (field("live"), field("live_bytes")), "{own:#?}");
        assert!(field("live") > 0);
        assert_eq!(field("allocs") - field("frees"), field("live"));
        // Every allocation and free came: one event each, or one for both (a free merged
        // with its allocation's event).
        let d = &parent["diagnostics"];
        assert!(d["events"].as_u64().unwrap() + d["merged_frees"].as_u64().unwrap() >= 16 * 20000 * 2, "{d}");
    }
}
