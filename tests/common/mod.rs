//! Shared helpers for the integration tests: build C/C++ fixtures, run them under the
//! real preload library, and read the reports they produce.
#![allow(dead_code)]
pub mod skip;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The library cargo built for this test run: target/<profile>/libleaktrace.so, found
/// from the test binary's own path (target/<profile>/deps/<test>).
pub fn lib_path() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().unwrap().parent().unwrap();
    let lib = profile_dir.join("libleaktrace.so");
    assert!(lib.exists(), "{} missing: run scripts/test.sh (cargo test alone does not build a cdylib)", lib.display());
    // cargo test never rebuilds a cdylib that no test links: refuse to test a stale one.
    let built = std::fs::metadata(&lib).unwrap().modified().unwrap();
    let newest_source = newest_mtime(&root().join("src")).max(newest_mtime(&root().join("common/src")));
    assert!(built >= newest_source, "{} is older than the sources: run scripts/test.sh (it builds the library before testing)", lib.display());
    lib
}

fn newest_mtime(dir: &Path) -> std::time::SystemTime {
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let t = if p.is_dir() { newest_mtime(&p) } else { e.metadata().unwrap().modified().unwrap() };
        newest = newest.max(t);
    }
    newest
}

fn scratch_root() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("test-scratch")
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh, empty directory for one test's reports.
pub fn fresh_dir(tag: &str) -> PathBuf {
    let d = scratch_root().join(format!("{tag}-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Compiles `tests/fixtures/<name>` once per test process into the scratch directory.
pub fn build_fixture(name: &str, extra: &[&str]) -> PathBuf {
    let src = root().join("tests/fixtures").join(name);
    let stem = Path::new(name).file_stem().unwrap().to_string_lossy().into_owned();
    let tag = extra.join("_").replace(['/', '-', '.', '='], "");
    let out_dir = scratch_root().join("bin");
    std::fs::create_dir_all(&out_dir).unwrap();
    let shared = extra.contains(&"-shared");
    let out = out_dir.join(format!("{stem}{tag}-{}{}", std::process::id(), if shared { ".so" } else { "" }));
    // One build at a time: a second build renamed over a binary that a running test
    // uses would turn its /proc/self/exe into "... (deleted)" and cost it its symbols.
    static BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    if out.exists() {
        return out;
    }
    let cpp = name.ends_with(".cpp");
    let compiler = if cpp { "c++" } else { "cc" };
    // -O2 without frame pointers: the unwinder must cope with distro-style code.
    // Tests run in parallel and may build the same fixture: compile to a private name
    // and rename, so nobody ever runs a half-written binary.
    let tmp = out.with_extension(format!("tmp{}", COUNTER.fetch_add(1, Ordering::Relaxed)));
    let mut cmd = Command::new(compiler);
    cmd.args(["-O2", "-g", "-fomit-frame-pointer", "-pthread"]).args(extra).arg(&src).arg("-o").arg(&tmp);
    if !shared {
        cmd.arg("-ldl");
    }
    let o = cmd.output().expect("C compiler (cc/c++) must be installed");
    assert!(o.status.success(), "compiling {name} failed:\n{}", String::from_utf8_lossy(&o.stderr));
    std::fs::rename(&tmp, &out).unwrap();
    out
}

/// How long one traced program may run in a test before it counts as hung
/// (`LEAKTRACE_TEST_TIMEOUT` seconds; 180 by default).
pub fn time_limit() -> std::time::Duration {
    let secs = std::env::var("LEAKTRACE_TEST_TIMEOUT").ok().and_then(|v| v.parse().ok()).unwrap_or(180);
    std::time::Duration::from_secs(secs)
}

/// `Command::output` under a time limit: a program still running after `time_limit()`
/// is killed with its whole process group and the test fails as hung.
pub trait TimedOutput {
    fn timed_output(&mut self) -> std::io::Result<Output>;
    /// `timed_output` with a limit of its own: for a step that builds, not a traced
    /// program (a build of the whole crate takes minutes beside busy loops).
    fn timed_output_within(&mut self, limit: std::time::Duration) -> std::io::Result<Output>;
}

impl TimedOutput for Command {
    fn timed_output(&mut self) -> std::io::Result<Output> {
        self.timed_output_within(time_limit())
    }

    fn timed_output_within(&mut self, limit: std::time::Duration) -> std::io::Result<Output> {
        use std::io::Read;
        use std::os::unix::process::CommandExt;
        use std::process::Stdio;
        let mut child = self.stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn()?;
        let mut out_pipe = child.stdout.take().unwrap();
        let mut err_pipe = child.stderr.take().unwrap();
        let out_reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = out_pipe.read_to_end(&mut v);
            v
        });
        let err_reader = std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = err_pipe.read_to_end(&mut v);
            v
        });
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if start.elapsed() > limit {
                // SAFETY: kill of the process group this test made.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
                let _ = child.wait();
                panic!("hung: {:?} ran longer than {} s and was killed", self, limit.as_secs());
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        // Descendants that kept the pipes open (daemons) are killed with the group
        // once the program itself has ended, after a grace period.
        let grace = std::time::Instant::now();
        while !out_reader.is_finished() || !err_reader.is_finished() {
            if grace.elapsed() > std::time::Duration::from_secs(10) {
                // SAFETY: as above.
                unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        Ok(Output { status, stdout: out_reader.join().unwrap(), stderr: err_reader.join().unwrap() })
    }
}

pub struct Run {
    pub output: Output,
    pub dir: PathBuf,
}

impl Run {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.output.stdout).into_owned()
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.output.stderr).into_owned()
    }
    pub fn code(&self) -> Option<i32> {
        self.output.status.code()
    }
    pub fn reports(&self) -> Vec<Value> {
        reports_in(&self.dir)
    }
    /// The one report of this run (fails if there are several).
    pub fn report(&self) -> Value {
        let mut r = self.reports();
        assert_eq!(r.len(), 1, "expected exactly one report in {}; stderr:\n{}", self.dir.display(), self.stderr());
        r.remove(0)
    }
}

pub fn reports_in(dir: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()).map(|e| e.path()).collect();
    names.sort();
    for p in names {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("leaktrace.") && name.ends_with(".json") {
            let text = std::fs::read_to_string(&p).unwrap();
            let mut report: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
            // Stacks are frame-table indices in the file; every test reads them as frames.
            leaktrace_common::report_schema::inline_frames(&mut report).unwrap_or_else(|e| panic!("{name}: {e}"));
            out.push(report);
        }
    }
    out
}

/// Starts `cmd` with SIGINT, SIGQUIT and SIGHUP at their defaults, as a terminal's
/// shell starts a program: a test runner started in the background of a script (`cmd
/// &` ignores SIGINT and SIGQUIT) or under `nohup` (SIGHUP) would hand its children
/// those signals ignored, and the tests of how a program ends by them would test that.
pub fn signals_at_default(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: `signal` is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGQUIT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        })
    }
}

/// Runs `cmd` under the library with reports going to a fresh directory.
pub fn run_traced(mut cmd: Command, tag: &str) -> Run {
    let dir = fresh_dir(tag);
    signals_at_default(&mut cmd);
    cmd.env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &dir);
    let output = cmd.timed_output().unwrap();
    Run { output, dir }
}

pub fn run_plain(mut cmd: Command) -> Output {
    signals_at_default(&mut cmd).env_remove("LD_PRELOAD").timed_output().unwrap()
}

/// The library's lines saying that the program's `malloc` does not reach it.
pub fn host_tracking_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("host allocations are not seen")).collect()
}

/// Leak groups whose stack mentions `function` (as a demangled name prefix or exact).
pub fn groups_with<'a>(report: &'a Value, function: &str) -> Vec<&'a Value> {
    report["leaks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| {
            g["stack"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["function"].as_str().map(|n| n == function || n.starts_with(&format!("{function}("))).unwrap_or(false))
        })
        .collect()
}

pub fn sum(groups: &[&Value], field: &str) -> u64 {
    groups.iter().map(|g| g[field].as_u64().unwrap()).sum()
}

pub fn host(report: &Value, field: &str) -> u64 {
    report["summary"]["host"][field].as_u64().unwrap_or_else(|| panic!("summary.host.{field} missing"))
}

/// The real Python interpreter (not a shim script that would exec several processes).
pub fn python() -> PathBuf {
    let out = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().expect("python3 must be installed");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Starts `sleeper.c` under the library (it leaks `bytes` in `leak_then_wait`, then
/// sleeps until a signal), with reports to a fresh directory and `env` set; waits
/// 300 ms for it to settle and sends it SIGTERM. Returns its output and the reports.
pub fn sleeper_until_sigterm(bytes: u64, env: &[(&str, &str)]) -> (Output, Vec<serde_json::Value>) {
    sleeper_until(libc::SIGTERM, bytes, env)
}

/// `sleeper_until_sigterm` with another signal.
pub fn sleeper_until(signal: i32, bytes: u64, env: &[(&str, &str)]) -> (Output, Vec<serde_json::Value>) {
    let bin = build_fixture("sleeper.c", &[]);
    let out_dir = fresh_dir("sleeper");
    let mut cmd = Command::new(&bin);
    cmd.arg(bytes.to_string());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = spawn_traced(cmd, &out_dir);
    std::thread::sleep(std::time::Duration::from_millis(300));
    // SAFETY: plain kill of our own child.
    unsafe { libc::kill(child.id() as i32, signal) };
    let out = wait_within(child);
    (out, reports_in(&out_dir))
}

/// Starts `cmd` under the library, its reports in `dir`, without the exit summary, its
/// stdout and stderr piped (for `wait_within`, or read as it runs).
pub fn spawn_traced(mut cmd: Command, dir: &Path) -> std::process::Child {
    signals_at_default(&mut cmd)
        .env("LD_PRELOAD", lib_path())
        .env("LEAKTRACE_OUTPUT", dir)
        .env("LEAKTRACE_SUMMARY", "0")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// `Child::wait_with_output` under `time_limit()`: a child still running then is killed
/// and the test fails as hung.
pub fn wait_within(mut child: std::process::Child) -> Output {
    let start = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > time_limit() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("hung: pid {} ran longer than {} s and was killed", child.id(), time_limit().as_secs());
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
