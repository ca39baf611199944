//! The ABI boundary: every symbol this library exports to the program it is preloaded
//! into. This list is the single place that says what is interposed; a test checks it
//! against the symbols the built library really exports.
//!
//! | family    | file           | symbols |
//! |-----------|----------------|---------|
//! | malloc    | `malloc.rs`    | malloc, calloc, realloc, reallocarray, free, posix_memalign, aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size (+ free_sized, free_aligned_sized where glibc has them) |
//! | lifecycle | `lifecycle.rs` | _exit, _Exit, dlclose, unshare, setns (+ constructor/destructor, atfork, snapshot and SIGTERM handlers) |
//!
//! Each hook forwards to the real function found with `dlsym(RTLD_NEXT)` (`real.rs`),
//! keeps its C semantics (return values, errno, NULL and zero sizes) and reports to the
//! agent only after the real call succeeded (allocations) or before it runs (frees).
pub mod lifecycle;
pub mod malloc;
pub mod real;

/// Exported symbol names, checked against the built library by `tests/exports.rs`.
pub const EXPORTED: &[&str] = &[
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "malloc_usable_size",
    "_exit",
    "_Exit",
    "dlclose",
    "unshare",
    "setns",
];

/// Exported only when the build machine's glibc has them (C23, glibc >= 2.41).
pub const EXPORTED_IF_LIBC_HAS: &[&str] = &["free_sized", "free_aligned_sized"];

/// Saves errno across the bookkeeping of a hook so the program sees exactly what the
/// real function left there.
pub struct ErrnoGuard(i32);

impl ErrnoGuard {
    #[inline(always)]
    pub fn save() -> ErrnoGuard {
        // SAFETY: __errno_location always returns this thread's valid errno slot.
        ErrnoGuard(unsafe { *libc::__errno_location() })
    }
}

impl Drop for ErrnoGuard {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = self.0 };
    }
}
