//! Signal dispositions: ours only where the program left the default.
use std::ffi::c_int;
use std::sync::atomic::{AtomicU64, Ordering};

/// Signals whose handler is ours while the program sees their default action (bit
/// `sig - 1`): termination signals, whose handler ends the process by the signal as
/// the default does, after the final report (`interpose::signals`).
static HELD: AtomicU64 = AtomicU64::new(0);

/// Termination signals we manage in this process: a request of the program for their
/// default installs our handler (`hold`) even after a handler of its own had replaced
/// ours — GNU `sort` cleans up in its own handler, then resets the default and raises
/// the signal again to die by it.
static ELIGIBLE: AtomicU64 = AtomicU64::new(0);

fn bit(sig: c_int) -> u64 {
    if (1..=64).contains(&sig) {
        1 << (sig - 1)
    } else {
        0
    }
}

/// Marks `sig` as held: our handler is installed in place of the default the program
/// set or left, and stays when the program asks for the default again.
pub fn hold(sig: c_int) {
    HELD.fetch_or(bit(sig), Ordering::AcqRel);
}

/// The program took `sig` over: no longer ours until it asks for the default again.
pub fn release(sig: c_int) {
    HELD.fetch_and(!bit(sig), Ordering::AcqRel);
}

/// `sig` is managed by us in this process (see `ELIGIBLE`).
pub fn manage(sig: c_int) {
    ELIGIBLE.fetch_or(bit(sig), Ordering::AcqRel);
}

/// Whether a request for `sig`'s default installs our handler instead.
pub fn managed(sig: c_int) -> bool {
    let b = bit(sig);
    b != 0 && ELIGIBLE.load(Ordering::Acquire) & b != 0
}

/// We are about to die by `sig`: neither held nor managed any more, so that setting its
/// default really sets it.
fn retire(sig: c_int) {
    HELD.fetch_and(!bit(sig), Ordering::AcqRel);
    ELIGIBLE.fetch_and(!bit(sig), Ordering::AcqRel);
}

/// Whether `sig` is held (async-signal-safe: one load).
pub fn held_for_program(sig: c_int) -> bool {
    let b = bit(sig);
    b != 0 && HELD.load(Ordering::Acquire) & b != 0
}

/// Our action for a handler (an async-signal-safe `extern "C"` function): restarting,
/// on the alternate stack where there is one; `siginfo` selects the three-argument form,
/// `block_all` blocks every signal while it runs.
pub fn action(handler: usize, siginfo: bool, block_all: bool) -> libc::sigaction {
    // SAFETY: a zeroed sigaction is valid; the set functions write inside it.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = handler;
        act.sa_flags = libc::SA_RESTART | libc::SA_ONSTACK | if siginfo { libc::SA_SIGINFO } else { 0 };
        if block_all {
            libc::sigfillset(&mut act.sa_mask);
        } else {
            libc::sigemptyset(&mut act.sa_mask);
        }
        act
    }
}

/// Installs `action(handler, siginfo, block_all)` for `sig` only if the program left
/// `sig` at its default action, so its own handlers are never replaced. Returns whether
/// it was installed.
pub fn install_if_default(sig: c_int, handler: usize, siginfo: bool, block_all: bool) -> bool {
    // SAFETY: sigaction with valid pointers; the handler address comes from an extern
    // "C" fn of the matching arity.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
            return false;
        }
        libc::sigaction(sig, &action(handler, siginfo, block_all), std::ptr::null_mut()) == 0
    }
}

/// Puts back the default action of `sig` where its handler is still `handler` (ours),
/// and gives the signal up: the program's own requests pass through again.
pub fn default_if_ours(sig: c_int, handler: usize) {
    retire(sig);
    // SAFETY: sigaction with valid pointers; a zeroed action with SIG_DFL is the default.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != handler {
            return;
        }
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(sig, &act, std::ptr::null_mut());
    }
}

/// Waits (async-signal-safe sleeps) for the process to be ended by someone else —
/// the collector, after the final report — and after `limit_s` seconds ends it by `sig`.
pub fn wait_to_die(sig: c_int, limit_s: u32) {
    let pause = libc::timespec { tv_sec: 0, tv_nsec: 10_000_000 };
    for _ in 0..limit_s * 100 {
        // SAFETY: nanosleep with a valid duration; the remainder is not wanted.
        unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
    }
    die_by_signal(sig);
}

/// Restores the default action of `sig` and delivers it to the process.
pub fn die_by_signal(sig: c_int) {
    retire(sig);
    // SAFETY: sigaction, sigprocmask and kill are async-signal-safe; the default action
    // of a termination signal ends the process.
    unsafe {
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(sig, &act, std::ptr::null_mut());
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
    }
}
