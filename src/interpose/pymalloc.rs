//! CPython's object allocator (pymalloc) keeps small objects in arenas that it maps
//! itself: they are neither tracked blocks nor roots, so a block that only a live
//! Python object points to (a list's item array, a tensor's storage) would look leaked.
//! The arena allocator is hooked through the interpreter's public
//! `PyObject_SetArenaAllocator` (not an exported symbol: no ABI entry of ours), so that
//! every live arena is known; the scan reads the objects in them as roots
//! (`scan::pymalloc`); the table of live arenas is `scan::arenas`. Installed at start-up, before the interpreter maps its first
//! arena; the hooks run under the GIL and cost one table update per arena (256 KiB or
//! 1 MiB).
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::scan::arenas;

/// `PyObjectArenaAllocator`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ArenaAllocator {
    ctx: *mut libc::c_void,
    alloc: Option<extern "C" fn(*mut libc::c_void, usize) -> *mut libc::c_void>,
    free: Option<extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize)>,
}

static ORIGINAL_CTX: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_ALLOC: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_FREE: AtomicUsize = AtomicUsize::new(0);

extern "C" fn arena_alloc(_ctx: *mut libc::c_void, size: usize) -> *mut libc::c_void {
    let f = ORIGINAL_ALLOC.load(Ordering::Relaxed);
    // SAFETY: the interpreter's own arena allocator, saved before ours was installed.
    let f: extern "C" fn(*mut libc::c_void, usize) -> *mut libc::c_void = unsafe { std::mem::transmute(f) };
    // Untracked: the arena is not a mapping of the program's (its objects are sampled).
    let p = crate::hotpath::thread::untracked(|| f(ORIGINAL_CTX.load(Ordering::Relaxed) as *mut libc::c_void, size));
    if !p.is_null() {
        arenas::note(p as u64, size as u64);
    }
    // The first arena: the interpreter is set up and this thread holds its lock.
    super::pyalloc::install_from_arena();
    p
}

extern "C" fn arena_free(_ctx: *mut libc::c_void, p: *mut libc::c_void, size: usize) {
    // Out of the table first: a scan never reads an arena being unmapped.
    arenas::forget(p as u64);
    let f = ORIGINAL_FREE.load(Ordering::Relaxed);
    // SAFETY: as in `arena_alloc`.
    let f: extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize) = unsafe { std::mem::transmute(f) };
    crate::hotpath::thread::untracked(|| f(ORIGINAL_CTX.load(Ordering::Relaxed) as *mut libc::c_void, p, size));
}

/// Whether the scan wants the arenas (`install` was called at the library's start): an
/// interpreter loaded later gets the hooks too (`install_loaded`).
static WANTED: AtomicBool = AtomicBool::new(false);

/// The mean bytes between sampled Python objects (`LEAKTRACE_PYTHON_SAMPLE`).
static PYTHON_SAMPLE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Installs the arena hooks in a process that runs CPython with pymalloc; returns
/// whether they are in place. Call before the interpreter starts (the library's start).
/// `python_sample`: the mean bytes between sampled Python objects, 0 for none.
pub fn install(python_sample: u64) -> bool {
    PYTHON_SAMPLE.store(python_sample, Ordering::Relaxed);
    WANTED.store(true, Ordering::Relaxed);
    // The two names a program without an interpreter lacks, in one walk of the
    // modules' tables; any other name is looked up as asked.
    let names = [c"PyObject_GetArenaAllocator", c"PyObject_SetArenaAllocator"];
    let found = crate::os::loader::global_symbols(names);
    install_with(&crate::os::loader::global_symbols_or_lookup(names, found))
}

/// `install` for a libpython the program loaded itself, found by `symbol`, when the
/// program is about to start it (see `python::init_loaded`): only while that
/// interpreter is not initialised, so that no arena was mapped unseen.
pub fn install_loaded(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> bool {
    if arenas::open_now() || !WANTED.load(Ordering::Relaxed) {
        return arenas::open_now();
    }
    let Some(is_initialized) = symbol(c"Py_IsInitialized") else { return false };
    // SAFETY: the interpreter's exported `int Py_IsInitialized(void)`, callable at any time.
    if unsafe { std::mem::transmute::<usize, extern "C" fn() -> i32>(is_initialized)() } != 0 {
        return false;
    }
    install_with(symbol)
}

fn install_with(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> bool {
    if arenas::open_now() {
        return true;
    }
    let (Some(get), Some(set)) = (symbol(c"PyObject_GetArenaAllocator"), symbol(c"PyObject_SetArenaAllocator")) else {
        return false;
    };
    if !arenas::prepare() {
        return false;
    }
    let mut original = ArenaAllocator { ctx: std::ptr::null_mut(), alloc: None, free: None };
    // SAFETY: the interpreter's exported functions, of these signatures; they copy the
    // struct (callable before the interpreter is initialised).
    unsafe {
        let get: extern "C" fn(*mut ArenaAllocator) = std::mem::transmute::<usize, _>(get);
        get(&mut original);
    }
    let (Some(alloc), Some(free)) = (original.alloc, original.free) else {
        return false;
    };
    super::pyalloc::prepare(symbol, PYTHON_SAMPLE.load(Ordering::Relaxed));
    let minor = python_minor(symbol);
    if let Some(m) = minor {
        arenas::set_arena_size(if m >= 10 { 1 << 20 } else { 256 << 10 });
    }
    let int_layout = int_layout_of(minor, symbol);
    arenas::set_layouts(int_layout, object_types_of(int_layout, symbol), code_adaptive_of(minor));
    arenas::set_thread_walk(symbol(c"PyInterpreterState_Head"), symbol(c"PyInterpreterState_Next"), symbol(c"PyInterpreterState_ThreadHead"), minor);
    ORIGINAL_CTX.store(original.ctx as usize, Ordering::Relaxed);
    ORIGINAL_ALLOC.store(alloc as usize, Ordering::Relaxed);
    ORIGINAL_FREE.store(free as usize, Ordering::Relaxed);
    arenas::open();
    let mut ours = ArenaAllocator { ctx: std::ptr::null_mut(), alloc: Some(arena_alloc), free: Some(arena_free) };
    // SAFETY: as above.
    unsafe {
        let set: extern "C" fn(*mut ArenaAllocator) = std::mem::transmute::<usize, _>(set);
        set(&mut ours);
    }
    true
}

/// The interpreter's minor version (3.x), from its exported `Py_GetVersion`.
fn python_minor(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> Option<u8> {
    let version = symbol(c"Py_GetVersion")?;
    // SAFETY: the interpreter's exported `Py_GetVersion`.
    let version = unsafe { crate::hotpath::python::version_of(version) };
    crate::hotpath::python::minor_of_version(&version)
}

/// How this interpreter keeps an int, when its version is one whose `PyLongObject` is
/// known (3.8 to 3.13): the scan reads the addresses a program keeps as Python ints
/// (a ctypes `c_void_p` result, PyTorch's weak storage references) as references.
fn int_layout_of(minor: Option<u8>, symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> u64 {
    let Some(long_type) = symbol(c"PyLong_Type") else { return 0 };
    match minor {
        Some(8..=11) => long_type as u64,
        Some(12..=13) => long_type as u64 | 1,
        _ => 0,
    }
}

/// The built-in types the scan reads by their layout besides int: tuple, list, float,
/// bytes, str, code; only for an interpreter whose layouts are known (3.8 to 3.13).
fn object_types_of(int_layout: u64, symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> [u64; 6] {
    if int_layout == 0 {
        return [0; 6];
    }
    let names = [c"PyTuple_Type", c"PyList_Type", c"PyFloat_Type", c"PyBytes_Type", c"PyUnicode_Type", c"PyCode_Type"];
    names.map(|name| symbol(name).unwrap_or(0) as u64)
}

/// `offsetof(PyCodeObject, co_code_adaptive)` (`scan::pymalloc::ObjectTypes`): the
/// Python frames' table for 3.11 and 3.12; for 3.13, whose frames' layout is read from
/// the interpreter's `_Py_DebugOffsets` once it runs (after this), from the 3.13.0
/// headers. 0 before 3.11 (the bytecode was a bytes object of its own) and for a
/// version not known.
fn code_adaptive_of(minor: Option<u8>) -> u64 {
    match minor {
        Some(13) => 200,
        Some(m) => crate::hotpath::python::table_code_adaptive(m),
        None => 0,
    }
}
