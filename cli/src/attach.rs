//! `leaktrace attach PID`: the command's side of standby (the library's is
//! `agent::standby`). It finds the process's socket — in `/tmp/leaktrace-UID/`, under
//! the process's own root when it runs in another mount namespace (a container), named
//! by the process id the process sees itself by — and sends one request.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// What /proc says of the process: its effective user and its id in its own pid
/// namespace.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    uid: u32,
    own_pid: u32,
}

/// From the text of /proc/PID/status.
fn target_of(status: &str, pid: u32) -> Option<Target> {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::split_whitespace);
    let uid = field("Uid:")?.nth(1)?.parse().ok()?;
    let own_pid = field("NSpid:").and_then(|f| f.last()?.parse().ok()).unwrap_or(pid);
    Some(Target { uid, own_pid })
}

/// The socket of process `pid` as this process can reach it.
fn socket_path(pid: u32, t: &Target) -> PathBuf {
    let same_mounts = std::fs::read_link("/proc/self/ns/mnt").ok().is_some_and(|own| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok() == Some(own));
    let tmp = if same_mounts && same_root(pid) { PathBuf::from("/tmp") } else { PathBuf::from(format!("/proc/{pid}/root/tmp")) };
    tmp.join(format!("leaktrace-{}", t.uid)).join(format!("standby-{}.sock", t.own_pid))
}

/// Whether process `pid` sees the same file system root as this one (not chrooted, not
/// a container's).
pub fn same_root(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let a = std::fs::metadata("/proc/self/root");
    let b = std::fs::metadata(format!("/proc/{pid}/root"));
    matches!((a, b), (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino())
}

/// Sends `request` to process `pid` in standby; its answer (what follows `ok`, or the
/// whole line for `status`), or the one line that says why not and what would work.
pub fn ask(pid: u32, request: &str) -> Result<String, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| format!("no process {pid}"))?;
    let t = target_of(&status, pid).ok_or_else(|| format!("cannot read /proc/{pid}/status"))?;
    let path = socket_path(pid, &t);
    let not_standby = || {
        format!(
            "process {pid} is not in standby: start it with `leaktrace run --standby -- CMD` (or LEAKTRACE_STANDBY=1 with the library in LD_PRELOAD), or run `leaktrace attach {pid}` to load the library into it"
        )
    };
    let mut conn = match UnixStream::connect(&path) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            // SAFETY: geteuid cannot fail.
            let own = unsafe { libc::geteuid() };
            return Err(format!("process {pid} is user {}'s and this is user {own}: run as that user or as root", t.uid));
        }
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
            return without_socket(pid, request, &path).unwrap_or_else(|| Err(not_standby()));
        }
        Err(e) => return Err(format!("cannot reach process {pid} at {} ({e})", path.display())),
    };
    // Switching on reads the whole heap once: seconds for a large one.
    let _ = conn.set_read_timeout(Some(Duration::from_secs(120)));
    conn.write_all(format!("{request}\n").as_bytes()).map_err(|e| format!("process {pid} did not take the request ({e})"))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).map_err(|e| format!("process {pid} did not answer ({e})"))?;
    let line = line.trim();
    if let Some(err) = line.strip_prefix("error ") {
        return Err(format!("process {pid}: {err}"));
    }
    match line.strip_prefix("ok") {
        Some(rest) => Ok(rest.trim().to_string()),
        None if request == "status" && !line.is_empty() => Ok(line.to_string()),
        None => Err(format!("process {pid} answered {line:?}; is it the same leaktrace version as this command?")),
    }
}

/// The answer to `off`: the report directory, once the library's thread that answered
/// has left the process (a library loaded by `attach` leaves no thread behind; its id
/// follows the directory after a tab).
pub fn after_off(pid: u32, reply: &str) -> String {
    let Some((dir, tid)) = reply.rsplit_once('\t') else { return reply.to_string() };
    let start = std::time::Instant::now();
    while std::path::Path::new(&format!("/proc/{pid}/task/{}", tid.trim())).exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(2));
    }
    dir.to_string()
}

/// Signals held off this command while it lives: SIGINT and SIGTERM during `attach
/// --duration` (taken by `wait_interruptible`, and any that came after the wait taken
/// when the guard goes: the recording has ended anyway), and the terminal's signals
/// while a thread of the target runs our call (`inject`: delivered after it).
pub struct HeldSignals {
    old: libc::sigset_t,
    held: libc::sigset_t,
    take_pending: bool,
}

/// SIGINT and SIGTERM: what ends `attach --duration`.
pub const INTERRUPT: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

impl HeldSignals {
    pub fn new(signals: &[libc::c_int], take_pending: bool) -> HeldSignals {
        let held = signal_set(signals);
        // SAFETY: pthread_sigmask with valid pointers; a zeroed sigset_t is valid.
        unsafe {
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &held, &mut old);
            HeldSignals { old, held, take_pending }
        }
    }
}

fn signal_set(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset operations on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

impl Drop for HeldSignals {
    fn drop(&mut self) {
        // SAFETY: sigtimedwait with a zero timeout on the held set; then the mask saved
        // above is restored.
        unsafe {
            if self.take_pending {
                let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                while libc::sigtimedwait(&self.held, std::ptr::null_mut(), &zero) > 0 {}
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

/// Waits up to `limit` for SIGINT or SIGTERM to this command (held off meanwhile), or
/// for process `pid` to end; true when it ended.
pub fn wait_interruptible(pid: u32, limit: Duration) -> bool {
    let _held = HeldSignals::new(&INTERRUPT, true);
    let set = signal_set(&INTERRUPT);
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid) {
            return true;
        }
        let step = (limit - start.elapsed()).min(Duration::from_millis(200));
        let ts = libc::timespec { tv_sec: step.as_secs() as libc::time_t, tv_nsec: step.subsec_nanos() as libc::c_long };
        // SAFETY: sigtimedwait with a valid set and timeout; the signals are blocked.
        if unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) } > 0 {
            break;
        }
    }
    false
}

/// Whether process `pid` has ended and waits for its parent (state Z).
fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}

/// What /proc says of the library in process `pid`.
struct Library {
    /// libleaktrace is mapped.
    loaded: bool,
    /// It is in the process's `LD_PRELOAD`.
    preloaded: bool,
    /// `LEAKTRACE_STANDBY` is on in its environment.
    standby: bool,
    environ: Vec<u8>,
}

impl Library {
    fn of(pid: u32) -> Library {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
        Library::from(&maps, std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default())
    }

    fn from(maps: &str, environ: Vec<u8>) -> Library {
        let loaded = maps.lines().any(|l| l.rsplit('/').next().is_some_and(|f| f.starts_with("libleaktrace")));
        let mut lib = Library { loaded, preloaded: false, standby: false, environ };
        lib.preloaded = lib.var("LD_PRELOAD").is_some_and(|p| p.contains("libleaktrace"));
        lib.standby = lib.on("LEAKTRACE_STANDBY");
        lib
    }

    fn var(&self, name: &str) -> Option<String> {
        leaktrace_common::launch::environ_var(&self.environ, name)
    }

    fn on(&self, name: &str) -> bool {
        self.var(name).is_some_and(|v| matches!(v.trim(), "1" | "true" | "yes" | "on"))
    }
}

/// A process started without the library, which ptrace can load it into: its user and
/// its program's name.
pub struct ToInject {
    pub uid: u32,
    pub program: String,
}

/// `Some` when process `pid` runs without the library (`inject` loads it); `None` when
/// the library is there (standby, or recording since its start: the socket answers);
/// the reason when it can never be loaded (gone, static, musl).
/// A process with the library loaded and no thread answering for it, which the
/// library's `leaktrace_attach_listen` (called through ptrace) wakes.
#[derive(Debug, PartialEq, Eq)]
pub enum Asleep {
    /// Loaded late by an earlier `attach`, and detached from: reports go where the
    /// command says.
    Detached,
    /// A child a standby process forked before the switch: reports go where the
    /// process was told at its start.
    StandbyChild,
}

/// Whether process `pid` is `Asleep`.
pub fn asleep(pid: u32) -> Option<Asleep> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let t = target_of(&status, pid)?;
    let lib = Library::of(pid);
    if !lib.loaded || UnixStream::connect(socket_path(pid, &t)).is_ok() {
        return None;
    }
    // Late and detached, or a child forked by a standby process (it has no socket of
    // its own until it is asked to listen).
    if !lib.preloaded {
        Some(Asleep::Detached)
    } else if lib.standby && forked(pid) {
        Some(Asleep::StandbyChild)
    } else {
        None
    }
}

/// Whether process `pid` was forked by a process that runs the same program (its
/// parent's executable is its own): a DataLoader worker, a forked server child.
fn forked(pid: u32) -> bool {
    let ppid = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok())));
    let exe = |p: u32| std::fs::read_link(format!("/proc/{p}/exe")).ok();
    ppid.is_some_and(|pp| pp > 1 && exe(pp).is_some() && exe(pp) == exe(pid))
}

pub fn to_inject(pid: u32) -> Result<Option<ToInject>, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| format!("no process {pid}"))?;
    let t = target_of(&status, pid).ok_or_else(|| format!("cannot read /proc/{pid}/status"))?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| {
        // SAFETY: geteuid cannot fail.
        let own = unsafe { libc::geteuid() };
        if e.kind() == std::io::ErrorKind::PermissionDenied || t.uid != own && own != 0 {
            format!("process {pid} is user {}'s and this is user {own}: run as that user or as root", t.uid)
        } else {
            format!("cannot read /proc/{pid}/maps ({e})")
        }
    })?;
    if Library::from(&maps, Vec::new()).loaded {
        return Ok(None);
    }
    if let Ok(exe) = std::fs::read(format!("/proc/{pid}/exe")) {
        match interpreter(&exe) {
            Some(None) => return Err(format!("process {pid} is statically linked: it can load no library, leaktrace's included")),
            Some(Some(i)) if i.contains("musl") => return Err(format!("process {pid} runs on musl ({i}): leaktrace needs glibc")),
            _ => {}
        }
    }
    let program = std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim().to_string()).unwrap_or_else(|_| "process".into());
    Ok(Some(ToInject { uid: t.uid, program }))
}

/// For a process that does not answer on a standby socket: what /proc says of it.
/// Recording since its start (`leaktrace run`, the library preloaded): "on" and "status"
/// answer where its reports go; a standby process whose socket is gone, a static or
/// musl program: the reason. `None` when nothing more is known (not in standby).
fn without_socket(pid: u32, request: &str, socket: &std::path::Path) -> Option<Result<String, String>> {
    let lib = Library::of(pid);
    let (loaded, var) = (lib.loaded, |name: &str| lib.var(name));
    if loaded && lib.standby {
        return Some(Err(format!(
            "process {pid} was started in standby but does not answer at {}: its stderr says why (a directory it could not use)",
            socket.display()
        )));
    }
    if loaded && !lib.preloaded {
        return Some(Err(format!(
            "process {pid} is not recording (attached to and detached from before; the library stays loaded, off): `leaktrace attach {pid}` records it again"
        )));
    }
    if loaded && !lib.on("LEAKTRACE_DISABLE") {
        let dir = var("LEAKTRACE_OUTPUT")
            .or_else(|| std::fs::read_link(format!("/proc/{pid}/cwd")).ok().map(|p| p.display().to_string()))
            .unwrap_or_else(|| "its working directory".into());
        let signal = var("LEAKTRACE_SNAPSHOT_SIGNAL").unwrap_or_else(|| "USR2".into());
        return Some(match request {
            "on" => Ok(dir),
            "status" => Ok(format!("on {dir}")),
            _ => Err(format!(
                "process {pid} records since its start (not in standby) and takes no requests: `kill -{signal} {pid}` asks it for a report, if the program left SIG{signal} to leaktrace"
            )),
        });
    }
    let exe = std::fs::read(format!("/proc/{pid}/exe")).ok()?;
    match interpreter(&exe) {
        Some(None) => Some(Err(format!("process {pid} is statically linked: it loads no library, leaktrace's included"))),
        Some(Some(i)) if i.contains("musl") => Some(Err(format!("process {pid} runs on musl ({i}): leaktrace needs glibc"))),
        _ => None,
    }
}

/// The program interpreter an ELF64 file asks for: `Some(None)` when it has none
/// (statically linked), `None` when the file is no ELF64 file this can read.
fn interpreter(elf: &[u8]) -> Option<Option<String>> {
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let (phoff, phentsize, phnum) = (u64_at(0x20)? as usize, u16_at(0x36)? as usize, u16_at(0x38)? as usize);
    for k in 0..phnum {
        let ph = phoff + k * phentsize;
        if u32::from_le_bytes(elf.get(ph..ph + 4)?.try_into().ok()?) == 3 {
            let (off, len) = (u64_at(ph + 8)? as usize, u64_at(ph + 32)? as usize);
            let raw = elf.get(off..off + len)?;
            return Some(Some(String::from_utf8_lossy(raw).trim_end_matches('\0').to_string()));
        }
    }
    Some(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_user_and_the_id_a_process_sees_itself_by_come_from_its_status() {
        let status = "Name:\tpython3\nUid:\t1000\t1001\t1001\t1001\nGid:\t1000\nNSpid:\t4242\t17\n";
        assert_eq!(target_of(status, 4242), Some(Target { uid: 1001, own_pid: 17 }));
        // No pid namespaces (an old kernel): the id given.
        assert_eq!(target_of("Uid:\t0\t0\t0\t0\n", 7), Some(Target { uid: 0, own_pid: 7 }));
        assert_eq!(target_of("Name:\tx\n", 7), None);
        let me = std::process::id();
        let t = Target { uid: 1000, own_pid: me };
        assert_eq!(socket_path(me, &t), PathBuf::from(format!("/tmp/leaktrace-1000/standby-{me}.sock")));
    }

    #[test]
    fn a_programs_interpreter_is_read_from_its_program_headers() {
        let me = std::fs::read("/proc/self/exe").unwrap();
        let interp = interpreter(&me).expect("an ELF64 file").expect("a dynamic program");
        assert!(interp.contains("ld-linux"), "{interp}");
        // No PT_INTERP: a static program; not ELF: unknown.
        let mut elf = vec![0u8; 0x40];
        elf[..5].copy_from_slice(b"\x7fELF\x02");
        assert_eq!(interpreter(&elf), Some(None));
        assert_eq!(interpreter(b"#!/bin/sh\n"), None);
    }

    #[test]
    fn a_process_that_is_not_in_standby_or_gone_is_told_apart() {
        let e = ask(std::process::id(), "status").unwrap_err();
        assert!(e.contains("not in standby") && e.contains("leaktrace run --standby"), "{e}");
        assert!(ask(u32::MAX - 1, "on").unwrap_err().starts_with("no process"));
    }
}
