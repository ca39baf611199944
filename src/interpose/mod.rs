//! The ABI boundary: every symbol this library exports to the program it is preloaded
//! into. This list is the single place that says what is interposed; a test checks it
//! against the symbols the built library really exports.
//!
//! | family    | file           | symbols |
//! |-----------|----------------|---------|
//! | malloc    | `malloc.rs`    | malloc, calloc, realloc, reallocarray, free, posix_memalign, aligned_alloc, memalign, valloc, pvalloc, malloc_usable_size (+ free_sized, free_aligned_sized where glibc has them) |
//! | lifecycle | `lifecycle.rs` | exit, quick_exit, _exit, _Exit, dlclose, unshare, setns, chroot (+ constructor/destructor, atfork, snapshot and SIGTERM handlers) |
//! | threads   | `threads.rs`   | pthread_create (notes each new thread's stack bounds before its routine runs) |
//! | signals   | `signals.rs`   | sigaction, signal, bsd_signal (a termination signal whose handler is ours stays ours when the program asks for its default; everything else passes through) |
//! | API       | `api.rs`       | leaktrace_active, leaktrace_mark, leaktrace_snapshot, leaktrace_snapshot_json, leaktrace_attach_listen, __lsan_do_leak_check, __lsan_do_recoverable_leak_check, __lsan_ignore_object, __lsan_disable, __lsan_enable, __lsan_register_root_region, __lsan_unregister_root_region (`include/leaktrace.h`) |
//! | resolver  | `resolve.rs`   | dlsym, dlvsym (hand out our malloc hooks for the C library's functions and CUDA wrappers; `RTLD_NEXT` passes straight through) |
//! | CUDA runtime | `cuda_runtime.rs` | `cuda_runtime::WRAPPED`: cudaMalloc, cudaFree, cudaMallocAsync, cudaFreeAsync, cudaMallocFromPoolAsync (+ `_ptsz`), cudaMallocManaged, cudaMallocPitch, cudaMalloc3D, cudaMallocHost, cudaHostAlloc, cudaFreeHost, cudaHostRegister, cudaHostUnregister, cudaDeviceReset, cudaGetDriverEntryPoint(ByVersion) (+ `_ptsz`) |
//! | CUDA driver | `cuda_driver.rs` | `cuda_driver::WRAPPED`: cuMemAlloc_v2, cuMemFree_v2, cuMemAllocPitch_v2, cuMemAllocManaged, cuMemAllocAsync, cuMemFreeAsync, cuMemAllocFromPoolAsync (+ `_ptsz`), cuMemAllocHost_v2, cuMemHostAlloc, cuMemFreeHost, cuMemHostRegister_v2, cuMemHostUnregister, cuMemCreate, cuMemRelease, cuMemAddressReserve, cuMemAddressFree, cuMemMap, cuMemUnmap, cuCtxDestroy_v2, cuDevicePrimaryCtxReset(_v2), cuGetProcAddress(_v2, _v2_ptsz) |
//!
//! A library loaded into a running process (`leaktrace attach`) binds the same hooks
//! by rewriting the loaded modules' GOT slots (`got.rs`) instead of by preloading.
//!
//! The CUDA families share `cuda.rs` (slots, the hook macro, the record-once rule).
//! Each hook forwards to the real function found with `dlsym(RTLD_NEXT)` (`real.rs`),
//! keeps its C semantics (return values, errno, NULL and zero sizes) and reports to the
//! agent only after the real call succeeded (allocations) or before it runs (frees).
pub mod api;
pub mod cuda;
pub mod cuda_driver;
pub mod cuda_runtime;
pub mod got;
pub mod lifecycle;
pub mod malloc;
pub mod mmap;
pub mod pyalloc;
pub mod pymalloc;
pub mod real;
pub mod resolve;
pub mod signals;
pub mod threads;

/// Every exported name: the list below, `dlsym`, `dlvsym`, and the CUDA families' tables.
pub fn exported() -> Vec<String> {
    let cuda = cuda_runtime::WRAPPED.iter().chain(cuda_driver::WRAPPED).map(|(n, _)| n.to_string_lossy().into_owned());
    EXPORTED.iter().map(|s| s.to_string()).chain(["dlsym".to_string(), "dlvsym".to_string()]).chain(cuda).collect()
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
    "mmap",
    "mmap64",
    "munmap",
    "mremap",
    "sigaction",
    "signal",
    "bsd_signal",
    "leaktrace_active",
    "leaktrace_mark",
    "leaktrace_snapshot",
    "leaktrace_snapshot_json",
    "leaktrace_attach_listen",
    "__lsan_do_leak_check",
    "__lsan_do_recoverable_leak_check",
    "__lsan_ignore_object",
    "__lsan_disable",
    "__lsan_enable",
    "__lsan_register_root_region",
    "__lsan_unregister_root_region",
];

/// Exported only when the build machine's glibc has them (C23, glibc >= 2.41).
pub const EXPORTED_IF_LIBC_HAS: &[&str] = &["free_sized", "free_aligned_sized"];

pub use crate::os::ErrnoGuard;
