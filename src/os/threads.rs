//! The library's own threads. Each starts with every signal blocked (the mask is set on
//! the creating thread around `pthread_create`, so not even the new thread's first
//! instruction can take one of the program's signals), detached, through the C
//! library's `pthread_create` itself rather than our hook, and without Rust's
//! `std::thread` machinery (which needs a pthread key: a program that used them all
//! would be aborted by an exit-time thread of ours).
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

type CreateFn = unsafe extern "C" fn(*mut libc::pthread_t, *const libc::pthread_attr_t, extern "C" fn(*mut c_void) -> *mut c_void, *mut c_void) -> c_int;

static CREATE: AtomicUsize = AtomicUsize::new(0);

fn create_fn() -> Option<CreateFn> {
    let mut p = CREATE.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: RTLD_NEXT with a NUL-terminated name: the C library's definition.
        p = unsafe { libc::dlsym(libc::RTLD_NEXT, c"pthread_create".as_ptr()) } as usize;
        if p == 0 {
            return None;
        }
        CREATE.store(p, Ordering::Release);
    }
    // SAFETY: p is the C library's pthread_create, of this prototype.
    Some(unsafe { std::mem::transmute::<usize, CreateFn>(p) })
}

/// Runs `f` with every signal blocked on the calling thread, then restores its mask.
pub fn with_signals_blocked<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: sigfillset and pthread_sigmask with valid pointers; the old mask is
    // restored below whatever `f` returns.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let blocked = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0;
        let r = f();
        if blocked {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        }
        r
    }
}

/// Starts a detached thread running `start(arg)` with every signal blocked. Returns the
/// error number of `pthread_create` on failure. Errno is kept.
///
/// # Safety
/// `arg` must be what `start` expects, valid for as long as the new thread uses it.
pub unsafe fn spawn_raw(start: extern "C" fn(*mut c_void) -> *mut c_void, arg: *mut c_void) -> Result<libc::pthread_t, i32> {
    let _errno = super::ErrnoGuard::save();
    let Some(create) = create_fn() else { return Err(libc::ENOSYS) };
    with_signals_blocked(|| {
        // SAFETY: a standard attribute object, initialised and destroyed here; the start
        // routine is an extern "C" fn that receives `arg` as its caller intends.
        unsafe {
            let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
            libc::pthread_attr_init(attr.as_mut_ptr());
            libc::pthread_attr_setdetachstate(attr.as_mut_ptr(), libc::PTHREAD_CREATE_DETACHED);
            let mut tid: libc::pthread_t = 0;
            let rc = create(&mut tid, attr.as_ptr(), start, arg);
            libc::pthread_attr_destroy(attr.as_mut_ptr());
            if rc == 0 {
                Ok(tid)
            } else {
                Err(rc)
            }
        }
    })
}

/// Whether the thread `tid` of this process has exited.
pub fn thread_is_gone(tid: u32) -> bool {
    if tid == 0 {
        return true;
    }
    let _errno = super::ErrnoGuard::save();
    // SAFETY: signal 0 only checks that the thread exists.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, libc::getpid(), tid as c_int, 0) };
    rc != 0 && super::errno() == libc::ESRCH
}

/// Whether the calling thread has `sig` blocked.
pub fn blocks(sig: c_int) -> bool {
    // SAFETY: querying the mask with a valid out pointer.
    unsafe {
        let mut cur: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut cur) == 0 && libc::sigismember(&cur, sig) == 1
    }
}

/// Whether the calling thread's thread pointer is the C library's: glibc's x86-64 thread
/// control block starts with a pointer to itself (`tcbhead_t.tcb`, offset 0) and holds it
/// again as `self` (offset 16). A thread made with a raw `clone(..., CLONE_SETTLS, ...)`
/// and a TLS block of its own — Chromium's zygote makes such a helper with a zeroed one,
/// which then calls `_exit` — has neither: nothing of ours that reads thread-local state
/// may run there. Two loads through the thread pointer, no system call (a sandbox's
/// seccomp policy kills a process for `arch_prctl(ARCH_GET_FS)`: Chromium's renderers).
/// An address unique to the calling thread while it lives, identical in a forked child
/// for the thread that called fork (unlike the kernel tid): its thread pointer.
#[inline]
pub fn identity() -> usize {
    let tp: usize;
    // SAFETY: one load through the thread pointer, which every thread that runs our
    // code has (glibc's TCB holds its own address at offset 0).
    unsafe {
        std::arch::asm!("mov {tp}, qword ptr fs:[0]", tp = out(reg) tp, options(nostack, readonly, preserves_flags));
    }
    tp
}

pub fn tls_is_glibcs() -> bool {
    let (tcb, this): (u64, u64);
    // SAFETY: two loads relative to the thread pointer, which every thread has: glibc's
    // TCB, or the block a raw clone set (a thread with no thread pointer at all would
    // already fault in any access to our thread-local state, as before this check).
    unsafe {
        std::arch::asm!(
            "mov {tcb}, qword ptr fs:[0]",
            "mov {this}, qword ptr fs:[16]",
            tcb = out(reg) tcb,
            this = out(reg) this,
            options(nostack, readonly, preserves_flags)
        );
    }
    tcb != 0 && tcb == this
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    static SEEN: AtomicU32 = AtomicU32::new(0);

    extern "C" fn probe(_: *mut c_void) -> *mut c_void {
        let all = [libc::SIGINT, libc::SIGTERM, libc::SIGCHLD, libc::SIGALRM, libc::SIGUSR1, libc::SIGRTMIN()].iter().all(|&s| blocks(s));
        SEEN.store(if all { 1 } else { 2 }, Ordering::SeqCst);
        std::ptr::null_mut()
    }

    #[test]
    fn spawned_threads_block_every_signal_and_the_caller_keeps_its_mask() {
        assert!(!blocks(libc::SIGUSR1) || blocks(libc::SIGUSR1));
        let before = blocks(libc::SIGUSR2);
        // SAFETY: the probe ignores its argument.
        unsafe { spawn_raw(probe, std::ptr::null_mut()) }.expect("spawn");
        let start = std::time::Instant::now();
        while SEEN.load(Ordering::SeqCst) == 0 && start.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(SEEN.load(Ordering::SeqCst), 1, "the new thread had a signal unblocked");
        assert_eq!(blocks(libc::SIGUSR2), before);
    }
}
