//! The library's own threads. Each starts with every signal blocked (the mask is set on
//! the creating thread around `pthread_create`, so not even the new thread's first
//! instruction can take one of the program's signals), detached, through the C
//! library's `pthread_create` itself rather than our hook, and without Rust's
//! `std::thread` machinery (which needs a pthread key: a program that used them all
//! would be aborted by an exit-time thread of ours).
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

type CreateFn = unsafe extern "C" fn(*mut libc::pthread_t, *const libc::pthread_attr_t, extern "C" fn(*mut c_void) -> *mut c_void, *mut c_void) -> c_int;

static CREATE: AtomicUsize = AtomicUsize::new(0);

/// The C library's `pthread_create`, as the interposer resolved it with the other real
/// functions (from the modules' tables: the first successful `dlsym` of a process, as
/// `create_fn` would make, costs ~20 us of its start).
pub fn know_create(p: usize) {
    if p != 0 {
        CREATE.store(p, Ordering::Release);
    }
}

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

/// The library's own threads, by kernel id, for the pointer scan, which must neither
/// hold them nor read their stacks as roots (they hold the addresses of the events they
/// just processed, which the program may have lost). A fixed table (no allocation: a
/// thread of ours may be started in a fork handler or at exit). Each thread writes its
/// id as the first thing it does; a slot stays `STARTING` from before `pthread_create`
/// until then, so that a scan can wait for the ids of the threads already created
/// (`own_tids_settled`): an id read once the collector was created but before it ran
/// once let the scan read its stack as the program's (a leak called reachable).
const OWN_SLOTS: usize = 32;
const FREE: u32 = 0;
const STARTING: u32 = 1;
const RUNNING: u32 = 2;
/// Its start routine returned; the thread may exist a moment longer (its exit path).
const ENDED: u32 = 3;

struct OwnSlot {
    state: AtomicU32,
    tid: AtomicU32,
    start: AtomicUsize,
    arg: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: OwnSlot = OwnSlot { state: AtomicU32::new(FREE), tid: AtomicU32::new(0), start: AtomicUsize::new(0), arg: AtomicUsize::new(0) };
static OWN: [OwnSlot; OWN_SLOTS] = [EMPTY_SLOT; OWN_SLOTS];

/// A slot for a thread about to be created, marked `STARTING`: a free one, or one whose
/// thread has ended and is gone.
fn claim_slot() -> Option<usize> {
    for (i, s) in OWN.iter().enumerate() {
        let st = s.state.load(Ordering::SeqCst);
        let reusable = st == FREE || (st == ENDED && thread_is_gone(s.tid.load(Ordering::SeqCst)));
        if reusable && s.state.compare_exchange(st, STARTING, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            s.tid.store(0, Ordering::SeqCst);
            return Some(i);
        }
    }
    None
}

extern "C" fn own_thread_start(arg: *mut c_void) -> *mut c_void {
    let slot = &OWN[arg as usize % OWN_SLOTS];
    // SAFETY: gettid cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    slot.tid.store(tid, Ordering::SeqCst);
    let start = slot.start.load(Ordering::SeqCst);
    let arg = slot.arg.load(Ordering::SeqCst) as *mut c_void;
    slot.state.store(RUNNING, Ordering::SeqCst);
    // SAFETY: `start` is the start routine `spawn_raw` stored for this slot.
    let start = unsafe { std::mem::transmute::<usize, extern "C" fn(*mut c_void) -> *mut c_void>(start) };
    let r = start(arg);
    slot.state.store(ENDED, Ordering::SeqCst);
    r
}

/// The kernel ids of the library's threads that may exist now, once every thread of
/// ours already created has written its id (at most `wait`: a thread that has not run
/// by then has run none of our code yet). To be called after the program's threads
/// were listed: a thread of ours in that list has then written its id before this reads
/// it. Ended threads that are gone are freed (their ids may be reused).
pub fn own_tids_settled(wait: std::time::Duration) -> Vec<u32> {
    let begin = std::time::Instant::now();
    while OWN.iter().any(|s| s.state.load(Ordering::SeqCst) == STARTING) && begin.elapsed() < wait {
        std::thread::yield_now();
    }
    let mut tids = Vec::with_capacity(OWN_SLOTS);
    for s in OWN.iter() {
        let st = s.state.load(Ordering::SeqCst);
        let tid = s.tid.load(Ordering::SeqCst);
        if st == ENDED && thread_is_gone(tid) {
            let _ = s.state.compare_exchange(ENDED, FREE, Ordering::SeqCst, Ordering::SeqCst);
        } else if st != FREE && tid != 0 {
            tids.push(tid);
        }
    }
    tids
}

/// In a forked child: none of the parent's threads of ours exists here.
pub fn forget_after_fork() {
    for s in OWN.iter() {
        s.tid.store(0, Ordering::SeqCst);
        s.state.store(FREE, Ordering::SeqCst);
    }
}

/// Starts a detached thread running `start(arg)` with every signal blocked, known to
/// the scan as one of ours from its first instruction (`own_tids_settled`). Returns the
/// error number of `pthread_create` on failure (EAGAIN: 32 threads of ours at once).
/// Errno is kept.
///
/// # Safety
/// `arg` must be what `start` expects, valid for as long as the new thread uses it.
pub unsafe fn spawn_raw(start: extern "C" fn(*mut c_void) -> *mut c_void, arg: *mut c_void) -> Result<libc::pthread_t, i32> {
    let _errno = super::ErrnoGuard::save();
    let Some(create) = create_fn() else { return Err(libc::ENOSYS) };
    // The slot is claimed with the signals blocked too: a termination signal's final
    // report taken between the claim and the creation would wait on a slot that stays
    // `STARTING` until its handler returns (5 s, `own_tids_settled`).
    with_signals_blocked(|| {
        let slot = claim_slot().ok_or(libc::EAGAIN)?;
        OWN[slot].start.store(start as usize, Ordering::SeqCst);
        OWN[slot].arg.store(arg as usize, Ordering::SeqCst);
        // SAFETY: a standard attribute object, initialised and destroyed here; the start
        // routine is an extern "C" fn that receives the slot, which holds `arg` for the
        // routine the caller gave.
        let created = unsafe {
            let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
            libc::pthread_attr_init(attr.as_mut_ptr());
            libc::pthread_attr_setdetachstate(attr.as_mut_ptr(), libc::PTHREAD_CREATE_DETACHED);
            let mut tid: libc::pthread_t = 0;
            let rc = create(&mut tid, attr.as_ptr(), own_thread_start, slot as *mut c_void);
            libc::pthread_attr_destroy(attr.as_mut_ptr());
            if rc == 0 {
                Ok(tid)
            } else {
                Err(rc)
            }
        };
        if created.is_err() {
            OWN[slot].state.store(FREE, Ordering::SeqCst);
        }
        created
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
    use std::sync::atomic::AtomicBool;

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

    static HOLD: AtomicBool = AtomicBool::new(true);
    static ITS_TID: AtomicU32 = AtomicU32::new(0);

    extern "C" fn held(_: *mut c_void) -> *mut c_void {
        // SAFETY: gettid cannot fail.
        ITS_TID.store(unsafe { libc::syscall(libc::SYS_gettid) } as u32, Ordering::SeqCst);
        while HOLD.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::ptr::null_mut()
    }

    #[test]
    fn a_thread_of_ours_is_known_by_its_id_from_the_moment_it_is_created_until_it_is_gone() {
        // SAFETY: the routine ignores its argument.
        unsafe { spawn_raw(held, std::ptr::null_mut()) }.expect("spawn");
        // At once, before the new thread may have run: the call waits for its id.
        let own = own_tids_settled(std::time::Duration::from_secs(30));
        let tid = ITS_TID.load(Ordering::SeqCst);
        assert!(tid != 0, "own_tids_settled returned before the thread ran");
        assert!(own.contains(&tid), "{own:?} lacks {tid}");
        HOLD.store(false, Ordering::SeqCst);
        let start = std::time::Instant::now();
        while !thread_is_gone(tid) && start.elapsed().as_secs() < 30 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(thread_is_gone(tid));
        assert!(!own_tids_settled(std::time::Duration::from_secs(30)).contains(&tid), "an ended thread that is gone is no longer ours");
    }
}
