//! CPython's object allocator (pymalloc) keeps small objects in arenas that it maps
//! itself: they are neither tracked blocks nor roots, so a block that only a live
//! Python object points to (a list's item array, a tensor's storage) would look leaked.
//! The arena allocator is hooked through the interpreter's public
//! `PyObject_SetArenaAllocator` (not an exported symbol: no ABI entry of ours), so that
//! every live arena is known; the scan reads the objects in them as roots
//! (`scan::pymalloc`). Installed at start-up, before the interpreter maps its first
//! arena; the hooks run under the GIL and cost one table update per arena (256 KiB or
//! 1 MiB).
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// `PyObjectArenaAllocator`.
#[repr(C)]
#[derive(Clone, Copy)]
struct ArenaAllocator {
    ctx: *mut libc::c_void,
    alloc: Option<extern "C" fn(*mut libc::c_void, usize) -> *mut libc::c_void>,
    free: Option<extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize)>,
}

const SLOTS: usize = 1 << 16;

struct Table {
    addr: [AtomicU64; SLOTS],
    size: [AtomicU64; SLOTS],
}

static TABLE: AtomicUsize = AtomicUsize::new(0);
/// Slots below this index may be in use.
static HIGH: AtomicUsize = AtomicUsize::new(0);
static FULL: AtomicBool = AtomicBool::new(false);
static ORIGINAL_CTX: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_ALLOC: AtomicUsize = AtomicUsize::new(0);
static ORIGINAL_FREE: AtomicUsize = AtomicUsize::new(0);

fn table() -> Option<&'static Table> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: a zeroed mapping of one Table (all-zero atomics are valid), never unmapped.
    (p != 0).then(|| unsafe { &*(p as *const Table) })
}

extern "C" fn arena_alloc(_ctx: *mut libc::c_void, size: usize) -> *mut libc::c_void {
    let f = ORIGINAL_ALLOC.load(Ordering::Relaxed);
    // SAFETY: the interpreter's own arena allocator, saved before ours was installed.
    let f: extern "C" fn(*mut libc::c_void, usize) -> *mut libc::c_void = unsafe { std::mem::transmute(f) };
    let p = f(ORIGINAL_CTX.load(Ordering::Relaxed) as *mut libc::c_void, size);
    if !p.is_null() {
        note(p as u64, size as u64);
    }
    p
}

extern "C" fn arena_free(_ctx: *mut libc::c_void, p: *mut libc::c_void, size: usize) {
    // Out of the table first: a scan never reads an arena being unmapped.
    forget(p as u64);
    let f = ORIGINAL_FREE.load(Ordering::Relaxed);
    // SAFETY: as in `arena_alloc`.
    let f: extern "C" fn(*mut libc::c_void, *mut libc::c_void, usize) = unsafe { std::mem::transmute(f) };
    f(ORIGINAL_CTX.load(Ordering::Relaxed) as *mut libc::c_void, p, size);
}

fn note(addr: u64, size: u64) {
    let Some(t) = table() else { return };
    for i in 0..SLOTS {
        if t.addr[i].load(Ordering::Relaxed) == 0 && t.addr[i].compare_exchange(0, u64::MAX, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            t.size[i].store(size, Ordering::Relaxed);
            t.addr[i].store(addr, Ordering::Release);
            HIGH.fetch_max(i + 1, Ordering::AcqRel);
            return;
        }
    }
    FULL.store(true, Ordering::Relaxed);
}

fn forget(addr: u64) {
    let Some(t) = table() else { return };
    let high = HIGH.load(Ordering::Acquire);
    if let Some(slot) = t.addr[..high].iter().find(|a| a.load(Ordering::Acquire) == addr) {
        slot.store(0, Ordering::Release);
    }
}

/// Whether the scan wants the arenas (`install` was called at the library's start): an
/// interpreter loaded later gets the hooks too (`install_loaded`).
static WANTED: AtomicBool = AtomicBool::new(false);

/// Installs the arena hooks in a process that runs CPython with pymalloc; returns
/// whether they are in place. Call before the interpreter starts (the library's start).
pub fn install() -> bool {
    WANTED.store(true, Ordering::Relaxed);
    install_with(&crate::os::loader::global_symbol)
}

/// `install` for a libpython the program loaded itself, found by `symbol`, when the
/// program is about to start it (see `python::init_loaded`): only while that
/// interpreter is not initialised, so that no arena was mapped unseen.
pub fn install_loaded(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> bool {
    if table().is_some() || !WANTED.load(Ordering::Relaxed) {
        return table().is_some();
    }
    let Some(is_initialized) = symbol(c"Py_IsInitialized") else { return false };
    // SAFETY: the interpreter's exported `int Py_IsInitialized(void)`, callable at any time.
    if unsafe { std::mem::transmute::<usize, extern "C" fn() -> i32>(is_initialized)() } != 0 {
        return false;
    }
    install_with(symbol)
}

fn install_with(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> bool {
    if table().is_some() {
        return true;
    }
    let (Some(get), Some(set)) = (symbol(c"PyObject_GetArenaAllocator"), symbol(c"PyObject_SetArenaAllocator")) else {
        return false;
    };
    let Some(mem) = crate::hotpath::mapping::map_zeroed(std::mem::size_of::<Table>()) else { return false };
    let mut original = ArenaAllocator { ctx: std::ptr::null_mut(), alloc: None, free: None };
    // SAFETY: the interpreter's exported functions, of these signatures; they copy the
    // struct (callable before the interpreter is initialised).
    unsafe {
        let get: extern "C" fn(*mut ArenaAllocator) = std::mem::transmute::<usize, _>(get);
        get(&mut original);
    }
    let (Some(alloc), Some(free)) = (original.alloc, original.free) else {
        crate::hotpath::mapping::unmap(mem, std::mem::size_of::<Table>());
        return false;
    };
    INT_LAYOUT.store(int_layout_of(symbol), Ordering::Relaxed);
    store_object_types(symbol);
    ORIGINAL_CTX.store(original.ctx as usize, Ordering::Relaxed);
    ORIGINAL_ALLOC.store(alloc as usize, Ordering::Relaxed);
    ORIGINAL_FREE.store(free as usize, Ordering::Relaxed);
    TABLE.store(mem as usize, Ordering::Release);
    let mut ours = ArenaAllocator { ctx: std::ptr::null_mut(), alloc: Some(arena_alloc), free: Some(arena_free) };
    // SAFETY: as above.
    unsafe {
        let set: extern "C" fn(*mut ArenaAllocator) = std::mem::transmute::<usize, _>(set);
        set(&mut ours);
    }
    true
}

/// `&PyLong_Type` with bit 0 set for the 3.12+ layout (see `int_layout`); 0 when
/// unknown.
static INT_LAYOUT: AtomicU64 = AtomicU64::new(0);

/// How this interpreter keeps an int, when its version is one whose `PyLongObject` is
/// known (3.8 to 3.13): the scan reads the addresses a program keeps as Python ints
/// (a ctypes `c_void_p` result, PyTorch's weak storage references) as references.
fn int_layout_of(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> u64 {
    let (Some(long_type), Some(version)) = (symbol(c"PyLong_Type"), symbol(c"Py_GetVersion")) else { return 0 };
    // SAFETY: the interpreter's exported `Py_GetVersion`.
    let version = unsafe { crate::hotpath::python::version_of(version) };
    match crate::hotpath::python::minor_of_version(&version) {
        Some(8..=11) => long_type as u64,
        Some(12..=13) => long_type as u64 | 1,
        _ => 0,
    }
}

/// The built-in types the scan reads by their layout (`scan::pymalloc::ObjectTypes`)
/// besides int (`INT_LAYOUT`): tuple, list, float, bytes, str; stored only for an
/// interpreter whose layouts are known (3.8 to 3.13).
static OBJECT_TYPES: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

fn store_object_types(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) {
    if INT_LAYOUT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let names = [c"PyTuple_Type", c"PyList_Type", c"PyFloat_Type", c"PyBytes_Type", c"PyUnicode_Type"];
    for (slot, name) in OBJECT_TYPES.iter().zip(names) {
        slot.store(symbol(name).unwrap_or(0) as u64, Ordering::Relaxed);
    }
}

/// The built-in types found at `install` (`None` before, or for an unknown version);
/// the int's and the str headers' sizes follow from the int layout (3.12 changed both).
pub fn object_types() -> Option<crate::scan::pymalloc::ObjectTypes> {
    let int = int_layout()?;
    let [tuple, list, float, bytes, str] = std::array::from_fn(|i| OBJECT_TYPES[i].load(Ordering::Relaxed));
    let (str_ascii_header, str_compact_header) = if int.tagged { (40, 56) } else { (48, 72) };
    Some(crate::scan::pymalloc::ObjectTypes { tuple, list, float, int: int.type_addr, bytes, str, str_ascii_header, str_compact_header })
}

/// The int layout found at `install` (`None` before, or for an unknown version).
pub fn int_layout() -> Option<crate::scan::pymalloc::IntLayout> {
    let v = INT_LAYOUT.load(Ordering::Relaxed);
    (v != 0).then_some(crate::scan::pymalloc::IntLayout { type_addr: v & !1, tagged: v & 1 != 0 })
}

/// Whether arenas were mapped that the table had no room for (the scan then misses
/// the objects in them).
pub fn overflowed() -> bool {
    FULL.load(Ordering::Relaxed)
}

/// The most arenas `live_arenas` can report.
pub fn capacity() -> usize {
    if table().is_some() {
        SLOTS
    } else {
        0
    }
}

/// Appends the live arenas (start, size) to `out` without allocating: at most its
/// spare capacity (reserve `capacity()` first).
pub fn live_arenas(out: &mut Vec<(u64, u64)>) {
    let Some(t) = table() else { return };
    let high = HIGH.load(Ordering::Acquire);
    for i in 0..high {
        let a = t.addr[i].load(Ordering::Acquire);
        if a != 0 && a != u64::MAX && out.len() < out.capacity() {
            out.push((a, t.size[i].load(Ordering::Relaxed)));
        }
    }
}
