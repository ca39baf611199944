//! The live arenas of CPython's object allocator (pymalloc), as its arena hooks
//! (`interpose::pymalloc`) report them, and the layouts of the built-in types the scan
//! reads: a fixed table of atomics in a mapping of its own, written under the GIL by
//! the hooks and read without a lock by the scan and the memory accounting.
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

const SLOTS: usize = 1 << 16;

struct Table {
    addr: [AtomicU64; SLOTS],
    size: [AtomicU64; SLOTS],
}

static TABLE: AtomicUsize = AtomicUsize::new(0);
/// Slots below this index may be in use.
static HIGH: AtomicUsize = AtomicUsize::new(0);
static FULL: AtomicBool = AtomicBool::new(false);

fn table() -> Option<&'static Table> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: a zeroed mapping of one Table (all-zero atomics are valid), never unmapped.
    (p != 0).then(|| unsafe { &*(p as *const Table) })
}

/// Maps the table (once); false when no memory could be mapped.
pub fn prepare() -> bool {
    if PREPARED.load(Ordering::Acquire) != 0 {
        return true;
    }
    let Some(mem) = crate::hotpath::mapping::map_zeroed(std::mem::size_of::<Table>()) else { return false };
    PREPARED.store(mem as usize, Ordering::Release);
    true
}

/// The mapped table, not yet published (`open`).
static PREPARED: AtomicUsize = AtomicUsize::new(0);

/// The hooks are in place: arenas are noted from now on.
pub fn open() {
    TABLE.store(PREPARED.load(Ordering::Acquire), Ordering::Release);
}

/// Whether the hooks are in place.
pub fn open_now() -> bool {
    table().is_some()
}

pub fn set_layouts(int_layout: u64, types: [u64; 5]) {
    INT_LAYOUT.store(int_layout, Ordering::Relaxed);
    for (slot, v) in OBJECT_TYPES.iter().zip(types) {
        slot.store(v, Ordering::Relaxed);
    }
}

pub fn note(addr: u64, size: u64) {
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

pub fn forget(addr: u64) {
    let Some(t) = table() else { return };
    let high = HIGH.load(Ordering::Acquire);
    if let Some(slot) = t.addr[..high].iter().find(|a| a.load(Ordering::Acquire) == addr) {
        slot.store(0, Ordering::Release);
    }
}

/// `&PyLong_Type` with bit 0 set for the 3.12+ layout (see `int_layout`); 0 when
/// unknown.
static INT_LAYOUT: AtomicU64 = AtomicU64::new(0);

/// The built-in types the scan reads by their layout (`scan::pymalloc::ObjectTypes`)
/// besides int (`INT_LAYOUT`): tuple, list, float, bytes, str; stored only for an
/// interpreter whose layouts are known (3.8 to 3.13).
static OBJECT_TYPES: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];

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
