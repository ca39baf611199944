//! The C API a program may call (`include/leaktrace.h`): leak checks by region for test
//! runners, and LeakSanitizer's interface (`<sanitizer/lsan_interface.h>`), so that a
//! program written for LSan works unchanged under leaktrace. Without the library the
//! program's weak references stay null, as they do without LSan.
//!
//! Every function is safe to call from any thread, any number of times, with tracking
//! off (it then does nothing and says so), and keeps `errno`.
//!
//! In a process that has a sanitizer runtime (`-fsanitize=leak` or `address`), the
//! `__lsan_*` names are that runtime's own: it calls them itself, from its start-up
//! (before our constructor) and from inside its `malloc`. Each of ours then forwards to
//! the runtime's definition (`sanitizers_own`): taken over by ours, LeakSanitizer's
//! start registering a root region allocated inside our lock and waited for it forever.
use std::ffi::{c_char, c_int, c_longlong, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::agent;
use crate::os::lock::SpinLock;
use crate::os::ErrnoGuard;
use crate::report::checks::{self, Scope};

/// Not looked up yet, and being looked up (`sanitizers_own`).
const UNKNOWN: usize = 1;
const LOOKING: usize = 2;

/// The definition of `name` that follows this library — a sanitizer runtime's — looked
/// up once into `slot`: `Ok(Some(p))` to forward to, `Ok(None)` in a process without
/// one, `Err(())` for a call made while the lookup runs (the runtime's `free` of
/// `dlsym`'s error buffer calls these functions again): it does nothing.
fn sanitizers_own(slot: &AtomicUsize, name: &CStr) -> Result<Option<usize>, ()> {
    let p = match slot.compare_exchange(UNKNOWN, LOOKING, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            let p = super::resolve::next_definition(name).unwrap_or(0);
            slot.store(p, Ordering::Release);
            p
        }
        Err(LOOKING) => return Err(()),
        Err(p) => p,
    };
    Ok((p != 0).then_some(p))
}

/// Forwards the call to the sanitizer runtime's own function of this name, if any; a
/// call made while that is being looked up does nothing (returns the default: 0).
macro_rules! sanitizers_first {
    ($name:literal, $ty:ty, |$f:ident| $call:expr) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(UNKNOWN);
        match sanitizers_own(&SLOT, $name) {
            Ok(Some(p)) => {
                // SAFETY: the runtime's definition of this very function, with the same C
                // prototype; its arguments are passed on unchanged, never read here.
                let $f = unsafe { std::mem::transmute::<usize, $ty>(p) };
                return $call;
            }
            Ok(None) => {}
            Err(()) => return Default::default(),
        }
    }};
}

/// The last check's JSON (`leaktrace_snapshot_json`).
static LAST_CHECK: SpinLock<String> = SpinLock::new(String::new());

/// # Safety
/// `label` is null or a NUL-terminated string.
unsafe fn label_of(label: *const c_char, default: &str) -> String {
    if label.is_null() {
        return default.to_string();
    }
    // SAFETY: as the caller vouches.
    unsafe { CStr::from_ptr(label) }.to_string_lossy().into_owned()
}

fn run_check(label: &str, scope: Scope) -> Option<checks::Check> {
    let check = agent::checkpoint(label, scope)?;
    *LAST_CHECK.lock() = checks::to_json(&check);
    Some(check)
}

/// Runs an API call's body: `errno` kept, the library's own allocations untracked
/// (made and freed inside), and no panic out of the C boundary (`fallback` then).
fn guarded<R>(fallback: R, f: impl FnOnce() -> R) -> R {
    let _errno = ErrnoGuard::save();
    crate::hotpath::thread::untracked(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(fallback))
}

/// 1 when this process is tracked (the library is preloaded and recording), else 0.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn leaktrace_active() -> c_int {
    agent::active() as c_int
}

/// Starts a region: the blocks the program allocates from now on are the ones the next
/// `leaktrace_snapshot` checks. Returns 1, or 0 when nothing is tracked.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn leaktrace_mark() -> c_int {
    let _errno = ErrnoGuard::save();
    agent::start_region() as c_int
}

/// Checks the blocks allocated since the last `leaktrace_mark` (since the start when
/// there was none) and still outstanding, with the pointer scan, and keeps the result
/// under `label` in the process's reports. Returns the bytes leaked (definite +
/// indirect, after suppressions): memory still reachable from globals and caches does
/// not count. -1 when nothing is tracked or the scan is off.
///
/// # Safety
/// `label` is null or a NUL-terminated string.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn leaktrace_snapshot(label: *const c_char) -> c_longlong {
    // SAFETY: as the caller vouches.
    guarded(-1, || match run_check(&unsafe { label_of(label, "snapshot") }, Scope::Region) {
        Some(c) => c.leaked_bytes().min(i64::MAX as u64) as c_longlong,
        None => -1,
    })
}

/// The last check of this process as JSON (counts, and the largest leaks with their
/// stacks as text), NUL-terminated in `buf` (cut to `len - 1` bytes). Returns the JSON's
/// full length; 0 when there was no check.
///
/// # Safety
/// `buf` is null or has `len` writable bytes.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn leaktrace_snapshot_json(buf: *mut c_char, len: usize) -> usize {
    let _errno = ErrnoGuard::save();
    let last = LAST_CHECK.lock();
    let bytes = last.as_bytes();
    if !buf.is_null() && len > 0 {
        let n = bytes.len().min(len - 1);
        // SAFETY: the caller gives `len` writable bytes at `buf`; n < len.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf as *mut u8, n);
            *buf.add(n) = 0;
        }
    }
    bytes.len()
}

/// LeakSanitizer's on-demand check of every outstanding block: prints the leaks found
/// (if any) on stderr and returns 1 when there are some, 0 when not. The process goes on.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_do_recoverable_leak_check() -> c_int {
    sanitizers_first!(c"__lsan_do_recoverable_leak_check", extern "C" fn() -> c_int, |f| f());
    guarded(0, || {
        let Some(check) = run_check("__lsan_do_recoverable_leak_check", Scope::All) else { return 0 };
        let leaked = check.leaked_blocks() > 0;
        if leaked {
            crate::os::fds::write_stderr(checks::summary_lines(std::slice::from_ref(&check), 0).as_bytes());
        }
        leaked as c_int
    })
}

static LEAK_CHECK_DONE: AtomicBool = AtomicBool::new(false);

/// LeakSanitizer's one-time check: as the recoverable one, once per process; when it
/// finds leaks and `LEAKTRACE_EXIT_CODE` is set, the process exits with that status
/// (LeakSanitizer's `exitcode`), its final report written.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_do_leak_check() {
    sanitizers_first!(c"__lsan_do_leak_check", extern "C" fn(), |f| f());
    if LEAK_CHECK_DONE.swap(true, Ordering::SeqCst) {
        return;
    }
    let leaked = __lsan_do_recoverable_leak_check() != 0;
    if let (true, Some(code)) = (leaked, crate::lifecycle::LIFECYCLE.leak_exit_code()) {
        // SAFETY: exit is always callable; ours writes the final report first.
        unsafe { libc::exit(code as c_int) };
    }
}

/// The block starting at `p` is never reported, nor what only it points to.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_ignore_object(p: *const c_void) {
    sanitizers_first!(c"__lsan_ignore_object", extern "C" fn(*const c_void), |f| f(p));
    let _errno = ErrnoGuard::save();
    if !p.is_null() {
        agent::ignore_block(p as u64);
    }
}

/// Blocks the calling thread allocates until the matching `__lsan_enable` are never
/// reported. Calls nest.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_disable() {
    sanitizers_first!(c"__lsan_disable", extern "C" fn(), |f| f());
    agent::lsan_disable(true);
}

#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_enable() {
    sanitizers_first!(c"__lsan_enable", extern "C" fn(), |f| f());
    agent::lsan_disable(false);
}

/// `[p, p + size)` is read as a root by every later scan.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_register_root_region(p: *const c_void, size: usize) {
    sanitizers_first!(c"__lsan_register_root_region", extern "C" fn(*const c_void, usize), |f| f(p, size));
    guarded((), || crate::scan::roots::register_root_region(p as u64, size as u64));
}

#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn __lsan_unregister_root_region(p: *const c_void, size: usize) {
    sanitizers_first!(c"__lsan_unregister_root_region", extern "C" fn(*const c_void, usize), |f| f(p, size));
    guarded((), || {
        if !crate::scan::roots::unregister_root_region(p as u64, size as u64) {
            crate::os::fds::stderr_line(&format!("leaktrace: __lsan_unregister_root_region({p:p}, {size}): no such region registered"));
        }
    });
}

/// For `leaktrace attach`, which calls it through ptrace in a process it attached to
/// and detached from before: the library (loaded, off) listens on its socket again so
/// that it can be switched on again. 1 when it listens, 0 otherwise.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn leaktrace_attach_listen() -> c_int {
    let _errno = ErrnoGuard::save();
    std::panic::catch_unwind(agent::standby::listen_again).map_or(0, c_int::from)
}
