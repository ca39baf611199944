//! Real programs from Debian's packages, each run plain and under the library: the exit
//! status and stdout must be the same, nothing may hang (every run has a time limit), no
//! summary text may reach stdout, and every process that ran the library must leave a
//! report that parses. These are the runtimes that hung or broke before (JVM, Rust and
//! Ruby threads, chromium's zygote, Go), and the everyday programs a CI job runs.
//!
//! A program that is not installed is a skip, printed with the package that brings it,
//! except under CI (`CI` set), where `scripts/setup.sh` installs them all and a missing one fails.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What a traced run must leave in its report directory.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Reports {
    /// At least one report, every one whole; each process without a final report says why.
    Some,
    /// None: the program does not load the library (statically linked).
    None,
}

struct Program {
    name: &'static str,
    /// The command, run in a fresh directory holding copies of `files`.
    argv: Vec<String>,
    /// Fixture files (under tests/fixtures/real) copied into that directory.
    files: &'static [&'static str],
    /// Executables the run needs, and the Debian package of each.
    needs: &'static [(&'static str, &'static str)],
    env: Vec<(&'static str, String)>,
    reports: Reports,
}

impl Program {
    fn new(name: &'static str, argv: &[&str]) -> Program {
        Program { name, argv: argv.iter().map(|s| s.to_string()).collect(), files: &[], needs: &[], env: Vec::new(), reports: Reports::Some }
    }
    fn files(mut self, f: &'static [&'static str]) -> Program {
        self.files = f;
        self
    }
    fn needs(mut self, n: &'static [(&'static str, &'static str)]) -> Program {
        self.needs = n;
        self
    }
    fn env(mut self, k: &'static str, v: impl Into<String>) -> Program {
        self.env.push((k, v.into()));
        self
    }
    fn reports(mut self, r: Reports) -> Program {
        self.reports = r;
        self
    }
}

fn which(exe: &str) -> Option<PathBuf> {
    if exe.contains('/') {
        return Path::new(exe).exists().then(|| PathBuf::from(exe));
    }
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(exe)).find(|c| c.is_file()))
}

/// Whether everything `p` needs is installed; otherwise a skip (or, under CI, a failure).
fn available(p: &Program) -> bool {
    let missing: Vec<_> = p.needs.iter().filter(|(exe, _)| which(exe).is_none()).collect();
    if missing.is_empty() {
        return true;
    }
    let exes = missing.iter().map(|(exe, _)| *exe).collect::<Vec<_>>().join(", ");
    let pkgs = missing.iter().map(|(_, pkg)| *pkg).collect::<Vec<_>>().join(" ");
    skip::missing(&exes, &format!("apt-get install {pkgs}"));
    false
}

fn fixture_dir() -> PathBuf {
    root().join("tests/fixtures/real")
}

fn copy_tree(from: &Path, to: &Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap().flatten() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap();
    }
}

fn workdir(p: &Program, tag: &str) -> PathBuf {
    let d = fresh_dir(&format!("real-{}-{tag}", p.name));
    for f in p.files {
        copy_tree(&fixture_dir().join(f), &d.join(f));
    }
    d
}

fn command(p: &Program, dir: &Path) -> Command {
    let mut c = Command::new(&p.argv[0]);
    c.args(&p.argv[1..]).current_dir(dir).env_remove("LD_PRELOAD").env("LC_ALL", "C");
    for (k, v) in &p.env {
        c.env(k, v);
    }
    c
}

fn check(p: Program) {
    if !available(&p) {
        return;
    }
    let plain = command(&p, &workdir(&p, "plain")).timed_output().unwrap();
    let dir = workdir(&p, "traced");
    let out = dir.join("leaktrace-reports");
    let traced = command(&p, &dir).env("LD_PRELOAD", lib_path()).env("LEAKTRACE_OUTPUT", &out).timed_output().unwrap();
    let (po, to) = (String::from_utf8_lossy(&plain.stdout), String::from_utf8_lossy(&traced.stdout));
    let te = String::from_utf8_lossy(&traced.stderr);
    assert_eq!(traced.status, plain.status, "{}: exit status differs\nplain stderr:\n{}\ntraced stderr:\n{te}", p.name, String::from_utf8_lossy(&plain.stderr));
    assert_eq!(to, po, "{}: stdout differs\ntraced stderr:\n{te}", p.name);
    assert!(!to.contains("leaktrace"), "{}: library text on stdout:\n{to}", p.name);
    let reports = if out.exists() { reports_in(&out) } else { Vec::new() };
    match p.reports {
        Reports::None => assert!(reports.is_empty(), "{}: {} report(s) from a program that cannot load the library", p.name, reports.len()),
        Reports::Some => {
            assert!(!reports.is_empty(), "{}: no report\ntraced stderr:\n{te}", p.name);
            each_process_ended_with_a_report_or_a_reason(p.name, &reports);
        }
    }
    if std::env::var_os("LEAKTRACE_TEST_VERBOSE").is_some() {
        eprintln!("{}: status {:?}, {} report(s)", p.name, traced.status, reports.len());
    }
}

/// Every process image that ran the library ended with a final report, or says in its
/// last one why it cannot have one.
fn each_process_ended_with_a_report_or_a_reason(name: &str, reports: &[serde_json::Value]) {
    let mut pids: Vec<u64> = reports.iter().map(|r| r["pid"].as_u64().unwrap()).collect();
    pids.sort_unstable();
    pids.dedup();
    for pid in pids {
        let of_pid: Vec<_> = reports.iter().filter(|r| r["pid"].as_u64() == Some(pid)).collect();
        let final_or_why = of_pid.iter().any(|r| r["reason"] == "exit" || r["no_final_report"].is_string());
        assert!(final_or_why, "{name}: pid {pid} left no final report and no reason:\n{:#}", of_pid[0]["argv"]);
    }
}

fn scratch_bin(name: &str) -> PathBuf {
    let d = fresh_dir("real-bin");
    d.join(name)
}

// ---- runtimes with threads of their own ----------------------------------------------

#[test]
fn java_version() {
    check(Program::new("java-version", &["java", "-version"]).needs(&[("java", "default-jre-headless")]));
}

/// The Java program `tests/fixtures/real/CLASS.java`, compiled plain into each run's
/// directory by the command itself, then run.
fn java_program(name: &'static str, class: &'static str, file: &'static [&'static str]) {
    let p = Program::new(name, &["java", class]).files(file).needs(&[("java", "default-jre-headless"), ("javac", "default-jdk-headless")]);
    if !available(&p) {
        return;
    }
    let p = Program { argv: vec!["bash".into(), "-c".into(), format!("javac {class}.java && java {class}")], ..p };
    check(p);
}

#[test]
fn java_threads() {
    java_program("java-threads", "Threads", &["Threads.java"]);
}

#[test]
fn rustc_compiles_a_program() {
    check(Program::new("rustc", &["rustc", "-O", "threads.rs", "-o", "threads"]).files(&["threads.rs"]).needs(&[("rustc", "rustc (or rustup)")]));
}

#[test]
fn rust_std_threads() {
    let p = Program::new("rust-threads", &["true"]).needs(&[("rustc", "rustc (or rustup)")]);
    if !available(&p) {
        return;
    }
    let bin = scratch_bin("rust-threads");
    let ok = Command::new("rustc").args(["-O", "-o"]).arg(&bin).arg(fixture_dir().join("threads.rs")).status().unwrap();
    assert!(ok.success());
    check(Program::new("rust-threads", &[bin.to_str().unwrap()]));
}

#[test]
fn ruby_threads() {
    check(Program::new("ruby-threads", &["ruby", "threads.rb"]).files(&["threads.rb"]).needs(&[("ruby", "ruby")]));
}

#[test]
fn node_worker_thread() {
    check(Program::new("node-worker", &["node", "worker.js"]).files(&["worker.js"]).needs(&[("node", "nodejs")]));
}

fn go_build(dir: &str, cgo: bool) -> Option<PathBuf> {
    let bin = scratch_bin(dir);
    let cache = bin.parent().unwrap().join("gocache");
    let src = fresh_dir("real-go-src");
    copy_tree(&fixture_dir().join(dir), &src);
    let st = Command::new("go")
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&src)
        .env("GOCACHE", &cache)
        .env("GOPATH", bin.parent().unwrap().join("gopath"))
        .env("GOFLAGS", "-mod=mod")
        .env("GOPROXY", "off")
        .env("CGO_ENABLED", if cgo { "1" } else { "0" })
        .timed_output()
        .unwrap();
    assert!(st.status.success(), "go build {dir}: {}", String::from_utf8_lossy(&st.stderr));
    Some(bin)
}

#[test]
fn go_with_cgo() {
    let p = Program::new("go-cgo", &["true"]).needs(&[("go", "golang-go")]);
    if !available(&p) {
        return;
    }
    let bin = go_build("gocgo", true).unwrap();
    check(Program::new("go-cgo", &[bin.to_str().unwrap()]));
}

#[test]
fn go_statically_linked() {
    let p = Program::new("go-static", &["true"]).needs(&[("go", "golang-go")]);
    if !available(&p) {
        return;
    }
    let bin = go_build("gonocgo", false).unwrap();
    check(Program::new("go-static", &[bin.to_str().unwrap()]).reports(Reports::None));
}

#[test]
fn perl_script() {
    check(Program::new("perl", &["perl", "-e", "my %h = map { $_ => $_ * 2 } 1..5000; print scalar(keys %h), \"\\n\";"]).needs(&[("perl", "perl")]));
}

#[test]
fn python_multiprocessing_pool() {
    check(Program::new("python-pool", &["python3", "pool.py"]).files(&["pool.py"]).needs(&[("python3", "python3")]));
}

#[test]
fn python_threads() {
    check(
        Program::new(
            "python-threads",
            &["python3", "-c", "import threading\nr=[]\nts=[threading.Thread(target=lambda i=i: r.append(sum(range(i*1000)))) for i in range(8)]\n[t.start() for t in ts]\n[t.join() for t in ts]\nprint(len(r))"],
        )
        .needs(&[("python3", "python3")]),
    );
}

// ---- everyday programs of a CI job ---------------------------------------------------

#[test]
fn git_init_commit_log() {
    check(
        Program::new(
            "git",
            &["bash", "-c", "git init -q repo && cd repo && echo x > f && git add f && git -c user.email=ci@example.com -c user.name=ci commit -q -m first && git log --format=%s && git status --short | wc -l"],
        )
        .needs(&[("git", "git"), ("bash", "bash")]),
    );
}

#[test]
fn gcc_compiles_and_runs() {
    check(Program::new("gcc", &["bash", "-c", "gcc -O2 hello.c -o hello && ./hello"]).files(&["hello.c"]).needs(&[("gcc", "gcc")]));
}

#[test]
fn gxx_compiles_and_runs() {
    check(Program::new("g++", &["bash", "-c", "g++ -O1 hello.cpp -o hello && ./hello"]).files(&["hello.cpp"]).needs(&[("g++", "g++")]));
}

#[test]
fn make_builds_targets() {
    check(Program::new("make", &["make", "-s", "OUT=."]).files(&["Makefile"]).needs(&[("make", "make")]));
}

#[test]
fn sqlite3_in_memory() {
    check(
        Program::new(
            "sqlite3",
            &["sqlite3", ":memory:", "create table t(x integer); with recursive c(i) as (select 1 union all select i+1 from c where i < 5000) insert into t select i from c; create index ti on t(x); select count(*), sum(x) from t;"],
        )
        .needs(&[("sqlite3", "sqlite3")]),
    );
}

#[test]
fn xz_multithreaded_round_trip() {
    check(Program::new("xz", &["bash", "-c", "seq 1 300000 | xz -T0 -c | xz -d -T0 | md5sum"]).needs(&[("xz", "xz-utils"), ("md5sum", "coreutils")]));
}

#[test]
fn ffmpeg_generates_and_encodes_audio() {
    check(
        Program::new("ffmpeg", &["bash", "-c", "ffmpeg -nostdin -loglevel error -f lavfi -i sine=frequency=440:duration=0.5 -f s16le - | md5sum"])
            .needs(&[("ffmpeg", "ffmpeg")]),
    );
}

#[test]
fn chromium_headless_dump_dom() {
    let page = fixture_dir().join("page.html");
    check(
        Program::new("chromium", &["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom"])
            .needs(&[("chromium", "chromium")])
            .env("HOME", std::env::temp_dir().join("leaktrace-chromium-home").to_string_lossy().into_owned())
            .files(&[])
            .tap_argv(page.to_str().unwrap()),
    );
}

impl Program {
    fn tap_argv(mut self, arg: &str) -> Program {
        self.argv.push(format!("file://{arg}"));
        self
    }
}

#[test]
fn bash_pipelines_and_subshells() {
    check(
        Program::new("bash", &["bash", "-c", "for i in $(seq 1 200); do echo $((i * i)); done | sort -n | tail -3; (echo sub; exit 3); echo $?"])
            .needs(&[("bash", "bash")]),
    );
}

#[test]
fn coreutils_sort_in_parallel() {
    check(Program::new("sort", &["bash", "-c", "seq 1 200000 | sort -r --parallel=4 -S 1M | md5sum"]).needs(&[("sort", "coreutils")]));
}

#[test]
fn tar_and_gzip() {
    check(
        Program::new("tar-gzip", &["bash", "-c", "tar c -C /usr/share/doc/bash . | gzip -n | gzip -d | tar t | sort | md5sum"])
            .needs(&[("tar", "tar"), ("gzip", "gzip")]),
    );
}

#[test]
fn awk_and_sed() {
    check(Program::new("awk-sed", &["bash", "-c", "seq 1 5000 | awk '{ s += $1 } END { print s }' | sed 's/0/zero/g'"]).needs(&[("awk", "mawk")]));
}

#[test]
fn openssl_digest() {
    check(Program::new("openssl", &["bash", "-c", "seq 1 20000 | openssl dgst -sha256 -r"]).needs(&[("openssl", "openssl")]));
}

#[test]
fn a_setuid_program() {
    let p = Program::new("setuid-mount", &["mount", "--version"]).needs(&[("mount", "mount")]);
    if let Some(m) = which("mount") {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&m).unwrap().permissions().mode();
        assert!(mode & 0o4000 != 0 || std::env::var_os("CI").is_none(), "{} is not setuid here", m.display());
    }
    check(p);
}

#[test]
fn bubblewrap_sandbox() {
    check(
        Program::new(
            "bwrap",
            &[
                "bwrap",
                "--ro-bind",
                "/",
                "/",
                "--dev",
                "/dev",
                "--proc",
                "/proc",
                "--unshare-pid",
                "--unshare-ipc",
                "--",
                "bash",
                "-c",
                "echo sandboxed; ls / | wc -l",
            ],
        )
        .needs(&[("bwrap", "bubblewrap")]),
    );
}

#[test]
fn unshare_user_namespace() {
    check(Program::new("unshare", &["unshare", "-r", "--", "id", "-u"]).needs(&[("unshare", "util-linux")]));
}

#[test]
fn ssh_keygen() {
    check(Program::new("ssh-keygen", &["bash", "-c", "ssh-keygen -q -t ed25519 -N '' -f key && wc -l < key.pub"]).needs(&[("ssh-keygen", "openssh-client")]));
}

// ---- other runtimes, sandboxes, servers and pipelines (issue 42's matrix) ------------

#[test]
fn tcl_exec_of_traced_programs() {
    check(Program::new("tcl-exec", &["tclsh", "exec.tcl"]).files(&["exec.tcl"]).needs(&[("tclsh", "tcl")]));
}

#[test]
fn lua_tables() {
    check(Program::new("lua", &["lua5.4", "-e", "local t={} for i=1,100000 do t[i]=tostring(i) end print(#t)"]).needs(&[("lua5.4", "lua5.4")]));
}

#[test]
fn php_arrays() {
    check(
        Program::new("php", &["php", "-r", "$a=[]; for($i=0;$i<100000;$i++){$a[]=str_repeat('x',10);} echo count($a),\"\\n\";"]).needs(&[("php", "php-cli")]),
    );
}

#[test]
fn guile_lists() {
    check(Program::new("guile", &["guile", "-c", "(display (length (iota 100000))) (newline)"]).needs(&[("guile", "guile-3.0")]));
}

#[test]
fn busybox_pipeline() {
    check(Program::new("busybox", &["busybox", "sh", "-c", "seq 1 1000 | busybox sort -n | busybox tail -1"]).needs(&[("busybox", "busybox")]));
}

#[test]
fn gawk_arrays() {
    check(Program::new("gawk", &["gawk", "BEGIN{for(i=0;i<100000;i++) a[i]=i; print length(a)}"]).needs(&[("gawk", "gawk")]));
}

/// Programs that die of SIGPIPE when their reader leaves: each still dies by it (the
/// pipeline's statuses are the plain ones) and leaves its final report.
#[test]
fn yes_and_sort_die_of_sigpipe() {
    check(
        Program::new("sigpipe", &["bash", "-c", "yes | head -1; echo ${PIPESTATUS[@]}; seq 1 300000 | sort -rn | head -1; echo ${PIPESTATUS[@]}"])
            .needs(&[("sort", "coreutils")]),
    );
}

#[test]
fn python_dies_of_sigpipe_in_a_pipeline() {
    check(
        Program::new(
            "python-sigpipe",
            &["bash", "-c", "python3 -c 'import sys\nfor i in range(10**6): print(i)' 2>/dev/null | head -1; echo ${PIPESTATUS[@]}"],
        )
        .needs(&[("python3", "python3")]),
    );
}

/// Servers started and stopped on a loopback port by a client of their own.
#[test]
fn redis_server_on_loopback() {
    check(Program::new("redis", &["bash", "redis.sh"]).files(&["redis.sh"]).needs(&[("redis-server", "redis-server"), ("redis-cli", "redis-tools")]));
}

#[test]
fn memcached_on_loopback() {
    check(Program::new("memcached", &["bash", "memcached.sh"]).files(&["memcached.sh"]).needs(&[("memcached", "memcached")]));
}

#[test]
fn nginx_master_and_workers_on_loopback() {
    check(Program::new("nginx", &["bash", "nginx.sh"]).files(&["nginx.sh"]).needs(&[("nginx", "nginx-light"), ("curl", "curl")]));
}

/// firejail makes its sandbox's first process with a raw clone() (no fork handlers),
/// which forks the command and returns from its clone function.
#[test]
fn firejail_sandbox() {
    check(Program::new("firejail", &["firejail", "--quiet", "--noprofile", "bash", "-c", "echo inside; ls / | wc -l"]).needs(&[("firejail", "firejail")]));
}

/// valgrind's own tools over a program with the library preloaded: the library stays off
/// and the tool's verdict is the one without it.
#[test]
fn valgrind_memcheck_and_helgrind() {
    check(
        Program::new("valgrind", &["bash", "-c", "valgrind -q --error-exitcode=9 ls / > /dev/null; echo $?; valgrind -q --tool=helgrind --error-exitcode=9 sort /etc/passwd > /dev/null; echo $?"])
            .needs(&[("valgrind", "valgrind")]),
    );
}

#[test]
fn java_many_threads() {
    java_program("java-many-threads", "ManyThreads", &["ManyThreads.java"]);
}

/// A ptrace-based tool over traced programs: strace follows every child of a pipeline.
#[test]
fn strace_following_a_pipeline() {
    check(Program::new("strace", &["bash", "-c", "strace -f -q -o /dev/null bash -c 'seq 1 1000 | sort -n | tail -1'"]).needs(&[("strace", "strace")]));
}

/// Chromium with its sandbox on, as a non-root user: its renderers run under a seccomp
/// policy that kills a process (SIGSYS, "seccomp-bpf failure") for system calls it does
/// not expect — `arch_prctl`, `process_vm_readv`, `rt_sigpending` were made by the library
/// and crashed renderers (the page still came out: the browser replaces them). The same
/// DOM, status, no crash, and a final report or a reason for every process.
#[test]
fn chromium_sandboxed_as_a_non_root_user() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        skip::not_here("runs chromium as user nobody, which needs root (as CI has)");
        return;
    }
    let p = Program::new("chromium-sandboxed", &["runuser"]).needs(&[("chromium", "chromium"), ("runuser", "util-linux")]);
    if !available(&p) {
        return;
    }
    let dir = fresh_dir("real-chromium-sandboxed");
    let open = |d: &Path| {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o777)).unwrap();
    };
    for d in [dir.clone(), dir.join("home"), dir.join("reports")] {
        open(&d);
    }
    std::fs::copy(fixture_dir().join("page.html"), dir.join("page.html")).unwrap();
    let run = |traced: bool| {
        let mut c = Command::new("runuser");
        c.args(["-u", "nobody", "--", "env"]).arg(format!("HOME={}", dir.join("home").display()));
        if traced {
            c.arg(format!("LD_PRELOAD={}", lib_path().display())).arg(format!("LEAKTRACE_OUTPUT={}", dir.join("reports").display()));
        }
        c.args(["chromium", "--headless", "--disable-gpu", "--dump-dom"]).arg(format!("file://{}", dir.join("page.html").display()));
        c.current_dir(&dir).env_remove("LD_PRELOAD").timed_output().unwrap()
    };
    let plain = run(false);
    let traced = run(true);
    let err = String::from_utf8_lossy(&traced.stderr);
    assert_eq!(traced.status, plain.status, "{err}");
    assert_eq!(String::from_utf8_lossy(&traced.stdout), String::from_utf8_lossy(&plain.stdout), "{err}");
    assert!(String::from_utf8_lossy(&plain.stdout).contains("from script"));
    assert!(!err.contains("seccomp-bpf failure") && !err.contains("CRASHING"), "a sandboxed process crashed:\n{err}");
    let reports = reports_in(&dir.join("reports"));
    assert!(reports.len() > 3, "{} reports\n{err}", reports.len());
    each_process_ended_with_a_report_or_a_reason("chromium-sandboxed", &reports);
}
