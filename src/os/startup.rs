//! The arguments and the environment the C library hands the library's constructor
//! (glibc calls each `.init_array` entry with `argc`, `argv` and `envp`): the same bytes
//! as `/proc/self/cmdline` and `/proc/self/environ` (both read the process's argument
//! and environment areas, where these pointers point), read without opening a file —
//! two `/proc` files were four system calls each in every process's start.
//!
//! Kept only while the constructor runs (`note` ... `forget`): afterwards the program may
//! rewrite its argument area (`setproctitle`) or the pointers, and the `/proc` files are
//! read as before (a forked child, a recording switched on later).
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The noted pointers (zero outside the window).
pub struct Window {
    argc: AtomicUsize,
    argv: AtomicUsize,
    envp: AtomicUsize,
}

/// The constructor's window of this process.
pub static WINDOW: Window = Window::new();

/// More than any kernel accepts (`execve` limits the whole area to a quarter of the
/// stack): a larger count is not a real `argc`.
const MAX_ARGS: usize = 1 << 20;

impl Default for Window {
    fn default() -> Window {
        Window::new()
    }
}

impl Window {
    pub const fn new() -> Window {
        Window { argc: AtomicUsize::new(0), argv: AtomicUsize::new(0), envp: AtomicUsize::new(0) }
    }

    /// Notes the constructor's arguments, if they look like glibc's: `argv` non-null
    /// with a null after its `argc` entries, `envp` non-null.
    ///
    /// # Safety
    /// `argv` and `envp` must be the pointers the C library passed the constructor (or
    /// null), valid until `forget`.
    pub unsafe fn note(&self, argc: c_int, argv: *const *const c_char, envp: *const *const c_char) {
        let Ok(n) = usize::try_from(argc) else { return };
        if argv.is_null() || envp.is_null() || n > MAX_ARGS {
            return;
        }
        // SAFETY: glibc's argv has `argc` entries and a terminating null (the caller's contract).
        if !unsafe { *argv.add(n) }.is_null() {
            return;
        }
        self.argc.store(n, Ordering::Relaxed);
        self.envp.store(envp as usize, Ordering::Relaxed);
        self.argv.store(argv as usize, Ordering::Release);
    }

    /// Ends the constructor's window: the files are read from now on.
    pub fn forget(&self) {
        self.argv.store(0, Ordering::Release);
        self.envp.store(0, Ordering::Relaxed);
    }

    /// The command line as `/proc/self/cmdline` holds it, while the constructor runs.
    pub fn cmdline(&self) -> Option<Vec<u8>> {
        let argv = self.argv.load(Ordering::Acquire);
        if argv == 0 {
            return None;
        }
        // SAFETY: noted by `note` from glibc's constructor arguments, still in the window.
        Some(unsafe { joined(argv as *const *const c_char, self.argc.load(Ordering::Relaxed)) })
    }

    /// The initial environment array's address while the constructor runs, else 0.
    pub fn envp(&self) -> usize {
        if self.argv.load(Ordering::Acquire) == 0 {
            return 0;
        }
        self.envp.load(Ordering::Relaxed)
    }

    /// The environment the process started with, as `/proc/self/environ` holds it,
    /// while the constructor runs: only the variables (`NAME=value`) that `keep`
    /// accepts (no copy of the rest, when only a few are wanted).
    pub fn environ_where(&self, keep: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
        let envp = self.envp();
        // SAFETY: as `cmdline`; the initial environment array is null-terminated.
        (envp != 0).then(|| unsafe { joined_where(envp as *const *const c_char, usize::MAX, keep) })
    }
}

/// The NUL-terminated `NAME=value` entries of `environ` (as `/proc/self/environ` holds
/// them) that `keep` accepts, in their order.
pub fn environ_keeping(environ: &[u8], keep: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    let mut out = Vec::new();
    for kv in environ.split(|b| *b == 0).filter(|kv| !kv.is_empty() && keep(kv)) {
        out.extend_from_slice(kv);
        out.push(0);
    }
    out
}

/// NUL-terminated strings from a null-terminated array, at most `limit` of them, as
/// `/proc` concatenates them.
///
/// # Safety
/// `array` must be a valid null-terminated array of valid C strings.
unsafe fn joined(array: *const *const c_char, limit: usize) -> Vec<u8> {
    // SAFETY: the caller's contract.
    unsafe { joined_where(array, limit, |_| true) }
}

/// `joined`, only the strings (without their NUL) that `keep` accepts.
///
/// # Safety
/// As `joined`.
unsafe fn joined_where(array: *const *const c_char, limit: usize, keep: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..limit {
        // SAFETY: within the array up to its terminating null (the caller's contract).
        let p = unsafe { *array.add(i) };
        if p.is_null() {
            break;
        }
        // SAFETY: a valid C string (the caller's contract).
        let s = unsafe { CStr::from_ptr(p) }.to_bytes_with_nul();
        if keep(&s[..s.len() - 1]) {
            out.extend_from_slice(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_variables_of_an_environment_text_stay_in_order() {
        let text = b"A=1\0RANK=3\0\0B=2\0WORLD_SIZE=4\0";
        assert_eq!(environ_keeping(text, |kv| kv != b"A=1" && kv != b"B=2"), b"RANK=3\0WORLD_SIZE=4\0");
        assert_eq!(environ_keeping(text, |_| false), b"");
        assert_eq!(environ_keeping(b"", |_| true), b"");
    }

    #[test]
    fn the_constructors_arguments_read_as_the_proc_files_and_only_in_the_window() {
        let args = [c"prog".as_ptr(), c"--flag".as_ptr(), c"".as_ptr(), std::ptr::null()];
        let env = [c"A=1".as_ptr(), c"RANK=3".as_ptr(), std::ptr::null()];
        let w = Window::new();
        // SAFETY: null-terminated arrays of C strings that outlive the window.
        unsafe { w.note(3, args.as_ptr(), env.as_ptr()) };
        assert_eq!(w.cmdline().unwrap(), b"prog\0--flag\0\0");
        assert_eq!(w.environ_where(|_| true).unwrap(), b"A=1\0RANK=3\0");
        assert_eq!(w.envp(), env.as_ptr() as usize);
        assert_eq!(w.environ_where(|kv| kv.starts_with(b"RANK=")).unwrap(), b"RANK=3\0");
        assert_eq!(w.environ_where(|_| false).unwrap(), b"");
        w.forget();
        assert!(w.cmdline().is_none() && w.environ_where(|_| true).is_none() && w.envp() == 0);
        // Not glibc's shape: no null after argc entries.
        // SAFETY: as above; only `args[..3]` is read.
        unsafe { w.note(2, args.as_ptr(), env.as_ptr()) };
        assert!(w.cmdline().is_none());
        // SAFETY: null pointers are refused before any read.
        unsafe { w.note(1, std::ptr::null(), env.as_ptr()) };
        assert!(w.cmdline().is_none());
    }
}
