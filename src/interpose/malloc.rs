//! The malloc family. Allocations are recorded after the real call succeeded; frees are
//! recorded before the real free runs (see `hotpath::ring` for why the order matters).
// The exported functions are C entry points: their safety contract is the C standard's
// for the function of the same name, not something a Rust doc section can add to.
#![allow(clippy::missing_safety_doc)]

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::real;
use crate::agent;
use crate::hotpath::event::Api;

const MIN_ALIGN: usize = 16;

/// Blocks up to this size are handed out zeroed (`fresh`).
const FRESH_LIMIT: usize = 64 << 10;

/// Clears `len` bytes at `p`, memory the allocator just handed out: a block the program
/// will write (the cache lines are its next ones) whose bytes until then are the words
/// of the memory's earlier owner. A word of those left in a part the program never
/// writes (an entry's padding, a code object's slack, a list's spare capacity) would be
/// read by the pointer scan as a reference: a dangling pointer into memory handed out
/// again since kept blocks "reachable" that were lost (the pytest fixture's ctypes block,
/// 2 runs in 100; valgrind, whose allocator hands out fresh memory, calls them lost).
/// What the program reads there is unspecified by C (glibc's `MALLOC_PERTURB_` fills
/// it too); calloc's blocks are zero already and large blocks come from fresh mappings
/// or are bulk data, which the limit leaves alone.
#[inline(always)]
fn fresh(p: *mut c_void, len: usize) {
    if len <= FRESH_LIMIT && !crate::hotpath::thread::is_busy_or_internal() {
        clear_handed_out(p, len);
    }
}

/// Clears `len` bytes at `p` while the scan is on (`fresh`; Python's small objects too,
/// `interpose::pyalloc`). `p` must be a block of at least `len` bytes that an
/// allocator just handed out and that is not yet returned to the program.
#[inline(always)]
pub(super) fn clear_handed_out(p: *mut c_void, len: usize) {
    if agent::scanning() {
        // SAFETY: the caller's contract above: the block is ours to write, `len` bytes.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, len) };
    }
}

#[inline(always)]
fn track_alloc(p: *mut c_void, size: usize, api: Api) {
    // The recording step keeps errno as the real call left it.
    if !p.is_null() && agent::active() {
        if api != Api::Calloc {
            fresh(p, size);
        }
        agent::record_alloc(p as usize, size, api);
    }
}

/// A hook's way through when there is nothing to record: not tracking (not started,
/// `LEAKTRACE_DISABLE`, `LEAKTRACE_STANDBY` until an attach, finished) for an
/// allocation; for a release, nor the final report taking late frees either
/// (`agent::releases_recorded`). The call goes straight to the real function (once it
/// is known) as a tail call, before any of the recording path's work: that path's
/// register saves, stack frame and checks cost the bash loop of `scripts/bench.sh`
/// 10–12% more CPU time than without the library in standby, where a bare forwarding
/// library costs 3%. The
/// recording path (`*_recorded`, out of line) checks again, as it always did: a hook
/// that starts just as tracking does records or not, as one racing the start did.
///
/// Every exported hook is `#[inline(never)]`: one this small is otherwise inlined into
/// the library's own callers of the C function (the standard library's `realpath`
/// buffer freed in `fs::canonicalize`), which then skip the dynamic binding that sends
/// them to the program's own `free` where it has one (rustc's jemalloc, Chromium's
/// PartitionAlloc) and hand its block to glibc's: an abort at start-up.
macro_rules! hand_on {
    (unless $recording:expr, $real:ident($($arg:expr),*)) => {
        if !$recording {
            if let Some(f) = real::known::$real() {
                // SAFETY: forwarding the caller's arguments to the real function.
                return unsafe { f($($arg),*) };
            }
        }
    };
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    hand_on!(unless agent::active(), malloc(size));
    // SAFETY: the caller's arguments, as `malloc` took them.
    unsafe { malloc_recorded(size) }
}

#[inline(never)]
unsafe fn malloc_recorded(size: usize) -> *mut c_void {
    let Some(f) = real::malloc() else { return real::arena_alloc(size, MIN_ALIGN) };
    // SAFETY: forwarding the caller's arguments to the real malloc.
    let p = unsafe { f(size) };
    track_alloc(p, size, Api::Malloc);
    p
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    hand_on!(unless agent::active(), calloc(n, size));
    // SAFETY: the caller's arguments, as `calloc` took them.
    unsafe { calloc_recorded(n, size) }
}

#[inline(never)]
unsafe fn calloc_recorded(n: usize, size: usize) -> *mut c_void {
    let Some(f) = real::calloc() else {
        return match n.checked_mul(size) {
            Some(total) => real::arena_alloc(total, MIN_ALIGN),
            None => std::ptr::null_mut(),
        };
    };
    // SAFETY: forwarding the caller's arguments to the real calloc.
    let p = unsafe { f(n, size) };
    track_alloc(p, n.wrapping_mul(size), Api::Calloc);
    p
}

#[inline(always)]
fn track_free(p: *mut c_void) {
    if agent::active() {
        agent::record_free(p as usize);
    } else {
        agent::record_late_free(p as u64, Api::Malloc);
    }
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() || real::arena_owns(p) {
        return;
    }
    hand_on!(unless agent::releases_recorded(), free(p));
    // SAFETY: p is a block of the real allocator (arena blocks were filtered above).
    unsafe { free_recorded(p) }
}

/// `free` of a block of the real allocator, with its release recorded.
#[inline(never)]
unsafe fn free_recorded(p: *mut c_void) {
    track_free(p);
    if let Some(f) = real::free() {
        // SAFETY: the caller's contract: p came from the real allocator.
        unsafe { f(p) };
    }
}

/// realloc and reallocarray share this: the old block leaves the live set before the
/// real call (another thread may get its address as soon as it is freed), and comes back
/// if the call fails.
#[inline(always)]
unsafe fn realloc_common(p: *mut c_void, size: usize, api: Api, call: impl FnOnce() -> *mut c_void) -> *mut c_void {
    if p.is_null() {
        let q = call();
        track_alloc(q, size, api);
        return q;
    }
    if real::arena_owns(p) {
        // A bootstrap block: move it to the real heap; the arena block is never reused.
        // SAFETY: malloc is our hook above; it records the new block.
        let q = unsafe { malloc(size) };
        if !q.is_null() {
            // SAFETY: both blocks are valid for the copied length.
            unsafe { std::ptr::copy_nonoverlapping(p as *const u8, q as *mut u8, size.min(real::arena_size(p))) };
        }
        return q;
    }
    let tracking = agent::active();
    // What the block holds of the program's: the rest of a grown block is cleared.
    let kept = match real::malloc_usable_size() {
        // SAFETY: `p` is a live block of the real allocator (arena blocks were moved above).
        Some(f) if tracking && agent::scanning() => unsafe { f(p) },
        _ => usize::MAX,
    };
    let released = if tracking {
        agent::record_realloc_release(p as usize)
    } else {
        // After tracking stopped (the final report is being written): `p` may be gone
        // inside the call — glibc moves a mapped block with `mremap` and may trim the
        // heap under a freed one — while the exit scan, which holds this thread wherever
        // it is, still has `p` live and would read unmapped memory (SIGSEGV in 7 of 1,000
        // runs of exit_free_race.c). So it is published first, as a release is while
        // tracking; if the block stays (grown in place, or the call failed), the scan
        // counts it reachable without reading it, as it reads no block made after the stop.
        agent::record_late_free(p as u64, Api::Malloc);
        None
    };
    let q = call();
    if !q.is_null() && size > kept {
        // SAFETY: the new block has `size` bytes; the first `kept` are the program's.
        fresh(unsafe { (q as *mut u8).add(kept) } as *mut c_void, size - kept);
    }
    // glibc's realloc(p, 0) frees p and returns NULL.
    let freed_without_new_block = q.is_null() && size == 0;
    if tracking {
        // Nothing released: the outcome is recorded as a program thread's, if at all.
        let who = released.unwrap_or(agent::Releaser::Program);
        agent::record_realloc_outcome(who, p as usize, q as usize, size, api, freed_without_new_block);
    }
    q
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // A bootstrap arena block moves to the real heap, recording or not.
    hand_on!(unless agent::releases_recorded() || real::arena_owns(p), realloc(p, size));
    // SAFETY: the caller's arguments, as `realloc` took them.
    unsafe { realloc_recorded(p, size) }
}

#[inline(never)]
unsafe fn realloc_recorded(p: *mut c_void, size: usize) -> *mut c_void {
    let Some(f) = real::realloc() else {
        return if p.is_null() { real::arena_alloc(size, MIN_ALIGN) } else { std::ptr::null_mut() };
    };
    // SAFETY: forwarding the caller's arguments to the real realloc.
    unsafe { realloc_common(p, size, Api::Realloc, || f(p, size)) }
}

/// glibc's reallocarray is realloc behind an overflow check, and it calls realloc
/// through the PLT — that is, our hook. Doing the check here and calling the real
/// realloc directly records the block once, as `reallocarray`.
#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        // SAFETY: errno slot of this thread.
        unsafe { *libc::__errno_location() = libc::ENOMEM };
        return std::ptr::null_mut();
    };
    hand_on!(unless agent::releases_recorded() || real::arena_owns(p), realloc(p, total));
    // SAFETY: the caller's block and the checked product.
    unsafe { reallocarray_recorded(p, total) }
}

#[inline(never)]
unsafe fn reallocarray_recorded(p: *mut c_void, total: usize) -> *mut c_void {
    let Some(f) = real::realloc() else {
        return if p.is_null() { real::arena_alloc(total, MIN_ALIGN) } else { std::ptr::null_mut() };
    };
    // SAFETY: forwarding to the real realloc with the checked product.
    unsafe { realloc_common(p, total, Api::Reallocarray, || f(p, total)) }
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    hand_on!(unless agent::active(), posix_memalign(out, align, size));
    // SAFETY: the caller's arguments, as `posix_memalign` took them.
    unsafe { posix_memalign_recorded(out, align, size) }
}

#[inline(never)]
unsafe fn posix_memalign_recorded(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    let Some(f) = real::posix_memalign() else { return libc::ENOMEM };
    // SAFETY: forwarding the caller's arguments to the real posix_memalign.
    let rc = unsafe { f(out, align, size) };
    if rc == 0 && !out.is_null() {
        // SAFETY: on success the real function stored the block in *out.
        track_alloc(unsafe { *out }, size, Api::PosixMemalign);
    }
    rc
}

macro_rules! aligned_hook {
    ($name:ident, $api:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        #[inline(never)]
        pub unsafe extern "C" fn $name(align: usize, size: usize) -> *mut c_void {
            hand_on!(unless agent::active(), $name(align, size));
            let Some(f) = real::$name() else {
                return if real::resolving() { real::arena_alloc(size, align) } else { std::ptr::null_mut() };
            };
            // SAFETY: forwarding the caller's arguments to the real function.
            let p = unsafe { f(align, size) };
            track_alloc(p, size, $api);
            p
        }
    };
}

aligned_hook!(aligned_alloc, Api::AlignedAlloc);
aligned_hook!(memalign, Api::Memalign);

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    hand_on!(unless agent::active(), valloc(size));
    let Some(f) = real::valloc() else { return std::ptr::null_mut() };
    // SAFETY: forwarding the caller's argument to the real valloc.
    let p = unsafe { f(size) };
    track_alloc(p, size, Api::Valloc);
    p
}

#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    hand_on!(unless agent::active(), pvalloc(size));
    let Some(f) = real::pvalloc() else { return std::ptr::null_mut() };
    // SAFETY: forwarding the caller's argument to the real pvalloc.
    let p = unsafe { f(size) };
    track_alloc(p, size, Api::Pvalloc);
    p
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    if p.is_null() {
        return 0;
    }
    if real::arena_owns(p) {
        return real::arena_size(p);
    }
    match real::malloc_usable_size() {
        // SAFETY: forwarding the caller's pointer to the real function.
        Some(f) => unsafe { f(p) },
        None => 0,
    }
}

#[cfg(has_free_sized)]
#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn free_sized(p: *mut c_void, size: usize) {
    if p.is_null() || real::arena_owns(p) {
        return;
    }
    hand_on!(unless agent::releases_recorded(), free_sized(p, size));
    track_free(p);
    if let Some(f) = real::free_sized() {
        // SAFETY: forwarding to the real free_sized.
        unsafe { f(p, size) };
    }
}

#[cfg(has_free_sized)]
#[cfg_attr(not(test), no_mangle)]
#[inline(never)]
pub unsafe extern "C" fn free_aligned_sized(p: *mut c_void, align: usize, size: usize) {
    if p.is_null() || real::arena_owns(p) {
        return;
    }
    hand_on!(unless agent::releases_recorded(), free_aligned_sized(p, align, size));
    track_free(p);
    if let Some(f) = real::free_aligned_sized() {
        // SAFETY: forwarding to the real free_aligned_sized.
        unsafe { f(p, align, size) };
    }
}

/// The names `hook_for` substitutes: the ten whose hook forwards to the same name
/// beneath us, in `hook_for`'s table order, then `reallocarray`.
const HOOKED: [&CStr; 11] = [
    c"malloc",
    c"calloc",
    c"realloc",
    c"free",
    c"posix_memalign",
    c"aligned_alloc",
    c"memalign",
    c"valloc",
    c"pvalloc",
    c"malloc_usable_size",
    c"reallocarray",
];

/// Our hook for the malloc-family function `name`, when `found` is the C library's own
/// definition of it (the function our hook forwards to). `dlsym` hands it out in its
/// place: `ctypes.CDLL("libc.so.6").malloc`, `find_library("c")`, cffi and a plugin that
/// looks `malloc` up on a libc handle by hand all get the C library's function, and
/// allocations made through it would never be seen. Another allocator's `malloc`
/// (jemalloc opened with `dlopen`, say) is a different function and is left alone.
pub fn hook_for(name: &[u8], found: usize) -> Option<usize> {
    macro_rules! hooks {
        ($($f:ident),*) => {
            [$((real::$f().map(|r| r as *const () as usize), $f as *const () as usize)),*]
        };
    }
    let k = HOOKED.iter().position(|n| n.to_bytes() == name)?;
    let table = hooks!(malloc, calloc, realloc, free, posix_memalign, aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size);
    // glibc's reallocarray is not what our hook forwards to (that is realloc): it is
    // recognised as the definition that follows this library.
    let (beneath, hook) = table.get(k).copied().unwrap_or_else(|| (super::resolve::next_definition(c"reallocarray"), reallocarray as *const () as usize));
    (beneath == Some(found)).then(|| own_hook(k).unwrap_or(hook))
}

/// Whether `name` is one that `hook_for` may substitute.
pub fn is_hooked_name(name: &[u8]) -> bool {
    HOOKED.iter().any(|n| n.to_bytes() == name)
}

/// The address of our own hook `HOOKED[k]`, read once from this library's symbol table.
/// `malloc as *const ()` is not it when another interposer comes before us: an exported
/// function's address is taken through the GOT, which holds the program's first
/// definition of the name — the other interposer's, which handed to that interposer
/// as "the next malloc" would call itself forever.
fn own_hook(k: usize) -> Option<usize> {
    static OWN: [AtomicUsize; HOOKED.len()] = [const { AtomicUsize::new(0) }; HOOKED.len()];
    static READ: AtomicBool = AtomicBool::new(false);
    if !READ.load(Ordering::Acquire) {
        let found = crate::os::elf::own_definitions(HOOKED, own_hook as *const () as usize);
        for (slot, addr) in OWN.iter().zip(found) {
            slot.store(addr, Ordering::Relaxed);
        }
        READ.store(true, Ordering::Release);
    }
    Some(OWN[k].load(Ordering::Relaxed)).filter(|&a| a != 0)
}

/// The library's own Rust allocations go straight to the real allocator: they are
/// never seen by the hooks, so they are never tracked and never recurse.
///
/// Large ones (`own_mapping`) are mappings of their own instead: the collector's group
/// tables and a report's snapshot reach tens of MB each and grow by doubling. In the
/// program's malloc they left ~100 MB of freed memory in its arenas after `import
/// torch`'s final report, which the memory summary then blamed on the program ("malloc
/// keeps 107 MiB of freed memory"); a mapping goes back to the system when freed.
pub struct RealAllocator;

/// Whether an allocation of `layout` is a mapping of its own: decided by the layout
/// alone, which `dealloc` and `realloc` are given again.
#[inline]
fn own_mapping(layout: Layout) -> bool {
    layout.size() >= crate::hotpath::mapping::OWN_MAPPING_MIN && layout.align() <= crate::hotpath::mapping::PAGE
}

/// A block of the library's own heap for `layout`, on the library's own threads (see
/// `os::own_heap`); `None` elsewhere, or where that heap has none to give.
#[inline]
fn own_heap_alloc(layout: Layout) -> Option<*mut u8> {
    if layout.align() > MIN_ALIGN || layout.size() > crate::os::own_heap::MAX_BLOCK || !crate::hotpath::thread::uses_own_heap() {
        return None;
    }
    crate::os::own_heap::alloc(layout.size())
}

// SAFETY: blocks come from the real malloc family (or the never-freed bootstrap arena)
// with at least the requested size and alignment, and are returned to the same family;
// large ones are page-aligned private mappings (`own_mapping`), returned with munmap;
// the library's own threads' small ones (alignment up to 16) come from its own heap,
// which any thread may hand back (`os::own_heap::owns` tells them apart).
unsafe impl GlobalAlloc for RealAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if own_mapping(layout) {
            return crate::hotpath::mapping::map_buffer(layout.size()).unwrap_or(std::ptr::null_mut());
        }
        if let Some(p) = own_heap_alloc(layout) {
            return p;
        }
        crate::os::own::heap_grew(layout.size());
        if layout.align() <= MIN_ALIGN {
            match real::malloc() {
                // SAFETY: plain allocation of layout.size() bytes.
                Some(f) => unsafe { f(layout.size()) as *mut u8 },
                None => real::arena_alloc(layout.size(), layout.align()) as *mut u8,
            }
        } else {
            let mut out = std::ptr::null_mut();
            match real::posix_memalign() {
                // SAFETY: align is a power of two >= 16 (Layout guarantees), multiple of
                // sizeof(void*).
                Some(f) if unsafe { f(&mut out, layout.align(), layout.size()) } == 0 => out as *mut u8,
                Some(_) => std::ptr::null_mut(),
                None => real::arena_alloc(layout.size(), layout.align()) as *mut u8,
            }
        }
    }

    /// Through calloc: a large zeroed buffer (the scan's block directory) then comes as
    /// fresh pages the kernel zeroes when first touched, instead of being written whole.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if own_mapping(layout) {
            // A fresh mapping is zero-filled.
            return crate::hotpath::mapping::map_buffer(layout.size()).unwrap_or(std::ptr::null_mut());
        }
        if let Some(p) = own_heap_alloc(layout) {
            // SAFETY: a fresh block of at least layout.size() bytes (a reused one may
            // hold an earlier block's bytes).
            unsafe { std::ptr::write_bytes(p, 0, layout.size()) };
            return p;
        }
        if layout.align() <= MIN_ALIGN {
            if let Some(f) = real::calloc() {
                crate::os::own::heap_grew(layout.size());
                // SAFETY: plain zeroed allocation of layout.size() bytes.
                return unsafe { f(1, layout.size()) as *mut u8 };
            }
        }
        // SAFETY: the default strategy: allocate, then zero the layout's bytes.
        unsafe {
            let p = self.alloc(layout);
            if !p.is_null() {
                std::ptr::write_bytes(p, 0, layout.size());
            }
            p
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if own_mapping(layout) {
            crate::hotpath::mapping::unmap_buffer(p, layout.size());
            return;
        }
        if crate::os::own_heap::owns(p) {
            crate::os::own_heap::free(p, crate::hotpath::thread::uses_own_heap());
            return;
        }
        crate::os::own::heap_shrank(layout.size());
        if real::arena_owns(p as *mut c_void) {
            return;
        }
        if let Some(f) = real::free() {
            // SAFETY: p came from the real allocator through `alloc`.
            unsafe { f(p as *mut c_void) };
        }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the alignment is the old layout's, valid; new_size is non-zero and,
        // rounded up to it, does not overflow (GlobalAlloc contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if own_mapping(layout) && own_mapping(new_layout) {
            // SAFETY: `p` is a buffer of `map_buffer(layout.size())` (`own_mapping`),
            // handed back to us by the GlobalAlloc contract.
            return unsafe { crate::hotpath::mapping::remap_buffer(p, layout.size(), new_size) }.unwrap_or(std::ptr::null_mut());
        }
        if own_mapping(layout) != own_mapping(new_layout) {
            // Between malloc and a mapping: allocate, copy, free (below).
        } else if crate::os::own_heap::owns(p) {
            if crate::os::own_heap::same_block(layout.size(), new_size) {
                return p;
            }
            // Another class: allocate, copy, free (below).
        } else if layout.align() <= MIN_ALIGN && !real::arena_owns(p as *mut c_void) {
            if let Some(f) = real::realloc() {
                // SAFETY: p came from the real malloc; new_size is non-zero (GlobalAlloc contract).
                let q = unsafe { f(p as *mut c_void, new_size) as *mut u8 };
                if !q.is_null() {
                    crate::os::own::heap_grew(new_size);
                    crate::os::own::heap_shrank(layout.size());
                }
                return q;
            }
        }
        // SAFETY: default strategy: allocate, copy, free.
        unsafe {
            let q = self.alloc(new_layout);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                self.dealloc(p, layout);
            }
            q
        }
    }
}
