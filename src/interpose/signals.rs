//! `sigaction`, `signal` and `bsd_signal`, for the termination signals we manage
//! (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGPIPE: `lifecycle::TERMINATION_SIGNALS`).
//!
//! Programs reset signals to their default at start-up: Chromium does it in every
//! process (`SetupSignalHandlers`: SIGTERM among others, back to `SIG_DFL`), after our
//! constructor ran. Our handler then went away, and a renderer that the browser ended
//! with SIGTERM died without its final report. Our handler does what the default does
//! — the process dies by that signal — after writing the report; so a request for the
//! default keeps it in place, and the program is told the disposition is the default,
//! which is what it asked for and what it would see without us (before, a query saw our
//! handler). A program that installs a handler or `SIG_IGN` takes the signal over, as
//! always — and when it asks for the default again (GNU `sort` does, in its handler,
//! before raising the signal again to die by it), ours comes back. Every other signal
//! passes straight through.
// C entry points: their contract is the C library's.
#![allow(clippy::missing_safety_doc)]
use std::ffi::c_int;

use super::real;
use crate::os::signals::{held_for_program, hold, managed, release};

/// The disposition the program believes a held signal has: the default.
fn default_view(old: *mut libc::sigaction) {
    if !old.is_null() {
        // SAFETY: the caller's out-parameter, valid for writing as sigaction's contract says.
        unsafe {
            *old = std::mem::zeroed();
            (*old).sa_sigaction = libc::SIG_DFL;
        }
    }
}

/// A request for the default action.
fn default_action() -> libc::sigaction {
    // SAFETY: a zeroed sigaction is valid and means SIG_DFL.
    unsafe { std::mem::zeroed() }
}

fn no_real_function() -> c_int {
    // SAFETY: this thread's errno.
    unsafe { *libc::__errno_location() = libc::ENOSYS };
    -1
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn sigaction(sig: c_int, act: *const libc::sigaction, old: *mut libc::sigaction) -> c_int {
    let Some(real_sigaction) = real::sigaction() else { return no_real_function() };
    // SAFETY: `act` is null or points to the caller's sigaction (the C contract).
    let wanted = unsafe { act.as_ref() }.map(|a| a.sa_sigaction);
    if !held_for_program(sig) {
        if wanted == Some(libc::SIG_DFL) && managed(sig) {
            // The program gives up its own handler for the default: ours instead, whose
            // outcome is the default's after the report; `old` gets its handler.
            let ours = super::lifecycle::termination_action();
            // SAFETY: our valid action; `old` is the caller's out-parameter.
            let r = unsafe { real_sigaction(sig, &ours, old) };
            if r == 0 {
                hold(sig);
            }
            return r;
        }
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real_sigaction(sig, act, old) };
    }
    match wanted {
        // A query, or a request for the default: ours stays, the program sees the default.
        None | Some(libc::SIG_DFL) => {
            default_view(old);
            0
        }
        // The program's own handler (or SIG_IGN) takes the signal over.
        Some(_) => {
            // SAFETY: forwarding the caller's new action; the old one is ours, not theirs.
            let r = unsafe { real_sigaction(sig, act, std::ptr::null_mut()) };
            if r == 0 {
                release(sig);
                default_view(old);
            }
            r
        }
    }
}

/// `signal` (glibc: BSD semantics, as `bsd_signal`): glibc's own calls `sigaction`
/// inside the C library, where our `sigaction` does not see it.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: same contract as the C library's signal.
    unsafe { bsd_signal(sig, handler) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    if !held_for_program(sig) && handler == libc::SIG_DFL && managed(sig) {
        // As in `sigaction`: ours instead of the default; the program's handler returned.
        // SAFETY: a zeroed sigaction is a valid out-parameter.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: forwarding to our own sigaction with valid pointers.
        return if unsafe { sigaction(sig, &default_action(), &mut old) } == 0 { old.sa_sigaction } else { libc::SIG_ERR };
    }
    if !held_for_program(sig) || handler == libc::SIG_ERR {
        return match real::signal() {
            // SAFETY: forwarding the caller's arguments unchanged.
            Some(f) => unsafe { f(sig, handler) },
            None => {
                no_real_function();
                libc::SIG_ERR
            }
        };
    }
    if handler == libc::SIG_DFL {
        return libc::SIG_DFL;
    }
    // The program's own handler, with the flags glibc's `signal` gives it.
    // SAFETY: a zeroed sigaction is valid; the set functions write inside it.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    act.sa_flags = libc::SA_RESTART;
    // SAFETY: as above.
    unsafe {
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaddset(&mut act.sa_mask, sig);
    }
    let Some(real_sigaction) = real::sigaction() else {
        no_real_function();
        return libc::SIG_ERR;
    };
    // SAFETY: a valid action for a valid signal number.
    if unsafe { real_sigaction(sig, &act, std::ptr::null_mut()) } != 0 {
        return libc::SIG_ERR;
    }
    release(sig);
    libc::SIG_DFL
}
