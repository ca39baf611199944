//! The standard error the program started with. The library writes its diagnostics and
//! exit summary to fd 2 only while fd 2 is still the file it was at start-up: a program
//! that closes its descriptors and opens a data file that happens to get number 2 must
//! not find our text in its data.
use std::sync::atomic::{AtomicU64, Ordering};

static STDERR_DEV: AtomicU64 = AtomicU64::new(0);
static STDERR_INO: AtomicU64 = AtomicU64::new(0);
/// 0: not recorded yet (before the constructor: writes are allowed); 1: fd 2 was open
/// at start-up; 2: it was closed (never write).
static STDERR_STATE: AtomicU64 = AtomicU64::new(0);

/// The (device, inode) of the file open on `fd` (`stat`).
pub fn identity(fd: i32) -> Option<(u64, u64)> {
    stat(fd).map(|st| (st.st_dev, st.st_ino))
}

/// The status of the file open on `fd`. The `fstat` system call itself, not glibc's
/// `fstat` (since 2.33 a `newfstatat(fd, "", AT_EMPTY_PATH)`): Chromium's seccomp policy
/// traps that form and emulates it in a SIGSYS handler, and on a thread of ours (every
/// signal blocked) the trap's SIGSYS is forced: renderers died at their first timeline
/// point after their sandbox went on (docs/reliability.md).
pub fn stat(fd: i32) -> Option<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: the kernel's `struct stat` on x86-64 is libc's; written on success.
    if unsafe { libc::syscall(libc::SYS_fstat, fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: initialised by the successful call.
    Some(unsafe { st.assume_init() })
}

/// Records what fd 2 is. Called once from the constructor.
pub fn note_stderr() {
    let _errno = super::ErrnoGuard::save();
    match identity(2) {
        Some((dev, ino)) => {
            STDERR_DEV.store(dev, Ordering::Relaxed);
            STDERR_INO.store(ino, Ordering::Relaxed);
            STDERR_STATE.store(1, Ordering::Release);
        }
        None => STDERR_STATE.store(2, Ordering::Release),
    }
}

/// Whether fd 2 is still the standard error the program started with.
pub fn stderr_is_original() -> bool {
    match STDERR_STATE.load(Ordering::Acquire) {
        0 => true,
        1 => identity(2) == Some((STDERR_DEV.load(Ordering::Relaxed), STDERR_INO.load(Ordering::Relaxed))),
        _ => false,
    }
}

/// Writes `bytes` to the original standard error, whole (retrying short writes and
/// EINTR), or not at all when fd 2 is something else now. Errno is kept.
/// One line on the program's standard error, if fd 2 is still that.
pub fn stderr_line(line: &str) {
    let mut s = String::with_capacity(line.len() + 1);
    s.push_str(line);
    s.push('\n');
    write_stderr(s.as_bytes());
}

pub fn write_stderr(bytes: &[u8]) {
    let _errno = super::ErrnoGuard::save();
    if stderr_is_original() {
        // A stderr whose reader is gone (`2>&1 | head`) must not end the program by
        // SIGPIPE for our line: the signal is blocked for the write and, if the write
        // raised it, taken back (one that was pending before is left alone).
        let mut no_sigpipe = SigpipeBlocked::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            // SAFETY: writing from a valid buffer of the given length.
            let n = unsafe { libc::write(2, rest.as_ptr() as *const libc::c_void, rest.len()) };
            if n > 0 {
                rest = &rest[n as usize..];
            } else if n < 0 && super::errno() == libc::EINTR {
                continue;
            } else {
                no_sigpipe.raised = n < 0 && super::errno() == libc::EPIPE;
                break;
            }
        }
    }
}

/// SIGPIPE blocked on this thread while it lives; one that our write raised (`raised`:
/// it failed with EPIPE) is taken back. Only then is a signal system call beyond the
/// mask made: a sandbox's seccomp policy may kill for `rt_sigpending` (Chromium's does).
struct SigpipeBlocked {
    old: libc::sigset_t,
    was_blocked: bool,
    raised: bool,
}

impl SigpipeBlocked {
    fn new() -> SigpipeBlocked {
        // SAFETY: signal-set operations on local sets; pthread_sigmask changes only this
        // thread's mask, restored by Drop.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            SigpipeBlocked { was_blocked: libc::sigismember(&old, libc::SIGPIPE) == 1, old, raised: false }
        }
    }
}

impl Drop for SigpipeBlocked {
    fn drop(&mut self) {
        // SAFETY: as in `new`; a zero timeout only polls.
        unsafe {
            // Unblocked before, so nothing of the program's was pending: the one there is ours.
            if self.raised && !self.was_blocked {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_of_an_open_descriptor_is_stable_and_a_closed_one_has_none() {
        assert_eq!(identity(2), identity(2));
        assert_eq!(identity(-1), None);
    }
}
