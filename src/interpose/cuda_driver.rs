//! The CUDA driver API (libcuda): allocation, release, virtual memory management,
//! context destroy/reset and the driver's own resolver, `cuGetProcAddress`.
//!
//! The driver is the layer every CUDA allocation passes through; a driver call made by
//! the runtime on behalf of a runtime call is not recorded again (`cuda::allocation`).
// C entry points: their contract is the CUDA driver's.
#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};

use super::cuda::{self, allocation, allocation_on, passthrough, registration, release, ERROR_UNKNOWN};
use super::resolve::substitute_out;
use crate::cuda_hook;
use crate::hotpath::event::{Api, Space};

type DevPtr = u64;
type Stream = *mut c_void;
type Pool = *mut c_void;
type Context = *mut c_void;
type Handle = u64;

/// The start of `CUmemAllocationProp`: the location says which device the memory is on.
#[repr(C)]
pub struct AllocationPropHead {
    pub alloc_type: c_uint,
    pub handle_types: c_uint,
    pub location_type: c_uint,
    pub location_id: c_int,
}

const LOCATION_DEVICE: c_uint = 1;

/// # Safety
/// `prop` is NULL or the caller's valid `CUmemAllocationProp`.
unsafe fn prop_device(prop: *const AllocationPropHead) -> Option<u8> {
    if prop.is_null() {
        return None;
    }
    // SAFETY: per the contract.
    let p = unsafe { &*prop };
    (p.location_type == LOCATION_DEVICE).then(|| cuda::device_from(p.location_id)).flatten()
}

cuda_hook!(cuMemAlloc_v2(ptr: *mut DevPtr, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAlloc, ptr, || real(ptr, size), || size as u64));

cuda_hook!(cuMemFree_v2(ptr: DevPtr) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr, || real(ptr)));

cuda_hook!(cuMemAllocPitch_v2(ptr: *mut DevPtr, pitch: *mut usize, width: usize, height: usize, element: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocPitch, ptr, || real(ptr, pitch, width, height, element),
        // SAFETY: read after success, when the driver has written the pitch.
        || if pitch.is_null() { width as u64 } else { unsafe { *pitch as u64 } }.saturating_mul(height as u64)));

cuda_hook!(cuMemAllocManaged(ptr: *mut DevPtr, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocManaged, ptr, || real(ptr, size, flags), || size as u64));

cuda_hook!(cuMemAllocAsync(ptr: *mut DevPtr, size: usize, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocAsync, ptr, || real(ptr, size, stream), || size as u64));

cuda_hook!(cuMemAllocAsync_ptsz(ptr: *mut DevPtr, size: usize, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocAsync, ptr, || real(ptr, size, stream), || size as u64));

cuda_hook!(cuMemFreeAsync(ptr: DevPtr, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr, || real(ptr, stream)));

cuda_hook!(cuMemFreeAsync_ptsz(ptr: DevPtr, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr, || real(ptr, stream)));

cuda_hook!(cuMemAllocFromPoolAsync(ptr: *mut DevPtr, size: usize, pool: Pool, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocFromPoolAsync, ptr, || real(ptr, size, pool, stream), || size as u64));

cuda_hook!(cuMemAllocFromPoolAsync_ptsz(ptr: *mut DevPtr, size: usize, pool: Pool, stream: Stream) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocFromPoolAsync, ptr, || real(ptr, size, pool, stream), || size as u64));

cuda_hook!(cuMemAllocHost_v2(ptr: *mut *mut c_void, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemAllocHost, ptr as *const u64, || real(ptr, size), || size as u64));

cuda_hook!(cuMemHostAlloc(ptr: *mut *mut c_void, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation(Api::CuMemHostAlloc, ptr as *const u64, || real(ptr, size, flags), || size as u64));

cuda_hook!(cuMemFreeHost(ptr: *mut c_void) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Cuda, ptr as u64, || real(ptr)));

cuda_hook!(cuMemHostRegister_v2(ptr: *mut c_void, size: usize, flags: c_uint) -> c_int, missing = ERROR_UNKNOWN,
    |real| registration(Api::CuMemHostRegister, ptr as u64, size as u64, None, || real(ptr, size, flags)));

cuda_hook!(cuMemHostUnregister(ptr: *mut c_void) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::Registered, ptr as u64, || real(ptr)));

// Virtual memory management: physical allocations (handles), address reservations and
// the mappings between them are three kinds of record, each released by its own call.
cuda_hook!(cuMemCreate(handle: *mut Handle, size: usize, prop: *const AllocationPropHead, flags: c_ulonglong) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation_on(Api::CuMemCreate, handle, prop_device(prop), || real(handle, size, prop, flags), size as u64));

cuda_hook!(cuMemRelease(handle: Handle) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::VmmHandle, handle, || real(handle)));

cuda_hook!(cuMemAddressReserve(ptr: *mut DevPtr, size: usize, alignment: usize, addr: DevPtr, flags: c_ulonglong) -> c_int, missing = ERROR_UNKNOWN,
    |real| allocation_on(Api::CuMemAddressReserve, ptr, None, || real(ptr, size, alignment, addr, flags), size as u64));

cuda_hook!(cuMemAddressFree(ptr: DevPtr, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::VmmReservation, ptr, || real(ptr, size)));

cuda_hook!(cuMemMap(ptr: DevPtr, size: usize, offset: usize, handle: Handle, flags: c_ulonglong) -> c_int, missing = ERROR_UNKNOWN,
    |real| registration(Api::CuMemMap, ptr, size as u64, None, || real(ptr, size, offset, handle, flags)));

cuda_hook!(cuMemUnmap(ptr: DevPtr, size: usize) -> c_int, missing = ERROR_UNKNOWN,
    |real| release(Space::VmmMapping, ptr, || real(ptr, size)));

// Context destroy and primary-context reset free every context-bound allocation.
cuda_hook!(cuCtxDestroy_v2(ctx: Context) -> c_int, missing = ERROR_UNKNOWN,
|real| {
    let device = cuda::context_device(ctx as usize);
    cuda::reset(device, || real(ctx))
});

cuda_hook!(cuDevicePrimaryCtxReset_v2(device: c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| cuda::reset(cuda::device_from(device), || real(device)));

cuda_hook!(cuDevicePrimaryCtxReset(device: c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| cuda::reset(cuda::device_from(device), || real(device)));

// The driver's resolver. `cuGetProcAddress` (CUDA 11.3+) and `_v2` (12.0+, with a
// query-result pointer) are distinct ABIs, each forwarded as it is.
cuda_hook!(cuGetProcAddress(symbol: *const c_char, out: *mut *mut c_void, version: c_int, flags: c_ulonglong) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, version, flags)), out));

cuda_hook!(cuGetProcAddress_v2(symbol: *const c_char, out: *mut *mut c_void, version: c_int, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, version, flags, status)), out));

cuda_hook!(cuGetProcAddress_v2_ptsz(symbol: *const c_char, out: *mut *mut c_void, version: c_int, flags: c_ulonglong, status: *mut c_int) -> c_int, missing = ERROR_UNKNOWN,
    |real| substitute_out(passthrough(|| real(symbol, out, version, flags, status)), out));

type Substitute = fn(usize) -> Option<usize>;

/// Every driver hook by its exported name, for the resolver paths.
pub const WRAPPED: &[(&CStr, Substitute)] = &[
    (cuMemAlloc_v2::NAME, cuMemAlloc_v2::substitute),
    (cuMemFree_v2::NAME, cuMemFree_v2::substitute),
    (cuMemAllocPitch_v2::NAME, cuMemAllocPitch_v2::substitute),
    (cuMemAllocManaged::NAME, cuMemAllocManaged::substitute),
    (cuMemAllocAsync::NAME, cuMemAllocAsync::substitute),
    (cuMemAllocAsync_ptsz::NAME, cuMemAllocAsync_ptsz::substitute),
    (cuMemFreeAsync::NAME, cuMemFreeAsync::substitute),
    (cuMemFreeAsync_ptsz::NAME, cuMemFreeAsync_ptsz::substitute),
    (cuMemAllocFromPoolAsync::NAME, cuMemAllocFromPoolAsync::substitute),
    (cuMemAllocFromPoolAsync_ptsz::NAME, cuMemAllocFromPoolAsync_ptsz::substitute),
    (cuMemAllocHost_v2::NAME, cuMemAllocHost_v2::substitute),
    (cuMemHostAlloc::NAME, cuMemHostAlloc::substitute),
    (cuMemFreeHost::NAME, cuMemFreeHost::substitute),
    (cuMemHostRegister_v2::NAME, cuMemHostRegister_v2::substitute),
    (cuMemHostUnregister::NAME, cuMemHostUnregister::substitute),
    (cuMemCreate::NAME, cuMemCreate::substitute),
    (cuMemRelease::NAME, cuMemRelease::substitute),
    (cuMemAddressReserve::NAME, cuMemAddressReserve::substitute),
    (cuMemAddressFree::NAME, cuMemAddressFree::substitute),
    (cuMemMap::NAME, cuMemMap::substitute),
    (cuMemUnmap::NAME, cuMemUnmap::substitute),
    (cuCtxDestroy_v2::NAME, cuCtxDestroy_v2::substitute),
    (cuDevicePrimaryCtxReset_v2::NAME, cuDevicePrimaryCtxReset_v2::substitute),
    (cuDevicePrimaryCtxReset::NAME, cuDevicePrimaryCtxReset::substitute),
    (cuGetProcAddress::NAME, cuGetProcAddress::substitute),
    (cuGetProcAddress_v2::NAME, cuGetProcAddress_v2::substitute),
    (cuGetProcAddress_v2_ptsz::NAME, cuGetProcAddress_v2_ptsz::substitute),
];
