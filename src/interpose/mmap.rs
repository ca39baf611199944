//! The program's own anonymous memory: `mmap`, `munmap` and `mremap` of private
//! anonymous mappings made outside malloc become blocks of kind `mmap`, with their
//! stack, groups, growth and verdicts like heap blocks. malloc's own large blocks are
//! not seen twice: glibc maps them through its internal `__mmap`, which no preload
//! interposes. Not tracked: file and shared mappings (the accounting counts shared
//! memory apart), `PROT_NONE` reservations (address space without memory, as a JVM or
//! Go reserves its heap), what a hooked CUDA call maps (its allocation is tracked as
//! such), pymalloc's arenas (their objects are sampled), the library's
//! own mappings (raw system calls), and any mapping while the program's malloc is not
//! glibc's (see `ENABLED`). The system calls are made directly (as glibc's
//! wrappers make them), so no lookup of the next definition can recurse.
// C entry points: their contract is the C library's.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_int, c_long, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::agent;
use crate::hotpath::event::Api;
use crate::os::mapped::{self, Range};

/// Set when the malloc our hooks forward to is glibc's. Another allocator (jemalloc,
/// tcmalloc) maps its memory with `mmap` while it holds its own locks, and the stack
/// capture of a hook may allocate, through that same allocator: a deadlock (redis with
/// its jemalloc hung so). glibc's malloc maps through its internal `__mmap` instead.
static ENABLED: AtomicBool = AtomicBool::new(false);

/// Tracks mappings from now on, when `glibc_heap` (see `ENABLED`).
pub fn enable(glibc_heap: bool) {
    ENABLED.store(glibc_heap, Ordering::Relaxed);
}

/// Whether a mapping is the program's own anonymous memory.
fn tracked(prot: c_int, flags: c_int, fd: c_int) -> bool {
    ENABLED.load(Ordering::Relaxed)
        // What a CUDA call maps (page-locked host memory, the driver's bookkeeping) is
        // that call's allocation, tracked as such.
        && !crate::hotpath::thread::in_cuda_call() && flags & libc::MAP_ANONYMOUS != 0 && flags & libc::MAP_PRIVATE != 0 && fd == -1 && prot != libc::PROT_NONE
}

/// The result of a raw system call as the C wrapper gives it: `-1` and `errno` set on
/// failure.
fn syscall_result(rc: c_long) -> *mut c_void {
    rc as *mut c_void
}

/// A range is no longer mapped as it was: each tracked mapping it overlaps is freed,
/// and what stays of it published again under its stack. Also while the final report
/// is being written, as a free is (`agent::releases_recorded`): the mapping is in its
/// live set, and an unmapping left out was a leak the program had given back.
fn unmapped(start: u64, len: u64) {
    if !mapped::any() || !agent::releases_recorded() {
        return;
    }
    mapped::remove(
        start,
        len,
        |r| agent::record_unmapping(r.start),
        |r| {
            agent::record_mapping(r.start, r.len, Api::Mmap, Some(r.stack));
        },
    );
}

fn mapped_now(p: *mut c_void, len: usize, api: Api, stack: Option<u32>) {
    if p == libc::MAP_FAILED || !agent::active() {
        return;
    }
    if let Some(stack) = agent::record_mapping(p as u64, len as u64, api, stack) {
        if !mapped::add(Range { start: p as u64, len: len as u64, stack }) {
            // Untracked after all: take the block back out of the books.
            agent::record_unmapping(p as u64);
        }
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mmap(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: libc::off_t) -> *mut c_void {
    let ours = tracked(prot, flags, fd);
    if flags & libc::MAP_FIXED != 0 {
        // Whatever was mapped there is replaced.
        let _errno = super::ErrnoGuard::save();
        unmapped(addr as u64, len as u64);
    }
    // SAFETY: the caller's arguments, to the system call the C library makes.
    let p = syscall_result(unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) });
    if ours {
        let _errno = super::ErrnoGuard::save();
        mapped_now(p, len, Api::Mmap, None);
    }
    p
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mmap64(addr: *mut c_void, len: usize, prot: c_int, flags: c_int, fd: c_int, off: libc::off_t) -> *mut c_void {
    // SAFETY: the same function (off_t is 64 bits on x86-64).
    unsafe { mmap(addr, len, prot, flags, fd, off) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    {
        // Published before the call: the range cannot be mapped again first.
        let _errno = super::ErrnoGuard::save();
        unmapped(addr as u64, len as u64);
    }
    // SAFETY: the caller's arguments, to the system call.
    unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int }
}

/// `mremap(old, old_len, new_len, flags, ...)`: the fifth argument is read only with
/// `MREMAP_FIXED`; on x86-64 a variadic argument arrives where a fifth one would.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn mremap(old: *mut c_void, old_len: usize, new_len: usize, flags: c_int, new: *mut c_void) -> *mut c_void {
    // While the final report still takes releases too (`unmapped`): a tracked mapping
    // moved then and left in the books at its old address was a leak the program did
    // not have.
    let before = if mapped::any() && agent::releases_recorded() { mapped::find(old as u64) } else { None };
    if let Some(r) = before {
        let _errno = super::ErrnoGuard::save();
        unmapped(r.start, r.len);
    }
    // The fifth argument only where the flags say it was passed (what glibc's wrapper
    // does): otherwise the register holds whatever the caller left there, and a seccomp
    // filter that checks the arguments (a sandboxed renderer's) would see it.
    let new = if flags & (libc::MREMAP_FIXED | libc::MREMAP_DONTUNMAP) != 0 { new } else { std::ptr::null_mut() };
    // SAFETY: the caller's arguments, to the system call.
    let p = syscall_result(unsafe { libc::syscall(libc::SYS_mremap, old, old_len, new_len, flags, new) });
    if let Some(r) = before {
        let _errno = super::ErrnoGuard::save();
        if p == libc::MAP_FAILED {
            // Unchanged: as it was.
            mapped_now(old, r.len as usize, Api::Mmap, Some(r.stack));
        } else {
            // Moved or resized: the memory is still the one mapped at its stack.
            mapped_now(p, new_len, Api::Mremap, Some(r.stack));
        }
    }
    p
}
