//! Operating-system utilities that belong to no stage: the calling thread's stack, the
//! library's own threads (started with every signal blocked), signal dispositions, the
//! loader's module list and the modules' own symbol tables, a spin lock, and the files
//! the program may move under us (standard error, `/proc` and the report directory
//! across `chroot`), the program's unwind tables' pages, a file for an arena's written head,
//! copies of the process's own memory that never fault, and the constructor's arguments. Nothing here imports from the stages.
pub mod anchor;
pub mod elf;
pub mod environ;
pub mod fds;
pub mod image;
pub mod loader;
pub mod lock;
pub mod mapped;
pub mod own;
pub mod own_heap;
pub mod pagemap;
pub mod procfs;
pub mod signals;
pub mod spill;
pub mod stack;
pub mod startup;
pub mod threads;
pub mod unwind_tables;

/// Types that any bytes are a valid value of: what `copy_own` may write into.
pub trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u64 {}

/// Copies `buf` from this process's own memory at `from` with `process_vm_readv`, which
/// fails, or stops at the first page that is not mapped, instead of faulting: memory the
/// program may unmap or free meanwhile. Returns how many bytes came, from the start. Not
/// under a seccomp filter, which may answer the call with SIGSYS
/// (`procfs::unfiltered_now`).
pub fn copy_own<T: Plain>(from: u64, buf: &mut [T]) -> usize {
    let len = std::mem::size_of_val(buf);
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut std::ffi::c_void, iov_len: len };
    let remote = libc::iovec { iov_base: from as *mut std::ffi::c_void, iov_len: len };
    // SAFETY: writes at most `len` bytes, `buf`'s own, of a type any bytes are a value of
    // (`Plain`); the kernel checks the remote range and fails rather than faulting.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n.max(0) as usize
}

/// The whole of `fd` from offset 0, a page at a time (`pread`: a descriptor held and
/// read again, as `/proc/self/status`, needs no seek). A `/proc` file has no size to ask
/// for, and the standard library's probing reads (32 bytes, then doubling) took nine
/// calls for a small process's maps; every short process reads some at its start and
/// its exit.
pub fn read_whole(fd: i32) -> std::io::Result<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    loop {
        if out.capacity() - out.len() < 1024 {
            out.reserve(out.capacity());
        }
        let spare = out.spare_capacity_mut();
        // SAFETY: reads at most `spare.len()` bytes into the vector's spare capacity.
        let n = unsafe { libc::pread(fd, spare.as_mut_ptr() as *mut libc::c_void, spare.len(), out.len() as libc::off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(out);
        }
        // SAFETY: the kernel wrote `n` bytes there.
        unsafe { out.set_len(out.len() + n as usize) };
    }
}

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
