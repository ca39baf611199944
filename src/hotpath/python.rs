//! Python frames of the allocating thread, captured as raw values: for each frame of the
//! thread's own CPython frame chain, the code object (registered once, see `codes`) and
//! the instruction offset. Names and lines are worked out off the hot path
//! (`report::python`), from what the registry copied while the code object was alive.
//!
//! A thread's frame chain changes only under that thread, so reading our own needs no
//! GIL: the frames are live for as long as the thread is inside the call that
//! allocates, and each holds a strong reference to its code object.
//!
//! The layout comes from the interpreter itself on 3.13 (`_Py_DebugOffsets`, the first
//! field of `_PyRuntime`), and from a table for 3.9–3.12 (offsets read from each
//! version's own headers with `offsetof`). Every code object met is checked to be a
//! code object (its type is `PyCode_Type`) before anything is read from it; a mismatch
//! turns Python frames off. An unknown or free-threaded interpreter turns them off with
//! one line on stderr; native stacks keep working either way.
use super::stacks::SharedTail;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// At most this many Python frames per stack (the innermost ones).
pub const MAX_PY_FRAMES: usize = 96;

/// First word of an interned stack that carries Python frames: `[PY_STACK, native id,
/// id of the Python part]`. No code address is this high.
pub const PY_STACK: u64 = 0xffff_ffff_ffff_ff50;
/// First word of an interned Python part: `[PY_FRAMES, python words…]`.
pub const PY_FRAMES: u64 = 0xffff_ffff_ffff_ff51;

/// The Python frame words of a stack with Python frames (`[PY_STACK, native, python]`),
/// innermost first; `None` for a native stack.
pub fn python_words(stack: &[u64]) -> Option<Vec<u64>> {
    if stack.first() != Some(&PY_STACK) {
        return None;
    }
    let part = crate::hotpath::stacks::frames(*stack.get(2)? as u32)?;
    (part.first() == Some(&PY_FRAMES)).then(|| part[1..].to_vec())
}

/// A Python frame word: code id (32 bits), instruction offset in bytes (31 bits), and
/// whether this frame is the outermost one its native eval call runs (bit 0).
#[inline(always)]
pub fn frame_word(code_id: u32, offset: u64, entry: bool) -> u64 {
    (code_id as u64) << 32 | (offset & 0x7fff_ffff) << 1 | entry as u64
}

pub fn word_code(w: u64) -> u32 {
    (w >> 32) as u32
}

pub fn word_offset(w: u64) -> u64 {
    (w >> 1) & 0x7fff_ffff
}

pub fn word_is_entry(w: u64) -> bool {
    w & 1 != 0
}

/// How the interpreter keeps its frame chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// 3.9, 3.10: `PyFrameObject`s linked by `f_back`; `f_lasti` an int (bytes in 3.9,
    /// code units in 3.10). One native eval call per frame.
    FrameObjects,
    /// 3.11, 3.12: `tstate->cframe->current_frame`, `_PyInterpreterFrame`s with
    /// `prev_instr`.
    CFrame,
    /// 3.13: `tstate->current_frame`, with `instr_ptr`.
    Direct,
}

/// Where the fields are, for one interpreter version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub minor: u8,
    pub model: Model,
    tstate_frame: usize,
    cframe_current: usize,
    frame_back: usize,
    frame_code: usize,
    frame_instr: usize,
    /// The frame's owner byte (3.12+), whose `FRAME_OWNED_BY_CSTACK` marks the shim
    /// frame each native eval call pushes; 0 when absent.
    frame_owner: usize,
    /// The frame's `is_entry` byte (3.11); 0 when absent.
    frame_is_entry: usize,
    code_adaptive: usize,
    code_filename: usize,
    code_name: usize,
    /// 0 where the version has no `co_qualname` (before 3.11).
    code_qualname: usize,
    code_firstlineno: usize,
    code_linetable: usize,
    ascii_size: usize,
    compact_size: usize,
}

const OWNED_BY_CSTACK: u8 = 3;
const UNICODE_STATE: usize = 32;
const UNICODE_LENGTH: usize = 16;
const BYTES_SIZE: usize = 16;
const BYTES_DATA: usize = 32;
const OB_TYPE: usize = 8;

/// Offsets of 3.9 to 3.12, as `offsetof` gives them from each version's headers
/// (`Py_BUILD_CORE`, x86-64).
pub fn table_layout(minor: u8) -> Option<Layout> {
    let old = |lasti| Layout {
        minor,
        model: Model::FrameObjects,
        tstate_frame: 24,
        cframe_current: 0,
        frame_back: 24,
        frame_code: 32,
        frame_instr: lasti,
        frame_owner: 0,
        frame_is_entry: 0,
        code_adaptive: 0,
        code_filename: 104,
        code_name: 112,
        code_qualname: 0,
        code_firstlineno: 40,
        code_linetable: 120,
        ascii_size: 48,
        compact_size: 72,
    };
    Some(match minor {
        9 => old(104),
        10 => old(96),
        11 => Layout {
            minor,
            model: Model::CFrame,
            tstate_frame: 56,
            cframe_current: 8,
            frame_back: 48,
            frame_code: 32,
            frame_instr: 56,
            frame_owner: 0,
            frame_is_entry: 68,
            code_adaptive: 184,
            code_filename: 112,
            code_name: 120,
            code_qualname: 128,
            code_firstlineno: 72,
            code_linetable: 136,
            ascii_size: 48,
            compact_size: 72,
        },
        12 => Layout {
            minor,
            model: Model::CFrame,
            tstate_frame: 56,
            cframe_current: 0,
            frame_back: 8,
            frame_code: 0,
            frame_instr: 56,
            frame_owner: 70,
            frame_is_entry: 0,
            code_adaptive: 192,
            code_filename: 112,
            code_name: 120,
            code_qualname: 128,
            code_firstlineno: 68,
            code_linetable: 136,
            ascii_size: 40,
            compact_size: 56,
        },
        _ => return None,
    })
}

/// The 3.13 layout from the interpreter's `_Py_DebugOffsets` (given as its 64-bit
/// words): `None` unless the cookie, the version and a GIL build are what 3.13 writes.
pub fn debug_offsets_layout(words: &[u64]) -> Result<Layout, String> {
    if words.len() < 71 || &words[0].to_le_bytes() != b"xdebugpy" {
        return Err("no _Py_DebugOffsets".into());
    }
    let (major, minor) = ((words[1] >> 24) & 0xff, (words[1] >> 16) & 0xff);
    if (major, minor) != (3, 13) {
        return Err(format!("Python {major}.{minor}"));
    }
    if words[2] != 0 {
        return Err("a free-threaded Python 3.13".into());
    }
    let w = |i: usize| words[i] as usize;
    // interpreter_frame.owner (33) is what the header calls it; the state word (68) of
    // a unicode object must be where the table has it.
    if w(68) != UNICODE_STATE || w(69) != UNICODE_LENGTH || w(65) != BYTES_SIZE || w(66) != BYTES_DATA {
        return Err("unexpected object layout in _Py_DebugOffsets".into());
    }
    Ok(Layout {
        minor: 13,
        model: Model::Direct,
        tstate_frame: w(23),
        cframe_current: 0,
        frame_back: w(29),
        frame_code: w(30),
        frame_instr: w(31),
        frame_owner: w(33),
        frame_is_entry: 0,
        code_adaptive: w(43),
        code_filename: w(35),
        code_name: w(36),
        code_qualname: w(37),
        code_firstlineno: w(39),
        code_linetable: w(38),
        ascii_size: w(70),
        // PyCompactUnicodeObject adds utf8_length and utf8 to PyASCIIObject.
        compact_size: w(70) + 16,
    })
}

/// The interpreter's version string, from its `Py_GetVersion` at `version_fn`.
///
/// # Safety
/// `version_fn` must be the address of CPython's `const char *Py_GetVersion(void)`
/// (it formats a static buffer and may be called before initialisation).
pub unsafe fn version_of(version_fn: usize) -> String {
    // SAFETY: as the caller vouches.
    unsafe {
        let f: extern "C" fn() -> *const libc::c_char = std::mem::transmute(version_fn);
        std::ffi::CStr::from_ptr(f()).to_string_lossy().into_owned()
    }
}

/// "3.11.7 (main, …)" → 11.
pub fn minor_of_version(v: &str) -> Option<u8> {
    let mut parts = v.split(|c: char| !c.is_ascii_digit());
    (parts.next()? == "3").then_some(())?;
    parts.next()?.parse().ok()
}

struct Interp {
    layout: Layout,
    is_initialized: extern "C" fn() -> i32,
    this_thread_state: extern "C" fn() -> usize,
    code_type: u64,
}

static ON: AtomicBool = AtomicBool::new(false);
static INTERP: AtomicPtr<Interp> = AtomicPtr::new(std::ptr::null_mut());
/// Set when the first frame read had no code object where the layout says: Python
/// frames stop.
static BROKEN: AtomicBool = AtomicBool::new(false);
/// Set once a frame's code object passed the type check.
static MATCHED: AtomicBool = AtomicBool::new(false);

/// Whether Python frames are being captured.
pub fn enabled() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The interpreter's minor version, when Python frames are on.
pub fn minor() -> Option<u8> {
    enabled().then(|| interp().map(|i| i.layout.minor)).flatten()
}

/// Where the running interpreter (3.11+, Python frames on) keeps what a reader of its
/// frame stack names a frame by: the code object's type, the frame's code offset, and a
/// code object's file name, qualified name and first line (a C int).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeFields {
    pub code_type: u64,
    pub frame_code: u64,
    pub filename: u64,
    pub qualname: u64,
    pub firstlineno: u64,
}

/// `CodeFields` of the running interpreter; `None` with Python frames off or before
/// 3.11 (no `co_qualname`).
pub fn code_fields() -> Option<CodeFields> {
    let i = interp().filter(|_| enabled())?;
    let l = &i.layout;
    (l.code_qualname != 0).then_some(CodeFields {
        code_type: i.code_type,
        frame_code: l.frame_code as u64,
        filename: l.code_filename as u64,
        qualname: l.code_qualname as u64,
        firstlineno: l.code_firstlineno as u64,
    })
}

/// `co_code_adaptive`'s offset in the version's table (3.11, 3.12; 0 otherwise: 3.13's
/// is read from the interpreter at run time).
pub fn table_code_adaptive(minor: u8) -> u64 {
    table_layout(minor).map_or(0, |l| l.code_adaptive as u64)
}

fn interp() -> Option<&'static Interp> {
    let p = INTERP.load(Ordering::Acquire);
    // SAFETY: set once to a leaked Box, never freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// What `init` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    NoPython,
    On(u8),
    /// A Python whose frames cannot be read: the stderr line to print.
    Off(String),
}

/// Whether Python frames are wanted (`LEAKTRACE_PYTHON`), as the library's start said:
/// an interpreter loaded later (`init_loaded`) gets them then.
static WANTED: AtomicBool = AtomicBool::new(false);

/// Looks for a CPython in the process (the executable or a library it loaded) and turns
/// Python frames on when its layout is known. Runs at start-up, before the program's
/// `main` (and so before the interpreter runs any Python).
pub fn init(wanted: bool) -> Found {
    WANTED.store(wanted, Ordering::Relaxed);
    // One walk of the modules' tables answers for the four names a program without an
    // interpreter (most of them) lacks; `init_with` is given those answers, and looks up
    // any other name itself.
    let needed = [c"Py_IsInitialized", c"PyGILState_GetThisThreadState", c"PyCode_Type", c"Py_GetVersion"];
    let found = crate::os::loader::global_symbols(needed);
    if interp().is_none() && found.iter().any(Option::is_none) {
        return Found::NoPython;
    }
    init_with(wanted, &crate::os::loader::global_symbols_or_lookup(needed, found))
}

/// A CPython that the program loaded itself (`dlopen` of libpython, as a C++ program
/// that embeds Python does) is found when the program looks up the function that
/// starts it (`dlsym(handle, "Py_Initialize")`): `symbol` finds names in that library.
/// Returns the stderr line to print when its frames cannot be read; nothing when frames
/// are on already, or not wanted.
pub fn init_loaded(symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> Option<String> {
    if interp().is_some() || !WANTED.load(Ordering::Relaxed) {
        return None;
    }
    match init_with(true, symbol) {
        Found::Off(line) if !line.is_empty() => Some(line),
        _ => None,
    }
}

fn init_with(wanted: bool, symbol: &dyn Fn(&std::ffi::CStr) -> Option<usize>) -> Found {
    if interp().is_some() {
        return Found::On(minor().unwrap_or(0));
    }
    let (Some(init_fn), Some(tstate_fn), Some(code_type), Some(version_fn)) =
        (symbol(c"Py_IsInitialized"), symbol(c"PyGILState_GetThisThreadState"), symbol(c"PyCode_Type"), symbol(c"Py_GetVersion"))
    else {
        return Found::NoPython;
    };
    if !wanted {
        return Found::Off(String::new());
    }
    // SAFETY: the interpreter's exported `Py_GetVersion`.
    let version = unsafe { version_of(version_fn) };
    let short = version.split_whitespace().next().unwrap_or("?").to_string();
    let layout = match minor_of_version(&version) {
        Some(m) if m >= 13 => {
            if let Some(runtime) = symbol(c"_PyRuntime") {
                let mut words = [0u64; 71];
                // SAFETY: _PyRuntime is the interpreter's static runtime state, far
                // larger than 71 words; its first field is _Py_DebugOffsets.
                unsafe { std::ptr::copy_nonoverlapping(runtime as *const u64, words.as_mut_ptr(), words.len()) };
                debug_offsets_layout(&words)
            } else {
                Err("no _PyRuntime".to_string())
            }
        }
        Some(m) => table_layout(m).ok_or_else(|| format!("Python 3.{m}")),
        None => Err("an interpreter that is not CPython 3".into()),
    };
    let layout = match layout {
        Ok(l) => l,
        Err(why) => return Found::Off(format!("leaktrace: Python {short}: frames of {why} cannot be read (CPython 3.9 to 3.13 are); stacks stay native")),
    };
    if !codes::init() {
        return Found::Off("leaktrace: no memory for the Python code registry; stacks stay native".into());
    }
    let interp = Box::new(Interp {
        layout,
        // SAFETY: both are the interpreter's exported functions of these signatures.
        is_initialized: unsafe { std::mem::transmute::<usize, extern "C" fn() -> i32>(init_fn) },
        this_thread_state: unsafe { std::mem::transmute::<usize, extern "C" fn() -> usize>(tstate_fn) },
        code_type: code_type as u64,
    });
    let interp = Box::into_raw(interp);
    if INTERP.compare_exchange(std::ptr::null_mut(), interp, Ordering::AcqRel, Ordering::Acquire).is_err() {
        // Another thread found it first (two `dlsym`s at once): its answer stands.
        // SAFETY: ours, never published.
        drop(unsafe { Box::from_raw(interp) });
        return Found::On(minor().unwrap_or(0));
    }
    ON.store(true, Ordering::Release);
    Found::On(layout.minor)
}

/// Reads a word of the interpreter's memory.
///
/// # Safety
/// `addr` must be readable: a field of a live object of the layout.
#[inline(always)]
unsafe fn word(addr: u64) -> u64 {
    // SAFETY: the caller vouches for the address.
    unsafe { std::ptr::read(addr as *const u64) }
}

#[inline(always)]
fn plausible(p: u64) -> bool {
    p >= 4096 && p & 7 == 0 && p < (1 << 47)
}

/// Writes the calling thread's Python frames (innermost first) as frame words into
/// `out`; returns how many. 0 when the thread runs no Python (or Python frames are off).
///
/// `cache`, the calling thread's own (see `ThreadCache`), spares the shared registry's
/// lookup for the code objects the thread met recently.
#[inline]
pub fn capture(out: &mut [u64], cache: Option<&mut ThreadCache>) -> usize {
    if !enabled() {
        return 0;
    }
    let Some(py) = interp() else { return 0 };
    if (py.is_initialized)() == 0 {
        return 0;
    }
    let tstate = (py.this_thread_state)() as u64;
    if !plausible(tstate) {
        return 0;
    }
    // SAFETY: below, every address read is a field of the thread state the interpreter
    // gave us for this thread, or of a frame on its chain, or of a code object such a
    // frame holds: all live while this thread is inside the call (see the module notes).
    unsafe { walk(py, tstate, out, cache) }
}

const THREAD_CODES: usize = 512;
const THREAD_PARTS: usize = 256;
/// (native, Python) pairs: sets of `COMBINED_WAYS` by native id, one cache line each.
const COMBINED_SETS: usize = 2048;
const COMBINED_WAYS: usize = 4;

/// One thread's caches of the ids a capture looks up (145 KiB, kept in the
/// thread's unwind memo; all-zero bytes are a valid empty cache). A training loop
/// allocates again and again under the same code objects, the same Python parts and
/// the same (native, Python) pairs; the shared tables behind them hold millions of
/// stacks after `import torch`, and each of their lookups is a cache miss or three.
#[repr(C)]
pub struct ThreadCache {
    /// By code object address: (code, a mix of the objects it points to, id).
    codes: [(u64, u64, u64); THREAD_CODES],
    /// By hash of the Python part's words: (hash, id).
    parts: [(u64, u64); THREAD_PARTS],
    /// By native id, then (native << 32 | python, epoch << 32 | combined id) in one of
    /// the set's ways. A set depends on the native id alone, so its line can be loaded
    /// (`prefetch_combined`) while the Python frames are walked: the lookup was a cache
    /// miss, the largest single item of the Python part of a capture.
    combined: [CombinedSet; COMBINED_SETS],
    /// The Python part interned last through `parts`' miss: its words, their number (0:
    /// none), its id and epoch. The next new part shares its outer frames
    /// (`shared_tail`).
    last_part: [u64; 1 + MAX_PY_FRAMES],
    last_len: usize,
    last_id: u32,
    last_epoch: u32,
}

/// The fewest outer frames a new Python part shares with the last one to refer to it
/// for them (fewer are not worth a link of a chain).
const MIN_SHARED: usize = 4;

#[repr(C, align(64))]
struct CombinedSet([(u64, u64); COMBINED_WAYS]);

impl ThreadCache {
    /// The code id cached for `code`, whose file name, name and line table objects mix
    /// to `mix`.
    #[inline(always)]
    fn code(&self, code: u64, mix: u64) -> Option<u32> {
        let e = &self.codes[slot_of(code, THREAD_CODES)];
        (e.0 == code && e.1 == mix && e.2 != 0).then_some(e.2 as u32)
    }

    #[inline(always)]
    fn put_code(&mut self, code: u64, mix: u64, id: u32) {
        self.codes[slot_of(code, THREAD_CODES)] = (code, mix, id as u64);
    }

    /// The id of the Python part of hash `h` (64 bits: a collision is out of reach).
    #[inline(always)]
    pub fn part(&self, h: u64) -> Option<u32> {
        let e = &self.parts[(h as usize) & (THREAD_PARTS - 1)];
        (e.0 == h && e.1 != 0).then_some(e.1 as u32)
    }

    #[inline(always)]
    pub fn put_part(&mut self, h: u64, id: u32) {
        self.parts[(h as usize) & (THREAD_PARTS - 1)] = (h, id as u64);
    }

    /// Starts loading the set that `combined` will read for `native`.
    #[inline(always)]
    pub fn prefetch_combined(&self, native: u32) {
        super::mapping::prefetch_line(&self.combined[slot_of(native as u64, COMBINED_SETS)]);
    }

    /// The combined id of (`native`, `python`) interned in `epoch`.
    #[inline(always)]
    pub fn combined(&self, native: u32, python: u32, epoch: u32) -> Option<u32> {
        let key = (native as u64) << 32 | python as u64;
        let set = &self.combined[slot_of(native as u64, COMBINED_SETS)].0;
        set.iter().find(|e| e.0 == key && (e.1 >> 32) as u32 == epoch && e.1 as u32 != 0).map(|e| e.1 as u32)
    }

    /// Files a combined id: in the way that holds the pair already or an empty one, else
    /// in a way chosen by the Python part (the pairs of one native stack spread).
    #[inline(always)]
    pub fn put_combined(&mut self, native: u32, python: u32, epoch: u32, id: u32) {
        let key = (native as u64) << 32 | python as u64;
        let set = &mut self.combined[slot_of(native as u64, COMBINED_SETS)].0;
        let way = set.iter().position(|e| e.0 == key || e.1 as u32 == 0).unwrap_or(python as usize % COMBINED_WAYS);
        set[way] = (key, (epoch as u64) << 32 | id as u64);
    }

    /// The outer frames that the Python part `words` (`[PY_FRAMES, frames…]`, captured
    /// in `epoch`) shares with the last one interned: a part of an import nested 40
    /// frames deep differs from the one before in its innermost few. 38k parts of
    /// `import torch` kept 42 frames each, 9.4 MB of the frame arena.
    #[inline]
    pub fn shared_tail(&self, words: &[u64], epoch: u32) -> Option<SharedTail> {
        let (n, m) = (words.len(), self.last_len.min(self.last_part.len()));
        if m == 0 || self.last_id == 0 || self.last_epoch != epoch {
            return None;
        }
        // Each keeps at least its first word (the marker) as its own.
        let most = n.min(m) - 1;
        let common = words.iter().rev().zip(self.last_part[..m].iter().rev()).take(most).take_while(|(a, b)| a == b).count();
        (common >= MIN_SHARED).then_some(SharedTail { own: n - common, parent: self.last_id, first: m - common, count: common })
    }

    /// Keeps `words`, interned as `id` in `epoch`, for the next `shared_tail`.
    #[inline]
    pub fn put_last_part(&mut self, words: &[u64], id: u32, epoch: u32) {
        let n = words.len().min(self.last_part.len());
        self.last_part[..n].copy_from_slice(&words[..n]);
        (self.last_len, self.last_id, self.last_epoch) = (n, id, epoch);
    }
}

#[inline(always)]
fn slot_of(key: u64, slots: usize) -> usize {
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize & (slots - 1)
}

/// # Safety
/// `tstate` must be this thread's live thread state of the layout `py.layout`.
#[inline(always)]
unsafe fn walk(py: &Interp, tstate: u64, out: &mut [u64], mut cache: Option<&mut ThreadCache>) -> usize {
    let l = &py.layout;
    // SAFETY: as the caller vouches.
    let mut frame = unsafe { word(tstate + l.tstate_frame as u64) };
    if l.model == Model::CFrame {
        if !plausible(frame) {
            return 0;
        }
        // SAFETY: the thread's _PyCFrame, live while it runs.
        frame = unsafe { word(frame + l.cframe_current as u64) };
    }
    let mut n = 0;
    let limit = out.len();
    let mut steps = 0;
    while plausible(frame) && n < limit && steps < 4 * MAX_PY_FRAMES {
        steps += 1;
        // SAFETY: `frame` is on this thread's chain.
        let back = unsafe { word(frame + l.frame_back as u64) };
        if l.frame_owner != 0 && unsafe { *((frame + l.frame_owner as u64) as *const u8) } == OWNED_BY_CSTACK {
            // The shim a native eval call pushes: the frame before it was that call's
            // outermost.
            if n > 0 {
                out[n - 1] |= 1;
            }
            frame = back;
            continue;
        }
        // SAFETY: as above.
        let code = unsafe { word(frame + l.frame_code as u64) };
        if !plausible(code) || unsafe { word(code + OB_TYPE as u64) } != py.code_type {
            // A layout that never once found a code object is wrong: frames go off.
            if !MATCHED.load(Ordering::Relaxed) {
                BROKEN.store(true, Ordering::Relaxed);
                ON.store(false, Ordering::Relaxed);
                return 0;
            }
            break;
        }
        if !MATCHED.load(Ordering::Relaxed) {
            MATCHED.store(true, Ordering::Relaxed);
        }
        // SAFETY: fields of this frame and of its (live) code object.
        let (offset, entry) = unsafe {
            match l.model {
                Model::FrameObjects => {
                    let lasti = *((frame + l.frame_instr as u64) as *const i32);
                    let units = if l.minor == 9 { 1 } else { 2 };
                    ((lasti.max(0) as u64) * units, true)
                }
                Model::CFrame | Model::Direct => {
                    let ip = word(frame + l.frame_instr as u64);
                    let start = code + l.code_adaptive as u64;
                    let entry = l.frame_is_entry != 0 && *((frame + l.frame_is_entry as u64) as *const u8) != 0;
                    (ip.saturating_sub(start), entry)
                }
            }
        };
        // SAFETY: `code` is a live code object (checked above).
        let id = unsafe { codes::id_of(l, code, cache.as_deref_mut()) };
        out[n] = frame_word(id, offset, entry);
        n += 1;
        frame = back;
    }
    if n > 0 && l.model != Model::FrameObjects {
        out[n - 1] |= 1;
    }
    n
}

/// Whether a code object ever failed the type check (Python frames were turned off).
pub fn broke() -> bool {
    BROKEN.load(Ordering::Relaxed)
}

/// The registry of code objects met in captures: each gets an id and a copy of what
/// its lines and names are worked out from (file name, name, first line, line table),
/// made while it is alive, so that a report can name it after it is gone. A code
/// object freed and another made at the same address is told apart by the objects it
/// points to. Lock-free: an id is reserved with one atomic add, the copy goes to an
/// append-only mapping, and the record is published with one release store.
pub mod codes {
    use super::*;

    const SLOTS: usize = 1 << 16;
    const PROBES: usize = 8;
    const MAX_CODES: usize = 1 << 20;
    const ARENA_BYTES: usize = 1 << 30;
    const MAX_TEXT: usize = 4096;
    const MAX_TABLE: usize = 1 << 20;

    /// One code object, as copied. The strings and the table follow it in the arena.
    #[repr(C)]
    pub struct CodeRecord {
        code: u64,
        filename_obj: u64,
        name_obj: u64,
        linetable_obj: u64,
        pub firstlineno: i32,
        pub minor: u8,
        filename_len: u32,
        name_len: u32,
        table_len: u32,
    }

    impl CodeRecord {
        fn tail(&self) -> *const u8 {
            // SAFETY: the bytes follow the record in the same arena allocation.
            unsafe { (self as *const CodeRecord as *const u8).add(std::mem::size_of::<CodeRecord>()) }
        }

        pub fn filename(&self) -> &[u8] {
            // SAFETY: written before the record was published, never changed after.
            unsafe { std::slice::from_raw_parts(self.tail(), self.filename_len as usize) }
        }

        pub fn name(&self) -> &[u8] {
            // SAFETY: as for `filename`.
            unsafe { std::slice::from_raw_parts(self.tail().add(self.filename_len as usize), self.name_len as usize) }
        }

        pub fn line_table(&self) -> &[u8] {
            let at = self.filename_len as usize + self.name_len as usize;
            // SAFETY: as for `filename`.
            unsafe { std::slice::from_raw_parts(self.tail().add(at), self.table_len as usize) }
        }
    }

    static SLOT_TABLE: AtomicUsize = AtomicUsize::new(0);
    static RECORDS: AtomicUsize = AtomicUsize::new(0);
    static ARENA: AtomicUsize = AtomicUsize::new(0);
    static ARENA_USED: AtomicUsize = AtomicUsize::new(0);
    static NEXT_ID: AtomicU32 = AtomicU32::new(1);
    static FULL: AtomicU64 = AtomicU64::new(0);

    pub(super) fn init() -> bool {
        let slots = crate::hotpath::mapping::map_zeroed(SLOTS * 8, crate::os::own::Part::Python);
        let records = crate::hotpath::mapping::map_zeroed(MAX_CODES * 8, crate::os::own::Part::Python);
        let arena = crate::hotpath::mapping::map_zeroed(ARENA_BYTES, crate::os::own::Part::Python);
        match (slots, records, arena) {
            (Some(s), Some(r), Some(a)) => {
                SLOT_TABLE.store(s as usize, Ordering::Release);
                RECORDS.store(r as usize, Ordering::Release);
                ARENA.store(a as usize, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    fn slot(i: usize) -> &'static AtomicU64 {
        // SAFETY: the slot table is a zeroed mapping of SLOTS words, never unmapped;
        // AtomicU64 has u64's layout.
        unsafe { &*((SLOT_TABLE.load(Ordering::Relaxed) as *const AtomicU64).add(i & (SLOTS - 1))) }
    }

    fn record_slot(id: u32) -> Option<&'static AtomicU64> {
        let base = RECORDS.load(Ordering::Acquire);
        // SAFETY: as for `slot`, MAX_CODES words.
        (base != 0 && (id as usize) < MAX_CODES).then(|| unsafe { &*((base as *const AtomicU64).add(id as usize)) })
    }

    /// The record of a code id (what `id_of` handed out), once published.
    pub fn record(id: u32) -> Option<&'static CodeRecord> {
        let p = record_slot(id)?.load(Ordering::Acquire);
        // SAFETY: a published record in the arena, never changed or freed.
        (p != 0).then(|| unsafe { &*(p as *const CodeRecord) })
    }

    /// Code objects registered so far.
    pub fn count() -> u32 {
        NEXT_ID.load(Ordering::Relaxed) - 1
    }

    /// Code objects not registered because the registry was full.
    pub fn full() -> u64 {
        FULL.load(Ordering::Relaxed)
    }

    /// The id of a live code object, registering it on first sight; 0 when the
    /// registry is full.
    ///
    /// # Safety
    /// `code` must be a live code object of layout `l`.
    #[inline(always)]
    pub unsafe fn id_of(l: &Layout, code: u64, cache: Option<&mut ThreadCache>) -> u32 {
        // SAFETY: fields of a live code object.
        let (f, n, t) = unsafe { (word(code + l.code_filename as u64), word(code + name_field(l) as u64), word(code + l.code_linetable as u64)) };
        // The thread's cache is trusted as far as the registry is: same address, same
        // objects (mixed into one word; a mix that matches by chance after the address
        // was reused needs three new objects whose addresses collide in 64 bits).
        let mix = f.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ n.rotate_left(21).wrapping_mul(0xc2b2_ae3d_27d4_eb4f) ^ t.rotate_left(42);
        if let Some(c) = cache.as_deref() {
            if let Some(id) = c.code(code, mix) {
                return id;
            }
        }
        // SAFETY: as the caller vouches.
        let id = unsafe { shared_id_of(l, code, f, n, t) };
        if let Some(c) = cache {
            if id != 0 {
                c.put_code(code, mix, id);
            }
        }
        id
    }

    /// # Safety
    /// As for `id_of`; `f`, `n`, `t` are its file name, name and line table objects.
    #[inline(always)]
    unsafe fn shared_id_of(l: &Layout, code: u64, f: u64, n: u64, t: u64) -> u32 {
        let home = (code.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48) as usize;
        for k in 0..PROBES {
            let p = slot(home + k).load(Ordering::Acquire);
            if p == 0 {
                break;
            }
            // SAFETY: a published record (see `record`).
            let r = unsafe { &*(p as *const CodeRecord) };
            if r.code == code && r.filename_obj == f && r.name_obj == n && r.linetable_obj == t {
                // The id is the index its record was published at: kept beside it.
                // SAFETY: the id word precedes the record in its arena allocation.
                return unsafe { *((p - 8) as *const u32) };
            }
        }
        // SAFETY: as the caller vouches.
        unsafe { register(l, code, f, n, t, home) }
    }

    fn name_field(l: &Layout) -> usize {
        if l.code_qualname != 0 {
            l.code_qualname
        } else {
            l.code_name
        }
    }

    /// # Safety
    /// As for `id_of`; `f`, `n`, `t` are its file name, name and line table objects.
    #[inline(never)]
    unsafe fn register(l: &Layout, code: u64, f: u64, n: u64, t: u64, home: usize) -> u32 {
        // SAFETY: the objects a live code object holds are live.
        let (fname, name, table) = unsafe { (text_of(l, f), text_of(l, n), bytes_of(t)) };
        let (fname_len, name_len) = (utf8_len(&fname), utf8_len(&name));
        let table_len = table.map_or(0, |(_, len)| len.min(MAX_TABLE));
        let need = (8 + std::mem::size_of::<CodeRecord>() + fname_len + name_len + table_len).next_multiple_of(8);
        let at = ARENA_USED.fetch_add(need, Ordering::Relaxed);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let Some(rslot) = record_slot(id).filter(|_| at + need <= ARENA_BYTES) else {
            FULL.fetch_add(1, Ordering::Relaxed);
            return 0;
        };
        let base = ARENA.load(Ordering::Relaxed) + at;
        let rec = base + 8;
        // SAFETY: [base, base + need) was reserved above for this record alone, inside
        // the arena mapping; the copies read live objects.
        unsafe {
            *(base as *mut u32) = id;
            std::ptr::write(
                rec as *mut CodeRecord,
                CodeRecord {
                    code,
                    filename_obj: f,
                    name_obj: n,
                    linetable_obj: t,
                    firstlineno: *((code + l.code_firstlineno as u64) as *const i32),
                    minor: l.minor,
                    filename_len: fname_len as u32,
                    name_len: name_len as u32,
                    table_len: table_len as u32,
                },
            );
            let mut dst = (rec as usize + std::mem::size_of::<CodeRecord>()) as *mut u8;
            dst = write_utf8(&fname, dst);
            dst = write_utf8(&name, dst);
            if let Some((src, _)) = table {
                std::ptr::copy_nonoverlapping(src, dst, table_len);
            }
        }
        rslot.store(rec as u64, Ordering::Release);
        // Into the first free slot of its window, or over its home slot.
        let target = (0..PROBES).map(|k| slot(home + k)).find(|s| s.load(Ordering::Relaxed) == 0).unwrap_or_else(|| slot(home));
        target.store(rec as u64, Ordering::Release);
        id
    }

    /// A string object's characters: (data, length, bytes per character), or empty.
    struct Text {
        data: *const u8,
        len: usize,
        width: usize,
    }

    /// # Safety
    /// `s` must be null or a live `str` object.
    unsafe fn text_of(l: &Layout, s: u64) -> Text {
        let empty = Text { data: std::ptr::null(), len: 0, width: 1 };
        if !plausible(s) {
            return empty;
        }
        // SAFETY: header fields of a live unicode object.
        let (state, len) = unsafe { (*((s + UNICODE_STATE as u64) as *const u32), word(s + UNICODE_LENGTH as u64) as usize) };
        let (kind, compact, ascii) = ((state >> 2) & 7, state >> 5 & 1 != 0, state >> 6 & 1 != 0);
        if !compact || !matches!(kind, 1 | 2 | 4) {
            return empty;
        }
        let header = if ascii { l.ascii_size } else { l.compact_size };
        Text { data: (s as usize + header) as *const u8, len: len.min(MAX_TEXT), width: kind as usize }
    }

    /// # Safety
    /// `b` must be null or a live `bytes` object.
    unsafe fn bytes_of(b: u64) -> Option<(*const u8, usize)> {
        if !plausible(b) {
            return None;
        }
        // SAFETY: header of a live bytes object.
        let len = unsafe { word(b + BYTES_SIZE as u64) } as usize;
        Some(((b as usize + BYTES_DATA) as *const u8, len))
    }

    fn char_at(t: &Text, i: usize) -> u32 {
        // SAFETY: i < t.len, inside the object's character data.
        unsafe {
            match t.width {
                1 => *t.data.add(i) as u32,
                2 => *(t.data as *const u16).add(i) as u32,
                _ => *(t.data as *const u32).add(i),
            }
        }
    }

    fn utf8_len(t: &Text) -> usize {
        (0..t.len).map(|i| char::from_u32(char_at(t, i)).map_or(3, char::len_utf8)).sum()
    }

    /// # Safety
    /// `dst` must have room for `utf8_len(t)` bytes.
    unsafe fn write_utf8(t: &Text, mut dst: *mut u8) -> *mut u8 {
        for i in 0..t.len {
            let c = char::from_u32(char_at(t, i)).unwrap_or('\u{fffd}');
            let mut buf = [0u8; 4];
            let s = c.encode_utf8(&mut buf);
            // SAFETY: the caller reserved utf8_len bytes, the sum of these.
            unsafe {
                std::ptr::copy_nonoverlapping(s.as_ptr(), dst, s.len());
                dst = dst.add(s.len());
            }
        }
        dst
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_cache() -> Box<ThreadCache> {
        // SAFETY: all-zero bytes are a valid empty cache (plain integers throughout).
        unsafe { Box::new(std::mem::zeroed()) }
    }

    #[test]
    fn a_new_python_part_shares_the_outer_frames_of_the_last_one() {
        let mut c = empty_cache();
        let part = |inner: &[u64], outer: usize| {
            let mut w = vec![PY_FRAMES];
            w.extend_from_slice(inner);
            w.extend((0..outer as u64).map(|i| 0x6100_0000 + i * 8));
            w
        };
        let a = part(&[0x10, 0x11], 30);
        assert!(c.shared_tail(&a, 2).is_none(), "nothing interned yet");
        let a_id = crate::hotpath::stacks::intern(2, &a);
        c.put_last_part(&a, a_id, 2);
        // Three new innermost frames, then 29 of a's 30 outer ones.
        let b = [vec![PY_FRAMES, 0x20, 0x21, 0x22], a[4..].to_vec()].concat();
        let tail = c.shared_tail(&b, 2).unwrap();
        assert_eq!((tail.own, tail.parent, tail.first, tail.count), (4, a_id, 4, 29));
        let b_id = crate::hotpath::stacks::intern_hashed(2, &b, Some(tail), crate::hotpath::stacks::hash_frames(2, &b));
        assert_eq!(crate::hotpath::stacks::frames(b_id).unwrap(), b);
        assert_eq!(crate::hotpath::stacks::intern(2, &b), b_id);
        // Another epoch, too few frames in common, or the same part: no tail, or one that
        // leaves the marker its own.
        assert!(c.shared_tail(&b, 3).is_none());
        assert!(c.shared_tail(&part(&[0x30], 3), 2).is_none());
        let same = c.shared_tail(&a, 2).unwrap();
        assert_eq!((same.own, same.first, same.count), (1, 1, a.len() - 1));
        // A deeper part shares the whole of a shallower one's outer frames.
        c.put_last_part(&b, b_id, 2);
        let deep = [vec![PY_FRAMES, 0x40, 0x41], b[1..].to_vec()].concat();
        let t = c.shared_tail(&deep, 2).unwrap();
        assert_eq!((t.own, t.first, t.count), (3, 1, b.len() - 1));
        let id = crate::hotpath::stacks::intern_hashed(2, &deep, Some(t), crate::hotpath::stacks::hash_frames(2, &deep));
        assert_eq!(crate::hotpath::stacks::frames(id).unwrap(), deep);
    }

    #[test]
    fn thread_cache_answers_only_what_it_was_told() {
        let mut c = empty_cache();
        assert_eq!(c.code(0x1000, 7), None);
        c.put_code(0x1000, 7, 42);
        assert_eq!(c.code(0x1000, 7), Some(42));
        // Same address, other objects: a new code object there.
        assert_eq!(c.code(0x1000, 8), None);
        c.put_combined(5, 6, 1, 99);
        assert_eq!(c.combined(5, 6, 1), Some(99));
        assert_eq!(c.combined(5, 6, 2), None, "another dlclose epoch");
        assert_eq!(c.combined(6, 5, 1), None);
        // One native stack under more Python parts than a set has ways: each answer is
        // right or missing, never another pair's; a pair filed again is answered; the
        // latest epoch's id replaces an older one.
        for python in 10..30u32 {
            c.put_combined(5, python, 1, 1000 + python);
        }
        for python in 10..30u32 {
            assert!(c.combined(5, python, 1).is_none_or(|id| id == 1000 + python));
        }
        assert_eq!(c.combined(5, 29, 1), Some(1029));
        c.put_combined(5, 29, 2, 2029);
        assert_eq!((c.combined(5, 29, 1), c.combined(5, 29, 2)), (None, Some(2029)));
        let held = (10..30u32).filter(|&p| c.combined(5, p, 1).is_some()).count();
        assert!(held <= COMBINED_WAYS, "{held}");
        c.put_part(0xabcdef, 17);
        assert_eq!(c.part(0xabcdef), Some(17));
        assert_eq!(c.part(0xabcdef + THREAD_PARTS as u64), None);
    }

    #[test]
    fn words_round_trip() {
        let w = frame_word(77, 1234, true);
        assert_eq!((word_code(w), word_offset(w), word_is_entry(w)), (77, 1234, true));
        let w = frame_word(u32::MAX, 0x7fff_ffff, false);
        assert_eq!((word_code(w), word_offset(w), word_is_entry(w)), (u32::MAX, 0x7fff_ffff, false));
    }

    #[test]
    fn versions_and_tables() {
        assert_eq!(minor_of_version("3.11.7 (main, May  9 2026, 07:35:25) [GCC 12.2.0]"), Some(11));
        assert_eq!(minor_of_version("3.9.18"), Some(9));
        assert_eq!(minor_of_version("2.7.18"), None);
        for m in 9..=12 {
            assert_eq!(table_layout(m).unwrap().minor, m);
        }
        assert!(table_layout(8).is_none() && table_layout(13).is_none());
    }

    #[test]
    fn debug_offsets_of_3_13() {
        let mut words = [0u64; 71];
        words[0] = u64::from_le_bytes(*b"xdebugpy");
        words[1] = 0x030d00f0;
        (words[23], words[29], words[30], words[31], words[33]) = (72, 8, 0, 56, 70);
        (words[35], words[36], words[37], words[38], words[39], words[43]) = (112, 120, 128, 136, 68, 200);
        (words[65], words[66], words[68], words[69], words[70]) = (16, 32, 32, 16, 40);
        let l = debug_offsets_layout(&words).unwrap();
        assert_eq!((l.tstate_frame, l.frame_instr, l.code_adaptive, l.compact_size), (72, 56, 200, 56));
        words[2] = 1;
        assert!(debug_offsets_layout(&words).unwrap_err().contains("free-threaded"));
        words[2] = 0;
        words[1] = 0x030e0000;
        assert!(debug_offsets_layout(&words).unwrap_err().contains("3.14"));
        words[0] = 0;
        assert!(debug_offsets_layout(&words).is_err());
    }
}
