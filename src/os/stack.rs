//! The calling thread's stack bounds, for the unwinder's bounds checks.
//!
//! `pthread_getattr_np` takes the thread's own lock and then allocates (a `realloc` for
//! the affinity mask; `fopen` of `/proc/self/maps` on the main thread). A thread whose
//! first allocation is inside that call (the JVM, Rust's `std::thread`, Ruby threads ask
//! for their own bounds first thing) would re-enter it from the hook and wait on itself.
//! So the bounds of the threads the program starts are taken at thread start, before its
//! start routine runs (`interpose::threads`), and the main thread's come from the loader's
//! `__libc_stack_end` and the stack limit, with no lock at all. `pthread_getattr_np`
//! from a hook is left only for threads started by other means (glibc's own helpers).
use std::sync::atomic::{AtomicUsize, Ordering};

static MAIN_THREAD: AtomicUsize = AtomicUsize::new(0);
static MAIN_STACK_END: AtomicUsize = AtomicUsize::new(0);

/// A main thread's stack deeper than this below its entry is not followed (an unlimited
/// stack limit gives no bound of its own; the next mapping is at least 128 MiB away).
const MAIN_STACK_MAX: usize = 128 << 20;

/// Records the loader's `__libc_stack_end` and, when the caller is the main thread
/// (the library constructor runs there unless the library is `dlopen`ed by another
/// thread), that thread. Otherwise the main thread's bounds are queried like others'.
pub fn note_main_thread() {
    // SAFETY: getpid and gettid have no preconditions.
    if unsafe { libc::syscall(libc::SYS_gettid) } as i64 == unsafe { libc::getpid() } as i64 {
        // SAFETY: pthread_self has no preconditions.
        MAIN_THREAD.store(unsafe { libc::pthread_self() } as usize, Ordering::Relaxed);
    }
    let [sym] = crate::os::loader::library_symbols([c"__libc_stack_end"]);
    if let Some(sym) = sym {
        // SAFETY: the loader's `void *__libc_stack_end`, set before any constructor runs.
        let end = unsafe { *(sym as *const usize) };
        MAIN_STACK_END.store(end, Ordering::Relaxed);
    }
}

/// Whether the calling thread is the process's main thread (a forked child's only
/// thread is the main thread only if the parent's main thread forked).
pub fn is_main_thread() -> bool {
    let main = MAIN_THREAD.load(Ordering::Relaxed);
    // SAFETY: pthread_self has no preconditions and takes no lock.
    main != 0 && unsafe { libc::pthread_self() } as usize == main
}

/// The main thread's stack, `[lo, hi)`: from the top of the page holding the entry
/// stack pointer down by the stack limit. No lock, no allocation.
pub fn main_thread_stack() -> Option<(usize, usize)> {
    let end = MAIN_STACK_END.load(Ordering::Relaxed);
    if end == 0 {
        return None;
    }
    // The page holding `end` is mapped to its last byte: mappings are whole pages.
    let hi = (end | 4095) + 1;
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct; it is a plain system call.
    let limit = if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut lim) } == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
        (lim.rlim_cur as usize).min(MAIN_STACK_MAX)
    } else {
        MAIN_STACK_MAX
    };
    Some((hi.saturating_sub(limit), hi))
}

/// The calling thread's stack, `[lo, hi)`, from `pthread_getattr_np`. Must not be called
/// from a hook that may run inside the program's own `pthread_getattr_np` (see above):
/// allocations it makes must be untracked by the caller.
pub fn queried_thread_stack() -> Option<(usize, usize)> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    // SAFETY: standard pthread attribute query of the calling thread; attr is destroyed.
    unsafe {
        if libc::pthread_getattr_np(libc::pthread_self(), attr.as_mut_ptr()) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: usize = 0;
        let rc = libc::pthread_attr_getstack(attr.as_ptr(), &mut addr, &mut size);
        libc::pthread_attr_destroy(attr.as_mut_ptr());
        if rc != 0 || size == 0 {
            return None;
        }
        Some((addr as usize, addr as usize + size))
    }
}

/// The calling thread's stack by the cheapest safe route: the main thread's without a
/// lock, any other thread's by query.
pub fn current_thread_stack() -> Option<(usize, usize)> {
    if is_main_thread() {
        if let Some(b) = main_thread_stack() {
            return Some(b);
        }
    }
    queried_thread_stack()
}

/// The readable and writable mapping holding `addr`, `[start, end)`, from
/// `/proc/self/maps`, read with a buffer on the stack: no allocation, no lock (it runs
/// inside a hook, for a thread found running on a stack of its own making:
/// `swapcontext` coroutines, a signal's alternate stack).
pub fn writable_mapping_of(addr: usize) -> Option<(usize, usize)> {
    let fd = super::anchor::open_maps_no_alloc();
    if fd < 0 {
        return None;
    }
    let mut buf = [0u8; 4096];
    let mut line = [0u8; 256];
    let mut len = 0usize;
    let mut found = None;
    'read: loop {
        // SAFETY: reading into a buffer of the given length from our descriptor.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n <= 0 {
            break;
        }
        for &c in &buf[..n as usize] {
            if c != b'\n' {
                if len < line.len() {
                    line[len] = c;
                    len += 1;
                }
                continue;
            }
            if let Some((start, end, rw)) = parse_maps_line(&line[..len]) {
                if start <= addr && addr < end {
                    found = rw.then_some((start, end));
                    break 'read;
                }
            }
            len = 0;
        }
    }
    // SAFETY: closing our descriptor.
    unsafe { libc::close(fd) };
    found
}

/// `start-end perms ...` of one maps line: the range, and whether it is readable and
/// writable.
fn parse_maps_line(l: &[u8]) -> Option<(usize, usize, bool)> {
    fn hex(s: &[u8]) -> Option<usize> {
        let mut v = 0usize;
        for &c in s {
            let d = (c as char).to_digit(16)? as usize;
            v = v.checked_mul(16)?.checked_add(d)?;
        }
        (!s.is_empty()).then_some(v)
    }
    let dash = l.iter().position(|&c| c == b'-')?;
    let space = l.iter().position(|&c| c == b' ')?;
    let start = hex(&l[..dash])?;
    let end = hex(l.get(dash + 1..space)?)?;
    let perms = l.get(space + 1..space + 3)?;
    Some((start, end, perms == b"rw"))
}

/// The stacks of the threads the program started (noted at their start) and the main
/// thread's, for the memory accounting (`resident_stacks`): kernel id, low and high end;
/// a slot whose thread is gone is freed when the stacks are next measured.
const STACK_SLOTS: usize = 4096;
static STACK_TIDS: [AtomicUsize; STACK_SLOTS] = [const { AtomicUsize::new(0) }; STACK_SLOTS];
static STACK_LO: [AtomicUsize; STACK_SLOTS] = [const { AtomicUsize::new(0) }; STACK_SLOTS];
static STACK_HI: [AtomicUsize; STACK_SLOTS] = [const { AtomicUsize::new(0) }; STACK_SLOTS];
/// Slots at and past this were never used: the measure reads only the ones before (a
/// process with one thread read 32 KiB of never-touched zero pages at its exit report,
/// 8 page faults of its start-up cost, issue 55).
static STACK_USED: AtomicUsize = AtomicUsize::new(0);

/// Lists the calling thread's stack `[lo, hi)`.
pub fn list_stack(tid: u32, lo: usize, hi: usize) {
    for i in 0..STACK_SLOTS {
        if STACK_TIDS[i].load(Ordering::Relaxed) == 0 && STACK_TIDS[i].compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            STACK_LO[i].store(lo, Ordering::Relaxed);
            STACK_HI[i].store(hi, Ordering::Relaxed);
            STACK_TIDS[i].store(tid as usize, Ordering::Release);
            STACK_USED.fetch_max(i + 1, Ordering::AcqRel);
            return;
        }
    }
}

/// The resident bytes of the listed threads' stacks (the main thread's is not listed:
/// `/proc/self/status` has it as `VmStk`); threads that are gone are unlisted.
pub fn resident_stacks() -> u64 {
    let mut total = 0;
    for i in 0..STACK_USED.load(Ordering::Acquire).min(STACK_SLOTS) {
        let tid = STACK_TIDS[i].load(Ordering::Acquire);
        if tid == 0 || tid == usize::MAX {
            continue;
        }
        if super::threads::thread_is_gone(tid as u32) {
            let _ = STACK_TIDS[i].compare_exchange(tid, 0, Ordering::AcqRel, Ordering::Relaxed);
            continue;
        }
        let (lo, hi) = (STACK_LO[i].load(Ordering::Relaxed), STACK_HI[i].load(Ordering::Relaxed));
        total += super::own::resident(lo, hi.saturating_sub(lo));
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_stack_holds_the_callers_frame_and_only_the_main_thread_is_main() {
        // The test harness runs tests on spawned threads, never on the main thread.
        note_main_thread();
        let local = 0u64;
        let here = &local as *const u64 as usize;
        let (lo, hi) = current_thread_stack().expect("query");
        assert!(lo <= here && here < hi);
        assert!(!is_main_thread());
    }

    #[test]
    fn the_mapping_of_a_heap_block_is_found_and_holds_it() {
        let v = vec![7u8; 256 << 10];
        let a = v.as_ptr() as usize;
        let (lo, hi) = writable_mapping_of(a).expect("a heap block lies in a writable mapping");
        assert!(lo <= a && a + v.len() <= hi);
        assert_eq!(writable_mapping_of(the_mapping_of_a_heap_block_is_found_and_holds_it as *const () as usize), None, "code is not writable");
        assert_eq!(parse_maps_line(b"7f00-7f10 rw-p 00000000 00:00 0"), Some((0x7f00, 0x7f10, true)));
        assert_eq!(parse_maps_line(b"7f00-7f10 r-xp 00000000 00:00 0 /lib/x.so"), Some((0x7f00, 0x7f10, false)));
        assert_eq!(parse_maps_line(b"garbage"), None);
    }

    #[test]
    fn main_stack_bounds_are_page_aligned_and_limited() {
        note_main_thread();
        if let Some((lo, hi)) = main_thread_stack() {
            assert_eq!(hi % 4096, 0);
            assert!(hi - lo <= MAIN_STACK_MAX);
            assert!(hi > lo);
        }
    }
}
