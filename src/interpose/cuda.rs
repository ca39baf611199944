//! What the CUDA hook families share: the real-function slots, the hook macro, the
//! record-once rule, the device query, and the table of wrappers that the resolver
//! paths (`dlsym`, `cuGetProcAddress`, `cudaGetDriverEntryPoint`) hand out.
//!
//! Nothing here links libcuda or libcudart: every real function is found lazily, so a
//! process that never loads CUDA pays nothing but a few exported names.
//!
//! **Several copies.** A process may hold more than one libcudart (PyTorch, CuPy and
//! TensorFlow each bring one). The exported hook forwards to the copy `dlsym(RTLD_NEXT)`
//! finds; a function pointer that a resolver returns is replaced by one of `COPIES`
//! per-function wrappers, each bound to the exact real function it stands for, so every
//! copy is forwarded to itself. A fifth distinct copy of one function is passed through
//! untracked (counted in `untracked_copies`).
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::ErrnoGuard;
use crate::agent;
use crate::hotpath::event::{Api, Space};
use crate::hotpath::thread;

pub const COPIES: usize = 4;

/// `cudaErrorUnknown` / `CUDA_ERROR_UNKNOWN`: returned when no real function exists to
/// forward to (a program bound to our export without any CUDA library loaded).
pub const ERROR_UNKNOWN: c_int = 999;

/// The real functions one hooked name forwards to.
pub struct Slots {
    exported: AtomicUsize,
    copies: [AtomicUsize; COPIES],
}

impl Slots {
    #[allow(clippy::new_without_default, clippy::declare_interior_mutable_const)]
    pub const fn new() -> Slots {
        const ZERO: AtomicUsize = AtomicUsize::new(0);
        Slots { exported: ZERO, copies: [ZERO; COPIES] }
    }

    /// The function the exported hook forwards to, found on first use.
    #[inline]
    pub fn exported(&self, name: &CStr) -> Option<usize> {
        let p = self.exported.load(Ordering::Acquire);
        if p != 0 {
            return Some(p);
        }
        let p = find_real(name)?;
        self.exported.store(p, Ordering::Release);
        Some(p)
    }

    #[inline]
    pub fn copy(&self, i: usize) -> usize {
        self.copies[i].load(Ordering::Acquire)
    }

    /// The index of the copy wrapper bound to `real`, binding a free one if needed.
    pub fn bind(&self, real: usize) -> Option<usize> {
        for (i, c) in self.copies.iter().enumerate() {
            match c.compare_exchange(0, real, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(i),
                Err(cur) if cur == real => return Some(i),
                Err(_) => {}
            }
        }
        crate::agent::note_untracked_copy();
        None
    }
}

/// The next definition of `name` after this library: `dlsym(RTLD_NEXT)`, or, when the
/// CUDA library was loaded with `RTLD_LOCAL` (out of the global scope), the first
/// loaded module that defines it.
fn find_real(name: &CStr) -> Option<usize> {
    // SAFETY: RTLD_NEXT lookup of a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    if p != 0 && !crate::os::elf::in_own_module(p) {
        return Some(p);
    }
    super::resolve::first_definition_outside_us(name)
}

/// One CUDA entry point: the exported hook, `COPIES` wrappers for pointers handed out by
/// resolvers, and a `substitute` for the resolver table. `$body` sees the real function
/// as `$real` and the arguments by name.
#[macro_export]
macro_rules! cuda_hook {
    ($name:ident ( $($arg:ident : $ty:ty),* $(,)? ) -> $ret:ty, missing = $missing:expr, |$real:ident| $body:expr) => {
        #[allow(non_snake_case)]
        pub mod $name {
            #[allow(unused_imports)]
            use super::*;
            use $crate::interpose::cuda::{Slots, COPIES};

            pub type Real = unsafe extern "C" fn($($ty),*) -> $ret;
            pub static SLOTS: Slots = Slots::new();
            pub const NAME: &std::ffi::CStr = match std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(n) => n,
                Err(_) => panic!("hook name"),
            };

            #[inline(always)]
            #[allow(unused_unsafe, clippy::macro_metavars_in_unsafe)]
            unsafe fn body($real: Real, $($arg: $ty),*) -> $ret {
                $body
            }

            #[inline(always)]
            fn real_at(p: usize) -> Real {
                // SAFETY: p is the address the loader or a CUDA resolver gave for this
                // exact symbol, whose C prototype is `Real`.
                unsafe { std::mem::transmute::<usize, Real>(p) }
            }

            /// The exported entry point.
            #[cfg_attr(not(test), no_mangle)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
                match SLOTS.exported(NAME) {
                    // SAFETY: forwarding the caller's arguments to the real function.
                    Some(p) => unsafe { body(real_at(p), $($arg),*) },
                    None => {
                        $crate::interpose::cuda::missing(NAME);
                        $missing
                    }
                }
            }

            unsafe extern "C" fn copy0($($arg: $ty),*) -> $ret {
                // SAFETY: copy 0 is bound before this wrapper is ever handed out.
                unsafe { body(real_at(SLOTS.copy(0)), $($arg),*) }
            }
            unsafe extern "C" fn copy1($($arg: $ty),*) -> $ret {
                // SAFETY: as copy0.
                unsafe { body(real_at(SLOTS.copy(1)), $($arg),*) }
            }
            unsafe extern "C" fn copy2($($arg: $ty),*) -> $ret {
                // SAFETY: as copy0.
                unsafe { body(real_at(SLOTS.copy(2)), $($arg),*) }
            }
            unsafe extern "C" fn copy3($($arg: $ty),*) -> $ret {
                // SAFETY: as copy0.
                unsafe { body(real_at(SLOTS.copy(3)), $($arg),*) }
            }

            /// The wrapper that forwards to `real`, if a copy slot is free for it.
            pub fn substitute(real: usize) -> Option<usize> {
                let wrappers: [Real; COPIES] = [copy0, copy1, copy2, copy3];
                SLOTS.bind(real).map(|i| wrappers[i] as usize)
            }
        }
        pub use $name::$name;
    };
}

/// One stderr line per process when a program calls a CUDA function that no loaded
/// library defines.
pub fn missing(name: &CStr) {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, Ordering::Relaxed) {
        crate::os::fds::stderr_line(&format!(
            "leaktrace: {} was called but no CUDA library defines it; returning error {ERROR_UNKNOWN}",
            name.to_string_lossy()
        ));
    }
}

/// An allocation call whose result address is written to `*out` on success (`rc` 0).
/// Records it once, after it succeeded, with the caller's stack, on the current device.
///
/// # Safety
/// `out` is the caller's out-pointer, read only after the real call succeeded.
#[inline]
pub unsafe fn allocation(api: Api, out: *const u64, call: impl FnOnce() -> c_int, size: impl FnOnce() -> u64) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { allocated(api, out, call, size, current_device) }
}

/// Like `allocation` for a block whose device is known from the call's arguments.
///
/// # Safety
/// As `allocation`.
#[inline]
pub unsafe fn allocation_on(api: Api, out: *const u64, device: Option<u8>, call: impl FnOnce() -> c_int, size: u64) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { allocated(api, out, call, || size, || device) }
}

/// # Safety
/// As `allocation`.
#[inline]
unsafe fn allocated(api: Api, out: *const u64, call: impl FnOnce() -> c_int, size: impl FnOnce() -> u64, device: impl FnOnce() -> Option<u8>) -> c_int {
    let (rc, outermost) = thread::cuda_call(call);
    if rc == 0 && outermost && !out.is_null() && agent::active() {
        let _errno = ErrnoGuard::save();
        // SAFETY: on success the real function stored the new address (or handle) in *out.
        let addr = unsafe { out.read_unaligned() };
        // 0 is never a valid pointer or handle (and `release` ignores it).
        if addr != 0 {
            agent::record_cuda_alloc(addr, size(), api, device());
        }
    }
    rc
}

/// A call that makes `key` (an address or handle given by the caller) live on success.
#[inline]
pub fn registration(api: Api, key: u64, size: u64, device: Option<u8>, call: impl FnOnce() -> c_int) -> c_int {
    let (rc, outermost) = thread::cuda_call(call);
    if rc == 0 && outermost && agent::active() {
        let _errno = ErrnoGuard::save();
        let device = device.or_else(current_device);
        agent::record_cuda_alloc(key, size, api, device);
    }
    rc
}

/// A call that releases `key` in `space`. Published before the call (the address may be
/// handed out again the moment it returns) and confirmed or undone after it.
#[inline]
pub fn release(space: Space, key: u64, call: impl FnOnce() -> c_int) -> c_int {
    let outermost = key != 0 && !thread::in_cuda_call();
    let track = outermost && agent::active();
    if track {
        let _errno = ErrnoGuard::save();
        agent::record_cuda_release(key, space);
    }
    let (rc, _) = thread::cuda_call(call);
    if track {
        let _errno = ErrnoGuard::save();
        agent::record_cuda_release_outcome(space, rc == 0);
    } else if outermost && rc == 0 {
        // After tracking stopped, the final report may still want it (as host frees).
        let _errno = ErrnoGuard::save();
        agent::record_late_free(key, Api::releasing(space));
    }
    rc
}

/// A context destroy or device reset of `device`, applied once it succeeded.
#[inline]
pub fn reset(device: Option<u8>, call: impl FnOnce() -> c_int) -> c_int {
    let (rc, outermost) = thread::cuda_call(call);
    if rc == 0 && outermost && agent::active() {
        if let Some(d) = device {
            let _errno = ErrnoGuard::save();
            agent::record_device_reset(d);
        }
    }
    rc
}

/// A plain pass-through that still counts as a CUDA call (so the driver calls it makes
/// are not recorded as the program's).
#[inline]
pub fn passthrough<R>(call: impl FnOnce() -> R) -> R {
    thread::cuda_call(call).0
}

// ---- device query ---------------------------------------------------------------------

type CtxGetDevice = unsafe extern "C" fn(*mut c_int) -> c_int;
type CtxPush = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxPop = unsafe extern "C" fn(*mut *mut c_void) -> c_int;

/// (cuCtxGetDevice, cuCtxPushCurrent_v2, cuCtxPopCurrent_v2) of the loaded driver, or 0s.
static DRIVER_QUERIES: [AtomicUsize; 3] = [AtomicUsize::new(0), AtomicUsize::new(0), AtomicUsize::new(0)];
static DRIVER_LOOKED_UP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn driver_query(i: usize) -> usize {
    if !DRIVER_LOOKED_UP.load(Ordering::Acquire) {
        let names: [&CStr; 3] = [c"cuCtxGetDevice", c"cuCtxPushCurrent_v2", c"cuCtxPopCurrent_v2"];
        // SAFETY: NOLOAD only returns a handle to an already loaded libcuda (its
        // reference is kept: the driver is never unloaded).
        let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        if h.is_null() {
            return 0;
        }
        for (slot, name) in DRIVER_QUERIES.iter().zip(names) {
            slot.store(super::resolve::real_dlsym(h as usize, name), Ordering::Release);
        }
        DRIVER_LOOKED_UP.store(true, Ordering::Release);
    }
    DRIVER_QUERIES[i].load(Ordering::Acquire)
}

/// A CUDA device ordinal as the report keeps it (0..=254), from the API's `int`.
pub fn device_from(d: c_int) -> Option<u8> {
    u8::try_from(d).ok().filter(|d| *d < u8::MAX)
}

/// The device of the calling thread's current context, when the driver says.
pub fn current_device() -> Option<u8> {
    let f = driver_query(0);
    if f == 0 {
        return None;
    }
    let mut d: c_int = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) of the loaded driver, with a valid out pointer.
    let rc = thread::cuda_call(|| unsafe { std::mem::transmute::<usize, CtxGetDevice>(f)(&mut d) }).0;
    if rc == 0 {
        device_from(d)
    } else {
        None
    }
}

/// The device a context (an opaque `CUcontext` value) belongs to: made current for a
/// moment, then put back.
pub fn context_device(ctx: usize) -> Option<u8> {
    let (push, pop) = (driver_query(1), driver_query(2));
    if push == 0 || pop == 0 || ctx == 0 {
        return None;
    }
    // SAFETY: the driver's push/pop pair with a context the caller is about to destroy
    // (so still valid), and a valid out pointer for the popped context.
    unsafe {
        if std::mem::transmute::<usize, CtxPush>(push)(ctx as *mut c_void) != 0 {
            return None;
        }
        let d = current_device();
        let mut popped: *mut c_void = std::ptr::null_mut();
        std::mem::transmute::<usize, CtxPop>(pop)(&mut popped);
        d
    }
}

/// Reads a C string argument for a lookup table.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub unsafe fn c_name<'a>(p: *const c_char) -> Option<&'a CStr> {
    // SAFETY: per the contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
}
