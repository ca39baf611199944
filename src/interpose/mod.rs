//! The ABI boundary: every symbol this library exports to the program it is preloaded
//! into. This list is the single place that says what is interposed; a test checks it
//! against the symbols the built library really exports.
//!
//! | family    | file           | symbols |
//! |-----------|----------------|---------|
//! | malloc    | `malloc.rs`    | malloc, calloc, realloc, reallocarray, free, posix_memalign, aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size (+ free_sized, free_aligned_sized where glibc has them) |
//! | lifecycle | `lifecycle.rs` | exit, quick_exit, _exit, _Exit, dlclose, unshare, setns, chroot (+ constructor/destructor, atfork, snapshot and SIGTERM handlers) |
//! | threads   | `threads.rs`   | pthread_create (notes each new thread's stack bounds before its routine runs) |
//! | resolver  | `resolve.rs`   | dlsym (hands out CUDA wrappers; `RTLD_NEXT` passes straight through) |
//! | CUDA runtime | `cuda_runtime.rs` | `cuda_runtime::WRAPPED`: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync, cudaMallocFromPoolAsync (+ `_ptsz`), cudaMallocManaged, cudaMallocPitch, cudaMalloc3D, cudaMallocHost, cudaHostAlloc, cudaFreeHost, cudaHostRegister, cudaHostUnregister, cudaDeviceReset, cudaGetDriverEntryPoint(ByVersion) (+ `_ptsz`) |
//! | CUDA driver | `cuda_driver.rs` | `cuda_driver::WRAPPED`: cuMemAlloc_v2, cuMemFree_v2, cuMemAllocPitch_v2, cuMemAllocManaged, cuMemAllocAsync, cuMemFreeAsync, cuMemAllocFromPoolAsync (+ `_ptsz`), cuMemAllocHost_v2, cuMemHostAlloc, cuMemFreeHost, cuMemHostRegister_v2, cuMemHostUnregister, cuMemCreate, cuMemRelease, cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap, cuCtxDestroy_v2, cuDevicePrimaryCtxReset(_v2), cuGetProcAddress(_v2, _v2_ptsz) |
//!
//! The CUDA families share `cuda.rs` (slots, the hook macro, the record-once rule).
//! Each hook forwards to the real function found with `dlsym(RTLD_NEXT)` (`real.rs`),
//! keeps its C semantics (return values, errno, NULL and zero sizes) and reports to the
//! agent only after the real call succeeded (allocations) or before it runs (frees).
pub mod cuda;
pub mod cuda_driver;
pub mod cuda_runtime;
pub mod lifecycle;
pub mod malloc;
pub mod real;
pub mod resolve;
pub mod threads;

/// Our own walks of the loader's module list (`dl_iterate_phdr`). glibc holds the
/// loader's write lock while it calls back, and a fork at that moment leaves the lock
/// held in the child for good (glibc does not reset it), so the child's next walk — the
/// scan of its final report — never returns. The fork `prepare` handler takes this
/// lock first: no walk of ours is under way across a fork.
static LOADER_WALKS: crate::collector::lock::SpinLock<()> = crate::collector::lock::SpinLock::new(());

/// A `dl_iterate_phdr` callback.
pub type ModuleVisitor = unsafe extern "C" fn(*mut libc::dl_phdr_info, usize, *mut std::ffi::c_void) -> std::ffi::c_int;

/// `dl_iterate_phdr`, never across a fork.
///
/// # Safety
/// As `dl_iterate_phdr`: `callback` must treat `data` as what the caller passes.
pub unsafe fn iterate_modules(callback: Option<ModuleVisitor>, data: *mut std::ffi::c_void) -> std::ffi::c_int {
    let _walk = LOADER_WALKS.lock();
    // SAFETY: forwarded under the caller's contract.
    unsafe { libc::dl_iterate_phdr(callback, data) }
}

/// Fork `prepare`: waits for our walks of the module list to end and holds off new ones.
pub fn fork_hold_loader_walks() {
    LOADER_WALKS.lock_raw();
}

/// Fork `parent` / `child`: walks may start again.
pub fn fork_release_loader_walks() {
    LOADER_WALKS.unlock_raw();
}

/// Every exported name: the list below, `dlsym`, and the CUDA families' tables.
pub fn exported() -> Vec<String> {
    let cuda = cuda_runtime::WRAPPED.iter().chain(cuda_driver::WRAPPED).map(|(n, _)| n.to_string_lossy().into_owned());
    EXPORTED.iter().map(|s| s.to_string()).chain(["dlsym".to_string()]).chain(cuda).collect()
}

/// Exported symbol names of the malloc and lifecycle families.
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
    "exit",
    "quick_exit",
    "_exit",
    "_Exit",
    "dlclose",
    "unshare",
    "setns",
    "chroot",
    "pthread_create",
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
