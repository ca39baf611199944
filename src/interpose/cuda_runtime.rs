//! The CUDA runtime API (libcudart): allocation, release, reset and the runtime's
//! driver entry-point resolvers. Recorded here, a runtime call is one event with the
//! runtime's name and the program's stack; the driver calls it makes underneath are
//! not recorded again (`cuda::allocation` and friends).
// C entry points: their contract is the CUDA runtime's.
#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use super::cuda::{self, allocation, passthrough, registration, release, ERROR_UNKNOWN};
use super::resolve::substitute_out;
use crate::cuda_hook;
use crate::hotpath::event::{Api, Space};

type Stream = *mut c_void;
type Pool = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Extent {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
}

#[repr(C)]
pub struct PitchedPtr {
    pub ptr: *mut c_void,
    pub pitch: usize,
    pub xsize: usize,
    pub ysize: usize,
}

cuda_hook!(cudaMalloc(ptr: *mut *mut c_void, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMalloc, ptr as *const u64, || real(ptr, size), || size as u64));

cuda_hook!(cudaFree(ptr: *mut c_void) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr as u64, || real(ptr)));

cuda_hook!(cudaMallocAsync(ptr: *mut *mut c_void, size: usize, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocAsync, ptr as *const u64, || real(ptr, size, stream), || size as u64));

cuda_hook!(cudaMallocAsync_ptsz(ptr: *mut *mut c_void, size: usize, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocAsync, ptr as *const u64, || real(ptr, size, stream), || size as u64));

cuda_hook!(cudaFreeAsync(ptr: *mut c_void, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr as u64, || real(ptr, stream)));

cuda_hook!(cudaFreeAsync_ptsz(ptr: *mut c_void, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr as u64, || real(ptr, stream)));

cuda_hook!(cudaMallocFromPoolAsync(ptr: *mut *mut c_void, size: usize, pool: Pool, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocFromPoolAsync, ptr as *const u64, || real(ptr, size, pool, stream), || size as u64));

cuda_hook!(cudaMallocFromPoolAsync_ptsz(ptr: *mut *mut c_void, size: usize, pool: Pool, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocFromPoolAsync, ptr as *const u64, || real(ptr, size, pool, stream), || size as u64));

cuda_hook!(cudaMallocManaged(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocManaged, ptr as *const u64, || real(ptr, size, flags), || size as u64));

cuda_hook!(cudaMallocPitch(ptr: *mut *mut c_void, pitch: *mut usize, width: usize, height: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocPitch, ptr as *const u64, || real(ptr, pitch, width, height),
        // SAFETY: read after success, when the runtime has written the pitch.
        || if pitch.is_null() { width as u64 } else { unsafe { *pitch as u64 } }.saturating_mul(height as u64)));

cuda_hook!(cudaMalloc3D(out: *mut PitchedPtr, extent: Extent) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMalloc3D, out as *const u64, || real(out, extent),
        // SAFETY: read after success; `ptr` is the struct's first field (the out word).
        || (unsafe { (*out).pitch } as u64).saturating_mul(extent.height as u64).saturating_mul(extent.depth.max(1) as u64)));

cuda_hook!(cudaMallocHost(ptr: *mut *mut c_void, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaMallocHost, ptr as *const u64, || real(ptr, size), || size as u64));

cuda_hook!(cudaHostAlloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CudaHostAlloc, ptr as *const u64, || real(ptr, size, flags), || size as u64));

cuda_hook!(cudaFreeHost(ptr: *mut c_void) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr as u64, || real(ptr)));

cuda_hook!(cudaHostRegister(ptr: *mut c_void, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| registration(Api::CudaHostRegister, ptr as u64, size as u64, None, || real(ptr, size, flags)));

cuda_hook!(cudaHostUnregister(ptr: *mut c_void) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Registered, ptr as u64, || real(ptr)));

cuda_hook!(cudaDeviceReset() -> c_int, missing = ERROR_UNKNOWN,
|real| {
    // The runtime resets its current device: read it before it is gone.
    let device = cuda::current_device();
    cuda::reset(device, || real())
});

// The runtime's own resolvers: CUDA 12 passes a query-result pointer as the last
// argument; CUDA 11 had one argument less, which forwarding an extra register ignores.
cuda_hook!(cudaGetDriverEntryPoint(symbol: *const c_char, out: *mut *mut c_void, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, flags, status)), out));

cuda_hook!(cudaGetDriverEntryPoint_ptsz(symbol: *const c_char, out: *mut *mut c_void, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, flags, status)), out));

cuda_hook!(cudaGetDriverEntryPointByVersion(symbol: *const c_char, out: *mut *mut c_void, version: c_uint, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, version, flags, status)), out));

cuda_hook!(cudaGetDriverEntryPointByVersion_ptsz(symbol: *const c_char, out: *mut *mut c_void, version: c_uint, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, version, flags, status)), out));

type Substitute = fn(usize) -> Option<usize>;

/// Every runtime hook by its exported name, for the resolver paths.
pub const WRAPPED: &[(&CStr, Substitute)] = &[
    (cudaMalloc::NAME, cudaMalloc::substitute),
    (cudaFree::NAME, cudaFree::substitute),
    (cudaMallocAsync::NAME, cudaMallocAsync::substitute),
    (cudaMallocAsync_ptsz::NAME, cudaMallocAsync_ptsz::substitute),
    (cudaFreeAsync::NAME, cudaFreeAsync::substitute),
    (cudaFreeAsync_ptsz::NAME, cudaFreeAsync_ptsz::substitute),
    (cudaMallocFromPoolAsync::NAME, cudaMallocFromPoolAsync::substitute),
    (cudaMallocFromPoolAsync_ptsz::NAME, cudaMallocFromPoolAsync_ptsz::substitute),
    (cudaMallocManaged::NAME, cudaMallocManaged::substitute),
    (cudaMallocPitch::NAME, cudaMallocPitch::substitute),
    (cudaMalloc3D::NAME, cudaMalloc3D::substitute),
    (cudaMallocHost::NAME, cudaMallocHost::substitute),
    (cudaHostAlloc::NAME, cudaHostAlloc::substitute),
    (cudaFreeHost::NAME, cudaFreeHost::substitute),
    (cudaHostRegister::NAME, cudaHostRegister::substitute),
    (cudaHostUnregister::NAME, cudaHostUnregister::substitute),
    (cudaDeviceReset::NAME, cudaDeviceReset::substitute),
    (cudaGetDriverEntryPoint::NAME, cudaGetDriverEntryPoint::substitute),
    (cudaGetDriverEntryPoint_ptsz::NAME, cudaGetDriverEntryPoint_ptsz::substitute),
    (cudaGetDriverEntryPointByVersion::NAME, cudaGetDriverEntryPointByVersion::substitute),
    (cudaGetDriverEntryPointByVersion_ptsz::NAME, cudaGetDriverEntryPointByVersion_ptsz::substitute),
];
