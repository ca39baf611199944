//! `/proc/self/status` and `/proc/self/smaps_rollup`, opened once per process image (at
//! the library's start, and again in a forked child before it can enter a sandbox; the
//! second only there) and
//! read with `pread` afterwards. The memory measure runs on our collector thread, which
//! blocks every signal: in a process under a seccomp filter that traps `openat` (a
//! sandboxed Chromium renderer), a trapped call there is a SIGSYS the kernel delivers
//! by force, with its default action — the renderer died so under load. `pread` on a
//! descriptor we hold is allowed where `read` is.
//!
//! The descriptors live high (from `anchor::HIGH_FD` up, close-on-exec) and are checked
//! before each use (device and inode as opened): a program may `dup2` over any
//! descriptor or close them all, and one of its own is never read or closed as ours
//! (a shell's `exec 3<>/dev/tcp/...` over a low descriptor of ours was closed in its
//! forked child: memcached's test lost its socket).
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

struct Held {
    fd: AtomicI32,
    dev: AtomicU64,
    ino: AtomicU64,
    rel: &'static str,
}

static STATUS: Held = Held { fd: AtomicI32::new(-1), dev: AtomicU64::new(0), ino: AtomicU64::new(0), rel: "self/status" };
static ROLLUP: Held = Held { fd: AtomicI32::new(-1), dev: AtomicU64::new(0), ino: AtomicU64::new(0), rel: "self/smaps_rollup" };

impl Held {
    /// Whether `fd` is still the file this slot opened.
    fn is_ours(&self, fd: i32) -> bool {
        fd >= 0 && super::fds::identity(fd) == Some((self.dev.load(Ordering::Relaxed), self.ino.load(Ordering::Relaxed)))
    }

    /// Opens the file afresh; the old descriptor is closed only if it is still ours.
    fn reopen(&self) {
        let _errno = super::ErrnoGuard::save();
        let old = self.fd.swap(-1, Ordering::AcqRel);
        if self.is_ours(old) {
            // SAFETY: checked to be the descriptor this slot opened.
            unsafe { libc::close(old) };
        }
        let Ok(low) = super::anchor::open_proc(self.rel, libc::O_RDONLY) else { return };
        // SAFETY: duplicating our own descriptor high, then closing the original.
        let fd = unsafe { libc::fcntl(low, libc::F_DUPFD_CLOEXEC, super::anchor::HIGH_FD) };
        // SAFETY: the descriptor opened just above.
        unsafe { libc::close(low) };
        if let Some((dev, ino)) = (fd >= 0).then(|| super::fds::identity(fd)).flatten() {
            self.dev.store(dev, Ordering::Relaxed);
            self.ino.store(ino, Ordering::Relaxed);
            self.fd.store(fd, Ordering::Release);
        }
    }
}

impl Held {
    /// Closes the descriptor, if it is still ours.
    fn close(&self) {
        let old = self.fd.swap(-1, Ordering::AcqRel);
        if self.is_ours(old) {
            // SAFETY: checked to be the descriptor this slot opened.
            unsafe { libc::close(old) };
        }
    }
}

/// Closes both (a recording ended with the process running on).
pub fn close() {
    let _errno = super::ErrnoGuard::save();
    STATUS.close();
    ROLLUP.close();
}

/// Opens `status` for this process (again in a forked child: its own, the parent's
/// closed), and `smaps_rollup` with `forked_child`: a forked child is the one process
/// whose measure reads it (its proportional share of the pages it shares with its
/// parent); four system calls fewer in every other process's start.
pub fn open(forked_child: bool) {
    STATUS.reopen();
    if forked_child {
        ROLLUP.reopen();
    }
}

fn read(slot: &Held) -> String {
    let fd = slot.fd.load(Ordering::Acquire);
    if !slot.is_ours(fd) {
        // Closed or replaced by the program: forgotten, never closed. Not opened again
        // here (the collector thread, where a sandbox's trapped `openat` kills): the
        // parts read from it are absent until the next process image.
        slot.fd.store(-1, Ordering::Release);
        return String::new();
    }
    // What was read before an error is dropped with it: the parts read from the file
    // are absent from this report, as for a file that could not be opened.
    let buf = super::read_whole(fd).unwrap_or_default();
    String::from_utf8_lossy(&buf).into_owned()
}

/// Whether a `/proc/self/status` text says no seccomp filter is in place
/// (`Seccomp: 0`); false where it could not be read.
pub fn unfiltered(status: &str) -> bool {
    status.lines().find_map(|l| l.strip_prefix("Seccomp:")).is_some_and(|m| m.trim() == "0")
}

/// Whether no seccomp filter is in place now (`unfiltered` of `status()`): what may be
/// answered with SIGSYS under one (`process_vm_readv`, `mincore`, most `madvise`) is
/// asked for once per report or lookup, not per call.
pub fn unfiltered_now() -> bool {
    unfiltered(&status())
}

/// `/proc/self/status` now, or "" when it could not be opened.
pub fn status() -> String {
    read(&STATUS)
}

/// `/proc/self/smaps_rollup` now, or "".
pub fn smaps_rollup() -> String {
    read(&ROLLUP)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_files_are_read_again_each_time() {
        super::open(true);
        let a = super::status();
        assert!(a.contains("VmRSS:") && a.contains("Seccomp:"), "{a}");
        assert!(super::unfiltered(&a) && !super::unfiltered("Seccomp:\t2\n") && !super::unfiltered(""));
        let _grow = vec![1u8; 8 << 20];
        assert!(super::status().contains("VmRSS:"));
        assert!(super::smaps_rollup().contains("Pss:"));
    }
}
