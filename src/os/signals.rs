//! Signal dispositions: ours only where the program left the default.
use std::ffi::c_int;

/// Installs `handler` (an async-signal-safe `extern "C"` function) for `sig` only if the
/// program left `sig` at its default action, so its own handlers are never replaced.
/// `siginfo` selects the three-argument form. Returns whether it was installed.
pub fn install_if_default(sig: c_int, handler: usize, siginfo: bool, block_all: bool) -> bool {
    // SAFETY: sigaction with valid pointers; the handler address comes from an extern
    // "C" fn of the matching arity.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
            return false;
        }
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = handler;
        act.sa_flags = libc::SA_RESTART | libc::SA_ONSTACK | if siginfo { libc::SA_SIGINFO } else { 0 };
        if block_all {
            libc::sigfillset(&mut act.sa_mask);
        } else {
            libc::sigemptyset(&mut act.sa_mask);
        }
        libc::sigaction(sig, &act, std::ptr::null_mut()) == 0
    }
}

/// Restores the default action of `sig` and delivers it to the process.
pub fn die_by_signal(sig: c_int) {
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
