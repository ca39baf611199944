//! `leaktrace attach PID` to a process started without the library: the ptrace side.
//! One thread of the process is stopped at a point where it holds none of the C
//! library's locks, made to call the C library's `dlopen` on libleaktrace.so (whose
//! constructor, finding itself loaded late, waits on its standby socket), and put back
//! exactly as it was — its registers, its vector state, an interrupted system call
//! restarted. The other threads never stop. No debugger, no other program.
//!
//! The thread is chosen by where it stopped: in the program's own code (or the
//! interpreter's), or blocked in a system call that holds no lock of the C library's
//! (a sleep, a read, a poll, a wait). One stopped inside the C library, the loader or the
//! unwinder may hold the allocator's or the loader's lock that `dlopen` takes: it is let
//! go and asked again a moment later, the main thread first, then the others.
use std::ffi::CString;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What an injection did.
#[derive(Debug)]
pub struct Injected {
    /// The main thread's thread pointer (its `fs` base), for the library's scan.
    pub main_tp: u64,
    /// The thread that loaded the library, and how long it was stopped.
    pub thread: u32,
    pub pause: Duration,
}

/// The C library a process uses: its file (as this process can open it) and where it
/// is mapped.
struct Libc {
    file: PathBuf,
    base: u64,
}

/// One line of /proc/PID/maps: its range, permissions, file offset and path.
struct Mapping {
    lo: u64,
    hi: u64,
    exec: bool,
    offset: u64,
    inode: u64,
    path: String,
}

fn maps_of(pid: u32) -> Result<Vec<Mapping>, String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(|e| format!("cannot read /proc/{pid}/maps ({e})"))?;
    Ok(text.lines().filter_map(parse_map_line).collect())
}

fn parse_map_line(l: &str) -> Option<Mapping> {
    let mut f = l.split_whitespace();
    let (lo, hi) = f.next()?.split_once('-')?;
    let perms = f.next()?;
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let _dev = f.next()?;
    let inode = f.next()?.parse().ok()?;
    let path = f.collect::<Vec<_>>().join(" ");
    Some(Mapping {
        lo: u64::from_str_radix(lo, 16).ok()?,
        hi: u64::from_str_radix(hi, 16).ok()?,
        exec: perms.as_bytes().get(2) == Some(&b'x'),
        offset,
        inode,
        path,
    })
}

/// The file mapped at `m` in process `pid`, as this process can open it: through
/// `/proc/PID/map_files` where allowed, else by its path as /proc shows it (relative
/// to this process's root) or through the process's root, whichever is the same file
/// (its inode).
fn mapped_file(pid: u32, m: &Mapping) -> Option<PathBuf> {
    let candidates =
        [PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.lo, m.hi)), PathBuf::from(&m.path), PathBuf::from(format!("/proc/{pid}/root{}", m.path))];
    candidates.into_iter().find(|p| std::fs::metadata(p).is_ok_and(|meta| meta.ino() == m.inode))
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Whether code at an address in `path` may hold a lock that `dlopen` takes: the C
/// library, the loader, the unwinder (which walks the loader's list under its lock).
fn holds_locks(path: &str) -> bool {
    let f = file_name(path);
    f.starts_with("libc.so")
        || f.starts_with("libc-")
        || f.starts_with("ld-linux")
        || f.starts_with("libpthread")
        || f.starts_with("libgcc_s")
        || f.starts_with("libdl")
}

/// The system calls a thread may be blocked in without holding a lock of the C
/// library's: its wrappers for them take none.
fn lock_free_syscall(nr: u64) -> bool {
    const SAFE: [u64; 20] = [
        0,   // read
        7,   // poll
        23,  // select
        34,  // pause
        35,  // nanosleep
        43,  // accept
        45,  // recvfrom
        47,  // recvmsg
        61,  // wait4
        202, // futex: a condition or semaphore wait (the GIL), never inside malloc
        230, // clock_nanosleep
        232, // epoll_wait
        247, // waitid
        270, // pselect6
        271, // ppoll
        281, // epoll_pwait
        288, // accept4
        17,  // pread64
        19,  // readv
        441, // epoll_pwait2
    ];
    SAFE.contains(&nr)
}

/// Whether a thread stopped with these registers may call `dlopen` now.
fn safe_point(regs: &libc::user_regs_struct, maps: &[Mapping]) -> bool {
    let in_syscall = (regs.orig_rax as i64) >= 0 && is_interrupted(regs.rax as i64);
    if in_syscall {
        return lock_free_syscall(regs.orig_rax);
    }
    match maps.iter().find(|m| regs.rip >= m.lo && regs.rip < m.hi) {
        Some(m) => m.exec && !holds_locks(&m.path),
        None => false,
    }
}

/// The values a system call interrupted by a stop leaves in `rax`.
fn is_interrupted(rax: i64) -> bool {
    (-516..=-512).contains(&rax) || rax == -(libc::EINTR as i64)
}

/// The process's C library, or why it has none this can use.
fn find_libc(pid: u32, maps: &[Mapping]) -> Result<Libc, String> {
    let m = maps
        .iter()
        .find(|m| m.offset == 0 && file_name(&m.path).starts_with("libc.so"))
        .ok_or_else(|| format!("process {pid} does not use glibc (no libc.so.6 in /proc/{pid}/maps): leaktrace attaches to glibc programs only"))?;
    let file = mapped_file(pid, m).ok_or_else(|| format!("cannot open process {pid}'s C library ({})", m.path))?;
    Ok(Libc { file, base: m.lo })
}

use crate::attach::same_root;

/// The value of the default-version definition of function `name` in the ELF64 shared
/// object `elf` (its .dynsym), if any.
fn dynamic_symbol(elf: &[u8], name: &str) -> Option<u64> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    if elf.get(..5)? != b"\x7fELF\x02" {
        return None;
    }
    let (shoff, shentsize, shnum) = (u64_at(0x28)? as usize, u16_at(0x3a)? as usize, u16_at(0x3c)? as usize);
    let section = |k: usize| -> Option<(u32, u64, u64, u32)> {
        let s = shoff + k * shentsize;
        // sh_type, sh_offset, sh_size, sh_link
        Some((u32_at(s + 4)?, u64_at(s + 0x18)?, u64_at(s + 0x20)?, u32_at(s + 0x28)?))
    };
    let mut versym = None;
    for k in 0..shnum {
        if section(k)?.0 == 0x6fff_ffff {
            versym = Some(section(k)?.1 as usize);
        }
    }
    for k in 0..shnum {
        let (kind, off, size, link) = section(k)?;
        if kind != 11 {
            continue;
        }
        let (_, stroff, strsize, _) = section(link as usize)?;
        for i in 0..(size / 24) as usize {
            let sym = off as usize + i * 24;
            let (st_name, st_info, st_shndx, st_value) = (u32_at(sym)? as usize, elf[sym + 4], u16_at(sym + 6)?, u64_at(sym + 8)?);
            if st_shndx == 0 || st_info & 0xf != 2 || st_name >= strsize as usize {
                continue;
            }
            let start = stroff as usize + st_name;
            let end = start + elf.get(start..)?.iter().position(|&b| b == 0)?;
            if &elf[start..end] != name.as_bytes() {
                continue;
            }
            let hidden = versym.and_then(|v| u16_at(v + i * 2)).is_some_and(|v| v & 0x8000 != 0);
            if !hidden {
                return Some(st_value);
            }
        }
    }
    None
}

/// The module whose own `malloc` the program's calls bind to, when it is not the C
/// library's: the program itself (a linked-in jemalloc or PartitionAlloc) or a library
/// preloaded before the C library (`LD_PRELOAD`). Modules it loaded later with
/// `dlopen` are private to their callers and do not count.
fn own_malloc(pid: u32, maps: &[Mapping]) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let preloaded: Vec<String> = leaktrace_common::launch::environ_var(&environ, "LD_PRELOAD")
        .map(|v| v.split([':', ' ']).filter(|p| !p.is_empty()).map(str::to_string).collect())
        .unwrap_or_default();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok().map(|p| (PathBuf::from(format!("/proc/{pid}/exe")), p.display().to_string()));
    let libs = maps
        .iter()
        .filter(|m| m.offset == 0 && preloaded.iter().any(|p| file_name(p) == file_name(&m.path)))
        .filter_map(|m| Some((mapped_file(pid, m)?, m.path.clone())));
    for (file, shown) in exe.into_iter().chain(libs) {
        let Ok(elf) = std::fs::read(&file) else { continue };
        if dynamic_symbol(&elf, "malloc").is_some() && !file_name(&shown).starts_with("libc.so") {
            return Some(shown);
        }
    }
    None
}

/// For a process in another root (a container, seen from the host): a copy of the
/// library inside its root, in `/tmp/leaktrace-UID/` (made by the process's user, 0700,
/// as the standby socket's), and the copy's path as the process sees it. An existing
/// directory that is not the user's own or is open to others is refused.
fn copy_into_root(pid: u32, uid: u32, lib: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let inside = PathBuf::from(format!("/tmp/leaktrace-{uid}"));
    let dir = PathBuf::from(format!("/proc/{pid}/root")).join(inside.strip_prefix("/").unwrap_or(&inside));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {
            let c = CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| "a path with a NUL byte".to_string())?;
            // SAFETY: chown of the directory just made, by a NUL-terminated path.
            unsafe { libc::chown(c.as_ptr(), uid, u32::MAX) };
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(format!(
                "process {pid} runs in another root (a container), and {} cannot be made there ({e}): start it with `leaktrace run --standby`",
                dir.display()
            ))
        }
    }
    leaktrace_common::private_dir::check(&dir, uid)?;
    let bytes = std::fs::read(lib).map_err(|e| format!("cannot read {} ({e})", lib.display()))?;
    // Named by its content, so that a copy already there is the same library.
    let fnv = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    let name = format!("libleaktrace-{fnv:016x}.so");
    let target = dir.join(&name);
    if std::fs::read(&target).ok().as_deref() != Some(&bytes[..]) {
        let tmp = dir.join(format!(".{name}.{}", std::process::id()));
        std::fs::write(&tmp, &bytes).map_err(|e| format!("cannot copy the library into process {pid}'s root ({e})"))?;
        let _ = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644));
        std::fs::rename(&tmp, &target).map_err(|e| format!("cannot copy the library into process {pid}'s root ({e})"))?;
    }
    Ok(inside.join(name))
}

/// Refuses a library file that a user other than root or the process's could replace:
/// the process would run whatever was put there.
fn check_library(lib: &Path, uid: u32) -> Result<(), String> {
    let mut p = Some(lib);
    while let Some(path) = p {
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let sticky = meta.mode() & 0o1000 != 0;
        if (meta.uid() != 0 && meta.uid() != uid) || (meta.mode() & 0o022 != 0 && !sticky) || (meta.mode() & 0o002 != 0 && path == lib) {
            return Err(format!(
                "{} could be replaced by another user (owner {}, mode {:o}): the process would load whatever is there; install leaktrace where only root or the process's user may write",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            ));
        }
        p = path.parent().filter(|q| !q.as_os_str().is_empty());
    }
    Ok(())
}

/// Why this process may not ptrace `pid`, when that is known before trying.
fn ptrace_refusal(pid: u32, status: &str) -> Option<String> {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string());
    let standby = "or start it with `leaktrace run --standby` (attach then needs no ptrace)";
    if let Some(tracer) = field("TracerPid:").and_then(|t| t.parse::<u32>().ok()).filter(|&t| t != 0) {
        return Some(format!("process {pid} is already traced by process {tracer} (a debugger or another tool): detach it first, {standby}"));
    }
    let cap_ptrace = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()))
        .is_some_and(|caps| caps & (1 << 19) != 0);
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok().and_then(|s| s.trim().parse::<u32>().ok()).unwrap_or(0);
    if scope >= 3 {
        return Some(format!("ptrace is switched off on this machine (kernel.yama.ptrace_scope = 3): attaching to process {pid} needs standby: start it with `leaktrace run --standby`"));
    }
    if scope >= 1 && !cap_ptrace {
        return Some(format!(
            "kernel.yama.ptrace_scope = {scope} lets only a process's parent (or a holder of CAP_SYS_PTRACE) trace it: run `sudo leaktrace attach {pid}`, give the command CAP_SYS_PTRACE, {standby}"
        ));
    }
    None
}

/// The kernel's ptrace calls this module makes, each with its errno on failure.
mod pt {
    use std::ffi::c_void;

    pub fn call(req: libc::c_uint, tid: u32, addr: usize, data: usize) -> Result<libc::c_long, i32> {
        // SAFETY: ptrace with a request and arguments of the kinds the kernel defines for
        // it; pointers passed point to buffers of the size the request writes.
        let r = unsafe { libc::ptrace(req, tid as libc::pid_t, addr as *mut c_void, data as *mut c_void) };
        if r == -1 {
            Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
        } else {
            Ok(r)
        }
    }

    pub fn regs(tid: u32) -> Result<libc::user_regs_struct, i32> {
        // SAFETY: zeroed is a valid user_regs_struct; GETREGS fills it.
        let mut r: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        call(libc::PTRACE_GETREGS, tid, 0, &mut r as *mut _ as usize)?;
        Ok(r)
    }

    pub fn set_regs(tid: u32, r: &libc::user_regs_struct) -> Result<(), i32> {
        call(libc::PTRACE_SETREGS, tid, 0, r as *const _ as usize).map(|_| ())
    }

    const NT_X86_XSTATE: usize = 0x202;

    /// The thread's whole vector state (XSAVE area).
    pub fn xstate(tid: u32) -> Result<Vec<u8>, i32> {
        let mut buf = vec![0u8; 16 << 10];
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr() as *mut c_void, iov_len: buf.len() };
        call(libc::PTRACE_GETREGSET, tid, NT_X86_XSTATE, &mut iov as *mut _ as usize)?;
        buf.truncate(iov.iov_len);
        Ok(buf)
    }

    pub fn set_xstate(tid: u32, state: &mut [u8]) -> Result<(), i32> {
        let mut iov = libc::iovec { iov_base: state.as_mut_ptr() as *mut c_void, iov_len: state.len() };
        call(libc::PTRACE_SETREGSET, tid, NT_X86_XSTATE, &mut iov as *mut _ as usize).map(|_| ())
    }

    /// Waits for a change of `tid`'s state: its raw status.
    pub fn wait(tid: u32) -> Result<i32, i32> {
        let mut status = 0;
        loop {
            // SAFETY: waitpid with a valid out-pointer.
            let r = unsafe { libc::waitpid(tid as libc::pid_t, &mut status, libc::__WALL) };
            if r == tid as libc::pid_t {
                return Ok(status);
            }
            let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if e != libc::EINTR {
                return Err(e);
            }
        }
    }
}

/// A thread held with ptrace (seized); let go when dropped.
struct Held {
    tid: u32,
}

impl Held {
    fn seize(tid: u32) -> Result<Held, i32> {
        pt::call(libc::PTRACE_SEIZE, tid, 0, 0)?;
        Ok(Held { tid })
    }

    /// Stops the thread; its registers once stopped.
    fn stop(&self) -> Result<libc::user_regs_struct, String> {
        pt::call(libc::PTRACE_INTERRUPT, self.tid, 0, 0).map_err(|e| format!("cannot stop thread {} ({})", self.tid, errno_text(e)))?;
        loop {
            let status = pt::wait(self.tid).map_err(|e| format!("thread {} is gone ({})", self.tid, errno_text(e)))?;
            if !libc::WIFSTOPPED(status) {
                return Err(format!("thread {} ended", self.tid));
            }
            if status >> 16 == libc::PTRACE_EVENT_STOP {
                return pt::regs(self.tid).map_err(|e| format!("cannot read thread {}'s registers ({})", self.tid, errno_text(e)));
            }
            // A signal arrived first: it goes to the thread as it would have.
            let _ = pt::call(libc::PTRACE_CONT, self.tid, 0, libc::WSTOPSIG(status) as usize);
        }
    }

    fn resume(&self) {
        let _ = pt::call(libc::PTRACE_CONT, self.tid, 0, 0);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // A running tracee must be stopped to be detached: interrupt, then detach at the stop.
        if pt::call(libc::PTRACE_DETACH, self.tid, 0, 0).is_err() && pt::call(libc::PTRACE_INTERRUPT, self.tid, 0, 0).is_ok() {
            while let Ok(status) = pt::wait(self.tid) {
                if !libc::WIFSTOPPED(status) {
                    return;
                }
                let sig = if status >> 16 == libc::PTRACE_EVENT_STOP { 0 } else { libc::WSTOPSIG(status) as usize };
                if pt::call(libc::PTRACE_DETACH, self.tid, 0, sig).is_ok() {
                    return;
                }
            }
        }
    }
}

fn errno_text(e: i32) -> String {
    std::io::Error::from_raw_os_error(e).to_string()
}

/// Reads and writes the traced process's memory.
struct Memory {
    file: std::fs::File,
}

impl Memory {
    fn open(pid: u32) -> Result<Memory, String> {
        let file =
            std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/mem")).map_err(|e| format!("cannot open /proc/{pid}/mem ({e})"))?;
        Ok(Memory { file })
    }

    fn write(&self, addr: u64, bytes: &[u8]) -> Result<(), String> {
        self.file.write_all_at(bytes, addr).map_err(|e| format!("cannot write the process's stack ({e})"))
    }

    fn c_string(&self, addr: u64) -> String {
        let mut buf = vec![0u8; 512];
        let n = self.file.read_at(&mut buf, addr).unwrap_or(0);
        buf.truncate(n);
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    }
}

/// How long to look for a thread at a safe point before giving up.
const FIND_SAFE_POINT: Duration = Duration::from_secs(10);

/// Loads `lib` into process `pid` (its user's `uid`); see the module's text. The
/// process is left as it was on every error.
pub fn inject(pid: u32, uid: u32, lib: &Path) -> Result<Injected, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| format!("no process {pid}"))?;
    if let Some(why) = ptrace_refusal(pid, &status) {
        return Err(why);
    }
    check_library(lib, uid)?;
    let maps = maps_of(pid)?;
    if let Some(owner) = own_malloc(pid, &maps) {
        return Err(format!(
            "process {pid} allocates with its own malloc (defined in {owner}): leaktrace would not see its host memory, so it is left alone; run a build that uses glibc's malloc"
        ));
    }
    let libc_map = find_libc(pid, &maps)?;
    let elf = std::fs::read(&libc_map.file).map_err(|e| format!("cannot read {} ({e})", libc_map.file.display()))?;
    let dlopen =
        dynamic_symbol(&elf, "dlopen").ok_or_else(|| format!("{} has no dlopen (glibc 2.34 or later is needed)", libc_map.file.display()))? + libc_map.base;
    let dlerror = dynamic_symbol(&elf, "dlerror").map(|v| v + libc_map.base);
    let lib_path = if same_root(pid) { lib.to_path_buf() } else { copy_into_root(pid, uid, lib)? };
    let lib_c = CString::new(lib_path.as_os_str().as_encoded_bytes()).map_err(|_| "the library's path has a NUL byte".to_string())?;
    at_safe_point(pid, &maps, |held, mem, regs| {
        let handle = call_in(held, mem, regs, dlopen, &lib_c)?;
        if handle != 0 {
            return Ok(());
        }
        let why = match dlerror {
            Some(f) => restore_after(held, regs, |r| call_fn(held, mem, r, f, &[])).map(|p| mem.c_string(p)).unwrap_or_default(),
            None => String::new(),
        };
        Err(format!("process {pid} could not load {}: {why}", lib_path.display()))
    })
}

/// In a process attached to and detached from before (the library loaded, off, its
/// answering thread gone): has the library listen on its socket again
/// (`leaktrace_attach_listen`), so that `attach` can switch it on again.
pub fn listen_again(pid: u32) -> Result<Injected, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|_| format!("no process {pid}"))?;
    if let Some(why) = ptrace_refusal(pid, &status) {
        return Err(why);
    }
    let maps = maps_of(pid)?;
    let lib = maps
        .iter()
        .find(|m| m.offset == 0 && file_name(&m.path).starts_with("libleaktrace"))
        .ok_or_else(|| format!("process {pid} has no libleaktrace loaded"))?;
    let file = mapped_file(pid, lib).ok_or_else(|| format!("cannot open process {pid}'s leaktrace library ({})", lib.path))?;
    let elf = std::fs::read(&file).map_err(|e| format!("cannot read {} ({e})", file.display()))?;
    let listen = dynamic_symbol(&elf, "leaktrace_attach_listen").ok_or_else(|| {
        format!("the leaktrace library in process {pid} ({}) is another version, without leaktrace_attach_listen: it cannot be attached to again", lib.path)
    })? + lib.lo;
    at_safe_point(pid, &maps, |held, mem, regs| match restore_after(held, regs, |r| call_fn(held, mem, r, listen, &[]))? {
        1 => Ok(()),
        _ => Err(format!("process {pid}: the library could not listen again (see the process's stderr)")),
    })
}

/// Finds a thread of process `pid` at a point where it holds no lock of the C
/// library's (see the module's text), has `call` run on it (stopped, registers
/// `regs`), and lets it go.
fn at_safe_point(pid: u32, maps: &[Mapping], call: impl Fn(&Held, &Memory, &libc::user_regs_struct) -> Result<(), String>) -> Result<Injected, String> {
    let mem = Memory::open(pid)?;
    // Ctrl-C must not end this command while a thread of the process runs our call.
    let _blocked = crate::attach::HeldSignals::new(&[libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT], false);
    let tids = threads_of(pid);
    let deadline = Instant::now() + FIND_SAFE_POINT;
    let mut main_tp = 0u64;
    let mut round = 0u32;
    loop {
        for &tid in &tids {
            // The main thread on most rounds: it is the one whose TLS the scan reads.
            if tid != pid && round % 4 != 3 {
                continue;
            }
            let held = match Held::seize(tid) {
                Ok(h) => h,
                Err(libc::EPERM) => {
                    return Err(format!(
                        "not allowed to trace process {pid}: run as its user or as root (CAP_SYS_PTRACE), or start it with `leaktrace run --standby`"
                    ))
                }
                Err(libc::ESRCH) if tid == pid => return Err(format!("no process {pid}")),
                Err(_) => continue,
            };
            let stopped_at = Instant::now();
            let regs = match held.stop() {
                Ok(r) => r,
                Err(e) if tid == pid => return Err(format!("process {pid}: {e}")),
                Err(_) => continue,
            };
            if tid == pid {
                main_tp = regs.fs_base;
            }
            if main_tp == 0 || !safe_point(&regs, maps) {
                held.resume();
                drop(held);
                continue;
            }
            let result = call(&held, &mem, &regs).map(|()| Injected { main_tp, thread: tid, pause: stopped_at.elapsed() });
            drop(held);
            return result;
        }
        round += 1;
        if Instant::now() >= deadline {
            return Err(format!(
                "no thread of process {pid} came to a point where it could load the library safely in {} s (each was inside the C library): try again, or start it with `leaktrace run --standby`",
                FIND_SAFE_POINT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(2 + u64::from(round % 7)));
    }
}

/// Calls `dlopen(path, RTLD_NOW | RTLD_NODELETE)` on the held thread stopped with
/// `regs`, and puts the thread back as it was: the handle (0 on failure).
fn call_in(held: &Held, mem: &Memory, regs: &libc::user_regs_struct, dlopen: u64, path: &CString) -> Result<u64, String> {
    restore_after(held, regs, |r| {
        // The path below the red zone and some margin, 16-byte aligned.
        let bytes = path.as_bytes_with_nul();
        let at = (r.rsp - 1024 - bytes.len() as u64) & !15;
        mem.write(at, bytes)?;
        let mut call = *r;
        call.rsp = at;
        call_fn(held, mem, &call, dlopen, &[at, (libc::RTLD_NOW | libc::RTLD_NODELETE) as u64])
    })
}

/// Runs `f` with the thread's registers and vector state saved, and restores both after,
/// whatever `f` returned.
fn restore_after<T>(held: &Held, regs: &libc::user_regs_struct, f: impl FnOnce(&libc::user_regs_struct) -> Result<T, String>) -> Result<T, String> {
    let mut xstate = pt::xstate(held.tid).map_err(|e| format!("cannot read thread {}'s vector registers ({})", held.tid, errno_text(e)))?;
    let out = f(regs);
    let put_back = pt::set_regs(held.tid, regs).and_then(|_| pt::set_xstate(held.tid, &mut xstate));
    if let Err(e) = put_back {
        return Err(format!("could not restore thread {}'s registers ({}): the process may fail", held.tid, errno_text(e)));
    }
    out
}

/// Calls the function at `f` with up to six integer `args` on the held thread, whose
/// stack pointer `regs.rsp` is free below; returns `rax`. The call returns to address 0,
/// where the fault stops the thread again (the fault is never delivered).
fn call_fn(held: &Held, mem: &Memory, regs: &libc::user_regs_struct, f: u64, args: &[u64]) -> Result<u64, String> {
    let mut call = *regs;
    let sp = ((regs.rsp - 256) & !15) - 8;
    mem.write(sp, &0u64.to_ne_bytes())?;
    call.rsp = sp;
    call.rip = f;
    call.rax = 0;
    // No system call to restart at this stop.
    call.orig_rax = u64::MAX;
    // The direction flag clear, as the ABI has it at a call.
    call.eflags &= !(1 << 10);
    let slots = [&mut call.rdi, &mut call.rsi, &mut call.rdx, &mut call.rcx, &mut call.r8, &mut call.r9];
    for (slot, &v) in slots.into_iter().zip(args) {
        *slot = v;
    }
    pt::set_regs(held.tid, &call).map_err(|e| format!("cannot set thread {}'s registers ({})", held.tid, errno_text(e)))?;
    pt::call(libc::PTRACE_CONT, held.tid, 0, 0).map_err(|e| format!("cannot resume thread {} ({})", held.tid, errno_text(e)))?;
    let started = Instant::now();
    let mut said = false;
    loop {
        let status = pt::wait(held.tid).map_err(|e| format!("lost thread {} ({})", held.tid, errno_text(e)))?;
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err("the process ended during the call".into());
        }
        if !said && started.elapsed() > Duration::from_secs(5) {
            eprintln!("leaktrace: still waiting for thread {} to load the library (another thread holds the loader's lock?)", held.tid);
            said = true;
        }
        if status >> 16 == libc::PTRACE_EVENT_STOP {
            let _ = pt::call(libc::PTRACE_CONT, held.tid, 0, 0);
            continue;
        }
        let sig = libc::WSTOPSIG(status);
        if sig == libc::SIGSEGV {
            let now = pt::regs(held.tid).map_err(|e| format!("cannot read thread {}'s registers ({})", held.tid, errno_text(e)))?;
            if now.rip == 0 {
                return Ok(now.rax);
            }
        }
        // Any other signal is the program's: delivered as it would have been.
        let _ = pt::call(libc::PTRACE_CONT, held.tid, 0, sig as usize);
    }
}

/// The process's threads, the main one first.
fn threads_of(pid: u32) -> Vec<u32> {
    let mut tids: Vec<u32> =
        std::fs::read_dir(format!("/proc/{pid}/task")).map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()).unwrap_or_default();
    tids.sort_by_key(|&t| (t != pid, t));
    if tids.is_empty() {
        tids.push(pid);
    }
    tids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlopen_is_found_in_this_processs_c_library() {
        let maps = maps_of(std::process::id()).unwrap();
        let c = find_libc(std::process::id(), &maps).unwrap();
        let elf = std::fs::read(&c.file).unwrap();
        let value = dynamic_symbol(&elf, "dlopen").expect("glibc 2.34+ defines dlopen");
        // SAFETY: dlsym with a valid handle and a NUL-terminated name.
        let here = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"dlopen".as_ptr()) } as u64;
        assert_eq!(c.base + value, here);
        assert_eq!(dynamic_symbol(&elf, "no_such_function_here"), None);
    }

    #[test]
    fn a_thread_in_the_c_library_waits_and_one_in_a_sleep_or_its_own_code_goes() {
        let maps = vec![
            Mapping { lo: 0x1000, hi: 0x2000, exec: true, offset: 0, inode: 1, path: "/usr/bin/python3.11".into() },
            Mapping { lo: 0x5000, hi: 0x6000, exec: true, offset: 0, inode: 2, path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into() },
        ];
        // SAFETY: zeroed is a valid user_regs_struct.
        let mut r: libc::user_regs_struct = unsafe { std::mem::zeroed() };
        r.orig_rax = u64::MAX;
        r.rip = 0x1800;
        assert!(safe_point(&r, &maps));
        r.rip = 0x5800;
        assert!(!safe_point(&r, &maps));
        // Interrupted in clock_nanosleep: a sleep holds no lock.
        r.orig_rax = 230;
        r.rax = (-516i64) as u64;
        assert!(safe_point(&r, &maps));
        // In mmap (malloc growing its heap): not.
        r.orig_rax = 9;
        assert!(!safe_point(&r, &maps));
        // Nowhere known: not.
        r.orig_rax = u64::MAX;
        r.rip = 0x9000;
        assert!(!safe_point(&r, &maps));
    }

    #[test]
    fn a_library_others_could_replace_is_refused() {
        let dir = std::env::temp_dir().join(format!("lt-inject-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libleaktrace.so");
        std::fs::write(&lib, b"x").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o666)).unwrap();
        // SAFETY: geteuid cannot fail.
        let me = unsafe { libc::geteuid() };
        assert!(check_library(&lib, me).unwrap_err().contains("could be replaced"));
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o644)).unwrap();
        // The temporary directory's parents may be open to others (a sticky /tmp is fine).
        let _ = check_library(&lib, me);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
