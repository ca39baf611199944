//! The resolver paths: `dlsym`, and the substitution rule that `cuGetProcAddress*` and
//! `cudaGetDriverEntryPoint*` share. TensorFlow, cudarc's dynamic loading and static
//! cudart never call an exported `cu*` symbol: they ask `dlsym` or the driver's own
//! resolver for a function pointer, and only a wrapper handed out here sees the calls.
//!
//! **The rule.** Call the real resolver first. Only when it succeeded, and only when
//! the pointer it returned is exactly an exported function of ours by name (the name
//! `dlsym` was asked for, or the symbol `dladdr` says the pointer is), hand out the
//! wrapper bound to that very pointer. So a v1 request (`cuMemAlloc`, 32-bit pointers)
//! never gets the `_v2` wrapper, nor a legacy-stream request a `_ptsz` one.
//!
//! **`dlsym` and `dlvsym` themselves** are naked functions: `dlsym(RTLD_NEXT, …)` means
//! "after the caller's module", and glibc takes the caller from the return address, so
//! those calls jump straight to the real function with the caller's return address
//! intact. Every other handle goes through the same substitution (`substitute_found`):
//! a `dlvsym(libc, "malloc", "GLIBC_2.2.5")` gets our hook as `dlsym` would.
//!
//! The real ones cannot come from the loader's `dlsym`/`dlvsym` (a call of ours to
//! either lands in our own export): they are read from the C library's symbol table
//! (`os::elf`), the definitions that follow this library in load order.
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::{cuda_driver, cuda_runtime};

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
static REAL_DLVSYM: AtomicUsize = AtomicUsize::new(0);
static RESOLVING: AtomicBool = AtomicBool::new(false);

/// Finds glibc's `dlsym` and `dlvsym` (both at once); returns the one asked for
/// (`versioned`: `dlvsym`). Returns 0 when called again while it runs.
extern "C" fn resolve_real(versioned: bool) -> usize {
    let slot = if versioned { &REAL_DLVSYM } else { &REAL_DLSYM };
    let p = slot.load(Ordering::Acquire);
    if p != 0 || RESOLVING.swap(true, Ordering::AcqRel) {
        return p;
    }
    let [mut dlsym, mut dlvsym] = crate::os::elf::next_definitions([c"dlsym", c"dlvsym"], resolve_real as *const () as usize);
    // Each can be asked for the other: `RTLD_NEXT` from here is the module after ours.
    if dlsym == 0 && dlvsym != 0 {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: glibc's dlvsym with RTLD_NEXT and NUL-terminated strings.
            dlsym = unsafe { std::mem::transmute::<usize, DlvsymFn>(dlvsym)(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) } as usize;
            if dlsym != 0 {
                break;
            }
        }
    }
    if dlvsym == 0 && dlsym != 0 {
        // SAFETY: glibc's dlsym with RTLD_NEXT and a NUL-terminated name.
        dlvsym = unsafe { std::mem::transmute::<usize, DlsymFn>(dlsym)(libc::RTLD_NEXT, c"dlvsym".as_ptr()) } as usize;
    }
    REAL_DLVSYM.store(dlvsym, Ordering::Release);
    REAL_DLSYM.store(dlsym, Ordering::Release);
    RESOLVING.store(false, Ordering::Release);
    slot.load(Ordering::Acquire)
}

extern "C" fn resolve_real_dlsym() -> usize {
    resolve_real(false)
}

extern "C" fn resolve_real_dlvsym() -> usize {
    resolve_real(true)
}

/// The exported `dlsym`.
///
/// # Safety
/// The C contract of `dlsym`.
#[cfg_attr(not(test), no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // rdi = handle, rsi = name. RTLD_NEXT is (void *)-1.
    std::arch::naked_asm!(
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jnz 2f",
        // First call: find the real dlsym, keeping the arguments (and the stack aligned).
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 4f",
        "2:",
        "cmp rdi, -1",
        "je 3f",
        "jmp {wrapped}",
        // RTLD_NEXT: a tail jump, so the real dlsym sees the caller's return address.
        "3:",
        "jmp rax",
        // No real dlsym (only while it is being found): NULL.
        "4:",
        "ret",
        real = sym REAL_DLSYM,
        resolve = sym resolve_real_dlsym,
        wrapped = sym dlsym_wrapped,
    )
}

/// The exported `dlvsym`: as `dlsym`, with the version in rdx.
///
/// # Safety
/// The C contract of `dlvsym`.
#[cfg_attr(not(test), no_mangle)]
#[unsafe(naked)]
pub unsafe extern "C" fn dlvsym(handle: *mut c_void, name: *const c_char, version: *const c_char) -> *mut c_void {
    // rdi = handle, rsi = name, rdx = version. Three pushes keep the stack aligned.
    std::arch::naked_asm!(
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jnz 2f",
        "push rdi",
        "push rsi",
        "push rdx",
        "call {resolve}",
        "pop rdx",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jz 4f",
        "2:",
        "cmp rdi, -1",
        "je 3f",
        "jmp {wrapped}",
        // RTLD_NEXT: our hook when the caller comes before us (see `next_hook`), else a
        // tail jump to the real dlvsym with the caller's return address.
        "3:",
        "push rdi",
        "push rsi",
        "push rdx",
        "mov rdi, rsi",
        "mov rsi, rdx",
        "mov rdx, qword ptr [rsp + 24]",
        "call {next_hook}",
        "pop rdx",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 4f",
        "mov rax, qword ptr [rip + {real}]",
        "jmp rax",
        "4:",
        "ret",
        real = sym REAL_DLVSYM,
        resolve = sym resolve_real_dlvsym,
        wrapped = sym dlvsym_wrapped,
        next_hook = sym dlvsym_next_hook,
    )
}

/// `dlvsym(RTLD_NEXT, name, version)` from `caller`: our hook, or 0 to let the real
/// `dlvsym` answer. The loader never gives an unversioned definition (ours) to a
/// versioned request, so a program or an earlier preload asking for the next
/// `malloc@GLIBC_2.2.5` would skip us and get the C library's: it gets our hook, as
/// `dlsym(RTLD_NEXT)` would give it. A caller after us in load order (an interposer
/// that wraps the C library beneath us) gets the real answer.
extern "C" fn dlvsym_next_hook(name: *const c_char, version: *const c_char, caller: usize) -> usize {
    let found = std::panic::catch_unwind(|| {
        // SAFETY: dlvsym's name argument, a C string by its contract (or NULL).
        let n = unsafe { super::cuda::c_name(name) }?;
        if !super::malloc::is_hooked_name(n.to_bytes()) || !loaded_before_us(caller) {
            return None;
        }
        let real = REAL_DLVSYM.load(Ordering::Acquire);
        // SAFETY: glibc's dlvsym (set before this path runs) with the caller's strings.
        let p = unsafe { std::mem::transmute::<usize, DlvsymFn>(real)(libc::RTLD_DEFAULT, name, version) };
        (!p.is_null()).then(|| super::malloc::hook_for(n.to_bytes(), p as usize)).flatten()
    });
    found.ok().flatten().unwrap_or(0)
}

/// Whether the module containing `addr` comes before this library in load order (false
/// for this library itself and for what follows it).
fn loaded_before_us(addr: usize) -> bool {
    let ours = loaded_before_us as *const () as usize;
    let mut before = false;
    for_each_module_span(|lo, hi| {
        let at_us = ours >= lo && ours < hi;
        before = !at_us && addr >= lo && addr < hi;
        !(before || at_us)
    });
    before
}

/// The definition of `name` after this library (`dlsym(RTLD_NEXT)` from here).
pub fn next_definition(name: &CStr) -> Option<usize> {
    // SAFETY: RTLD_NEXT from this library's code with a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    (p != 0).then_some(p)
}

/// glibc's `dlsym` on a handle (not RTLD_NEXT; an opaque value from `dlopen`), with no
/// substitution.
pub fn real_dlsym(handle: usize, name: &CStr) -> usize {
    let real = match REAL_DLSYM.load(Ordering::Acquire) {
        0 => resolve_real_dlsym(),
        p => p,
    };
    if real == 0 {
        return 0;
    }
    // SAFETY: glibc's dlsym with a handle the caller holds and a C string.
    unsafe { std::mem::transmute::<usize, DlsymFn>(real)(handle as *mut c_void, name.as_ptr()) as usize }
}

/// `dlsym` for every handle but RTLD_NEXT: the real lookup, then the substitution rule.
extern "C" fn dlsym_wrapped(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let real = REAL_DLSYM.load(Ordering::Acquire);
    // SAFETY: real is glibc's dlsym (the naked entry checked it is set); arguments are
    // the caller's.
    let p = unsafe { std::mem::transmute::<usize, DlsymFn>(real)(handle, name) };
    // A module loaded late: routed before its first call (Python looks up an
    // extension's `PyInit_` right after loading it).
    super::got::route_new();
    substitute_found(handle, name, p)
}

/// `dlvsym` for every handle but RTLD_NEXT: the real lookup, then the substitution rule.
extern "C" fn dlvsym_wrapped(handle: *mut c_void, name: *const c_char, version: *const c_char) -> *mut c_void {
    let real = REAL_DLVSYM.load(Ordering::Acquire);
    // SAFETY: real is glibc's dlvsym (the naked entry checked it is set); arguments are
    // the caller's.
    let p = unsafe { std::mem::transmute::<usize, DlvsymFn>(real)(handle, name, version) };
    substitute_found(handle, name, p)
}

/// What a lookup of `name` on `handle` that found `p` hands out: our malloc-family hook
/// for the C library's own function, a CUDA wrapper, or `p` itself.
fn substitute_found(handle: *mut c_void, name: *const c_char, p: *mut c_void) -> *mut c_void {
    if p.is_null() {
        return p;
    }
    // SAFETY: the loader just found a symbol by this name, so it is a valid C string.
    let Some(n) = (unsafe { super::cuda::c_name(name) }) else { return p };
    if let Some(hook) = super::malloc::hook_for(n.to_bytes(), p as usize) {
        return hook as *mut c_void;
    }
    if starts_python(n.to_bytes()) {
        python_library_seen(handle as usize);
    }
    substitute_named(n, p as usize).map(|w| w as *mut c_void).unwrap_or(p)
}

/// The names a program that loaded libpython itself calls to start the interpreter.
fn starts_python(name: &[u8]) -> bool {
    name.starts_with(b"Py_Initialize") || name == b"Py_Main" || name == b"Py_BytesMain"
}

/// A program looked up how to start a CPython in `handle` (its own `dlopen` of
/// libpython): the arena hooks and Python frames, which the library's start could not
/// find then, are set up from that library now, before the interpreter starts.
#[cold]
fn python_library_seen(handle: usize) {
    let symbol = |name: &CStr| Some(real_dlsym(handle, name)).filter(|&p| p != 0);
    super::pymalloc::install_loaded(&symbol);
    if let Some(line) = crate::hotpath::python::init_loaded(&symbol) {
        crate::os::fds::write_stderr(format!("{line}\n").as_bytes());
    }
}

/// The wrapper for the real function `real`, known to be the symbol `name`.
pub fn substitute_named(name: &CStr, real: usize) -> Option<usize> {
    let bytes = name.to_bytes();
    if !bytes.starts_with(b"cu") || crate::os::elf::in_own_module(real) {
        return None;
    }
    let result = std::panic::catch_unwind(|| {
        cuda_runtime::WRAPPED.iter().chain(cuda_driver::WRAPPED).find(|(n, _)| n.to_bytes() == bytes).and_then(|(_, substitute)| substitute(real))
    });
    result.ok().flatten()
}

/// The wrapper for a pointer a CUDA resolver returned, when `dladdr` names it exactly.
pub fn substitute_pointer(real: usize) -> Option<usize> {
    if real == 0 || crate::os::elf::in_own_module(real) {
        return None;
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr fills info for any address; dli_sname is a loader-owned C string.
    let name = unsafe {
        if libc::dladdr(real as *const c_void, info.as_mut_ptr()) == 0 {
            return None;
        }
        let i = &*info.as_ptr();
        if i.dli_sname.is_null() || i.dli_saddr as usize != real {
            return None;
        }
        CStr::from_ptr(i.dli_sname)
    };
    substitute_named(name, real)
}

/// A CUDA resolver's out-pointer after the call: replaced by our wrapper on success.
///
/// # Safety
/// `out` is NULL or the resolver's valid `void **` out-parameter.
pub unsafe fn substitute_out(rc: c_int, out: *mut *mut c_void) -> c_int {
    if rc == 0 && !out.is_null() {
        // SAFETY: per the contract; the resolver wrote it on success.
        let p = unsafe { *out } as usize;
        if let Some(w) = substitute_pointer(p) {
            // SAFETY: as above.
            unsafe { *out = w as *mut c_void };
        }
    }
    rc
}

// ---- the loaded modules ----------------------------------------------------------------

/// The span of each loaded module's PT_LOAD segments, in load order, until `visit`
/// returns false. Allocates nothing: it runs inside `dlvsym` and `dlsym`, which an
/// interposer beneath us may call from its own `malloc` before it can allocate.
fn for_each_module_span(mut visit: impl FnMut(usize, usize) -> bool) {
    type Visit<'a> = &'a mut dyn FnMut(usize, usize) -> bool;
    extern "C" fn each(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> c_int {
        // SAFETY: the loader passes a valid info whose dlpi_phdr holds dlpi_phnum
        // headers; data is the Visit below, alive for the whole walk.
        let (info, visit) = unsafe { (&*info, &mut *(data as *mut Visit)) };
        // SAFETY: as above.
        let (lo, hi) = crate::os::loader::span(info.dlpi_addr as usize, unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) });
        c_int::from(lo < hi && !visit(lo, hi))
    }
    let mut visit: Visit = &mut visit;
    // SAFETY: the callback only reads what the loader gives it and calls `visit`.
    unsafe { crate::os::loader::iterate_modules(Some(each), &mut visit as *mut Visit as *mut c_void) };
}

/// The first loaded module, in load order and other than this library, that defines
/// `name`: for CUDA libraries loaded with RTLD_LOCAL, which `RTLD_NEXT` cannot see.
pub fn first_definition_outside_us(name: &CStr) -> Option<usize> {
    let paths = crate::os::loader::loaded_modules().into_iter().map(|m| m.path).filter(|p| !p.as_bytes().is_empty());
    for path in paths {
        // SAFETY: NOLOAD never loads anything; the handle's reference is dropped at once
        // through the real dlclose (ours would re-symbolize for nothing).
        unsafe {
            let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY);
            if h.is_null() {
                continue;
            }
            let p = real_dlsym(h as usize, name);
            if let Some(close) = super::real::dlclose() {
                close(h);
            }
            if p != 0 && !crate::os::elf::in_own_module(p) {
                return Some(p);
            }
        }
    }
    None
}
