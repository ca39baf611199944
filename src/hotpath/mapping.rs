//! Anonymous memory for the hot path's tables and rings: zero-filled, never touching
//! the allocator the library interposes.

/// Maps `bytes` of zeroed, private, read-write memory (reserved lazily: untouched pages
/// cost nothing). Returns `None` when the kernel refuses.
pub fn map_zeroed(bytes: usize) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping has no preconditions; failure is checked.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    (p != libc::MAP_FAILED).then_some(p as *mut u8)
}

/// Returns a mapping made by `map_zeroed` that was never shared.
pub fn unmap(p: *mut u8, bytes: usize) {
    // SAFETY: callers pass a mapping of exactly `bytes` that no one else references.
    unsafe { libc::munmap(p as *mut libc::c_void, bytes) };
}

/// Maps a file read-only (the symbolizer reads module files this way: a PyTorch library
/// is 450 MB, of which a lookup touches little).
pub fn map_file(path: &str) -> Option<memmap2::Mmap> {
    let file = std::fs::File::open(path).ok()?;
    // SAFETY: a read-only private mapping; module files are not rewritten in place while
    // loaded (the loader maps them too), and a truncated file gives SIGBUS in the loader
    // first.
    unsafe { memmap2::Mmap::map(&file) }.ok()
}
