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
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};

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
    let buf = super::read_single_record(fd).unwrap_or_default();
    // Checked in place (the text is ASCII): no second copy.
    String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

/// Whether a `/proc/self/status` text says no seccomp filter is in place
/// (`Seccomp: 0`); false where it could not be read.
pub fn unfiltered(status: &str) -> bool {
    // One substring search, not a split of every line: this runs at each report and
    // each process's exit.
    let at = if status.starts_with("Seccomp:") { Some(0) } else { status.find("\nSeccomp:").map(|i| i + 1) };
    at.is_some_and(|i| {
        let value = &status[i + "Seccomp:".len()..];
        value[..value.find('\n').unwrap_or(value.len())].trim() == "0"
    })
}

/// Whether no seccomp filter is in place now (`unfiltered` of `status()`): what may be
/// answered with SIGSYS under one (`process_vm_readv`, `mincore`, most `madvise`) is
/// asked for once per report or lookup, not per call.
///
/// A filter, once in place, stays: a filtered answer is kept for good. Inside
/// `one_seccomp_check` (a report) the first answer serves the rest: its steps asked one
/// after the other, 32 reads of `/proc/self/status` (~15 us each here) at the exit of
/// `git --version`, and each step's own calls already follow its check by as long.
pub fn unfiltered_now() -> bool {
    if FILTERED.load(Ordering::Acquire) {
        return false;
    }
    let scoped = SCOPE_DEPTH.load(Ordering::Acquire) > 0;
    let generation = SCOPE_GENERATION.load(Ordering::Acquire);
    if scoped {
        let a = SCOPED_ANSWER.load(Ordering::Acquire);
        if a >> 1 == generation && a != 0 {
            return a & 1 == 1;
        }
    }
    let status = status();
    #[cfg(test)]
    STATUS_CHECKS.fetch_add(1, Ordering::Relaxed);
    let ok = unfiltered(&status);
    if !ok && status.contains("Seccomp:") {
        // Read and filtered (not merely unreadable): for good.
        FILTERED.store(true, Ordering::Release);
    }
    if scoped {
        SCOPED_ANSWER.store(generation << 1 | ok as u64, Ordering::Release);
    }
    ok
}

/// `unfiltered_now` for a hook on a program's thread: no allocation, the held
/// descriptor read once into a buffer on the stack (the `Seccomp:` line comes within
/// its first kilobyte). False where that cannot tell.
pub fn unfiltered_without_allocating() -> bool {
    if FILTERED.load(Ordering::Acquire) {
        return false;
    }
    let fd = STATUS.fd.load(Ordering::Acquire);
    if !STATUS.is_ours(fd) {
        return false;
    }
    let mut buf = [0u8; 2048];
    // SAFETY: reads at most `buf.len()` bytes into `buf` from a descriptor of ours.
    let n = unsafe { libc::syscall(libc::SYS_pread64, fd, buf.as_mut_ptr(), buf.len(), 0) };
    if n <= 0 {
        return false;
    }
    let read = &buf[..n as usize];
    let text = match std::str::from_utf8(read) {
        Ok(t) => t,
        // A name cut in the middle of a character: what comes before it.
        Err(e) => std::str::from_utf8(&read[..e.valid_up_to()]).unwrap_or(""),
    };
    unfiltered(text)
}

static FILTERED: AtomicBool = AtomicBool::new(false);
#[cfg(test)]
static STATUS_CHECKS: AtomicU64 = AtomicU64::new(0);
/// Scopes of `one_seccomp_check` running now, and the number of the outermost one: an
/// answer is kept with the number of the scope it was found in, so that one found as a
/// scope ended never serves the next.
static SCOPE_DEPTH: AtomicU32 = AtomicU32::new(0);
static SCOPE_GENERATION: AtomicU64 = AtomicU64::new(1);
static SCOPED_ANSWER: AtomicU64 = AtomicU64::new(0);

/// Runs `f` (a report's steps) with `unfiltered_now` read at most once.
pub fn one_seccomp_check<R>(f: impl FnOnce() -> R) -> R {
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            if SCOPE_DEPTH.fetch_sub(1, Ordering::AcqRel) == 1 {
                SCOPE_GENERATION.fetch_add(1, Ordering::AcqRel);
            }
        }
    }
    SCOPE_DEPTH.fetch_add(1, Ordering::AcqRel);
    let _scope = Scope;
    f()
}

/// `/proc/self/status` now, or "" when it could not be opened.
pub fn status() -> String {
    read(&STATUS)
}

/// Whether `/proc/self/status` is held open (`open`) and the descriptor is still ours.
pub fn status_held() -> bool {
    STATUS.is_ours(STATUS.fd.load(Ordering::Acquire))
}

/// `/proc/self/smaps_rollup` now, or "".
pub fn smaps_rollup() -> String {
    read(&ROLLUP)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_seccomp_line_is_found_wherever_it_is() {
        assert!(super::unfiltered("Name:\tx\nSeccomp:\t0\nSeccomp_filters:\t0\n"));
        assert!(!super::unfiltered("Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t1\n"));
        assert!(super::unfiltered("Seccomp:\t0"));
        assert!(!super::unfiltered("Name:\tx\nSeccomp_filters:\t0\n"), "no Seccomp line: not known to be unfiltered");
        assert!(!super::unfiltered(""));
    }

    #[test]
    fn a_report_reads_the_seccomp_state_once_and_the_next_one_reads_it_again() {
        use std::sync::atomic::Ordering;
        super::open(false);
        let truth = super::unfiltered(&super::status());
        // Other tests may check meanwhile: count only this thread's view of its scope.
        let within = super::one_seccomp_check(|| {
            let before = super::STATUS_CHECKS.load(Ordering::Relaxed);
            let answers: Vec<bool> = (0..20).map(|_| super::unfiltered_now()).collect();
            (answers, super::STATUS_CHECKS.load(Ordering::Relaxed) - before)
        });
        assert!(within.0.iter().all(|&a| a == truth));
        assert!(within.1 <= 1, "{} reads in one scope", within.1);
        let before = super::STATUS_CHECKS.load(Ordering::Relaxed);
        super::one_seccomp_check(|| assert_eq!(super::unfiltered_now(), truth));
        // Outside a scope every call reads.
        assert_eq!(super::unfiltered_now(), truth);
        assert!(super::STATUS_CHECKS.load(Ordering::Relaxed) - before >= 1);
    }

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
