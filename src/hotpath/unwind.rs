//! Stack capture on the hot path: raw return addresses, no symbolization.
//!
//! Code built without frame pointers (distro binaries, `-O2`) can only be unwound with
//! its DWARF call-frame information (`.eh_frame`). Interpreting CFI for every frame of
//! every allocation is what makes libunwind/libgcc-based tracers slow, so this unwinder
//! keeps two caches:
//!
//! 1. a process-wide, lock-free **rule cache**: return address -> compact x86-64 rule
//!    (CFA = RSP/RBP + k, return address at CFA-8, RBP saved at CFA+j or unchanged),
//!    computed once per address with gimli from the module's `.eh_frame_hdr`, which
//!    glibc's lock-free `_dl_find_object` hands us;
//! 2. a per-thread **memo** of recent unwinds: an unwind is a pure function of the start
//!    registers and the stack words it reads, so if the stack pointer is the same and
//!    every word read last time still holds the same value, the result is the same stack
//!    id and nothing needs to be unwound or hashed again (the common case of a loop that
//!    allocates at the bottom of a deep call chain).
//!
//! Every memory read is bounds-checked against the thread's own stack, so a wrong rule
//! (say, after 65536 dlclose epochs wrap) can produce a wrong stack but never a fault.
//! Frames the compact rule cannot express (signal trampolines, DWARF expressions) end
//! the stack there.
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use gimli::{BaseAddresses, CfaRule, EhFrame, EhFrameHdr, NativeEndian, Pointer, RegisterRule, UnwindContext, UnwindSection, X86_64};

use super::hit_tree::HitTree;
use super::stacks;
use super::thread::{self, ThreadState};

/// Upper bound on the configurable depth; keeps the hook's stack use small (~4 KiB).
pub const MAX_DEPTH: usize = crate::config::MAX_DEPTH;

#[repr(C)]
struct DlFindObject {
    flags: u64,
    map_start: *mut c_void,
    map_end: *mut c_void,
    link_map: *mut LinkMap,
    eh_frame: *mut c_void,
    reserved: [u64; 7],
}

/// The public head of glibc's `struct link_map` (<link.h>).
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
}

type FindObjectFn = unsafe extern "C" fn(*mut c_void, *mut DlFindObject) -> c_int;

static FIND_OBJECT: AtomicUsize = AtomicUsize::new(0);
static OWN_START: AtomicU64 = AtomicU64::new(0);
static OWN_END: AtomicU64 = AtomicU64::new(0);
/// Bumped after each dlclose: addresses may now belong to another module.
static EPOCH: AtomicU32 = AtomicU32::new(0);
static MEMO_KEY: AtomicUsize = AtomicUsize::new(usize::MAX);

/// A loaded module found by address.
#[derive(Clone, Copy, Debug)]
pub struct ObjectInfo {
    pub map_start: u64,
    pub map_end: u64,
    /// Load bias (`l_addr`): file virtual address = runtime address - base.
    pub base: u64,
    /// NUL-terminated path as the loader knows it ("" for the main program).
    pub name: *const c_char,
    eh_frame_hdr: u64,
}

/// Resolves `_dl_find_object` and the library's own address range. Called once from
/// the constructor (it may allocate through `dlsym`).
pub fn init() -> bool {
    if !resolve_find_object() {
        return false;
    }
    crate::os::stack::note_main_thread();
    // In unit tests the "library" is the test binary itself: skip nothing there.
    #[cfg(not(test))]
    if let Some(own) = find_object(capture_stack_id as *const () as u64) {
        OWN_START.store(own.map_start, Ordering::Relaxed);
        OWN_END.store(own.map_end, Ordering::Relaxed);
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: valid out pointer; the destructor is an extern "C" fn that never unwinds.
    if unsafe { libc::pthread_key_create(&mut key, Some(memo_destructor)) } == 0 {
        MEMO_KEY.store(key as usize, Ordering::Release);
    }
    true
}

/// Resolves `_dl_find_object` (glibc 2.35+) for `find_object`; whether it exists.
pub fn resolve_find_object() -> bool {
    if FIND_OBJECT.load(Ordering::Acquire) != 0 {
        return true;
    }
    // The loader's own symbol, found in the modules' tables as the real functions are
    // (`os::elf`: no lock, no allocation); `dlsym` only where that walk cannot tell (a
    // `dlsym` through our own export was a few microseconds of every process's start).
    let [mut f] = crate::os::elf::next_definitions([c"_dl_find_object"], resolve_find_object as *const () as usize);
    if f == 0 {
        // SAFETY: dlsym with a valid NUL-terminated name; RTLD_DEFAULT is a valid handle.
        f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) } as usize;
    }
    if f == 0 {
        return false;
    }
    FIND_OBJECT.store(f, Ordering::Release);
    true
}

pub fn available() -> bool {
    FIND_OBJECT.load(Ordering::Acquire) != 0
}

pub fn epoch() -> u32 {
    EPOCH.load(Ordering::Acquire)
}

pub fn bump_epoch() {
    EPOCH.fetch_add(1, Ordering::AcqRel);
}

pub fn is_own_address(ip: u64) -> bool {
    ip >= OWN_START.load(Ordering::Relaxed) && ip < OWN_END.load(Ordering::Relaxed)
}

/// Finds the module containing `addr` without taking any loader lock.
pub fn find_object(addr: u64) -> Option<ObjectInfo> {
    let f = FIND_OBJECT.load(Ordering::Acquire);
    if f == 0 {
        return None;
    }
    // SAFETY: `f` was returned by dlsym for `_dl_find_object`, whose C signature is
    // `int (void *, struct dl_find_object *)`.
    let f: FindObjectFn = unsafe { std::mem::transmute::<usize, FindObjectFn>(f) };
    let mut out = std::mem::MaybeUninit::<DlFindObject>::zeroed();
    // SAFETY: out points to a writable dl_find_object; glibc fills it or returns -1.
    if unsafe { f(addr as *mut c_void, out.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: initialised by the successful call (and zeroed before).
    let out = unsafe { out.assume_init() };
    let (base, name) = if out.link_map.is_null() {
        (0, std::ptr::null())
    } else {
        // SAFETY: glibc returns a live link_map for the object containing addr.
        unsafe { ((*out.link_map).l_addr, (*out.link_map).l_name) }
    };
    Some(ObjectInfo { map_start: out.map_start as u64, map_end: out.map_end as u64, base: base as u64, name, eh_frame_hdr: out.eh_frame as u64 })
}

/// A module as the report needs it: path, load bias and mapped range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleOf {
    /// Empty for the main program (the loader does not name it).
    pub path: String,
    pub base: u64,
    pub start: u64,
    pub end: u64,
}

/// Which loaded module holds `ip` (off the hot path: used by the symbolizer).
pub fn module_of(ip: u64) -> Option<ModuleOf> {
    let o = find_object(ip)?;
    let path = if o.name.is_null() {
        String::new()
    } else {
        // SAFETY: l_name is a NUL-terminated string owned by the loader, valid while the
        // module is loaded (it is: `ip` was just found inside it).
        unsafe { std::ffi::CStr::from_ptr(o.name) }.to_string_lossy().into_owned()
    };
    Some(ModuleOf { path, base: o.base, start: o.map_start, end: o.map_end })
}

// ---- compact rules -------------------------------------------------------------------

const VALID: u64 = 1;
const CFA_RBP: u64 = 1 << 1;
const RBP_SAVED: u64 = 1 << 2;
const OUTERMOST: u64 = 1 << 3;
const UNSUPPORTED: u64 = 1 << 4;

fn pack_i24(v: i64) -> Option<u64> {
    if (-(1 << 23)..(1 << 23)).contains(&v) {
        Some((v as u64) & 0xff_ffff)
    } else {
        None
    }
}

fn unpack_i24(bits: u64) -> i64 {
    (((bits & 0xff_ffff) << 40) as i64) >> 40
}

fn compute_rule(lookup_ip: u64) -> u64 {
    compute_rule_inner(lookup_ip).unwrap_or(VALID | UNSUPPORTED)
}

type Section = gimli::EndianSlice<'static, NativeEndian>;

/// Reads of the modules' unwind tables so far (`with_fde`): the collector gives their
/// pages back after a point at which this moved (`os::unwind_tables`).
static CFI_READS: AtomicU64 = AtomicU64::new(0);

pub fn cfi_reads() -> u64 {
    CFI_READS.load(Ordering::Relaxed)
}

/// Runs `f` on the FDE (the CFI of one function) that covers `lookup_ip`, found through
/// the module's `.eh_frame_hdr` search table, with the FDE's address as its identity.
fn with_fde<R>(lookup_ip: u64, f: impl FnOnce(&EhFrame<Section>, &BaseAddresses, &gimli::FrameDescriptionEntry<Section>, u64) -> Option<R>) -> Option<R> {
    CFI_READS.fetch_add(1, Ordering::Relaxed);
    let obj = find_object(lookup_ip)?;
    if obj.eh_frame_hdr == 0 || obj.eh_frame_hdr >= obj.map_end {
        return None;
    }
    // SAFETY: the PT_GNU_EH_FRAME segment lies inside the object's mapping, which stays
    // mapped while code from it is on our stack; gimli only reads the header, the
    // search table, and the FDE/CIE it points at.
    let hdr: &'static [u8] = unsafe { std::slice::from_raw_parts(obj.eh_frame_hdr as *const u8, (obj.map_end - obj.eh_frame_hdr) as usize) };
    let bases = BaseAddresses::default().set_eh_frame_hdr(obj.eh_frame_hdr);
    let parsed = EhFrameHdr::new(hdr, NativeEndian).parse(&bases, 8).ok()?;
    let eh_frame_addr = match parsed.eh_frame_ptr() {
        Pointer::Direct(a) => a,
        Pointer::Indirect(_) => return None,
    };
    if eh_frame_addr >= obj.map_end || eh_frame_addr < obj.map_start {
        return None;
    }
    // A module that keeps `.eh_frame` in a writable segment is read from a view of its
    // file (`os::unwind_view`), the others where the loader mapped them.
    // SAFETY: `obj` is the loaded module that holds `lookup_ip`, as the loader gave it.
    let view = unsafe { crate::os::unwind_view::eh_frame(obj.map_start, obj.map_end, obj.base, obj.name, eh_frame_addr) };
    // SAFETY: as above, `.eh_frame` is inside the object's mapping.
    let eh: &'static [u8] = view.unwrap_or_else(|| unsafe { std::slice::from_raw_parts(eh_frame_addr as *const u8, (obj.map_end - eh_frame_addr) as usize) });
    let eh_frame = EhFrame::new(eh, NativeEndian);
    let bases = bases.set_eh_frame(eh_frame_addr);
    let fde = match standard_table_fde(hdr, obj.eh_frame_hdr, lookup_ip) {
        Some(found) => {
            let offset = usize::try_from(found?.checked_sub(eh_frame_addr)?).ok()?;
            let fde = eh_frame.fde_from_offset(&bases, gimli::EhFrameOffset(offset), |s, b, o| s.cie_from_offset(b, o)).ok()?;
            // The table's entry at or below the address, whose FDE may end before it.
            if !fde.contains(lookup_ip) {
                return None;
            }
            fde
        }
        None => parsed.table()?.fde_for_address(&eh_frame, &bases, lookup_ip, |s, b, o| s.cie_from_offset(b, o)).ok()?,
    };
    f(&eh_frame, &bases, &fde, eh_frame_addr + fde.offset() as u64)
}

/// The address of the FDE whose entry in `.eh_frame_hdr`'s search table is the last at
/// or below `ip`, for a table in the encoding linkers write (GNU ld, gold, lld, mold:
/// version 1, the count as `udata4`, each entry two `sdata4` relative to the header's
/// start, sorted by address): `Some(None)` where no entry is; `None` for any other
/// encoding, which gimli's search then reads. gimli decodes each probe through its
/// generic pointer parser, ~1.7k instructions a lookup (callgrind: 103 lookups in `git
/// --version`, 173k instructions); as pairs of `i32` it is a plain binary search. `hdr`
/// starts at the header, at address `hdr_addr`.
fn standard_table_fde(hdr: &[u8], hdr_addr: u64, ip: u64) -> Option<Option<u64>> {
    const UDATA4: u8 = 0x03;
    const SDATA4: u8 = 0x0b;
    const DATAREL_SDATA4: u8 = 0x3b;
    // The pointer to `.eh_frame` before the count takes 4 bytes in a 4-byte format.
    let (&[version, ptr_enc, count_enc, table_enc], rest) = hdr.split_first_chunk::<4>()?;
    if version != 1 || count_enc != UDATA4 || table_enc != DATAREL_SDATA4 || !matches!(ptr_enc & 0x0f, UDATA4 | SDATA4) {
        return None;
    }
    let count = u32::from_ne_bytes(*rest.get(4..8)?.first_chunk::<4>()?) as usize;
    let table = rest.get(8..8 + count.checked_mul(8)?)?;
    let word = |at: usize| i32::from_ne_bytes([table[at], table[at + 1], table[at + 2], table[at + 3]]) as i64;
    // Both in one module: the difference fits.
    let target = ip.wrapping_sub(hdr_addr) as i64;
    let (mut lo, mut hi) = (0, count);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if word(8 * mid) <= target {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    Some(lo.checked_sub(1).map(|k| hdr_addr.wrapping_add_signed(word(8 * k + 4))))
}

/// Runs `f` on the CFI row that covers `lookup_ip`.
fn with_cfi_row<R>(lookup_ip: u64, f: impl FnOnce(&gimli::UnwindTableRow<usize>) -> Option<R>) -> Option<R> {
    with_fde(lookup_ip, |eh_frame, bases, fde, _| {
        let mut ctx = UnwindContext::new();
        let row = fde.unwind_info_for_address(eh_frame, bases, &mut ctx, lookup_ip).ok()?;
        f(row)
    })
}

/// The compact rule of one CFI row, `None` when the row needs more than it can say.
fn rule_of_row(row: &gimli::UnwindTableRow<usize>) -> Option<u64> {
    let mut rule = VALID;
    match row.register(X86_64::RA) {
        Some(RegisterRule::Undefined) => return Some(VALID | OUTERMOST),
        Some(RegisterRule::Offset(-8)) => {}
        _ => return None,
    }
    match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } => {
            if *register == X86_64::RBP {
                rule |= CFA_RBP;
            } else if *register != X86_64::RSP {
                return None;
            }
            rule |= pack_i24(*offset)? << 8;
        }
        CfaRule::Expression(_) => return None,
    }
    match row.register(X86_64::RBP) {
        None | Some(RegisterRule::Undefined) | Some(RegisterRule::SameValue) => {}
        Some(RegisterRule::Offset(off)) => rule |= RBP_SAVED | (pack_i24(off)? << 32),
        _ => return None,
    }
    Some(rule)
}

/// The compact rules of every row of the FDEs parsed last: a function's CFI is a
/// program run from the function's start, so finding the row of one address costs as
/// much as finding them all. Without this, a large function reached from many call
/// sites (the interpreter loop, framework dispatchers) ran its program once per call
/// site; it was the largest cost of a first `import torch` under the library.
///
/// Only the last `KEPT_FDES` FDEs keep their rows. Each return address's rule is kept in
/// the shared rule cache anyway, so an FDE's rows serve only the call sites in it met
/// for the first time later, and nearly all come soon after one another: in `import
/// torch`, keeping the rows of every FDE met (24k FDEs, 472k rows: ~6 MB of our heap
/// in the program's malloc, for good) spared 3,085 parses of 27,519; keeping the last
/// 64 spares 2,137 (25,293 parses, 489k rows read: +3.6%).
struct FdeRules {
    epoch: u32,
    /// `(FDE address, its rows)`, the oldest replaced first once `KEPT_FDES` are kept.
    kept: Vec<(u64, FdeRows)>,
    next_kept: usize,
    /// The address ranges `(start, end, FDE address)` of the FDEs asked for last. Call
    /// sites met one after another are mostly in one function (a static initialiser
    /// registering thousands of operators: 87% of the 200k rules computed in `import
    /// torch` were in one of the last 8 FDEs), and a range that holds the address skips
    /// the module lookup, the binary search of `.eh_frame_hdr` and the FDE's parse.
    recent: [(u64, u64, u64); RECENT_FDES],
    next_recent: usize,
}

/// FDEs whose rows are kept (`FdeRules::kept`).
const KEPT_FDES: usize = 64;
const RECENT_FDES: usize = 8;

impl FdeRules {
    fn new(epoch: u32) -> FdeRules {
        FdeRules { epoch, kept: Vec::new(), next_kept: 0, recent: [(0, 0, 0); RECENT_FDES], next_recent: 0 }
    }

    /// Forgets everything if a module was unloaded since (another may now sit at the
    /// same addresses).
    fn at_epoch(&mut self, epoch: u32) -> &mut FdeRules {
        if self.epoch != epoch {
            *self = FdeRules::new(epoch);
        }
        self
    }

    /// The rule at `ip` if a recent FDE covers it (`Some(None)`: covered, but not
    /// expressible), `None` if none does.
    fn recent_rule(&self, ip: u64) -> Option<Option<u64>> {
        let &(_, _, key) = self.recent.iter().find(|r| r.0 <= ip && ip < r.1)?;
        Some(rule_in(self.rows_of(key)?, ip))
    }

    /// The kept rows of the FDE at `key`.
    fn rows_of(&self, key: u64) -> Option<&FdeRows> {
        self.kept.iter().find(|k| k.0 == key).map(|k| &k.1)
    }

    /// The rows of the FDE at `key`, from `parse` unless kept; kept from now on, in
    /// place of the oldest once `KEPT_FDES` are.
    fn rows(&mut self, key: u64, parse: impl FnOnce() -> FdeRows) -> &FdeRows {
        let i = match self.kept.iter().position(|k| k.0 == key) {
            Some(i) => i,
            None if self.kept.len() < KEPT_FDES => {
                self.kept.push((key, parse()));
                self.kept.len() - 1
            }
            None => {
                let i = self.next_kept % KEPT_FDES;
                self.next_kept = self.next_kept.wrapping_add(1);
                self.kept[i] = (key, parse());
                i
            }
        };
        &self.kept[i].1
    }

    /// Notes the FDE at `key` as asked for last, if its rows are kept (a range that is
    /// no longer kept answers nothing: `recent_rule`).
    fn remember(&mut self, key: u64) {
        let Some(rows) = self.rows_of(key) else { return };
        let range = (rows.start, rows.end, key);
        if rows.start < rows.end && !self.recent.contains(&range) {
            self.recent[self.next_recent % RECENT_FDES] = range;
            self.next_recent = self.next_recent.wrapping_add(1);
        }
    }
}

/// One FDE's rows in 12 bytes each (`import torch` meets 24k FDEs with 470k rows: 15 MB
/// as `(start, end, rule)` triples in vectors, 6 MB so): a row's start as an offset
/// from the first one's, and its rule; a row ends where the next one starts, the last
/// one at `end`. A gap between two rows is a row of its own, with no rule.
struct FdeRows {
    start: u64,
    end: u64,
    /// `[start offset, rule low, rule high]`, by start.
    rows: Box<[[u32; 3]]>,
}

impl FdeRows {
    /// From gimli's rows `(start, end, rule)` in order; empty where an FDE spans 4 GiB.
    fn new(rows: &[(u64, u64, u64)]) -> FdeRows {
        let (Some(first), Some(last)) = (rows.first(), rows.last()) else { return FdeRows { start: 0, end: 0, rows: Box::new([]) } };
        let (start, end) = (first.0, last.1);
        if end.wrapping_sub(start) > u32::MAX as u64 || end < start {
            return FdeRows { start: 0, end: 0, rows: Box::new([]) };
        }
        let row = |at: u64, rule: u64| [(at - start) as u32, rule as u32, (rule >> 32) as u32];
        let mut out = Vec::with_capacity(rows.len());
        let mut prev_end = start;
        for &(s, e, rule) in rows {
            if s < prev_end || e < s || e > end {
                // Out of order: none of it is trusted.
                return FdeRows { start: 0, end: 0, rows: Box::new([]) };
            }
            if s > prev_end {
                out.push(row(prev_end, VALID | UNSUPPORTED));
            }
            out.push(row(s, rule));
            prev_end = e;
        }
        FdeRows { start, end, rows: out.into_boxed_slice() }
    }

    /// The rule of the row that covers `ip`.
    fn rule_at(&self, ip: u64) -> Option<u64> {
        if ip < self.start || ip >= self.end {
            return None;
        }
        let off = (ip - self.start) as u32;
        let i = self.rows.partition_point(|r| r[0] <= off).checked_sub(1)?;
        let [_, lo, hi] = self.rows[i];
        let rule = u64::from(lo) | u64::from(hi) << 32;
        (rule & UNSUPPORTED == 0).then_some(rule)
    }
}

/// The rule of the row (of one FDE's rows) that covers `ip`.
fn rule_in(rows: &FdeRows, ip: u64) -> Option<u64> {
    rows.rule_at(ip)
}

/// Only ever `try_lock`ed: a thread that finds it busy (or held by a thread that did
/// not survive a fork) computes its one row instead, so no hook waits on it.
static FDE_RULES: std::sync::Mutex<Option<FdeRules>> = std::sync::Mutex::new(None);

fn compute_rule_inner(lookup_ip: u64) -> Option<u64> {
    if let Ok(mut cache) = FDE_RULES.try_lock() {
        if let Some(rule) = cache.as_mut().and_then(|c| c.at_epoch(epoch()).recent_rule(lookup_ip)) {
            return rule;
        }
    }
    with_fde(lookup_ip, |eh_frame, bases, fde, key| {
        let epoch = epoch();
        let Ok(mut cache) = FDE_RULES.try_lock() else {
            let mut ctx = UnwindContext::new();
            return rule_of_row(fde.unwind_info_for_address(eh_frame, bases, &mut ctx, lookup_ip).ok()?);
        };
        let cache = cache.get_or_insert_with(|| FdeRules::new(epoch)).at_epoch(epoch);
        let rows = cache.rows(key, || {
            let mut rows = Vec::new();
            let mut ctx = UnwindContext::new();
            if let Ok(mut table) = fde.rows(eh_frame, bases, &mut ctx) {
                while let Ok(Some(row)) = table.next_row() {
                    let rule = rule_of_row(row).unwrap_or(VALID | UNSUPPORTED);
                    rows.push((row.start_address(), row.end_address(), rule));
                }
            }
            FdeRows::new(&rows)
        });
        let rule = rule_in(rows, lookup_ip);
        cache.remember(key);
        rule
    })
}

// ---- whole-frame walk (off the hot path) -------------------------------------------

/// One frame of the calling thread's stack, as `walk_own_stack` reports it.
#[derive(Clone, Copy, Debug)]
pub struct FrameSpan {
    /// The code the frame belongs to (a return address, or the walk's own position).
    pub ip: u64,
    /// The frame occupies `[sp, cfa)`.
    pub sp: u64,
    pub cfa: u64,
    /// Where this frame saved its caller's callee-saved registers (rbx, rbp, r12-r15).
    pub saved: [Option<u64>; 6],
}

/// How the walk ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalkEnd {
    /// The outermost frame was reached.
    Outermost,
    /// A frame could not be unwound (no CFI, a DWARF expression, a signal frame): the
    /// stack from this address up was not described.
    Unknown(u64),
}

/// The callee-saved registers of the x86-64 System V ABI other than rsp.
const CALLEE_SAVED: [gimli::Register; 6] = [X86_64::RBX, X86_64::RBP, X86_64::R12, X86_64::R13, X86_64::R14, X86_64::R15];

/// Walks the calling thread's stack from the caller of this function outwards with the
/// full CFI of every frame (not the hot path's compact rules): where each frame lies and
/// where it saved its caller's registers. `callee_saved` receives the current values of
/// those registers (whatever no frame saved still holds an outer frame's value). Reads
/// only inside `[sp, stack_end)`. May allocate (gimli): not while threads are stopped.
#[inline(never)]
pub fn walk_own_stack(stack_end: u64, callee_saved: &mut [u64; 6], mut f: impl FnMut(&FrameSpan)) -> WalkEnd {
    let (ip0, sp0, bp0) = registers();
    let regs: [u64; 5];
    // SAFETY: copies five registers; no memory access, no stack change.
    unsafe {
        let (rbx, r12, r13, r14, r15): (u64, u64, u64, u64, u64);
        std::arch::asm!(
            "mov {a}, rbx", "mov {b}, r12", "mov {c}, r13", "mov {d}, r14", "mov {e}, r15",
            a = out(reg) rbx, b = out(reg) r12, c = out(reg) r13, d = out(reg) r14, e = out(reg) r15,
            options(nomem, nostack, preserves_flags)
        );
        regs = [rbx, r12, r13, r14, r15];
    }
    *callee_saved = [regs[0], bp0, regs[1], regs[2], regs[3], regs[4]];
    let read = |addr: u64| -> Option<u64> {
        if addr < sp0 || addr.checked_add(8)? > stack_end || !addr.is_multiple_of(8) {
            return None;
        }
        // SAFETY: [sp0, stack_end) is the live part of this thread's own stack.
        Some(unsafe { std::ptr::read(addr as *const u64) })
    };
    let (mut ip, mut sp, mut bp) = (ip0, sp0, bp0);
    let mut first = true;
    for _ in 0..1024 {
        let lookup = if first { ip } else { ip.wrapping_sub(1) };
        let step = with_cfi_row(lookup, |row| {
            if matches!(row.register(X86_64::RA), Some(RegisterRule::Undefined)) {
                return Some(None);
            }
            let cfa = match row.cfa() {
                CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => sp.wrapping_add(*offset as u64),
                CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => bp.wrapping_add(*offset as u64),
                _ => return None,
            };
            let mut saved = [None; 6];
            for (slot, reg) in saved.iter_mut().zip(CALLEE_SAVED) {
                if let Some(RegisterRule::Offset(o)) = row.register(reg) {
                    *slot = Some(cfa.wrapping_add(o as u64));
                }
            }
            Some(Some((cfa, saved)))
        });
        let Some(step) = step else { return WalkEnd::Unknown(sp) };
        let Some((cfa, saved)) = step else { return WalkEnd::Outermost };
        if cfa <= sp || cfa > stack_end {
            return WalkEnd::Unknown(sp);
        }
        let Some(ra) = read(cfa - 8) else { return WalkEnd::Unknown(sp) };
        f(&FrameSpan { ip, sp, cfa, saved });
        if let Some(a) = saved[1] {
            match read(a) {
                Some(v) => bp = v,
                None => return WalkEnd::Unknown(cfa),
            }
        }
        sp = cfa;
        ip = ra;
        first = false;
        if ra == 0 {
            return WalkEnd::Outermost;
        }
    }
    WalkEnd::Unknown(sp)
}

// ---- rule cache ----------------------------------------------------------------------

// Three tables, like the stack index (`hotpath::stacks`): a lookup probes a window of
// the tiny table, then of the small one, then the large one. A short program with a
// few hundred return addresses (`git --version`: ~100) stays in the tiny one: spread
// over the small table they faulted in 51 of its 64 pages, two page faults each (a read
// maps the zero page, the claim copies it), ~0.3 ms of a 1.4 ms run. A program with a
// few thousand (Python starting up: ~1,000) stays in the tiny and small ones: spread
// over the large table they had faulted in nearly all of its 1,024 pages.
const TINY_RULE_SLOTS: usize = 1 << 9;
const TINY_RULE_PROBES: usize = 8;
const FIRST_RULE_SLOTS: usize = 1 << 14;
const FIRST_RULE_PROBES: usize = 8;
const RULE_SLOTS: usize = 1 << 18;
const RULE_PROBES: usize = 16;
/// The tables, in one mapping: the tiny one first, then the small one.
const RULE_TABLE_ENTRIES: usize = TINY_RULE_SLOTS + FIRST_RULE_SLOTS + RULE_SLOTS;

struct RuleEntry {
    key: AtomicU64,
    rule: AtomicU64,
}

static RULES: AtomicPtr<RuleEntry> = AtomicPtr::new(std::ptr::null_mut());
/// Entries filled in the small table (prefetched only once there are some).
static FIRST_RULES_USED: AtomicUsize = AtomicUsize::new(0);
/// Entries filled in the large table.
static RULES_USED: AtomicUsize = AtomicUsize::new(0);

/// The rule tables: tiny, small, large.
struct RuleTables {
    tiny: &'static [RuleEntry],
    first: &'static [RuleEntry],
    large: &'static [RuleEntry],
}

impl RuleTables {
    /// Probe `k` of the sequence that starts at slot `start` (`shared_slot`): a window
    /// of the tiny table, then of the small one, then of the large one; and which table
    /// it is in (0, 1, 2).
    #[inline(always)]
    fn probe(&self, start: usize, k: usize) -> (&'static RuleEntry, u8) {
        if k < TINY_RULE_PROBES {
            (&self.tiny[(start + k) & (TINY_RULE_SLOTS - 1)], 0)
        } else if k < TINY_RULE_PROBES + FIRST_RULE_PROBES {
            (&self.first[(start + k - TINY_RULE_PROBES) & (FIRST_RULE_SLOTS - 1)], 1)
        } else {
            (&self.large[(start + k - TINY_RULE_PROBES - FIRST_RULE_PROBES) & (RULE_SLOTS - 1)], 2)
        }
    }
}

/// The three rule tables, mapped at the first call.
fn rule_tables() -> Option<RuleTables> {
    let mut p = RULES.load(Ordering::Acquire);
    if p.is_null() {
        let bytes = RULE_TABLE_ENTRIES * std::mem::size_of::<RuleEntry>();
        let m = super::mapping::map_zeroed(bytes, super::mapping::Part::Unwind)?;
        match RULES.compare_exchange(std::ptr::null_mut(), m as *mut RuleEntry, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => p = m as *mut RuleEntry,
            Err(winner) => {
                super::mapping::unmap(m, bytes);
                p = winner;
            }
        }
    }
    // SAFETY: the mapping holds RULE_TABLE_ENTRIES zero-initialised entries and lives
    // forever.
    let all = unsafe { std::slice::from_raw_parts(p, RULE_TABLE_ENTRIES) };
    let (tiny, rest) = all.split_at(TINY_RULE_SLOTS);
    let (first, large) = rest.split_at(FIRST_RULE_SLOTS);
    Some(RuleTables { tiny, first, large })
}

/// Where a shared entry's rule word keeps `rule_check` of its key: a rule's own bits end
/// at 56 (`pack_i24(..) << 32`).
const RULE_CHECK_SHIFT: u32 = 56;
const RULE_BITS: u64 = (1 << RULE_CHECK_SHIFT) - 1;

/// Eight bits of `key` that its entry's rule word carries. A claim writes the key, then
/// the rule; if the large table's pages were given back in between (`give_back_rules`),
/// the rule lands in a slot whose key reads 0 again, and the next key to claim the slot
/// would find it there before its own: a reader takes a rule only with its key's check.
#[inline(always)]
fn rule_check(key: u64) -> u64 {
    let z = (key ^ key >> 31).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z >> RULE_CHECK_SHIFT
}

/// Gives back the pages of the large rule table (4 MiB, all resident after `import
/// torch`): at the Python interpreter's exit, whose teardown frees far more than it
/// allocates, and whose few new rules the tiny and small tables hold. Lookups go on
/// meanwhile: an entry read as zeros is computed and claimed again, and a rule that a
/// claim stores after its key was dropped is told apart by its check (`rule_check`).
/// Returns the bytes given back. Not under a seccomp filter (`madvise`).
pub fn give_back_rules() -> usize {
    let Some(t) = (!RULES.load(Ordering::Acquire).is_null()).then(rule_tables).flatten() else { return 0 };
    if RULES_USED.load(Ordering::Relaxed) == 0 {
        return 0;
    }
    let start = t.large.as_ptr() as usize;
    // SAFETY: the large table, a page-aligned part of our own anonymous mapping (the
    // tables before it are whole pages: 8 KiB and 256 KiB) that lives forever; zeros are
    // an empty table (see above for the lookups meanwhile).
    let given = unsafe { super::mapping::give_back_pages(start, start + std::mem::size_of_val(t.large)) };
    RULES_USED.store(0, Ordering::Relaxed);
    given
}

#[inline]
fn rule_key(lookup_ip: u64, epoch: u32) -> u64 {
    lookup_ip ^ ((epoch as u64 & 0xffff) << 48) ^ (1 << 63)
}

/// Where `key` sits in a thread's copy of the rule cache.
#[inline(always)]
fn l1_slot(key: u64) -> usize {
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) as usize & (L1_RULES - 1)
}

/// Where a probe for `key` starts in the shared rule cache (both tables: the small one
/// takes the low bits).
#[inline(always)]
fn shared_slot(key: u64) -> usize {
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 46) as usize & (RULE_SLOTS - 1)
}

#[inline]
fn rule_cached(lookup_ip: u64, epoch: u32, l1: Option<&mut [(u64, u64); L1_RULES]>) -> u64 {
    let Some(l1) = l1 else { return rule_for(lookup_ip, epoch) };
    let key = rule_key(lookup_ip, epoch);
    let slot = &mut l1[l1_slot(key)];
    if slot.0 == key {
        return slot.1;
    }
    let rule = rule_for(lookup_ip, epoch);
    *slot = (key, rule);
    rule
}

/// Starts loading the shared rule-cache line of `lookup_ip` if the thread's own copy
/// does not hold it: the unwind asks for it after this frame's bookkeeping, and a
/// return address new to the thread is usually a miss in the 4 MB shared table.
#[inline(always)]
fn prefetch_rule(lookup_ip: u64, epoch: u32, l1: Option<&[(u64, u64); L1_RULES]>) {
    let key = rule_key(lookup_ip, epoch);
    if l1.is_some_and(|l1| l1[l1_slot(key)].0 == key) {
        return;
    }
    if let Some(t) = rule_tables() {
        let i = shared_slot(key);
        super::mapping::prefetch_line(t.probe(i, 0).0);
        if FIRST_RULES_USED.load(Ordering::Relaxed) != 0 {
            super::mapping::prefetch_line(t.probe(i, TINY_RULE_PROBES).0);
        }
        if RULES_USED.load(Ordering::Relaxed) != 0 {
            super::mapping::prefetch_line(t.probe(i, TINY_RULE_PROBES + FIRST_RULE_PROBES).0);
        }
    }
}

#[inline]
fn rule_for(lookup_ip: u64, epoch: u32) -> u64 {
    let key = rule_key(lookup_ip, epoch);
    let Some(t) = rule_tables() else { return compute_rule(lookup_ip) };
    let start = shared_slot(key);
    for k in 0..TINY_RULE_PROBES + FIRST_RULE_PROBES + RULE_PROBES {
        let (e, table) = t.probe(start, k);
        let found = e.key.load(Ordering::Acquire);
        if found == key {
            let w = e.rule.load(Ordering::Acquire);
            if w != 0 && w >> RULE_CHECK_SHIFT == rule_check(key) {
                return w & RULE_BITS;
            }
            return compute_rule(lookup_ip);
        }
        if found == 0 {
            let r = compute_rule(lookup_ip);
            if (table < 2 || RULES_USED.load(Ordering::Relaxed) < RULE_SLOTS * 3 / 4)
                && e.key.compare_exchange(0, key, Ordering::AcqRel, Ordering::Relaxed).is_ok()
            {
                match table {
                    0 => {}
                    1 => {
                        FIRST_RULES_USED.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        RULES_USED.fetch_add(1, Ordering::Relaxed);
                    }
                }
                debug_assert_eq!(r & !RULE_BITS, 0);
                e.rule.store(r | rule_check(key) << RULE_CHECK_SHIFT, Ordering::Release);
            }
            return r;
        }
    }
    compute_rule(lookup_ip)
}

// ---- per-thread memo -----------------------------------------------------------------

const MEMO_ENTRIES: usize = 16;
const MEMO_READS: usize = 160;

/// This step computed its CFA from RBP.
const STEP_USES_BP: u8 = 1;
/// This step reloaded RBP from a stack slot.
const STEP_RELOADS_BP: u8 = 2;

// repr(C), header first: a memo hit reads the header and the first stack words
// together, from one or two lines of one page (the compiler's own order put the header
// after the 6 KiB of arrays, a second page per entry looked at).
#[repr(C)]
struct MemoEntry {
    sp: u64,
    bp: u64,
    bp_used: bool,
    /// The unwind stopped at the depth limit (its frames are a prefix of a longer stack).
    by_depth: bool,
    epoch: u32,
    stack_id: u32,
    nreads: u32,
    nframes: u32,
    reads: [(u64, u64); MEMO_READS],
    /// Per recorded frame: the return address, the CFA (the stack pointer once the
    /// frame was found), RBP at that point, how many reads had been made by then, and
    /// how the step that found it used RBP. From this state on the rest of the unwind
    /// is a function of the words read afterwards, so another unwind that reaches the
    /// same state can take this one's outer frames (see `suffix_from`).
    frames: [u64; MAX_DEPTH],
    cfas: [u64; MAX_DEPTH],
    bps: [u64; MAX_DEPTH],
    reads_end: [u8; MAX_DEPTH],
    steps: [u8; MAX_DEPTH],
    /// Per recorded frame: the stack hash's state once the frames from the outermost
    /// in to this one are folded in (`stacks::hash_step`). Another unwind that takes
    /// this one's outer frames through to the last takes their states too.
    hashes: [u64; MAX_DEPTH],
}

/// Paths the hit tree answered, copied for the memo to answer next time (`promote`):
/// kept apart from the full entries, which they used to push out (a full entry lends
/// its outer frames to the next unwind; a copy has none to lend), in entries of their
/// own size (a full entry is 6.9 KB, a copy's reads fit in 0.8), and found by their
/// stack pointer's set of `PATH_WAYS`, not by a scan of them all.
const PATH_SETS: usize = 64;
const PATH_WAYS: usize = 4;
const PATHS: usize = PATH_SETS * PATH_WAYS;

/// The set of `path_sps` (and `paths`) a capture at stack pointer `sp0` looks in.
#[inline(always)]
fn path_set(sp0: u64) -> usize {
    ((sp0 >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize & (PATH_SETS - 1)
}

/// A copied path: the stack words an unwind read from `sp` on, and its stack id.
#[repr(C)]
struct PathEntry {
    sp: u64,
    bp: u64,
    bp_used: bool,
    epoch: u32,
    stack_id: u32,
    nreads: u32,
    reads: [(u64, u64); PROMOTE_READS],
}

const L1_RULES: usize = 1024;

struct Memo {
    next: usize,
    /// The entry of the latest capture (answered or written), the likeliest to share
    /// outer frames with the next one.
    last: usize,
    /// This thread's `HitTree` (a separate mapping, made on first use), 0 when none.
    tree: usize,
    /// Paths the tree answered that were copied into the memo in this window
    /// (`PROMOTE_WINDOW`), and the memo's answers from such copies meanwhile.
    promotions: u32,
    promoted_hits: u32,
    /// Tree answers still to leave uncopied: the copies of the last window were not
    /// answered from (`promote`).
    promote_pause: u32,
    /// `entries[i].sp`, kept together so a lookup scans one or two cache lines.
    sps: [u64; MEMO_ENTRIES],
    entries: [MemoEntry; MEMO_ENTRIES],
    /// Per set of `paths`, the way a copy overwrites next (in turn).
    path_next: [u8; PATH_SETS],
    /// `paths[set * PATH_WAYS + way].sp`, a set's in one half line.
    path_sps: [[u64; PATH_WAYS]; PATH_SETS],
    paths: [PathEntry; PATHS],
    /// Direct-mapped per-thread copy of hot rule-cache entries (key, rule): the shared
    /// table is large and its lines are usually cold; the frames near `main` and the
    /// program's allocation helpers repeat on every capture.
    l1: [(u64, u64); L1_RULES],
    /// The thread's caches of Python capture ids.
    py: super::python::ThreadCache,
}

impl Memo {
    /// The entry the next capture at `sp0` overwrites (in turn), filed under `sp0`.
    fn take_slot(&mut self, sp0: u64) -> usize {
        let slot = self.next % MEMO_ENTRIES;
        self.next = self.next.wrapping_add(1);
        self.sps[slot] = sp0;
        slot
    }
}

extern "C" fn memo_destructor(p: *mut c_void) {
    thread::with(|s| {
        s.memo.set(0);
        s.exiting.set(true);
    });
    if !p.is_null() {
        // SAFETY: p is this thread's memo (see below); nothing else uses it any more.
        let tree = unsafe { (*(p as *const Memo)).tree };
        if tree != 0 {
            // SAFETY: the tree is this thread's mapping (`tree_for`), about to go.
            unsafe { (*(tree as *mut HitTree)).release() };
            super::mapping::unmap(tree as *mut u8, std::mem::size_of::<HitTree>());
        }
        // p is the mapping made in `memo_for_thread` for this thread only.
        super::mapping::unmap(p as *mut u8, std::mem::size_of::<Memo>());
    }
}

/// `f` on the calling thread's hit tree, if it has one. Never from a hook: the tree is
/// the thread's own, and no hook of the thread runs meanwhile (the caller holds the
/// guard).
fn with_this_threads_tree<R>(f: impl FnOnce(&mut HitTree) -> R) -> Option<R> {
    thread::with(|s| {
        let m = s.memo.get();
        if m == 0 || m == usize::MAX || s.exiting.get() {
            return None;
        }
        // SAFETY: the memo is owned by this thread alone, which is here, outside any
        // hook (see above).
        let tree = unsafe { (*(m as *const Memo)).tree };
        if tree == 0 {
            return None;
        }
        // SAFETY: the tree is this thread's mapping (`tree_for`), not in use now.
        Some(f(unsafe { &mut *(tree as *mut HitTree) }))
    })
}

/// Gives back the caches a run's unwinds filled, where little of them will be taken
/// again: the calling thread's hit tree past its first limit (`HitTree::shrink`) and
/// the large rule table (`give_back_rules`); both refill as the thread unwinds. For
/// Python's atexit callback (the teardown ahead frees more than it allocates, and the
/// process's peak is at its end) and a forked child's forking thread (a DataLoader
/// worker collates batches; its parent imported torch: ~12.5 MB of the worker's RSS
/// from its first instant, its parent's pages shared until written but counted in
/// each process's RSS). Never from a hook (`with_this_threads_tree`). Nothing is asked
/// where neither was filled (a shell's child, `make`'s): not even the seccomp check,
/// since `madvise` may be answered with SIGSYS under a filter. Returns the bytes given
/// back.
pub fn give_back_caches() -> usize {
    if !with_this_threads_tree(|t| t.grown()).unwrap_or(false) && RULES_USED.load(Ordering::Relaxed) == 0 {
        return 0;
    }
    if !crate::os::procfs::unfiltered_now() {
        return 0;
    }
    with_this_threads_tree(HitTree::shrink).unwrap_or(0) + give_back_rules()
}

fn memo_for_thread(state: &ThreadState) -> Option<&'static mut Memo> {
    let existing = if state.exiting.get() { usize::MAX } else { state.memo.get() };
    if existing == usize::MAX {
        return None;
    }
    if existing != 0 {
        // SAFETY: the memo is owned by this thread alone; hooks do not nest (guard).
        return Some(unsafe { &mut *(existing as *mut Memo) });
    }
    let key = MEMO_KEY.load(Ordering::Acquire);
    if key == usize::MAX {
        return None;
    }
    // Zeroed memory is a valid empty Memo (nreads = 0, sp = 0).
    let m = super::mapping::map_zeroed(std::mem::size_of::<Memo>(), super::mapping::Part::Unwind)? as *mut std::ffi::c_void;
    // SAFETY: key was created by pthread_key_create; setspecific does not allocate for
    // the first 32 keys and otherwise only through calloc, which our guard forwards.
    unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, m) };
    state.memo.set(m as usize);
    // SAFETY: fresh mapping owned by this thread.
    Some(unsafe { &mut *(m as *mut Memo) })
}

/// Paths up to this many reads that the hit tree answers are copied into the memo, so
/// that a loop the memo holds again is answered there (Python's captures read ~17
/// words). Longer ones are left in the tree: a PyTorch step's ~1,500 paths of 60–110
/// reads would only push each other out of 16 entries.
const PROMOTE_READS: usize = 48;

/// Copies are judged per this many: a window whose copies the memo answered from fewer
/// than half as many times as it made them pauses the copying for `PROMOTE_PAUSE` tree
/// answers. A copy costs a second walk of the path and ~0.8 KB written; with more paths
/// in turn than the memo's 16 entries hold, each copy is pushed out before its path comes
/// back (bash's loop: 6.2M copies, 0.5M answers from them; a PyTorch step: 690k, 32k),
/// and the copying was a quarter of the bash loop's time.
const PROMOTE_WINDOW: u32 = 1024;
const PROMOTE_PAUSE: u32 = 16 * PROMOTE_WINDOW;

/// Copies a path the hit tree answered into the memo's `paths`, in turn. It has no
/// frames, so it never lends outer frames to another unwind.
fn promote(m: &mut Memo, sp0: u64, bp_key: Option<u64>, reads: &[(u64, u64)], epoch: u32, id: u32) {
    let set = path_set(sp0);
    // An empty way first, else the set's ways in turn.
    let way = match m.path_sps[set].iter().position(|&sp| sp == 0) {
        Some(way) => way,
        None => {
            let way = m.path_next[set] as usize % PATH_WAYS;
            m.path_next[set] = m.path_next[set].wrapping_add(1);
            way
        }
    };
    m.path_sps[set][way] = sp0;
    let e = &mut m.paths[set * PATH_WAYS + way];
    e.sp = sp0;
    e.bp = bp_key.unwrap_or(0);
    e.bp_used = bp_key.is_some();
    e.epoch = epoch;
    e.stack_id = id;
    e.reads[..reads.len()].copy_from_slice(reads);
    e.nreads = reads.len() as u32;
    #[cfg(test)]
    PROMOTED_HERE.with(|c| c.set(c.get() + 1));
    m.promotions += 1;
    if m.promotions >= PROMOTE_WINDOW {
        if m.promoted_hits < m.promotions / 2 {
            m.promote_pause = PROMOTE_PAUSE;
        }
        m.promotions = 0;
        m.promoted_hits = 0;
    }
}

#[cfg(test)]
thread_local! {
    /// Paths the tree answered that this thread copied into its memo.
    static PROMOTED_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The thread's hit tree behind the memo's `tree` slot, mapped on first use; `None` if
/// no memory can be had (the tree is only a shortcut).
fn tree_for<'a>(slot: &'a mut Option<&mut usize>) -> Option<&'a mut HitTree> {
    let slot = slot.as_deref_mut()?;
    if *slot == 0 {
        // Zeroed memory is a valid empty tree.
        *slot = super::mapping::map_zeroed(std::mem::size_of::<HitTree>(), super::mapping::Part::Unwind)? as usize;
    }
    // SAFETY: the mapping holds one HitTree, owned by this thread alone (the slot is in
    // its memo); hooks do not nest (guard).
    Some(unsafe { &mut *(*slot as *mut HitTree) })
}

fn stack_bounds(state: &ThreadState) -> Option<(u64, u64)> {
    let (lo, hi) = (state.stack_lo.get(), state.stack_hi.get());
    if hi != 0 {
        return Some((lo as u64, hi as u64));
    }
    // Threads the program started through `pthread_create` had theirs noted at start
    // (`note_thread_stack`); the main thread's need no lock; the rest are queried.
    let (lo, hi) = crate::os::stack::current_thread_stack()?;
    state.stack_lo.set(lo);
    state.stack_hi.set(hi);
    Some((lo as u64, hi as u64))
}

/// How far above `sp` an unwind on a stack of the program's own making may read.
const OTHER_STACK_WINDOW: u64 = 8 << 20;

/// The end of the readable, writable mapping that holds `sp`, for a thread running
/// outside its own stack; found once per mapping (the thread's `alt_*` cache).
fn other_stack_end(state: &ThreadState, sp: u64) -> Option<u64> {
    let (lo, hi) = (state.alt_lo.get() as u64, state.alt_hi.get() as u64);
    let end = if sp >= lo && sp < hi {
        hi
    } else {
        let (lo, hi) = crate::os::stack::writable_mapping_of(sp as usize)?;
        state.alt_lo.set(lo);
        state.alt_hi.set(hi);
        hi as u64
    };
    Some(end.min(sp.saturating_add(OTHER_STACK_WINDOW)))
}

/// Notes the calling thread's stack bounds before its start routine runs, so that no
/// capture ever has to ask for them from inside the program's own calls. Allocations
/// made meanwhile are untracked (the caller marks the thread).
pub fn note_thread_stack() {
    if let Some((lo, hi)) = crate::os::stack::queried_thread_stack() {
        crate::os::stack::list_stack(thread::tid(), lo, hi);
        thread::with(|s| {
            s.stack_lo.set(lo);
            s.stack_hi.set(hi);
        });
    }
}

// ---- capture -------------------------------------------------------------------------

#[inline(always)]
fn registers() -> (u64, u64, u64) {
    let ip: u64;
    let sp: u64;
    let bp: u64;
    // SAFETY: reads three registers; no memory access, no stack change.
    unsafe {
        std::arch::asm!(
            "lea {ip}, [rip]",
            "mov {sp}, rsp",
            "mov {bp}, rbp",
            ip = out(reg) ip,
            sp = out(reg) sp,
            bp = out(reg) bp,
            options(nomem, nostack, preserves_flags)
        );
    }
    (ip, sp, bp)
}

/// Records the stack words an unwind consumed and the frames it found straight into
/// the memo entry it will become (no intermediate buffer, nothing zeroed per capture).
struct Recorder<'a> {
    entry: Option<&'a mut MemoEntry>,
    n: usize,
    overflow: bool,
}

impl Recorder<'_> {
    #[inline(always)]
    fn push(&mut self, addr: u64, val: u64) {
        if let Some(e) = self.entry.as_deref_mut() {
            if self.n < MEMO_READS {
                e.reads[self.n] = (addr, val);
                self.n += 1;
            } else {
                self.overflow = true;
            }
        }
    }

    /// `push` of each of `src`, in one copy.
    #[inline(always)]
    fn push_all(&mut self, src: &[(u64, u64)]) {
        if let Some(e) = self.entry.as_deref_mut() {
            let fits = src.len().min(MEMO_READS - self.n);
            e.reads[self.n..self.n + fits].copy_from_slice(&src[..fits]);
            self.n += fits;
            self.overflow |= fits < src.len();
        }
    }

    #[inline(always)]
    fn frame(&mut self, k: usize, ra: u64, cfa: u64, bp: u64, step: u8) {
        if let Some(e) = self.entry.as_deref_mut() {
            e.frames[k] = ra;
            e.cfas[k] = cfa;
            e.bps[k] = bp;
            e.reads_end[k] = self.n as u8;
            e.steps[k] = step;
        }
    }
}

/// Whether the rest of `e`'s unwind after its frame `k` depends on RBP as it was then
/// (a later step computes its CFA from RBP before any step reloads it).
fn suffix_needs_bp(e: &MemoEntry, k: usize) -> bool {
    first_bp_step(&e.steps[k + 1..e.nframes as usize]).is_some_and(|step| step & STEP_USES_BP != 0)
}

/// The first of `steps` that uses or reloads RBP. Eight steps at a time: in code built
/// without frame pointers nearly none does, and an unwind that takes an earlier one's
/// outer frames asks this about all of them (40 on average in `bench/new_stacks.c`,
/// where the byte-by-byte loop was 28% of `suffix_from`'s samples, `perf record`).
#[inline(always)]
fn first_bp_step(steps: &[u8]) -> Option<u8> {
    const BP_BITS: u64 = u64::from_le_bytes([STEP_USES_BP | STEP_RELOADS_BP; 8]);
    let mut eights = steps.chunks_exact(8);
    for eight in &mut eights {
        let word = u64::from_le_bytes([eight[0], eight[1], eight[2], eight[3], eight[4], eight[5], eight[6], eight[7]]) & BP_BITS;
        if word != 0 {
            // The lowest byte with a bit set is the first step: its bits alone.
            return Some((word >> (word.trailing_zeros() & !7)) as u8);
        }
    }
    eights.remainder().iter().map(|&step| step & (STEP_USES_BP | STEP_RELOADS_BP)).find(|&bits| bits != 0)
}

/// The outer frames an earlier unwind `e` found after its frame `k`, if this unwind
/// (now at the same return address and CFA, with RBP `bp`) would find the same ones:
/// same dlclose epoch, RBP equal where the rest depends on it, and every stack word the
/// rest read still the same and inside this unwind's live stack `[sp0, hi)`. Returns
/// how many frames to take and whether they depend on RBP as it is now, or `None`.
fn suffix_from(e: &MemoEntry, k: usize, epoch: u32, bp: u64, sp0: u64, hi: u64, wanted: usize) -> Option<(usize, bool)> {
    if e.epoch != epoch || e.nreads == 0 {
        return None;
    }
    let available = e.nframes as usize - (k + 1);
    // A suffix cut at the depth limit is too short for an unwind that needs more.
    if e.by_depth && available < wanted {
        return None;
    }
    let needs_bp = suffix_needs_bp(e, k);
    if needs_bp && e.bps[k] != bp {
        return None;
    }
    for &(addr, val) in &e.reads[e.reads_end[k] as usize..e.nreads as usize] {
        if addr < sp0 || addr >= hi {
            return None;
        }
        // SAFETY: addr is 8-aligned (it was read before) and inside [sp0, hi), the live
        // part of this thread's own stack.
        if unsafe { std::ptr::read(addr as *const u64) } != val {
            return None;
        }
    }
    Some((available.min(wanted), needs_bp))
}

/// The first `n` frames an unwind wrote.
///
/// # Safety
/// `frames[..n]` must all have been written.
unsafe fn written(frames: &[std::mem::MaybeUninit<u64>; MAX_DEPTH], n: usize) -> &[u64] {
    // SAFETY: the caller vouches that the first n (<= MAX_DEPTH) are initialised, and
    // MaybeUninit<u64> has u64's layout.
    unsafe { std::slice::from_raw_parts(frames.as_ptr() as *const u64, n) }
}

/// Folds `own` (a stack's frames, innermost first) into the hash state `outer` of the
/// frames outside them, from the outermost in, keeping the state after each frame in
/// `states`; returns the stack's hash.
fn fold_inward(outer: u64, own: &[u64], states: &mut [u64]) -> u64 {
    let mut h = outer;
    for (state, &f) in states.iter_mut().zip(own).rev() {
        h = stacks::hash_step(h, f);
        *state = h;
    }
    stacks::hash_finish(h)
}

/// Captures the caller's stack (the library's own frames skipped) and returns its
/// interned id; 0 when no stack could be taken. `state` is the calling thread's.
///
/// With Python frames on, an unwind that the memo does not answer walks the Python
/// frames *between* hashing the native stack and interning it: a new native stack's
/// index slot is a cache miss (a fifth of `capture_stack_id`'s samples in `import
/// torch`, where 60% of the native stacks are new), and its line, prefetched once the
/// hash is known, loads while the Python frames are read.
#[inline(never)]
pub fn capture_stack_id(state: &ThreadState, depth: usize) -> u32 {
    if !super::python::enabled() {
        return capture(state, depth, true, |_| {});
    }
    let mut walked = None;
    let native = capture(state, depth, true, |cache| walked = Some(python_part(cache)));
    let mut cache = memo_for_thread(state).map(|m| &mut m.py);
    let python = match walked {
        Some(python) => python,
        None => {
            // The memo answered: no index probe to hide; the pair's cache line loads
            // while the frames are walked instead.
            if let Some(c) = cache.as_deref() {
                c.prefetch_combined(native);
            }
            python_part(cache.as_deref_mut())
        }
    };
    match python {
        Some(python) => with_python_part(cache, native, python),
        None => native,
    }
}

/// The interned id of the calling thread's Python part (`[PY_FRAMES, python words…]`,
/// see `python::capture`), or `None` when the thread runs no Python. The id is 0 when
/// the tables are full.
#[inline(always)]
fn python_part(mut cache: Option<&mut super::python::ThreadCache>) -> Option<u32> {
    let mut words = [0u64; 1 + super::python::MAX_PY_FRAMES];
    let n = super::python::capture(&mut words[1..], cache.as_deref_mut());
    if n == 0 {
        return None;
    }
    words[0] = super::python::PY_FRAMES;
    Some(python_part_id(cache, epoch(), &words[..n + 1]))
}

/// The id of the stack `native` with the Python part `python`: `[PY_STACK, native,
/// python]`. Python frames are part of a stack's identity: two lines that reach one
/// native path are two stacks. The Python part is interned on its own: a few thousand
/// distinct ones serve every native stack under them, so a new combined stack costs a
/// record of three words, not forty, and the first one of each native stack no record
/// at all (`stacks::intern_child`). The thread's `ThreadCache` answers the repeated
/// lookups of a loop.
#[inline(always)]
fn with_python_part(cache: Option<&mut super::python::ThreadCache>, native: u32, python: u32) -> u32 {
    let epoch = epoch();
    if let Some(id) = cache.as_deref().and_then(|c| c.combined(native, python, epoch)) {
        return id;
    }
    let id = stacks::intern_child(epoch, native, python);
    if let Some(c) = cache {
        if id != 0 && python != 0 {
            c.put_combined(native, python, epoch, id);
        }
    }
    id
}

/// The id of a Python part (`[PY_FRAMES, words…]`), through the thread's cache.
#[inline(always)]
fn python_part_id(cache: Option<&mut super::python::ThreadCache>, epoch: u32, words: &[u64]) -> u32 {
    let h = stacks::hash_frames(epoch, words);
    if let Some(id) = cache.as_deref().and_then(|c| c.part(h)) {
        return id;
    }
    let tail = cache.as_deref().and_then(|c| c.shared_tail(words, epoch));
    let id = stacks::intern_hashed(epoch, words, tail, h);
    if let Some(c) = cache {
        c.put_part(h, id);
        if id != 0 {
            c.put_last_part(words, id, epoch);
        }
    }
    id
}

/// Tests: the same capture with no memo at all (every frame unwound), to compare with.
#[cfg(test)]
#[inline(never)]
fn capture_unmemoised(state: &ThreadState, depth: usize) -> u32 {
    capture(state, depth, false, |_| {})
}

#[cfg(test)]
static SUFFIXES_TAKEN: AtomicU64 = AtomicU64::new(0);
#[cfg(test)]
static TREE_ANSWERS: AtomicU64 = AtomicU64::new(0);

/// The native stack's id. `before_intern` runs once, just before a stack the memo did
/// not answer is interned (its index line is being loaded then), with the thread's
/// Python caches; not at all when the memo answers.
#[inline(always)]
fn capture(state: &ThreadState, depth: usize, memoise: bool, before_intern: impl FnOnce(Option<&mut super::python::ThreadCache>)) -> u32 {
    let (ip0, sp0, bp0) = registers();
    if !available() {
        return 0;
    }
    let Some((lo, hi)) = stack_bounds(state) else { return 0 };
    let (hi, memoise) = if sp0 >= lo && sp0 < hi {
        (hi, memoise)
    } else {
        // Running on a stack of the program's making (a coroutine's, a signal's
        // alternate stack): bounded by its mapping, and never memoised (the memo's
        // addresses are trusted to stay mapped, which a heap block need not).
        match other_stack_end(state, sp0) {
            Some(end) => (end, false),
            None => return 0,
        }
    };
    let epoch = epoch();
    let mut memo = if memoise { memo_for_thread(state) } else { None };
    if let Some(m) = memo.as_deref_mut() {
        // Copies of paths the tree answered first: in a steady loop most captures are
        // theirs, and the full entries below share their stack pointers.
        let set = path_set(sp0);
        'paths: for (way, sp) in m.path_sps[set].iter().enumerate() {
            if *sp != sp0 {
                continue;
            }
            let e = &m.paths[set * PATH_WAYS + way];
            if e.sp != sp0 || e.epoch != epoch || e.nreads == 0 || (e.bp_used && e.bp != bp0) {
                continue;
            }
            for &(addr, val) in &e.reads[..e.nreads as usize] {
                // SAFETY: addr was read (bounds-checked against this thread's stack) by an
                // unwind from the same stack pointer, above it, so it is mapped.
                if unsafe { std::ptr::read(addr as *const u64) } != val {
                    continue 'paths;
                }
            }
            // A path the tree answered, copied here (`promote`).
            m.promoted_hits = m.promoted_hits.saturating_add(1);
            return e.stack_id;
        }
        'entries: for (i, sp) in m.sps.iter().enumerate() {
            if *sp != sp0 {
                continue;
            }
            let e = &m.entries[i];
            if e.sp != sp0 || e.epoch != epoch || e.nreads == 0 || (e.bp_used && e.bp != bp0) {
                continue;
            }
            for &(addr, val) in &e.reads[..e.nreads as usize] {
                // SAFETY: addr was bounds-checked against this thread's stack when it was
                // recorded, and it lies above the same stack pointer, so it is mapped.
                if unsafe { std::ptr::read(addr as *const u64) } != val {
                    continue 'entries;
                }
            }
            if e.nframes > 0 {
                m.last = i;
            }
            return e.stack_id;
        }
        if m.tree != 0 {
            // SAFETY: the tree is this thread's own mapping (`tree_for`), used by it alone.
            let tree = unsafe { &mut *(m.tree as *mut HitTree) };
            let mut path = [std::mem::MaybeUninit::<(u64, u64)>::uninit(); PROMOTE_READS];
            let (mut len, mut bp_key, mut fits) = (0usize, None, true);
            let promoting = m.promote_pause == 0;
            if !promoting {
                m.promote_pause -= 1;
                if m.promote_pause == 0 {
                    // The next window counts the answers from its own copies only.
                    m.promoted_hits = 0;
                }
            }
            let hit = tree.lookup(
                sp0,
                bp0,
                epoch,
                // SAFETY: every address in the tree under the root of `sp0` was checked
                // to lie in this thread's stack, in [sp0, hi), when it was read with the
                // same stack pointer, so it is mapped now.
                |addr| unsafe { std::ptr::read(addr as *const u64) },
                // The start RBP, if the path has it, is a read too. Nothing to trace
                // while copies are paused: the path is walked once.
                if promoting { PROMOTE_READS + 1 } else { 0 },
                |addr, val| match addr {
                    None => bp_key = Some(val),
                    Some(a) if len < PROMOTE_READS => {
                        path[len].write((a, val));
                        len += 1;
                    }
                    Some(_) => fits = false,
                },
            );
            if let Some(id) = hit {
                #[cfg(test)]
                TREE_ANSWERS.fetch_add(1, Ordering::Relaxed);
                if fits && len > 0 {
                    // SAFETY: path[..len] were each written above.
                    let path = unsafe { std::slice::from_raw_parts(path.as_ptr() as *const (u64, u64), len) };
                    promote(m, sp0, bp_key, path, epoch, id);
                }
                return id;
            }
        }
    }

    let depth = depth.clamp(1, MAX_DEPTH);
    let mut frames = [std::mem::MaybeUninit::<u64>::uninit(); MAX_DEPTH];
    // The entry this unwind becomes, and the latest other entry: a candidate to share
    // outer frames with (consecutive allocations usually differ in a few inner frames).
    let (mut l1, mut reads, candidate, mut tree_slot, py_cache) = match memo {
        Some(m) => {
            let slot = m.take_slot(sp0);
            let last = m.last;
            m.last = slot;
            let (entry, candidate) = if last == slot || last >= MEMO_ENTRIES {
                (&mut m.entries[slot], None)
            } else if last < slot {
                let (a, b) = m.entries.split_at_mut(slot);
                (&mut b[0], Some(&a[last]))
            } else {
                let (a, b) = m.entries.split_at_mut(last);
                (&mut a[slot], Some(&b[0]))
            };
            // Invalid until the unwind completes.
            entry.nreads = 0;
            (Some(&mut m.l1), Recorder { entry: Some(entry), n: 0, overflow: false }, candidate, Some(&mut m.tree), Some(&mut m.py))
        }
        None => (None, Recorder { entry: None, n: 0, overflow: false }, None, None, None),
    };
    let mut n = 0usize;
    let mut by_depth = false;
    let mut tail = None;
    // The stack's hash, when it was known before the copying at the end of the unwind.
    let mut early_hash = None;
    // How far into the candidate's frames (by CFA, which only grows) this unwind is.
    let mut cand_at = 0usize;
    let (mut ip, mut sp, mut bp) = (ip0, sp0, bp0);
    // Where the current RBP value came from: the start registers, or a stack word. It
    // only becomes part of the memo key if a later frame's CFA is computed from it
    // (code without frame pointers uses RBP as a scratch register, and a saved scratch
    // value must not make every memo lookup miss).
    #[derive(Clone, Copy)]
    enum BpSource {
        StartRegister,
        StackWord(u64, u64),
        AlreadyKeyed,
    }
    let mut bp_source = BpSource::StartRegister;
    let mut bp_used = false;
    // RBP is about to matter: key the memo entry on where it came from.
    let use_bp = |bp_source: &mut BpSource, reads: &mut Recorder, bp_used: &mut bool| {
        match *bp_source {
            BpSource::StartRegister => *bp_used = true,
            BpSource::StackWord(addr, val) => reads.push(addr, val),
            BpSource::AlreadyKeyed => {}
        }
        if !matches!(*bp_source, BpSource::StartRegister) {
            *bp_source = BpSource::AlreadyKeyed;
        }
    };
    let mut first = true;
    let read = |addr: u64| -> Option<u64> {
        if addr < sp0 || addr.checked_add(8)? > hi || !addr.is_multiple_of(8) {
            return None;
        }
        // SAFETY: [sp0, hi) is the live part of this thread's own stack.
        Some(unsafe { std::ptr::read(addr as *const u64) })
    };
    // Bounded: capped at 4 * MAX_DEPTH steps so a long run of our own frames cannot loop.
    for _ in 0..(4 * MAX_DEPTH) {
        let lookup = if first { ip } else { ip.wrapping_sub(1) };
        let rule = rule_cached(lookup, epoch, l1.as_deref_mut());
        if rule & (UNSUPPORTED | OUTERMOST) != 0 {
            break;
        }
        let mut step = 0u8;
        let off = unpack_i24(rule >> 8);
        let cfa = if rule & CFA_RBP != 0 {
            use_bp(&mut bp_source, &mut reads, &mut bp_used);
            step |= STEP_USES_BP;
            bp.wrapping_add(off as u64)
        } else {
            sp.wrapping_add(off as u64)
        };
        if cfa <= sp || cfa > hi {
            break;
        }
        let Some(ra) = read(cfa - 8) else { break };
        prefetch_rule(ra.wrapping_sub(1), epoch, l1.as_deref());
        reads.push(cfa - 8, ra);
        if rule & RBP_SAVED != 0 {
            let addr = cfa.wrapping_add(unpack_i24(rule >> 32) as u64);
            let Some(v) = read(addr) else { break };
            bp = v;
            bp_source = BpSource::StackWord(addr, v);
            step |= STEP_RELOADS_BP;
        }
        sp = cfa;
        ip = ra;
        first = false;
        if ra == 0 {
            break;
        }
        // The library's own frames: those of the hook at the top, and any further down
        // (a Python allocation under `interpose::pyalloc`'s wrapper that reaches malloc).
        if is_own_address(ra) {
            continue;
        }
        frames[n].write(ra);
        reads.frame(n, ra, cfa, bp, step);
        n += 1;
        if n == depth {
            by_depth = true;
            break;
        }
        let Some(c) = candidate else { continue };
        while cand_at < c.nframes as usize && c.cfas[cand_at] < cfa {
            cand_at += 1;
        }
        if cand_at >= c.nframes as usize || c.cfas[cand_at] != cfa || c.frames[cand_at] != ra {
            continue;
        }
        let k = cand_at;
        let Some((take, needs_bp)) = suffix_from(c, k, epoch, bp, sp0, hi, depth - n) else { continue };
        if needs_bp {
            use_bp(&mut bp_source, &mut reads, &mut bp_used);
        }
        if take > 0 {
            tail = Some(stacks::SharedTail { own: n, parent: c.stack_id, first: k + 1, count: take });
        }
        let base = reads.n as isize - c.reads_end[k] as isize;
        // The candidate's states hold for the taken frames only if they run to its last.
        let states_hold = k + 1 + take == c.nframes as usize;
        if states_hold {
            // The whole hash is known now: start loading the index line it probes
            // while the candidate's reads and frames are copied below.
            if let Some(e) = reads.entry.as_deref_mut() {
                let outer = if take > 0 { c.hashes[k + 1] } else { stacks::hash_start(epoch) };
                // SAFETY: frames[..n] were each written above.
                let hash = fold_inward(outer, unsafe { written(&frames, n) }, &mut e.hashes[..n]);
                stacks::prefetch_index(hash);
                early_hash = Some(hash);
            }
        }
        // The taken part is a few kilobytes per new stack (880k of them in `import
        // torch`): copied slice by slice, not frame by frame.
        reads.push_all(&c.reads[c.reads_end[k] as usize..c.nreads as usize]);
        let (from, to) = (k + 1..k + 1 + take, n..n + take);
        for (slot, &ra) in frames[to.clone()].iter_mut().zip(&c.frames[from.clone()]) {
            slot.write(ra);
        }
        if let Some(e) = reads.entry.as_deref_mut() {
            e.frames[to.clone()].copy_from_slice(&c.frames[from.clone()]);
            e.cfas[to.clone()].copy_from_slice(&c.cfas[from.clone()]);
            e.bps[to.clone()].copy_from_slice(&c.bps[from.clone()]);
            e.steps[to.clone()].copy_from_slice(&c.steps[from.clone()]);
            if states_hold {
                e.hashes[to.clone()].copy_from_slice(&c.hashes[from.clone()]);
            }
            for (end, &was) in e.reads_end[to].iter_mut().zip(&c.reads_end[from]) {
                *end = (was as isize + base).clamp(0, MEMO_READS as isize) as u8;
            }
        }
        n += take;
        by_depth = n == depth && (c.by_depth || k + 1 + take < c.nframes as usize);
        #[cfg(test)]
        SUFFIXES_TAKEN.fetch_add(1, Ordering::Relaxed);
        break;
    }
    // SAFETY: frames[..n] were each written above (n only grows after a write).
    let captured = unsafe { written(&frames, n) };
    let hash = match (early_hash, reads.entry.as_deref_mut()) {
        (Some(hash), _) => hash,
        // No states taken from the candidate: every frame's state is folded here.
        (None, Some(e)) => fold_inward(stacks::hash_start(epoch), captured, &mut e.hashes[..n]),
        (None, None) => stacks::hash_frames(epoch, captured),
    };
    if cfg!(test) {
        assert_eq!(hash, stacks::hash_frames(epoch, captured), "incremental stack hash");
    }
    if early_hash.is_none() {
        stacks::prefetch_index(hash);
    }
    before_intern(py_cache);
    let known_before = stacks::count();
    let id = stacks::intern_hashed(epoch, captured, tail, hash);
    if let Some(e) = reads.entry {
        if !reads.overflow && reads.n > 0 && id != 0 {
            // A stack seen before is a path the program comes back to: file it in the
            // tree. (A new one would mostly fill the tree with paths taken once, as
            // `import torch`'s 880k are.)
            if id < known_before {
                if let Some(tree) = tree_for(&mut tree_slot) {
                    tree.insert(sp0, bp_used.then_some(bp0), &e.reads[..reads.n], epoch, id);
                }
            }
            e.sp = sp0;
            e.bp = bp0;
            e.bp_used = bp_used;
            e.by_depth = by_depth;
            e.epoch = epoch;
            e.stack_id = id;
            e.nframes = n as u32;
            e.nreads = reads.n as u32;
        }
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_step_that_touches_rbp_is_found_eight_at_a_time_as_one_by_one() {
        // The reference: one step at a time, as `suffix_needs_bp` read them before.
        fn one_by_one(steps: &[u8]) -> Option<u8> {
            steps.iter().map(|&s| s & (STEP_USES_BP | STEP_RELOADS_BP)).find(|&b| b != 0)
        }
        let mut rng = crate::test_rng::TestRng::new(7);
        for len in 0..40 {
            for _ in 0..200 {
                // Mostly steps that leave RBP alone, as in code without frame pointers;
                // other bits set too, which the search must not take for RBP's.
                let steps: Vec<u8> = (0..len)
                    .map(|_| match rng.below(20) {
                        0 => STEP_USES_BP,
                        1 => STEP_RELOADS_BP,
                        2 => STEP_USES_BP | STEP_RELOADS_BP,
                        3 => 0x80 | 0x04,
                        _ => 0,
                    })
                    .collect();
                assert_eq!(first_bp_step(&steps), one_by_one(&steps), "{steps:?}");
            }
        }
    }

    /// The search table read as pairs finds, for every address of this test program's
    /// and the C library's code sampled, the FDE gimli's search finds (or none where it
    /// finds none): the same FDE offset, containing the address.
    #[test]
    fn the_standard_search_table_finds_the_fde_gimli_finds() {
        assert!(init());
        let libc_fn = libc::getpid as *const () as usize as u64;
        let own_fn = the_standard_search_table_finds_the_fde_gimli_finds as *const () as usize as u64;
        let (mut compared, mut found) = (0, 0);
        for anchor in [own_fn, libc_fn] {
            let obj = find_object(anchor).expect("a loaded module");
            // SAFETY: the module's PT_GNU_EH_FRAME segment, mapped while it is loaded.
            let hdr: &'static [u8] = unsafe { std::slice::from_raw_parts(obj.eh_frame_hdr as *const u8, (obj.map_end - obj.eh_frame_hdr) as usize) };
            let bases = BaseAddresses::default().set_eh_frame_hdr(obj.eh_frame_hdr);
            let parsed = EhFrameHdr::new(hdr, NativeEndian).parse(&bases, 8).unwrap();
            let Pointer::Direct(eh_frame_addr) = parsed.eh_frame_ptr() else { panic!("indirect .eh_frame pointer") };
            // SAFETY: `.eh_frame` lies inside the module's mapping.
            let eh: &'static [u8] = unsafe { std::slice::from_raw_parts(eh_frame_addr as *const u8, (obj.map_end - eh_frame_addr) as usize) };
            let eh_frame = EhFrame::new(eh, NativeEndian);
            let bases = bases.set_eh_frame(eh_frame_addr);
            let table = parsed.table().unwrap();
            assert!(standard_table_fde(hdr, obj.eh_frame_hdr, anchor).is_some(), "a linker's table is read as pairs");
            // Below the module's first FDE, across the code around the anchor, and past it.
            let first = obj.map_start;
            for ip in (first..first + 0x2000).step_by(61).chain((anchor.saturating_sub(1 << 20)..anchor + (1 << 20)).step_by(509)) {
                let ours = standard_table_fde(hdr, obj.eh_frame_hdr, ip).unwrap().and_then(|p| {
                    let fde = eh_frame.fde_from_offset(&bases, gimli::EhFrameOffset((p - eh_frame_addr) as usize), |s, b, o| s.cie_from_offset(b, o)).ok()?;
                    fde.contains(ip).then(|| fde.offset())
                });
                let gimlis = table.fde_for_address(&eh_frame, &bases, ip, |s, b, o| s.cie_from_offset(b, o)).ok().map(|f| f.offset());
                assert_eq!(ours, gimlis, "{ip:#x}");
                compared += 1;
                found += ours.is_some() as usize;
            }
        }
        assert!(compared > 4000 && found > 1000, "{compared} addresses, {found} in an FDE");
    }

    #[test]
    fn a_search_table_in_another_encoding_is_left_to_gimli() {
        // version 1, .eh_frame pointer pcrel|sdata4, count udata4, table datarel|sdata4;
        // two entries: 0x100 -> FDE at +0x40, 0x200 -> +0x80.
        let mut hdr = vec![1u8, 0x1b, 0x03, 0x3b];
        hdr.extend_from_slice(&0i32.to_ne_bytes());
        hdr.extend_from_slice(&2u32.to_ne_bytes());
        for (at, fde) in [(0x100i32, 0x40i32), (0x200, 0x80)] {
            hdr.extend_from_slice(&at.to_ne_bytes());
            hdr.extend_from_slice(&fde.to_ne_bytes());
        }
        let base = 0x7000_0000_0000u64;
        assert_eq!(standard_table_fde(&hdr, base, base + 0xff), Some(None), "below the first entry");
        assert_eq!(standard_table_fde(&hdr, base, base + 0x100), Some(Some(base + 0x40)));
        assert_eq!(standard_table_fde(&hdr, base, base + 0x1ff), Some(Some(base + 0x40)));
        assert_eq!(standard_table_fde(&hdr, base, base + 0x5000), Some(Some(base + 0x80)), "the last entry");
        assert_eq!(standard_table_fde(&hdr, base, base - 0x10), Some(None), "below the header");
        let mut other = hdr.clone();
        other[3] = 0x3c; // datarel|sdata8
        assert_eq!(standard_table_fde(&other, base, base + 0x100), None);
        other = hdr.clone();
        other[1] = 0x1c; // an 8-byte .eh_frame pointer: the count is elsewhere
        assert_eq!(standard_table_fde(&other, base, base + 0x100), None);
        other = hdr.clone();
        other[8..12].copy_from_slice(&3u32.to_ne_bytes()); // more entries than the bytes hold
        assert_eq!(standard_table_fde(&other, base, base + 0x100), None);
        assert_eq!(standard_table_fde(&hdr[..3], base, base), None);
    }

    #[test]
    fn i24_round_trips() {
        for v in [-8_388_608i64, -16, -8, 0, 8, 16, 4096, 8_388_607] {
            assert_eq!(unpack_i24(pack_i24(v).unwrap()), v);
        }
        assert!(pack_i24(1 << 23).is_none());
    }

    #[test]
    fn compact_fde_rows_answer_as_the_rows_they_were_made_of() {
        let a = VALID | (8 << 8);
        let b = VALID | (16 << 8) | RBP_SAVED | (pack_i24(-16).unwrap() << 32);
        let rows = FdeRows::new(&[(0x1000, 0x1004, a), (0x1004, 0x1010, VALID | UNSUPPORTED), (0x1020, 0x1100, b)]);
        assert_eq!(rows.rule_at(0xfff), None);
        assert_eq!(rows.rule_at(0x1000), Some(a));
        assert_eq!(rows.rule_at(0x1003), Some(a));
        assert_eq!(rows.rule_at(0x1004), None, "unsupported");
        assert_eq!(rows.rule_at(0x1015), None, "the gap");
        assert_eq!(rows.rule_at(0x1020), Some(b), "a rule's high half");
        assert_eq!(rows.rule_at(0x10ff), Some(b));
        assert_eq!(rows.rule_at(0x1100), None, "one past the end");
        assert_eq!(rows.rows.len(), 4);
        // Nothing trusted from rows out of order or beyond 4 GiB.
        assert_eq!(FdeRows::new(&[(0x1000, 0x1010, a), (0x1008, 0x1020, a)]).rule_at(0x1000), None);
        assert_eq!(FdeRows::new(&[(0, 1 << 33, a)]).rule_at(0), None);
        assert_eq!(FdeRows::new(&[]).rule_at(0), None);
    }

    #[test]
    fn a_recent_fde_answers_for_its_own_range_only_and_an_unload_forgets_it() {
        let mut c = FdeRules::new(1);
        let rule = VALID | (16 << 8);
        c.rows(0x500, || FdeRows::new(&[(0x1000, 0x1004, VALID | (8 << 8)), (0x1004, 0x1100, rule)]));
        assert_eq!(c.recent_rule(0x1050), None, "not asked for yet");
        c.remember(0x500);
        assert_eq!(c.recent_rule(0x1050), Some(Some(rule)));
        assert_eq!(c.recent_rule(0x1000), Some(Some(VALID | (8 << 8))));
        assert_eq!(c.recent_rule(0x1100), None, "one past the end");
        assert_eq!(c.recent_rule(0xfff), None);
        // Remembering it again takes no second slot; 8 others push it out.
        c.remember(0x500);
        for k in 0..RECENT_FDES as u64 {
            let start = 0x10_000 + k * 0x100;
            c.rows(0x600 + k, || FdeRows::new(&[(start, start + 0x100, rule)]));
            c.remember(0x600 + k);
            assert_eq!(c.recent_rule(0x1050).is_some(), k + 1 < RECENT_FDES as u64, "after {} more", k + 1);
        }
        assert_eq!(c.at_epoch(2).recent_rule(0x10_050), None, "a dlclose forgets every FDE");
    }

    #[test]
    fn only_the_last_fdes_keep_their_rows_and_a_kept_one_is_not_parsed_again() {
        let mut c = FdeRules::new(1);
        let rule = |k: u64| VALID | ((8 + 8 * (k % 4)) << 8);
        let parses = std::cell::Cell::new(0);
        let ask = |c: &mut FdeRules, k: u64| {
            let start = 0x10_000 + k * 0x100;
            let rows = c.rows(k, || {
                parses.set(parses.get() + 1);
                FdeRows::new(&[(start, start + 0x100, rule(k))])
            });
            assert_eq!(rows.rule_at(start + 0x10), Some(rule(k)), "FDE {k}");
        };
        for k in 0..KEPT_FDES as u64 {
            ask(&mut c, k);
        }
        ask(&mut c, 0);
        assert_eq!((c.kept.len(), parses.get()), (KEPT_FDES, KEPT_FDES), "kept, not parsed again");
        // One more: the oldest goes, and the recent range of a gone FDE answers nothing.
        c.remember(0);
        ask(&mut c, KEPT_FDES as u64);
        assert_eq!((c.kept.len(), parses.get()), (KEPT_FDES, KEPT_FDES + 1));
        assert!(c.rows_of(0).is_none() && c.rows_of(1).is_some() && c.rows_of(KEPT_FDES as u64).is_some());
        assert_eq!(c.recent_rule(0x10_010), None, "FDE 0's rows are gone");
        ask(&mut c, 0);
        assert_eq!(parses.get(), KEPT_FDES + 2, "parsed again, in place of FDE 1");
        assert!(c.rows_of(1).is_none());
    }

    /// Every return address in a few functions of this binary, looked up in an order
    /// that revisits FDEs: the rules that come through the recent-FDE ranges are those a
    /// fresh CFI evaluation gives.
    /// A rule's probes: a window of the tiny table (two pages), then of the small one,
    /// then of the large one; each rule is found again where it was filed.
    #[test]
    fn rule_probes_go_to_the_tiny_table_first_then_the_small_and_large_ones() {
        let t = rule_tables().unwrap();
        let within = |e: &RuleEntry, table: &[RuleEntry]| table.as_ptr_range().contains(&(e as *const RuleEntry));
        for start in [0usize, 5, TINY_RULE_SLOTS - 1, RULE_SLOTS - 3] {
            for k in 0..TINY_RULE_PROBES + FIRST_RULE_PROBES + RULE_PROBES {
                let (e, table) = t.probe(start, k);
                let (want, in_it) = match k {
                    k if k < TINY_RULE_PROBES => (0, within(e, t.tiny)),
                    k if k < TINY_RULE_PROBES + FIRST_RULE_PROBES => (1, within(e, t.first)),
                    _ => (2, within(e, t.large)),
                };
                assert!(in_it && table == want, "probe {k} from {start}");
            }
        }
        assert_eq!(TINY_RULE_SLOTS * std::mem::size_of::<RuleEntry>(), 2 * 4096);
        let here = rule_probes_go_to_the_tiny_table_first_then_the_small_and_large_ones as *const () as u64;
        for ip in (here..here + 64).step_by(4) {
            let epoch = super::epoch();
            assert_eq!(rule_for(ip, epoch), rule_for(ip, epoch), "{ip:#x}");
            assert_eq!(rule_for(ip, epoch), compute_rule(ip), "{ip:#x}");
        }
    }

    /// Held by the tests that file rules by hand or give the large table back: the
    /// first must not have its entry dropped by the second midway (the other tests only
    /// look rules up, which a give-back never changes the answer of).
    static RULE_TABLE_WRITERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// A rule word filed under a key with another key's check (a claim whose key was
    /// dropped with the large table's pages before its rule was stored) is not taken:
    /// the rule is computed. One with its own check is taken.
    #[test]
    fn a_rule_filed_with_another_keys_check_is_not_taken() {
        let _alone = RULE_TABLE_WRITERS.lock().unwrap_or_else(|e| e.into_inner());
        let t = rule_tables().unwrap();
        let epoch = super::epoch();
        // An address no module holds (its rule: unsupported), in the first slot of its
        // probe sequence that is free or its own.
        let ip = 0x0000_1234_5600_0000u64 + (std::process::id() as u64 & 0xfff) * 16;
        let key = rule_key(ip, epoch);
        let start = shared_slot(key);
        let e = (0..TINY_RULE_PROBES + FIRST_RULE_PROBES + RULE_PROBES)
            .map(|k| t.probe(start, k).0)
            .find(|e| e.key.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire).map_or_else(|found| found == key, |_| true))
            .expect("a free slot");
        let right = compute_rule(ip);
        let other = (1..).map(|n| rule_key(ip + n, epoch)).find(|&o| rule_check(o) != rule_check(key)).unwrap();
        let wrong = (right ^ (8 << 8)) & RULE_BITS;
        e.rule.store(wrong | rule_check(other) << RULE_CHECK_SHIFT, Ordering::Release);
        assert_eq!(rule_for(ip, epoch), right);
        e.rule.store(wrong | rule_check(key) << RULE_CHECK_SHIFT, Ordering::Release);
        assert_eq!(rule_for(ip, epoch), wrong, "a rule with its key's check is taken as filed");
        e.rule.store(right | rule_check(key) << RULE_CHECK_SHIFT, Ordering::Release);
    }

    /// Giving back the large table leaves every lookup's answer what the CFI says, and
    /// the table fills again.
    #[test]
    fn rules_given_back_are_computed_and_filed_again() {
        let _alone = RULE_TABLE_WRITERS.lock().unwrap_or_else(|e| e.into_inner());
        let epoch = super::epoch();
        let here = rules_given_back_are_computed_and_filed_again as *const () as u64;
        // Enough keys that some go past the tiny and small windows.
        let ips: Vec<u64> = (0..40_000u64).map(|n| (here + n % 97 + (n / 97) * 131) ^ n << 40).collect();
        for &ip in &ips {
            assert_eq!(rule_for(ip, epoch), compute_rule(ip));
        }
        assert!(RULES_USED.load(Ordering::Relaxed) > 0);
        assert_eq!(give_back_rules(), RULE_SLOTS * std::mem::size_of::<RuleEntry>());
        for &ip in &ips {
            assert_eq!(rule_for(ip, epoch), compute_rule(ip));
        }
        assert!(RULES_USED.load(Ordering::Relaxed) > 0, "filed again");
    }

    #[test]
    fn rules_through_recent_fdes_are_what_the_cfi_says() {
        assert!(init());
        let functions = [level1 as *const () as u64, level2 as *const () as u64, level3 as *const () as u64, capture_stack_id as *const () as u64];
        let mut checked = 0;
        for round in 0..3u64 {
            for (i, &f) in functions.iter().enumerate() {
                for off in (round..160).step_by(3 + i) {
                    let ip = f + off;
                    let fresh = with_cfi_row(ip, rule_of_row);
                    assert_eq!(compute_rule_inner(ip), fresh, "{ip:#x} ({off} into function {i})");
                    checked += fresh.is_some() as u32;
                }
            }
        }
        assert!(checked > 100, "only {checked} addresses had a rule");
    }

    #[inline(never)]
    fn level3() -> u32 {
        thread::with(|s| capture_stack_id(s, 64))
    }
    #[inline(never)]
    fn level2() -> u32 {
        std::hint::black_box(level3())
    }
    #[inline(never)]
    fn level1() -> u32 {
        std::hint::black_box(level2())
    }

    #[test]
    fn captures_a_stack_and_memoises_it() {
        assert!(init());
        // One call site, twice: the second capture is answered by the memo.
        let mut ids = Vec::new();
        for _ in 0..std::hint::black_box(2) {
            ids.push(level1());
        }
        let (a, b) = (ids[0], ids[1]);
        assert_ne!(a, 0);
        assert_eq!(a, b);
        let frames = stacks::frames(a).unwrap();
        // The test harness runs us below several frames of its own.
        assert!(frames.len() >= 4, "only {} frames", frames.len());
        // The caller's addresses are all inside this test binary or libc.
        let me = find_object(level1 as *const () as u64).unwrap();
        assert!(frames.iter().take(3).all(|ip| *ip >= me.map_start && *ip < me.map_end));
    }

    /// Captures twice from one frame, memoised and not; returns both stacks without
    /// their innermost frame (the two call sites inside this function differ).
    #[inline(never)]
    fn both(depth: usize) -> (Vec<u64>, Vec<u64>) {
        let a = thread::with(|s| capture_stack_id(s, depth));
        let b = thread::with(|s| capture_unmemoised(s, depth));
        let strip = |id: u32| stacks::frames(id).unwrap().get(1..).unwrap_or(&[]).to_vec();
        (strip(a), strip(b))
    }

    #[inline(never)]
    fn down_f(level: u32, pattern: u32, depth: usize) -> (Vec<u64>, Vec<u64>) {
        let r = if level == 0 {
            both(depth)
        } else if pattern & 1 == 0 {
            down_f(level - 1, pattern >> 1, depth)
        } else {
            down_g(level - 1, pattern >> 1, depth)
        };
        std::hint::black_box(r)
    }

    #[inline(never)]
    fn down_g(level: u32, pattern: u32, depth: usize) -> (Vec<u64>, Vec<u64>) {
        // A different frame size, so that CFAs differ between the two paths.
        let pad = std::hint::black_box([level as u64; 9]);
        let r = if level == 0 { both(depth) } else { down_f(level - 1, pattern.rotate_right(1), depth) };
        std::hint::black_box(pad);
        std::hint::black_box(r)
    }

    /// Takes path `p` of the family `down_f` makes (one of 11 depths, a pattern of its
    /// two frame sizes) and checks the capture against a full unwind; `when` names the
    /// round in a failure.
    fn path_is_unwound_exactly(p: u32, when: std::fmt::Arguments) {
        let (memoised, full) = down_f(p % 11, p.wrapping_mul(2_654_435_761) >> 7, 64);
        assert_eq!(memoised, full, "path {p} in {when}");
    }

    #[test]
    fn a_reused_outer_part_is_exactly_what_a_full_unwind_finds() {
        assert!(init());
        // Varying depths and paths: consecutive captures share outer frames at
        // different offsets, and with a small depth limit the shared part is cut. One
        // thread per depth limit: a process has one, and the memo assumes it.
        for depth in [3usize, 8, 64] {
            std::thread::spawn(move || {
                for i in 0..300u32 {
                    let (memoised, full) = down_f(i % 11, i.wrapping_mul(2_654_435_761) >> 7, depth);
                    assert_eq!(memoised, full, "capture {i} at depth {depth}");
                    assert!(!full.is_empty());
                }
            })
            .join()
            .unwrap();
        }
        assert!(SUFFIXES_TAKEN.load(Ordering::Relaxed) > 100, "the outer part was reused {} times", SUFFIXES_TAKEN.load(Ordering::Relaxed));
    }

    /// More paths in turn than the memo's copies hold: each copy of a tree answer is pushed out
    /// before its path comes back, so the copying stops after a window (answers stay
    /// exact). A few paths taken again and again between others: their copies answer,
    /// and the copying goes on.
    #[test]
    fn tree_answers_are_copied_into_the_memo_only_while_the_copies_answer() {
        assert!(init());
        // 600 paths of a few dozen stack pointers: many more to a set than its ways.
        let thrash = std::thread::spawn(|| {
            for round in 0..20u32 {
                for p in 0..600u32 {
                    path_is_unwound_exactly(p, format_args!("round {round}"));
                }
            }
            PROMOTED_HERE.with(|c| c.get())
        })
        .join()
        .unwrap();
        assert!(thrash > 0, "no path was short enough to copy: the test says nothing");
        assert!(thrash <= PROMOTE_WINDOW as u64 + 64, "{thrash} copies made while none answered");
        let repeat = std::thread::spawn(|| {
            for cycle in 0..400u32 {
                // Six paths, ten times each (the memo answers from their copies) ...
                for _ in 0..10 {
                    for p in 0..6u32 {
                        path_is_unwound_exactly(p, format_args!("cycle {cycle}"));
                    }
                }
                // ... then others push them out.
                for p in 100..400u32 {
                    path_is_unwound_exactly(p, format_args!("cycle {cycle}"));
                }
            }
            PROMOTED_HERE.with(|c| c.get())
        })
        .join()
        .unwrap();
        assert!(repeat > 2 * PROMOTE_WINDOW as u64, "only {repeat} copies while the copies answered");
    }

    #[test]
    fn paths_the_memo_no_longer_holds_are_answered_by_the_tree_exactly() {
        assert!(init());
        // More paths than the memo's entries and copies hold, taken in turn: from the
        // second round on, the paths whose copies were pushed out come back to the tree
        // (a few hundred of them), and every answer is checked against a full unwind.
        std::thread::spawn(|| {
            for round in 0..6u32 {
                for p in 0..600u32 {
                    path_is_unwound_exactly(p, format_args!("round {round}"));
                }
            }
        })
        .join()
        .unwrap();
        assert!(TREE_ANSWERS.load(Ordering::Relaxed) > 100, "the tree answered {} captures", TREE_ANSWERS.load(Ordering::Relaxed));
    }
}
