//! Standby (issue 53): the library is loaded (`LEAKTRACE_STANDBY=1`, `leaktrace run
//! --standby`) and records nothing — its hooks pass through, no collector runs, Python's
//! object allocator is not wrapped — until `leaktrace attach PID` switches it on. Then
//! it starts as the constructor would have (`start_tracking`), and the heap blocks live
//! at that moment are kept as blocks from before: never a leak, read by the scan.
//!
//! The switch is a Unix socket, `/tmp/leaktrace-UID/standby-PID.sock`, that one thread
//! of ours (every signal blocked) accepts on: no ptrace, so it works in a container
//! without `CAP_SYS_PTRACE` and under Yama. The directory is the process's user's, mode
//! 0700 (one owned by anyone else, or open to others, is refused: standby stays off with
//! one line on stderr), and the thread answers only a peer of the same user or root
//! (`SO_PEERCRED`), ptrace's own rule. The socket is removed when the process exits.
//!
//! Requests, one line each, answered with one line: `on` (`ok REPORT_DIR`), `snapshot`
//! (`ok`, a report is written soon), `status` (`standby`, `on REPORT_DIR` or `off`),
//! `off` (`ok REPORT_DIR`: the last report is written, the process runs on as before
//! it was switched on; it cannot be switched on again). `on` may
//! carry `main_tp=HEX` (the main thread's thread pointer, for a library loaded on
//! another thread) and, last, `output=DIR` (the rest of the line).
//!
//! A library loaded into a running process by `leaktrace attach` (`dlopen`, not
//! preloaded) waits here the same way; switching it on also routes the program's calls
//! to its hooks (`interpose::got`), which a preload gets from the loader.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::config::Config;
use crate::hotpath::thread;
use crate::lifecycle::LIFECYCLE;
use crate::os::fds::stderr_line;

/// What switching on needs: what the constructor would have passed to `start`, and
/// what the interposition layer does once tracking runs (fork handlers, signals).
#[derive(Clone)]
struct Pending {
    config: Config,
    host_tracking: String,
    glibc_heap: bool,
    /// Loaded late: runs once the hooks record, to route the program's calls to them.
    route: Option<fn()>,
    on_started: fn(&Config),
    /// Once the recording is ended (`off`): what the interposition layer undoes.
    on_stopped: fn(),
}

static PENDING: Mutex<Option<Pending>> = Mutex::new(None);
static LISTENER: Mutex<Option<(UnixListener, PathBuf)>> = Mutex::new(None);
/// Set once switched on (or refused for good).
static SWITCHED: AtomicBool = AtomicBool::new(false);
/// The process that made the socket: a forked child neither answers nor removes it.
static OWNER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// The socket's directory for the user `uid` under `tmp`.
pub fn socket_dir(tmp: &std::path::Path, uid: u32) -> PathBuf {
    tmp.join(format!("leaktrace-{uid}"))
}

/// The socket's file name for process `pid` (as the process sees its own id).
pub fn socket_name(pid: u32) -> String {
    format!("standby-{pid}.sock")
}

/// From the constructor: binds the socket and starts the thread that answers on it.
/// Returns false (with one line on stderr) when standby cannot be offered; tracking then
/// stays off.
/// `route`: for a library loaded late, what routes the program's calls to its hooks once
/// switched on (the main thread's TLS is then recorded at the switch, not here).
pub fn listen(config: Config, host_tracking: String, glibc_heap: bool, route: Option<fn()>, on_started: fn(&Config), on_stopped: fn()) -> bool {
    thread::untracked(|| {
        if let Err(e) = bind_socket() {
            stderr_line(&format!("leaktrace: standby is off: {e}"));
            return false;
        }
        if config.scan && route.is_none() {
            // The main thread's TLS, read on the main thread (the constructor's).
            crate::scan::roots::record_main_tls();
        }
        *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = Some(Pending { config, host_tracking, glibc_heap, route, on_started, on_stopped });
        if let Err(e) = start_answering() {
            stderr_line(&format!("leaktrace: standby is off: {e}"));
            return false;
        }
        true
    })
}

/// Binds this process's socket in its user's private directory (a socket left by an
/// earlier process of the same id, killed before its exit, removed first) and keeps it
/// for the thread that answers; the reason when it cannot.
fn bind_socket() -> Result<(), String> {
    // SAFETY: geteuid cannot fail.
    let uid = unsafe { libc::geteuid() };
    let dir = socket_dir(std::path::Path::new("/tmp"), uid);
    private_dir(&dir, uid)?;
    let pid = std::process::id();
    let path = dir.join(socket_name(pid));
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600));
    OWNER.store(pid, Ordering::SeqCst);
    *LISTENER.lock().unwrap_or_else(|e| e.into_inner()) = Some((listener, path));
    Ok(())
}

/// Starts the thread that answers on the socket `bind_socket` made; the socket goes
/// when it cannot.
fn start_answering() -> Result<(), String> {
    thread::spawn_internal(listener_main).map(|_| ()).map_err(|rc| {
        remove_socket();
        format!("cannot start its thread (error {rc})")
    })
}

/// Creates `dir` (mode 0700) or checks the one there: owned by `uid`, open to no one
/// else, not a link.
fn private_dir(dir: &std::path::Path, uid: u32) -> Result<(), String> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    leaktrace_common::private_dir::check(dir, uid)
}

/// At exit, or when standby could not start: the socket goes (only by the process that
/// made it).
pub fn remove_socket() {
    if OWNER.load(Ordering::SeqCst) != std::process::id() {
        return;
    }
    let taken = LISTENER.try_lock().ok().and_then(|mut l| l.take());
    if let Some((_, path)) = taken {
        let _ = std::fs::remove_file(path);
    }
}

fn listener_main() {
    let listener = {
        let guard = LISTENER.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref().map(|(l, _)| l.try_clone()) {
            Some(Ok(l)) => l,
            _ => return,
        }
    };
    for conn in listener.incoming() {
        if OWNER.load(Ordering::SeqCst) != std::process::id() {
            return;
        }
        let Ok(conn) = conn else { continue };
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| answer(conn)));
        if LEAVE.load(Ordering::SeqCst) {
            // A library loaded late whose recording ended: no thread, socket or
            // descriptor of ours stays in the process.
            remove_socket();
            return;
        }
    }
}

/// Set when the thread that answers is to leave after its answer.
static LEAVE: AtomicBool = AtomicBool::new(false);
/// Set when the library was loaded late (`Pending::route`).
static LATE: AtomicBool = AtomicBool::new(false);

/// One request on `conn`, from a peer allowed to ask.
fn answer(mut conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(5)));
    let reply = match peer_allowed(&conn) {
        Err(e) => format!("error {e}"),
        Ok(()) => {
            let mut line = String::new();
            let mut reader = BufReader::new(&conn);
            match reader.read_line(&mut line) {
                Ok(_) => request(line.trim()),
                Err(e) => format!("error reading the request: {e}"),
            }
        }
    };
    let _ = conn.write_all(format!("{reply}\n").as_bytes());
}

/// The peer is this process's user, or root (`SO_PEERCRED`).
fn peer_allowed(conn: &UnixStream) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: u32::MAX };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the size passed.
    let rc = unsafe { libc::getsockopt(conn.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, &mut cred as *mut _ as *mut libc::c_void, &mut len) };
    // SAFETY: geteuid cannot fail.
    let own = unsafe { libc::geteuid() };
    if rc != 0 || !(cred.uid == own || cred.uid == 0) {
        return Err(format!("only user {own} or root may switch this process on"));
    }
    Ok(())
}

/// What an `on` request may carry.
#[derive(Debug, Default, PartialEq, Eq)]
struct OnArgs {
    main_tp: Option<u64>,
    output: Option<String>,
}

/// `main_tp=HEX output=DIR` (either may be missing; the directory is the rest of the
/// line, spaces and all). `None` for anything else.
fn on_args(rest: &str) -> Option<OnArgs> {
    let mut args = OnArgs::default();
    let mut rest = rest.trim_start();
    while !rest.is_empty() {
        if let Some(dir) = rest.strip_prefix("output=") {
            args.output = Some(dir.to_string()).filter(|d| !d.is_empty());
            break;
        }
        let (word, after) = rest.split_once(' ').unwrap_or((rest, ""));
        let hex = word.strip_prefix("main_tp=")?;
        args.main_tp = Some(u64::from_str_radix(hex.trim_start_matches("0x"), 16).ok()?);
        rest = after.trim_start();
    }
    Some(args)
}

fn request(line: &str) -> String {
    if let Some(rest) = line.strip_prefix("on ") {
        return match on_args(rest) {
            Some(args) => match switch_on(args) {
                Ok(dir) => format!("ok {dir}"),
                Err(e) => format!("error {e}"),
            },
            None => format!("error cannot read {line:?}: on [main_tp=HEX] [output=DIR]"),
        };
    }
    match line {
        "on" => match switch_on(OnArgs::default()) {
            Ok(dir) => format!("ok {dir}"),
            Err(e) => format!("error {e}"),
        },
        "status" => match report_dir() {
            Some(dir) if LIFECYCLE.tracking() => format!("on {dir}"),
            _ if SWITCHED.load(Ordering::SeqCst) => "off".into(),
            _ => "standby".into(),
        },
        "snapshot" if LIFECYCLE.tracking() => {
            super::request_snapshot();
            "ok".into()
        }
        "snapshot" => "error not recording: switch it on first (leaktrace attach PID)".into(),
        // Where this thread is to leave, its id follows (a tab between): the command
        // waits for it to be gone.
        "off" => match switch_off() {
            Ok(dir) if LEAVE.load(Ordering::SeqCst) => format!("ok {dir}\t{}", thread::tid()),
            Ok(dir) => format!("ok {dir}"),
            Err(e) => format!("error {e}"),
        },
        other => format!("error unknown request {other:?}: on, off, snapshot or status"),
    }
}

/// Where reports go, once tracking runs.
fn report_dir() -> Option<String> {
    let r = super::lock_bounded(&super::REPORT, Duration::from_secs(5))?;
    r.as_ref().map(|r| r.output_dir.display().to_string())
}

/// What ending the recording undoes (set when it is switched on).
static ON_STOPPED: Mutex<Option<fn()>> = Mutex::new(None);

/// Ends the recording (`leaktrace attach --detach`): its last report, and the process
/// runs on as before it was switched on; the report directory.
fn switch_off() -> Result<String, String> {
    if !LIFECYCLE.tracking() {
        return Err(if SWITCHED.load(Ordering::SeqCst) { "its recording has ended already".into() } else { "not recording: nothing to detach from".into() });
    }
    let undo = *ON_STOPPED.lock().unwrap_or_else(|e| e.into_inner());
    let done = super::detach(undo);
    if done.is_ok() {
        // It may be switched on again: what the last switch had.
        let last = LAST.lock().unwrap_or_else(|e| e.into_inner()).clone();
        *PENDING.lock().unwrap_or_else(|e| e.into_inner()) = last;
        if LATE.load(Ordering::SeqCst) {
            LEAVE.store(true, Ordering::SeqCst);
        }
    }
    done
}

/// What the last switch on was given (for the next one, after a detach).
static LAST: Mutex<Option<Pending>> = Mutex::new(None);

/// A library loaded late whose recording was ended (`off`): the thread that answers
/// starts again, on a new socket, so that `leaktrace attach` can switch it on again.
/// Called by the command through ptrace (`leaktrace_attach_listen`). False when there
/// is nothing to switch on or the thread could not start.
///
/// Also a child that a standby process forked before it was switched on: it inherits
/// the standby state, but not the thread (threads do not survive fork) nor the socket
/// (named by the parent's pid); the command calls the same function in the child.
pub fn listen_again() -> bool {
    let forked_child = OWNER.load(Ordering::SeqCst) != std::process::id();
    if LIFECYCLE.tracking() || PENDING.lock().unwrap_or_else(|e| e.into_inner()).is_none() || !(LATE.load(Ordering::SeqCst) || forked_child) {
        return false;
    }
    if forked_child {
        // The parent's listener and socket, as this copy of them holds them: forgotten,
        // never closed or removed here (the descriptor is closed, the name is the parent's).
        if let Some((l, _)) = LISTENER.lock().unwrap_or_else(|e| e.into_inner()).take() {
            drop(l);
        }
    } else if LISTENER.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
        return true;
    }
    thread::untracked(|| {
        LEAVE.store(false, Ordering::SeqCst);
        bind_socket().and_then(|()| start_answering()).is_ok()
    })
}

/// Starts tracking now, once; the report directory.
fn switch_on(args: OnArgs) -> Result<String, String> {
    if LIFECYCLE.tracking() {
        return report_dir().ok_or_else(|| "recording already, with no report directory".to_string());
    }
    let Some(mut p) = PENDING.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return Err("this process was switched on before and has ended its recording".into());
    };
    SWITCHED.store(true, Ordering::SeqCst);
    if p.route.is_some() && p.host_tracking != "active" {
        // Loaded late into a program whose calls go to an allocator of its own: routing
        // them to hooks that forward to the C library's would break it.
        return Err(format!("not switched on: host allocations could not be seen ({})", p.host_tracking));
    }
    if let Some(dir) = args.output {
        p.config.output_dir = Some(dir.into());
    }
    if p.route.is_some() {
        LATE.store(true, Ordering::SeqCst);
        // Loaded into a program that never asked for it: its stderr is its own (the
        // command that attached reads the reports).
        p.config.summary = crate::config::Summary::Never;
    }
    *ON_STOPPED.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.on_stopped);
    *LAST.lock().unwrap_or_else(|e| e.into_inner()) = Some(p.clone());
    if p.route.is_some() && p.config.scan {
        thread::untracked(|| crate::scan::roots::record_main_tls_of(args.main_tp));
    }
    let on_started = p.on_started;
    let config = p.config.clone();
    if !super::start_tracking(p.config, p.host_tracking, p.glibc_heap, true, p.route) {
        return Err("tracking could not start in this process (see its stderr)".into());
    }
    on_started(&config);
    report_dir().ok_or_else(|| "recording, with no report directory".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn an_on_request_carries_the_main_threads_pointer_and_the_output_directory() {
        assert_eq!(on_args(""), Some(OnArgs::default()));
        assert_eq!(on_args("main_tp=7f12ab00"), Some(OnArgs { main_tp: Some(0x7f12ab00), output: None }));
        assert_eq!(on_args("main_tp=0x10 output=/tmp/my reports"), Some(OnArgs { main_tp: Some(0x10), output: Some("/tmp/my reports".into()) }));
        assert_eq!(on_args("output=r"), Some(OnArgs { main_tp: None, output: Some("r".into()) }));
        assert_eq!(on_args("main_tp=zz"), None);
        assert_eq!(on_args("colour=blue"), None);
    }

    #[test]
    fn the_socket_lives_in_a_directory_of_the_users_own() {
        assert_eq!(socket_dir(std::path::Path::new("/tmp"), 1000), PathBuf::from("/tmp/leaktrace-1000"));
        assert_eq!(socket_name(42), "standby-42.sock");
        let base = std::env::temp_dir().join(format!("lt-standby-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        // SAFETY: geteuid cannot fail.
        let uid = unsafe { libc::geteuid() };
        let dir = socket_dir(&base, uid);
        private_dir(&dir, uid).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        // Open to others: refused, and said how to fix.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_dir(&dir, uid).unwrap_err().contains("remove it"));
        // Someone else's: refused.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(private_dir(&dir, uid + 1).is_err());
        let _ = std::fs::remove_dir_all(&base);
    }
}
