//! Operating-system utilities that belong to no stage: the calling thread's stack, the
//! library's own threads (started with every signal blocked), signal dispositions, the
//! loader's module list and the modules' own symbol tables, a spin lock, and the files
//! the program may move under us (standard error, `/proc` and the report directory
//! across `chroot`), the program's unwind tables' pages, a file for an arena's written head. Nothing here imports from the stages.
pub mod anchor;
pub mod elf;
pub mod environ;
pub mod fds;
pub mod image;
pub mod loader;
pub mod lock;
pub mod mapped;
pub mod own;
pub mod pagemap;
pub mod procfs;
pub mod signals;
pub mod spill;
pub mod stack;
pub mod threads;
pub mod unwind_tables;

/// Saves errno and puts it back when dropped: the program sees exactly what it (or the
/// real function a hook forwarded to) left there, whatever our bookkeeping did to it.
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

/// This thread's errno now.
pub fn errno() -> i32 {
    // SAFETY: __errno_location always returns this thread's valid errno slot.
    unsafe { *libc::__errno_location() }
}
