//! A scan just before the interpreter tears its modules down. At exit CPython clears
//! every module's globals (`Py_FinalizeEx`) before the process's exit hooks run, so the
//! final report's scan finds the memory a module-level list kept already freed, and
//! cannot say what held it. Python's `atexit` callbacks run first, with every module
//! intact: the collector asks the interpreter (`Py_AddPendingCall`, which any thread may
//! call) to register one on its main thread at its next safe point; the callback finds
//! the holders of the growing stacks (`reports::held_before_exit`), which the final
//! report then shows for the memory that teardown freed.
//!
//! Every call into the interpreter is looked up with `dlsym` and checked; any failure
//! leaves the program as it was (the exception cleared, nothing registered).
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

type PyObject = c_void;

/// `PyMethodDef`: name, function, flags, doc.
#[repr(C)]
struct MethodDef {
    name: *const c_char,
    meth: Option<unsafe extern "C" fn(*mut PyObject, *mut PyObject) -> *mut PyObject>,
    flags: c_int,
    doc: *const c_char,
}

// SAFETY: read-only after construction; the interpreter only reads it.
unsafe impl Sync for MethodDef {}

const METH_NOARGS: c_int = 0x0004;

static DEF: MethodDef = MethodDef { name: c"leaktrace_before_finalize".as_ptr(), meth: Some(before_finalize), flags: METH_NOARGS, doc: std::ptr::null() };

/// Asked once per process image.
static ASKED: AtomicBool = AtomicBool::new(false);

type ImportFn = unsafe extern "C" fn(*const c_char) -> *mut PyObject;
type GetAttrFn = unsafe extern "C" fn(*mut PyObject, *const c_char) -> *mut PyObject;
type NewFunctionFn = unsafe extern "C" fn(*const MethodDef, *mut PyObject, *mut PyObject) -> *mut PyObject;
type RefFn = unsafe extern "C" fn(*mut PyObject);
type ClearFn = unsafe extern "C" fn();

/// The interpreter's functions this needs, looked up once.
struct Api {
    import: ImportFn,
    getattr: GetAttrFn,
    new_function: NewFunctionFn,
    /// `PyObject_CallFunctionObjArgs(callable, ..., NULL)` (every 3.x).
    call: unsafe extern "C" fn(*mut PyObject, ...) -> *mut PyObject,
    decref: RefFn,
    incref: RefFn,
    clear_error: ClearFn,
    none: *mut PyObject,
}

// SAFETY: function pointers and the address of an immortal (or counted) object: nothing
// here is tied to a thread.
unsafe impl Send for Api {}
unsafe impl Sync for Api {}

/// Looked up by the collector (`arm`), before the interpreter is asked: the callbacks
/// run on the program's thread and call only these.
static API: std::sync::OnceLock<Option<Api>> = std::sync::OnceLock::new();

fn api() -> Option<&'static Api> {
    API.get().and_then(Option::as_ref)
}

fn look_up() -> Option<Api> {
    let s = crate::os::loader::global_symbol;
    // SAFETY: each symbol is CPython's exported function of that C signature (3.8 to
    // 3.13), or its `_Py_NoneStruct` object.
    unsafe {
        Some(Api {
            import: std::mem::transmute::<usize, ImportFn>(s(c"PyImport_ImportModule")?),
            getattr: std::mem::transmute::<usize, GetAttrFn>(s(c"PyObject_GetAttrString")?),
            new_function: std::mem::transmute::<usize, NewFunctionFn>(s(c"PyCFunction_NewEx")?),
            call: std::mem::transmute::<usize, unsafe extern "C" fn(*mut PyObject, ...) -> *mut PyObject>(s(c"PyObject_CallFunctionObjArgs")?),
            decref: std::mem::transmute::<usize, RefFn>(s(c"Py_DecRef")?),
            incref: std::mem::transmute::<usize, RefFn>(s(c"Py_IncRef")?),
            clear_error: std::mem::transmute::<usize, ClearFn>(s(c"PyErr_Clear")?),
            none: s(c"_Py_NoneStruct")? as *mut PyObject,
        })
    }
}

/// From the collector, between drains: once the interpreter runs, asks it to register
/// the callback. Python frames must be on (the interpreter is known), and the scan.
pub(super) fn arm() {
    if ASKED.load(Ordering::Relaxed) || !crate::hotpath::python::enabled() {
        return;
    }
    let s = crate::os::loader::global_symbol;
    let (Some(initialized), Some(pending)) = (is_initialized_fn(), s(c"Py_AddPendingCall")) else {
        ASKED.store(true, Ordering::Relaxed);
        return;
    };
    if initialized() == 0 || ASKED.swap(true, Ordering::AcqRel) {
        return;
    }
    if API.get_or_init(look_up).is_none() {
        return;
    }
    // SAFETY: CPython's `int Py_AddPendingCall(int (*)(void *), void *)`, documented as
    // callable from any thread without the GIL.
    let pending: extern "C" fn(extern "C" fn(*mut c_void) -> c_int, *mut c_void) -> c_int = unsafe { std::mem::transmute::<usize, _>(pending) };
    pending(register, std::ptr::null_mut());
}

/// `Py_IsInitialized`, and `Py_IsFinalizing` (3.13) or `_Py_IsFinalizing` (3.8–3.12):
/// their addresses once looked up (`no_arg_fn`).
static IS_INITIALIZED: AtomicUsize = AtomicUsize::new(0);
static IS_FINALIZING: AtomicUsize = AtomicUsize::new(0);

/// An interpreter function `int f(void)` by the first of `names` the program defines,
/// looked up once into `slot` (0: not yet; 1: none defined). Only asked once the
/// interpreter runs (`python::enabled`), when its symbols are there to find.
fn no_arg_fn(slot: &AtomicUsize, names: &[&std::ffi::CStr]) -> Option<extern "C" fn() -> c_int> {
    let mut f = slot.load(Ordering::Acquire);
    if f == 0 {
        f = names.iter().find_map(|n| crate::os::loader::global_symbol(n)).unwrap_or(1);
        slot.store(f, Ordering::Release);
    }
    // SAFETY: CPython's `int Py_IsInitialized(void)`, `int Py_IsFinalizing(void)` and
    // `int _Py_IsFinalizing(void)`, callable from any thread, also after `Py_FinalizeEx`
    // (they read the runtime's state).
    (f != 1).then(|| unsafe { std::mem::transmute::<usize, extern "C" fn() -> c_int>(f) })
}

fn is_initialized_fn() -> Option<extern "C" fn() -> c_int> {
    no_arg_fn(&IS_INITIALIZED, &[c"Py_IsInitialized"])
}

fn is_finalizing_fn() -> Option<extern "C" fn() -> c_int> {
    no_arg_fn(&IS_FINALIZING, &[c"Py_IsFinalizing", c"_Py_IsFinalizing"])
}

/// Whether the interpreter of this process began its teardown (`Py_FinalizeEx` past
/// its atexit callbacks: the modules' memory goes back into malloc's arenas) or ended
/// it: memory measured from then on is no state of the program's run. Asked of the
/// interpreter at each measure, where the atexit callback (which needs the collector to
/// have armed it in time) is not always there: a short `import torch` on a loaded
/// machine ended before its callback was registered, and its summary said "malloc keeps
/// 106 MiB"; and a timeline point can fall inside the teardown.
///
/// An interpreter that is not initialized ended only if it was initialized once:
/// before `Py_Initialize` ends (a point at start-up, or a program that links libpython
/// and never starts it) it is no teardown.
pub(super) fn teardown_began() -> bool {
    if !crate::hotpath::python::enabled() {
        return false;
    }
    if is_finalizing_fn().is_some_and(|f| f() != 0) {
        return true;
    }
    let Some(initialized) = is_initialized_fn() else { return false };
    if initialized() != 0 {
        WAS_INITIALIZED.store(true, Ordering::Relaxed);
        return false;
    }
    WAS_INITIALIZED.load(Ordering::Relaxed)
}

/// Set once `Py_IsInitialized` said 1 (`teardown_began`), or the atexit callback ran.
static WAS_INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Runs on the interpreter's main thread, with the GIL, at a safe point: `atexit.register
/// (leaktrace_before_finalize)`. Always returns 0 (-1 would raise in the program). Not
/// untracked: the interpreter allocates and reallocates its own blocks here (the list
/// of callbacks), which must stay in the model as any of the program's (an untracked
/// `realloc` of a tracked block left a stale entry, and the counts disagreed by one).
extern "C" fn register(_: *mut c_void) -> c_int {
    let _ = std::panic::catch_unwind(|| {
        let Some(a) = api() else { return };
        // SAFETY: the GIL is held here (a pending call); every object made is released;
        // a failure clears the exception it set.
        unsafe {
            let module = (a.import)(c"atexit".as_ptr());
            if module.is_null() {
                (a.clear_error)();
                return;
            }
            let reg = (a.getattr)(module, c"register".as_ptr());
            let func = (a.new_function)(&DEF, std::ptr::null_mut(), std::ptr::null_mut());
            if !reg.is_null() && !func.is_null() {
                let out = (a.call)(reg, func, std::ptr::null_mut::<PyObject>());
                if out.is_null() {
                    (a.clear_error)();
                } else {
                    (a.decref)(out);
                }
            } else {
                (a.clear_error)();
            }
            for o in [func, reg, module] {
                if !o.is_null() {
                    (a.decref)(o);
                }
            }
        }
    });
    0
}

/// The atexit callback: the holders of the growing stacks, while modules still hold
/// them. Returns `None` (a new reference), or null with no exception set never.
unsafe extern "C" fn before_finalize(_: *mut PyObject, _: *mut PyObject) -> *mut PyObject {
    let _errno = crate::os::ErrnoGuard::save();
    let _ = std::panic::catch_unwind(|| {
        crate::hotpath::thread::untracked(|| {
            // The memory as the program left it: the final report's is measured after
            // the interpreter's teardown freed its modules (malloc then holds ~100 MB
            // of freed memory after `import torch`), which is no state of the program's
            // run. This point ends the timeline's memory series instead.
            super::reports::record_point();
            WAS_INITIALIZED.store(true, Ordering::Relaxed);
            super::reports::INTERPRETER_FINALIZING.store(true, Ordering::Release);
            super::reports::held_before_exit();
            // The teardown ahead frees more than it allocates: the main thread's hit
            // tree, grown to 8 MiB by the run's paths, and the large rule table (4 MiB)
            // are only taking room at the process's peak, which is at its end.
            crate::hotpath::unwind::give_back_caches();
        })
    });
    match api() {
        Some(a) => {
            // SAFETY: `None` is immortal or counted; the caller takes the reference.
            unsafe { (a.incref)(a.none) };
            a.none
        }
        None => std::ptr::null_mut(),
    }
}
