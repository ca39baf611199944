//! The real allocator and the other functions we wrap, found as `dlsym(RTLD_NEXT)` would.
//!
//! `dlsym` itself may call `calloc`/`malloc` (for its error buffer) before we know where
//! the real ones are; those few early requests are served from a static bump arena.
//! Arena blocks are never freed (freeing one is a no-op) and are recognised by address.
use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub type MallocFn = unsafe extern "C" fn(usize) -> *mut c_void;
pub type CallocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub type ReallocFn = unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
pub type FreeFn = unsafe extern "C" fn(*mut c_void);
pub type FreeSizedFn = unsafe extern "C" fn(*mut c_void, usize);
pub type FreeAlignedSizedFn = unsafe extern "C" fn(*mut c_void, usize, usize);
pub type PosixMemalignFn = unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
pub type AlignedAllocFn = unsafe extern "C" fn(usize, usize) -> *mut c_void;
pub type UsableSizeFn = unsafe extern "C" fn(*mut c_void) -> usize;
pub type ExitFn = unsafe extern "C" fn(c_int) -> !;
pub type DlcloseFn = unsafe extern "C" fn(*mut c_void) -> c_int;
pub type UnshareFn = unsafe extern "C" fn(c_int) -> c_int;
pub type SetnsFn = unsafe extern "C" fn(c_int, c_int) -> c_int;
pub type ChrootFn = unsafe extern "C" fn(*const std::ffi::c_char) -> c_int;
pub type SigactionFn = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
pub type SignalFn = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;
pub type PthreadCreateFn =
    unsafe extern "C" fn(*mut libc::pthread_t, *const libc::pthread_attr_t, Option<extern "C" fn(*mut c_void) -> *mut c_void>, *mut c_void) -> c_int;

macro_rules! real_table {
    ($($field:ident : $ty:ty = $name:literal),* $(,)?) => {
        struct Table { $($field: AtomicUsize,)* }
        static TABLE: Table = Table { $($field: AtomicUsize::new(0),)* };

        /// One walk of the modules' own symbol tables for every name (`os::elf`: no
        /// lock, no allocation), `dlsym` only for a name it did not find (an IFUNC, a
        /// module without a GNU hash table, or a name no module defines): 23 `dlsym`
        /// calls were ~15 us of every process's start.
        fn resolve_all() {
            use crate::os::elf::Found;
            let found = crate::os::elf::next_definitions_found([$($name),*], resolve_all as *const () as usize);
            let mut found = found.iter();
            $(
                let p = match found.next() {
                    Some(&Found::At(p)) => p,
                    // A name this C library does not have (`free_sized` before glibc 2.39).
                    Some(&Found::Nowhere) => 0,
                    _ => lookup($name),
                };
                TABLE.$field.store(p, Ordering::Release);
            )*
        }

        $(
            #[inline(always)]
            pub fn $field() -> Option<$ty> {
                known::$field().or_else(|| {
                    ensure_resolved();
                    known::$field()
                })
            }
        )*

        /// The real functions already found, without finding them (`None` until then):
        /// for a hook's way through (`interpose::malloc`), whose caller takes the full
        /// path when it is `None`; the functions above find them first.
        pub mod known {
            use super::*;
            $(
                #[inline(always)]
                pub fn $field() -> Option<$ty> {
                    let p = TABLE.$field.load(Ordering::Acquire);
                    // SAFETY: p is the address dlsym (or the walk of the symbol tables)
                    // found for the symbol of this exact C prototype.
                    (p != 0).then(|| unsafe { std::mem::transmute::<usize, $ty>(p) })
                }
            )*
        }
    };
}

real_table! {
    malloc: MallocFn = c"malloc",
    calloc: CallocFn = c"calloc",
    realloc: ReallocFn = c"realloc",
    free: FreeFn = c"free",
    free_sized: FreeSizedFn = c"free_sized",
    free_aligned_sized: FreeAlignedSizedFn = c"free_aligned_sized",
    posix_memalign: PosixMemalignFn = c"posix_memalign",
    aligned_alloc: AlignedAllocFn = c"aligned_alloc",
    memalign: AlignedAllocFn = c"memalign",
    valloc: MallocFn = c"valloc",
    pvalloc: MallocFn = c"pvalloc",
    malloc_usable_size: UsableSizeFn = c"malloc_usable_size",
    exit: ExitFn = c"exit",
    quick_exit: ExitFn = c"quick_exit",
    exit_now: ExitFn = c"_exit",
    exit_now_c99: ExitFn = c"_Exit",
    dlclose: DlcloseFn = c"dlclose",
    unshare: UnshareFn = c"unshare",
    setns: SetnsFn = c"setns",
    chroot: ChrootFn = c"chroot",
    pthread_create: PthreadCreateFn = c"pthread_create",
    sigaction: SigactionFn = c"sigaction",
    signal: SignalFn = c"signal",
}

/// Puts `f` where our `malloc` hook finds the real malloc, and returns what was there
/// (0: not resolved). For the start-up check that the program's calls reach us.
pub fn swap_malloc(f: usize) -> usize {
    ensure_resolved();
    TABLE.malloc.swap(f, Ordering::AcqRel)
}

/// Runs `f` with this library's `calloc` serving from the bootstrap arena instead of
/// the C library's. For a signal handler that starts the collector thread: the one
/// allocation `pthread_create` makes (the new thread's TLS vector, `calloc`ed by the
/// dynamic loader) must not wait for a lock of malloc's that the interrupted code may
/// hold. Only where the process has one thread (no other caller sees the swap); the
/// block is never freed back to the C library (`free` and `realloc` know the arena's).
pub fn with_calloc_from_arena<R>(f: impl FnOnce() -> R) -> R {
    let real = TABLE.calloc.swap(0, Ordering::AcqRel);
    let r = f();
    if real != 0 {
        TABLE.calloc.store(real, Ordering::Release);
    }
    r
}

fn lookup(name: &CStr) -> usize {
    // SAFETY: RTLD_NEXT with a NUL-terminated name; returns NULL when absent.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize }
}

static RESOLVING: AtomicBool = AtomicBool::new(false);
static RESOLVED: AtomicBool = AtomicBool::new(false);

/// True while `dlsym` runs for us: allocation requests then go to the arena.
pub fn resolving() -> bool {
    RESOLVING.load(Ordering::Acquire)
}

#[cold]
pub fn ensure_resolved() {
    if RESOLVED.load(Ordering::Acquire) {
        return;
    }
    if RESOLVING.swap(true, Ordering::AcqRel) {
        // Another resolution is in flight (ours, recursively, or — before main, when
        // there is only one thread — never another thread's for long).
        return;
    }
    resolve_all();
    crate::os::threads::know_create(TABLE.pthread_create.load(Ordering::Acquire));
    RESOLVED.store(true, Ordering::Release);
    RESOLVING.store(false, Ordering::Release);
}

// ---- bootstrap arena -----------------------------------------------------------------

const ARENA_SIZE: usize = 256 * 1024;

#[repr(C, align(64))]
struct Arena([u8; ARENA_SIZE]);

static mut ARENA: Arena = Arena([0; ARENA_SIZE]);
static ARENA_USED: AtomicUsize = AtomicUsize::new(0);
const HEADER: usize = 16;

fn arena_base() -> usize {
    // Only the address is taken; no reference to the mutable static is formed.
    std::ptr::addr_of_mut!(ARENA) as usize
}

/// Serves an allocation before the real allocator is known. Zeroed (static memory never
/// handed out twice). Returns NULL when the arena is exhausted.
pub fn arena_alloc(size: usize, align: usize) -> *mut c_void {
    let align = align.max(16);
    let mut cur = ARENA_USED.load(Ordering::Relaxed);
    loop {
        let start = (arena_base() + cur + HEADER + align - 1) & !(align - 1);
        let end = match start.checked_add(size) {
            Some(e) => e,
            None => return std::ptr::null_mut(),
        };
        if end > arena_base() + ARENA_SIZE {
            return std::ptr::null_mut();
        }
        let new_used = end - arena_base();
        match ARENA_USED.compare_exchange(cur, new_used, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => {
                // SAFETY: [start - 8, end) is inside the arena and ours alone.
                unsafe { ((start - 8) as *mut usize).write(size) };
                return start as *mut c_void;
            }
            Err(actual) => cur = actual,
        }
    }
}

pub fn arena_owns(p: *mut c_void) -> bool {
    let a = p as usize;
    a >= arena_base() && a < arena_base() + ARENA_SIZE
}

/// The requested size of an arena block.
pub fn arena_size(p: *mut c_void) -> usize {
    // SAFETY: p came from arena_alloc, which stored the size just below it.
    unsafe { ((p as usize - 8) as *const usize).read() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_blocks_are_aligned_sized_and_owned() {
        let a = arena_alloc(24, 16);
        let b = arena_alloc(100, 64);
        assert!(!a.is_null() && !b.is_null());
        assert_eq!(b as usize % 64, 0);
        assert!(arena_owns(a) && arena_owns(b));
        assert_eq!(arena_size(a), 24);
        assert_eq!(arena_size(b), 100);
        assert!(arena_alloc(usize::MAX - 8, 16).is_null());
        let x = 0u64;
        assert!(!arena_owns(&x as *const u64 as *mut c_void));
    }

    /// The walk of the symbol tables finds what `dlsym(RTLD_NEXT)` finds, and a name no
    /// module defines stays unresolved.
    #[test]
    fn the_table_holds_what_dlsym_finds() {
        ensure_resolved();
        let pairs = [
            (malloc().map(|f| f as usize), c"malloc"),
            (free().map(|f| f as usize), c"free"),
            (posix_memalign().map(|f| f as usize), c"posix_memalign"),
            (exit().map(|f| f as usize), c"exit"),
            (pthread_create().map(|f| f as usize), c"pthread_create"),
            (sigaction().map(|f| f as usize), c"sigaction"),
        ];
        for (found, name) in pairs {
            assert_eq!(found, Some(lookup(name)), "{name:?}");
        }
        let [absent] = crate::os::elf::next_definitions([c"leaktrace_no_such_function"], resolve_all as *const () as usize);
        assert_eq!(absent, 0);
    }

    /// A hook's way through (`known`) hands on to the same functions as the full path,
    /// once they are found.
    #[test]
    fn the_known_functions_are_the_table_s_own() {
        ensure_resolved();
        assert_eq!(known::malloc().map(|f| f as usize), malloc().map(|f| f as usize));
        assert_eq!(known::free().map(|f| f as usize), free().map(|f| f as usize));
        assert_eq!(known::realloc().map(|f| f as usize), realloc().map(|f| f as usize));
        assert_eq!(known::calloc().map(|f| f as usize), Some(lookup(c"calloc")));
        assert!(known::malloc().is_some());
    }
}
