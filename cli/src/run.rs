//! `leaktrace run -- CMD`: the program runs with the user's terminal untouched (same
//! process group, inherited stdio); the library is added to `LD_PRELOAD` in front of
//! what was there; SIGTERM, SIGHUP and SIGQUIT — and SIGINT sent by a process rather
//! than typed at the terminal, which already reached the program — are forwarded.
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    let pid = CHILD.load(Ordering::Relaxed);
    if pid <= 0 {
        return;
    }
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let code = if info.is_null() { libc::SI_USER } else { unsafe { (*info).si_code } };
    // A terminal's ^C goes to the whole foreground group, the program included.
    if sig == libc::SIGINT && code > 0 {
        return;
    }
    // SAFETY: kill is async-signal-safe.
    unsafe { libc::kill(pid, sig) };
}

fn install_forwarding() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
        // SAFETY: a plain sigaction with an async-signal-safe SA_SIGINFO handler.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = forward as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            libc::sigaction(sig, &act, std::ptr::null_mut());
        }
    }
}

/// The preload library built into this executable (`build.rs`); empty when none was.
static EMBEDDED: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libleaktrace.so"));

/// Where the embedded library is unpacked: `$XDG_CACHE_HOME/leaktrace` when that is
/// set (and only there: the user chose it), else the first usable of
/// `~/.cache/leaktrace` and `/tmp/leaktrace-UID`; a directory of ours that no one else
/// can write to (a library another user could plant there would be preloaded into
/// every program we run).
fn cache_dir() -> Result<PathBuf, String> {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let bases: Vec<PathBuf> = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(xdg) => vec![PathBuf::from(xdg).join("leaktrace")],
        None => [std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache/leaktrace"))]
            .into_iter()
            .flatten()
            .chain([PathBuf::from(format!("/tmp/leaktrace-{uid}"))])
            .collect(),
    };
    let mut errors = Vec::new();
    for base in bases {
        match private_dir(&base, uid) {
            Ok(d) => return Ok(d),
            Err(e) => errors.push(e),
        }
    }
    Err(errors.join("; "))
}

/// `base/<version>-<hash>`, created private, if `base` and it belong to `uid` alone.
fn private_dir(base: &Path, uid: u32) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let dir = base.join(format!("{}-{}", env!("CARGO_PKG_VERSION"), env!("LEAKTRACE_EMBED_HASH")));
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| format!("cannot create {} ({e})", dir.display()))?;
    for d in [base, &dir] {
        let m = std::fs::metadata(d).map_err(|e| format!("cannot inspect {} ({e})", d.display()))?;
        if m.uid() != uid || m.permissions().mode() & 0o022 != 0 {
            return Err(format!("{} is not a private directory of this user", d.display()));
        }
    }
    Ok(dir)
}

/// The embedded library, unpacked once per version into `cache_dir()` (written to a
/// private temporary name, then renamed: a concurrent run never sees half a file).
fn embedded_library() -> Result<PathBuf, String> {
    if EMBEDDED.is_empty() {
        return Err("this leaktrace was built without its library; build it (cargo build --release) or set LEAKTRACE_LIB".into());
    }
    let dir = cache_dir().map_err(|e| {
        format!("no private cache directory to unpack the library into ({e}); set XDG_CACHE_HOME to a directory only you can write to, or LEAKTRACE_LIB to a libleaktrace.so")
    })?;
    let lib = dir.join("libleaktrace.so");
    if std::fs::metadata(&lib).map(|m| m.len() == EMBEDDED.len() as u64).unwrap_or(false) {
        return Ok(lib);
    }
    let tmp = dir.join(format!(".libleaktrace.so.{}", std::process::id()));
    let written = std::fs::write(&tmp, EMBEDDED).and_then(|()| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &lib)
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot unpack the library into {} ({e}); set XDG_CACHE_HOME to a writable directory, or LEAKTRACE_LIB", dir.display()));
    }
    Ok(lib)
}

/// The preload library: `LEAKTRACE_LIB`, beside this executable, in `../lib`, or the
/// copy built into this executable (unpacked into a private cache).
pub fn find_library() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("LEAKTRACE_LIB") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("LEAKTRACE_LIB={} is not a file; point it at libleaktrace.so", p.display())) };
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot locate the leaktrace executable ({e}); set LEAKTRACE_LIB"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    for candidate in [dir.join("libleaktrace.so"), dir.join("../lib/libleaktrace.so")] {
        if candidate.is_file() {
            return Ok(candidate.canonicalize().unwrap_or(candidate));
        }
    }
    embedded_library().map_err(|e| format!("libleaktrace.so not found beside {} or in ../lib, and {e}", exe.display()))
}

pub struct RunSettings {
    pub output: PathBuf,
    pub interval_ms: Option<u64>,
    pub depth: Option<usize>,
    pub scan: bool,
    pub suppressions: Option<PathBuf>,
    /// The library's built-in suppressions on (its default) or off.
    pub default_suppressions: bool,
    /// `--why-reachable TEMPLATE` (LEAKTRACE_WHY_REACHABLE).
    pub why_reachable: Option<String>,
    /// `--standby` (LEAKTRACE_STANDBY): recording nothing until `leaktrace attach`.
    pub standby: bool,
}

pub enum Outcome {
    /// The command's exit code (128 + signal when killed) and its pid.
    Exited(i32, u32),
    NotFound(String),
    Failed(String),
}

/// `cmd[0]` found through `PATH` (or as given when it names a path).
fn resolve_program(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    std::env::var_os("PATH").and_then(|p| std::env::split_paths(&p).map(|d| d.join(name)).find(|c| c.is_file()))
}

/// When `cmd[0]` is a pyenv shim (a shell script that runs `pyenv exec PROGRAM`), the
/// program it stands for, asked of pyenv once and untraced, with the bin directory
/// `pyenv exec` would put first on `PATH`. A shim runs some forty shell processes before
/// the interpreter starts; traced, each wrote a report of its own.
pub fn follow_pyenv_shim(cmd0: &str) -> Option<(PathBuf, PathBuf)> {
    let shim = resolve_program(cmd0)?;
    let mut head = vec![0u8; 1024];
    let n = std::io::Read::read(&mut std::fs::File::open(&shim).ok()?, &mut head).ok()?;
    let head = String::from_utf8_lossy(&head[..n]);
    if !head.starts_with("#!") || !head.contains("pyenv\" exec") && !head.contains("pyenv exec") {
        return None;
    }
    let program = shim.file_name()?.to_string_lossy().into_owned();
    let root = head
        .lines()
        .find_map(|l| l.trim().strip_prefix("export PYENV_ROOT=\"").and_then(|r| r.strip_suffix('"')).map(PathBuf::from))
        .or_else(|| std::env::var_os("PYENV_ROOT").map(PathBuf::from))?;
    let pyenv = [root.join("libexec/pyenv"), root.join("bin/pyenv")].into_iter().find(|p| p.is_file())?;
    let out = Command::new(&pyenv).args(["which", &program]).env("PYENV_ROOT", &root).env_remove("LD_PRELOAD").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let real = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let bin = real.parent()?.to_path_buf();
    real.is_file().then_some((real, bin))
}

/// Runs `cmd`; returns its exit code (128 + signal when killed, as shells report it).
pub fn run(lib: &Path, cmd: &[String], s: &RunSettings) -> Outcome {
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.trim().is_empty() => format!("{}:{existing}", lib.display()),
        _ => lib.display().to_string(),
    };
    let mut c = match follow_pyenv_shim(&cmd[0]) {
        Some((real, bin)) => {
            eprintln!("leaktrace: {} is a pyenv shim; running {}", cmd[0], real.display());
            let path = std::env::var_os("PATH").unwrap_or_default();
            let mut dirs = vec![bin];
            dirs.extend(std::env::split_paths(&path));
            let mut c = Command::new(real);
            if let Ok(joined) = std::env::join_paths(dirs) {
                c.env("PATH", joined);
            }
            c
        }
        None => Command::new(&cmd[0]),
    };
    c.args(&cmd[1..]).env("LD_PRELOAD", preload).env("LEAKTRACE_OUTPUT", &s.output).env("LEAKTRACE_SUMMARY", "0");
    if let Some(ms) = s.interval_ms {
        c.env("LEAKTRACE_INTERVAL_MS", ms.to_string());
    }
    if let Some(d) = s.depth {
        c.env("LEAKTRACE_STACK_DEPTH", d.to_string());
    }
    c.env("LEAKTRACE_SCAN", if s.scan { "1" } else { "0" });
    if let Some(sup) = &s.suppressions {
        c.env("LEAKTRACE_SUPPRESSIONS", sup);
    }
    if !s.default_suppressions {
        c.env("LEAKTRACE_DEFAULT_SUPPRESSIONS", "0");
    }
    if let Some(t) = &s.why_reachable {
        c.env("LEAKTRACE_WHY_REACHABLE", t);
    }
    if s.standby {
        c.env("LEAKTRACE_STANDBY", "1");
    }
    install_forwarding();
    // Orphaned descendants (daemonized helpers, Python's resource tracker) are
    // reparented to us, so the run can wait for them and collect their reports too.
    // SAFETY: prctl with an integer argument.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let mut child = match c.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Outcome::NotFound(format!("{}: command not found", cmd[0]));
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            return Outcome::Failed(format!("{}: permission denied; is it executable?", cmd[0]));
        }
        Err(e) => return Outcome::Failed(format!("cannot start {} ({e})", cmd[0])),
    };
    let pid = child.id();
    CHILD.store(pid as i32, Ordering::Relaxed);
    let progress = start_progress_line(&cmd[0], &s.output);
    let status = loop {
        match child.wait() {
            Ok(st) => break st,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Outcome::Failed(format!("waiting for {} failed ({e})", cmd[0])),
        }
    };
    CHILD.store(0, Ordering::Relaxed);
    wait_for_descendants(std::time::Duration::from_secs(10));
    if let Some(stop) = progress {
        stop.store(true, Ordering::Relaxed);
        eprint!("\r\x1b[2K");
    }
    Outcome::Exited(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)), pid)
}

/// Where stderr is a terminal: one line, rewritten each second, with the elapsed time
/// and the reports written so far. Returns the flag that stops it.
fn start_progress_line(cmd: &str, output: &Path) -> Option<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    // SAFETY: isatty on a file descriptor number.
    if unsafe { libc::isatty(2) } != 1 {
        return None;
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let name = Path::new(cmd).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let output = output.to_path_buf();
    let start = std::time::Instant::now();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(1));
        while !flag.load(Ordering::Relaxed) {
            let reports = std::fs::read_dir(&output)
                .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".json")).count())
                .unwrap_or(0);
            eprint!("\r\x1b[2Kleaktrace: {name} running for {}s, {reports} process report(s) so far", start.elapsed().as_secs());
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    });
    Some(stop)
}

/// Reaps descendants that outlived CMD (they were reparented to us), for at most
/// `limit`; one still running after that is reported and left alone.
fn wait_for_descendants(limit: std::time::Duration) {
    let start = std::time::Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child, non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            continue;
        }
        // SAFETY: reading errno after a failed call.
        if pid < 0 && unsafe { *libc::__errno_location() } == libc::ECHILD {
            return;
        }
        if start.elapsed() > limit {
            eprintln!("leaktrace: processes started by the command are still running after {}s; their reports may be missing", limit.as_secs());
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `./leaktrace-<cmd>-<YYYYmmdd-HHMMSS>` (local time), made unique if it exists.
pub fn default_output_dir(cmd: &str) -> PathBuf {
    let base = Path::new(cmd).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "cmd".into());
    let base: String = base.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect();
    // SAFETY: time/localtime_r with valid pointers.
    let stamp = unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&t, &mut tm);
        format!("{:04}{:02}{:02}-{:02}{:02}{:02}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec)
    };
    let mut dir = PathBuf::from(format!("leaktrace-{base}-{stamp}"));
    let mut n = 1;
    while dir.exists() {
        n += 1;
        dir = PathBuf::from(format!("leaktrace-{base}-{stamp}-{n}"));
    }
    dir
}
