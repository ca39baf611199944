//! Per-thread state of the hot path: the reentrancy guard, the "internal thread" mark,
//! the cached kernel thread id and the stack bounds used by the unwinder.
//!
//! Every field is a `Cell` of a plain type whose initial value is zero and which has no
//! destructor, so the state is a bare block of static TLS (below): touching it never
//! allocates, never registers a destructor (which would call malloc and recurse), and
//! never calls `__tls_get_addr`.
use std::cell::Cell;

pub struct ThreadState {
    /// Set while this thread runs inside a hook: nested allocations (made by the
    /// unwinder, by glibc on our behalf, ...) go straight to the real allocator.
    busy: Cell<bool>,
    /// Set for the library's own threads (the collector): nothing they do is tracked.
    internal: Cell<bool>,
    /// Set for the library's own threads from their start (never by `untracked`): their
    /// small blocks come from the library's own heap (`os::own_heap`).
    own_heap: Cell<bool>,
    tid: Cell<u32>,
    pub(crate) stack_lo: Cell<usize>,
    pub(crate) stack_hi: Cell<usize>,
    /// Per-thread unwind memo (see `hotpath::unwind`), 0 when none.
    pub(crate) memo: Cell<usize>,
    /// Set once the thread's pthread-key destructor has run: no new memo after it.
    pub(crate) exiting: Cell<bool>,
    /// This thread's event ring (see `hotpath::channel`), 0 until its first event.
    pub(crate) ring: Cell<usize>,
    /// Set while this thread is inside a hooked CUDA call: the calls it makes
    /// underneath (the runtime calling the driver) are the same allocation.
    in_cuda: Cell<bool>,
    /// This thread's `errno` slot (`__errno_location()`), 0 until first asked: it never
    /// moves while the thread lives, and a forked child's thread keeps its parent's.
    errno_slot: Cell<usize>,
    /// The mapping of the other stack this thread last ran on (a `swapcontext`
    /// coroutine's, a signal's alternate stack), `[alt_lo, alt_hi)`; 0 when none.
    pub(crate) alt_lo: Cell<usize>,
    pub(crate) alt_hi: Cell<usize>,
    /// `__lsan_disable` calls not yet matched by `__lsan_enable`.
    lsan_disabled: Cell<u32>,
    /// Bytes of Python objects this thread may still allocate before the next sampled
    /// one (`interpose::pyalloc`), and the state of its random intervals (0: not yet
    /// seeded).
    pub(crate) py_countdown: Cell<i64>,
    pub(crate) py_rng: Cell<u64>,
}

/// The thread's state lives in an initial-exec TLS block of this library, reached from
/// `%fs` through one GOT entry, never through `__tls_get_addr`. A `thread_local!` in a
/// shared library is general-dynamic: its first access from a thread after a `dlopen`
/// raised the TLS generation goes through `__tls_get_addr`'s slow path, which may grow
/// the thread's DTV with `malloc` — our hook, which asks for its state again, and so on
/// until the stack overflows. A real PyTorch job on a GPU machine crashed that way while
/// `import torch` dlopen'ed its CUDA libraries. The price of initial-exec is the
/// `STATIC_TLS` flag: the block (under 100 bytes) comes from the static TLS surplus if
/// the library is ever `dlopen`ed late instead of preloaded.
///
/// All-zero bytes are the initial state (`false`, 0 everywhere).
const STATE_BYTES: usize = std::mem::size_of::<ThreadState>();

std::arch::global_asm!(
    ".pushsection .tbss,\"awT\",@nobits",
    ".p2align 4",
    ".globl leaktrace_thread_state_block",
    ".hidden leaktrace_thread_state_block",
    ".type leaktrace_thread_state_block, @tls_object",
    ".size leaktrace_thread_state_block, {bytes}",
    "leaktrace_thread_state_block:",
    ".zero {bytes}",
    ".popsection",
    bytes = const STATE_BYTES,
);

#[inline(always)]
fn state() -> &'static ThreadState {
    let p: usize;
    // SAFETY: reads the thread pointer and adds the block's offset from the GOT; no
    // other memory is touched. The block is this thread's, as long as the thread lives,
    // zero-initialised (a valid ThreadState: every field is a Cell of 0 or false), and
    // aligned to 16.
    unsafe {
        std::arch::asm!(
            "mov {p}, qword ptr fs:[0]",
            "add {p}, qword ptr [rip + leaktrace_thread_state_block@GOTTPOFF]",
            p = out(reg) p,
            // Not `preserves_flags`: the `add` writes them. Declared so, the compiler
            // once kept a comparison's flags across this block and branched on the
            // `add`'s (a collector thread created fine was taken for a failed one).
            options(pure, readonly, nostack)
        );
        &*(p as *const ThreadState)
    }
}

pub fn with<R>(f: impl FnOnce(&ThreadState) -> R) -> R {
    f(state())
}

/// Held while a hook records an event: dropping it re-arms tracking for this thread and
/// puts back the `errno` the program had (whatever recording did to it).
///
/// It carries the thread's state so that the recording step reaches it without another
/// TLS lookup (the hot path used to make five of them per event, each a
/// `__tls_get_addr` call before the state moved to initial-exec TLS).
pub struct HookGuard {
    state: *const ThreadState,
    errno: i32,
}

impl ThreadState {
    /// Whether this thread is between `__lsan_disable` and `__lsan_enable`.
    #[inline(always)]
    pub fn lsan_disabled(&self) -> bool {
        self.lsan_disabled.get() != 0
    }

    pub fn lsan_disable(&self, on: bool) {
        let n = self.lsan_disabled.get();
        self.lsan_disabled.set(if on { n.saturating_add(1) } else { n.saturating_sub(1) });
    }
}

impl HookGuard {
    /// Returns `None` when this thread must not record: it is already inside a hook,
    /// or it is one of the library's own threads.
    #[inline(always)]
    pub fn enter() -> Option<HookGuard> {
        with(|s| {
            if s.busy.get() || s.internal.get() {
                None
            } else {
                s.busy.set(true);
                // SAFETY: the slot is this thread's errno, valid while the thread lives.
                let errno = unsafe { *s.errno_slot() };
                Some(HookGuard { state: s, errno })
            }
        })
    }

    /// Like `enter`, for a release (a free, an unmapping, a realloc's old block): also
    /// on the library's own threads and inside `untracked`, where the C library may free
    /// what the program's threads allocated. Returns the guard and whether the thread
    /// records nothing of its own there (the release must then be published without
    /// waiting: the thread may hold the collector). `None` only inside another hook.
    #[inline(always)]
    pub fn enter_release() -> Option<(HookGuard, bool)> {
        with(|s| {
            if s.busy.get() {
                None
            } else {
                s.busy.set(true);
                // SAFETY: as in `enter`.
                let errno = unsafe { *s.errno_slot() };
                Some((HookGuard { state: s, errno }, s.internal.get()))
            }
        })
    }

    /// The calling thread's state.
    #[inline(always)]
    pub fn state(&self) -> &ThreadState {
        // SAFETY: the guard never leaves the hook call that made it on this thread,
        // and the thread's TLS block outlives every call the thread makes.
        unsafe { &*self.state }
    }
}

impl Drop for HookGuard {
    #[inline(always)]
    fn drop(&mut self) {
        let s = self.state();
        // SAFETY: as in `enter`.
        unsafe { *s.errno_slot() = self.errno };
        s.busy.set(false);
    }
}

impl ThreadState {
    #[inline(always)]
    fn errno_slot(&self) -> *mut i32 {
        let p = self.errno_slot.get();
        if p != 0 {
            return p as *mut i32;
        }
        // SAFETY: __errno_location has no preconditions and returns this thread's slot.
        let p = unsafe { libc::__errno_location() };
        self.errno_slot.set(p as usize);
        p
    }
}

/// Runs `f` as a CUDA API call of this thread. Returns its result and whether this is
/// the outermost hooked CUDA call (the one that records).
#[inline]
pub fn cuda_call<R>(f: impl FnOnce() -> R) -> (R, bool) {
    let outer = !with(|s| s.in_cuda.replace(true));
    let r = f();
    if outer {
        with(|s| s.in_cuda.set(false));
    }
    (r, outer)
}

/// Counts `bytes` of Python objects against this thread's sampling interval; true when
/// the interval is used up (the caller samples, or seeds the interval: `py_sampling`).
#[inline(always)]
pub fn py_countdown(bytes: usize) -> bool {
    with(|s| {
        let left = s.py_countdown.get() - bytes as i64;
        s.py_countdown.set(left);
        left <= 0
    })
}

/// Starts this thread's next sampling interval, carrying over the bytes by which the
/// last one was overrun, so that the sample points form a renewal process over the
/// thread's bytes with one point per `mean` bytes on average. An interval is uniform in
/// [mean/2, 3 mean/2): random enough that no allocation pattern lines up with it, and
/// never shorter than a sampled object (at most `mean/2` bytes), so that an object of
/// `size` bytes is sampled with probability `size/mean` exactly and stands for `mean`
/// bytes. The count of samples over a span of a line's bytes then varies about a
/// twelfth as much as with exponential intervals (variance μ²/12 against μ²): a rate
/// measured from ~100 samples is within ±6% instead of ±20% (two standard deviations).
/// Returns false when the thread had no interval yet: its first one starts now at a
/// uniform phase in [0, mean) and nothing is sampled.
pub fn py_next_interval(mean: u64) -> bool {
    with(|s| {
        let mut x = s.py_rng.get();
        let seeded = x != 0;
        if !seeded {
            // Any odd seed unique to the thread.
            x = (s as *const ThreadState as u64) | 1;
        }
        // xorshift64*
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.py_rng.set(x);
        let u = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
        let mean = mean.max(2) as f64;
        let interval = if seeded { mean * (0.5 + u) } else { mean * u };
        let left = if seeded { s.py_countdown.get().min(0) } else { 0 };
        s.py_countdown.set((interval as i64 + left).max(1));
        seeded
    })
}

/// Seeds this thread's sampling intervals (tests: a fixed sequence, not one that
/// depends on where the thread's state lies).
#[cfg(test)]
pub fn py_seed(seed: u64) {
    with(|s| {
        s.py_rng.set(0);
        s.py_countdown.set(0);
        s.py_rng.set(seed | 1);
    });
}

/// Whether this thread is inside a hooked CUDA call.
pub fn in_cuda_call() -> bool {
    with(|s| s.in_cuda.get())
}

/// Marks the calling thread as the library's own: none of its allocations are tracked,
/// and its small blocks come from the library's own heap.
pub fn mark_internal() {
    with(|s| {
        s.internal.set(true);
        s.own_heap.set(true);
    });
}

/// Whether the calling thread is one of the library's own (`mark_internal`). False on a
/// thread whose thread pointer is not the C library's (no state of ours to read there).
#[inline]
pub fn uses_own_heap() -> bool {
    crate::os::threads::tls_is_glibcs() && with(|s| s.own_heap.get())
}

/// Runs `f` with tracking off for this thread, restoring the previous mark afterwards.
pub fn untracked<R>(f: impl FnOnce() -> R) -> R {
    let was = with(|s| s.internal.replace(true));
    let r = f();
    with(|s| s.internal.set(was));
    r
}

/// Whether the calling thread is inside one of its hooks now (a signal handler that
/// interrupted one, say, and called `fork`).
pub fn in_hook() -> bool {
    with(|s| s.busy.get())
}

pub fn is_busy_or_internal() -> bool {
    with(|s| s.busy.get() || s.internal.get())
}

#[inline(always)]
pub fn tid() -> u32 {
    with(|s| {
        let t = s.tid.get();
        if t != 0 {
            return t;
        }
        // SAFETY: gettid has no preconditions and cannot fail.
        let t = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
        s.tid.set(t);
        t
    })
}

/// In a forked child the calling thread has a new kernel id and a new stack mapping
/// owner; cached values from the parent are dropped.
pub fn reset_after_fork() {
    with(|s| {
        s.tid.set(0);
        s.busy.set(false);
        s.in_cuda.set(false);
    });
}

extern "C" fn internal_thread_start(arg: *mut std::ffi::c_void) -> *mut std::ffi::c_void {
    // Marked before anything else runs on this thread, so even the thread-local setup
    // that std does on first use is untracked.
    mark_internal();
    // SAFETY: arg is the fn pointer passed by `spawn_internal_thread`.
    let f: fn() = unsafe { std::mem::transmute::<*mut std::ffi::c_void, fn()>(arg) };
    let _ = std::panic::catch_unwind(f);
    std::ptr::null_mut()
}

/// Starts one of the library's own threads (signals blocked, detached) with tracking off
/// from its first instruction.
pub fn spawn_internal(f: fn()) -> Result<(), i32> {
    // SAFETY: the start routine takes the fn pointer back, which lives forever.
    unsafe { crate::os::threads::spawn_raw(internal_thread_start, f as *mut std::ffi::c_void) }.map(drop)
}
