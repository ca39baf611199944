//! The library's own memory, counted so that every report can state it (`tracer` in a
//! report's `memory`): the bytes of its heap blocks (the global allocator counts them)
//! and the mappings it makes for its tables and rings (registered here; their resident
//! part is measured with `mincore` at a snapshot, never on the hot path).
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Bytes of the library's own live heap blocks.
static HEAP: AtomicU64 = AtomicU64::new(0);

#[inline]
pub fn heap_grew(bytes: usize) {
    HEAP.fetch_add(bytes as u64, Ordering::Relaxed);
}

#[inline]
pub fn heap_shrank(bytes: usize) {
    HEAP.fetch_sub(bytes as u64, Ordering::Relaxed);
}

pub fn heap_bytes() -> u64 {
    HEAP.load(Ordering::Relaxed)
}

/// What a mapping of ours holds, so that a report can say where the tracer's memory
/// goes (`parts_resident`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Part {
    /// The stack table's frame arena (`hotpath::stacks`).
    StackFrames = 0,
    /// The stack table's per-stack records and its index.
    StackTable = 1,
    /// Python code objects and their frames' line tables (`hotpath::python`,
    /// `interpose::pyalloc`).
    Python = 2,
    /// The per-thread event rings (`hotpath::channel`).
    Rings = 3,
    /// The unwinder's memos, hit trees and rule tables (`hotpath::unwind`).
    Unwind = 4,
    /// The collector's table of live blocks by address.
    Blocks = 5,
    /// The library's large heap buffers (`hotpath::mapping::map_buffer`): the
    /// collector's groups, a report's snapshot, symbol tables.
    Buffers = 6,
    /// The library's own heap (`os::own_heap`): the small blocks of its own threads.
    Heap = 7,
    /// Anything else.
    Other = 8,
}

impl Part {
    pub const ALL: [Part; 9] =
        [Part::StackFrames, Part::StackTable, Part::Python, Part::Rings, Part::Unwind, Part::Blocks, Part::Buffers, Part::Heap, Part::Other];

    pub fn name(self) -> &'static str {
        match self {
            Part::StackFrames => "stack_frames",
            Part::StackTable => "stack_table",
            Part::Python => "python",
            Part::Rings => "rings",
            Part::Unwind => "unwind",
            Part::Blocks => "blocks",
            Part::Buffers => "buffers",
            Part::Heap => "heap",
            Part::Other => "other",
        }
    }
}

/// The library's mappings: start, then length and part, 0 for a free slot. A mapping that
/// finds no free slot is counted by its length in `UNLISTED` (as if wholly resident).
/// One slot's two words side by side, and the slots looked at only up to `IN_USE`: a
/// short process registers a few mappings and its exit report reads one page of this
/// table, where three arrays of 1,024 read 17 KiB of zero pages (5 page faults).
const SLOTS: usize = 1024;
struct Slot {
    start: AtomicUsize,
    /// The length in the low `LEN_BITS` bits, the part (with `FILE`) above them.
    len_part: AtomicUsize,
}
const LEN_BITS: u32 = 56;
const LEN_MASK: usize = (1 << LEN_BITS) - 1;
static TABLE: [Slot; SLOTS] = [const { Slot { start: AtomicUsize::new(0), len_part: AtomicUsize::new(0) } }; SLOTS];
/// One past the highest slot ever claimed.
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static UNLISTED: AtomicU64 = AtomicU64::new(0);

/// In a slot's part: the mapping is of a file (`spill`), whose pages `mincore` reports
/// as resident while they are in the page cache, mapped or not: counted by pagemap
/// instead.
const FILE: u8 = 0x80;

impl Slot {
    fn len(&self) -> usize {
        self.len_part.load(Ordering::Relaxed) & LEN_MASK
    }

    fn part(&self) -> u8 {
        (self.len_part.load(Ordering::Relaxed) >> LEN_BITS) as u8
    }

    /// Sets the length, keeping the part.
    fn set_len(&self, len: usize) {
        let v = self.len_part.load(Ordering::Relaxed);
        self.len_part.store((v & !LEN_MASK) | (len & LEN_MASK), Ordering::Relaxed);
    }
}

/// The slots that were ever claimed.
fn slots() -> &'static [Slot] {
    &TABLE[..IN_USE.load(Ordering::Acquire).min(SLOTS)]
}

/// A mapping of ours was made.
pub fn mapped(start: usize, len: usize, part: Part) {
    register(start, len, part as u8);
}

/// A file mapping of ours was made (`spill`): it counts by its pages mapped now.
pub fn mapped_file(start: usize, len: usize, part: Part) {
    register(start, len, part as u8 | FILE);
}

fn register(start: usize, len: usize, part: u8) {
    for (i, slot) in TABLE.iter().enumerate() {
        let s = &slot.start;
        if s.load(Ordering::Relaxed) == 0 && s.compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            slot.len_part.store((len & LEN_MASK) | (part as usize) << LEN_BITS, Ordering::Relaxed);
            IN_USE.fetch_max(i + 1, Ordering::AcqRel);
            s.store(start, Ordering::Release);
            return;
        }
    }
    UNLISTED.fetch_add(len as u64, Ordering::Relaxed);
}

/// The library's mappings now, `(start, len)`, sorted: memory that is never the
/// program's (`scan::glibc_heap` leaves it out).
pub fn ranges() -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = slots()
        .iter()
        .filter_map(|slot| {
            let a = slot.start.load(Ordering::Acquire);
            (a != 0 && a != usize::MAX).then(|| (a as u64, slot.len() as u64))
        })
        .collect();
    out.sort_unstable();
    out
}

/// `[start, start + len)` of a mapping of ours was unmapped: the whole mapping, or its
/// head or tail (`hotpath::mapping::map_zeroed_aligned` trims both).
pub fn unmapped(start: usize, len: usize) {
    for slot in slots() {
        let s = &slot.start;
        let (a, n) = (s.load(Ordering::Acquire), slot.len());
        if a == 0 || a == usize::MAX || start < a || start + len > a + n {
            continue;
        }
        if start == a && len == n {
            slot.len_part.store(0, Ordering::Relaxed);
            s.store(0, Ordering::Release);
        } else if start == a {
            // The head: the slot keeps the rest.
            s.store(usize::MAX, Ordering::Release);
            slot.set_len(n - len);
            s.store(a + len, Ordering::Release);
        } else if start + len == a + n {
            slot.set_len(n - len);
        }
        return;
    }
    let _ = UNLISTED.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(len as u64)));
}

/// A reservation of ours that is written from its start up (an arena): no page at or
/// past `touched_end` was ever touched.
#[derive(Clone, Copy, Debug)]
pub struct Touched {
    pub start: usize,
    pub len: usize,
    pub touched_end: usize,
}

/// The resident bytes of the library's mappings now, by `Part` (indexed by its value;
/// unlisted mappings count as `Other`). The parts of a mapping inside one of `arenas`
/// are looked at only below its `touched_end`: `mincore` costs by the pages asked
/// about, and the stack table reserves 1 GiB for its frames (~350 us a report, most of
/// the measure at the exit of a short process, for a few pages used).
pub fn parts_resident(arenas: &[Touched]) -> [u64; Part::ALL.len()] {
    let mut out = [0u64; Part::ALL.len()];
    out[Part::Other as usize] = UNLISTED.load(Ordering::Relaxed);
    let mut pagemap = -1;
    for slot in slots() {
        let a = slot.start.load(Ordering::Acquire);
        if a != 0 && a != usize::MAX {
            let p = slot.part();
            let part = ((p & !FILE) as usize).min(Part::Other as usize);
            let len = untouched_cut(a, slot.len(), arenas);
            out[part] += if p & FILE == 0 {
                resident(a, len)
            } else {
                if pagemap < 0 {
                    pagemap = super::anchor::open_proc("self/pagemap", libc::O_RDONLY).unwrap_or(-1);
                }
                mapped_pages(pagemap, a, len)
            };
        }
    }
    if pagemap >= 0 {
        // SAFETY: the descriptor opened above.
        unsafe { libc::close(pagemap) };
    }
    out
}

/// The length of `[start, start + len)` up to where an arena that holds it was touched.
fn untouched_cut(start: usize, len: usize, arenas: &[Touched]) -> usize {
    match arenas.iter().find(|t| start >= t.start && start + len <= t.start + t.len) {
        Some(t) => len.min(t.touched_end.saturating_sub(start)),
        None => len,
    }
}

/// The bytes of `[start, start + len)` mapped in this process now, by
/// `/proc/self/pagemap` (`pagemap`: its descriptor; 0 without one).
///
/// Its buffer and `resident`'s are small and in frames of their own (never inlined): a
/// frame over a page is probed page by page on entry, and the exit report of a process
/// that does nothing took two page faults of fresh stack for buffers it never used.
#[inline(never)]
pub fn mapped_pages(pagemap: i32, start: usize, len: usize) -> u64 {
    const PAGE: usize = 4096;
    let mut entries = [0u64; 64];
    let (mut at, end) = (start & !(PAGE - 1), start + len);
    let mut total = 0u64;
    while at < end {
        let pages = (end - at).div_ceil(PAGE).min(entries.len());
        if !super::pagemap::read(pagemap, (at / PAGE) as u64, &mut entries[..pages]) {
            break;
        }
        total += entries[..pages].iter().filter(|&&e| e & super::pagemap::PRESENT != 0).count() as u64 * PAGE as u64;
        at += pages * PAGE;
    }
    total
}

/// The resident bytes of `[start, start + len)` (`mincore`, 2 MiB a call); 0 where it
/// is not mapped.
#[inline(never)]
pub fn resident(start: usize, len: usize) -> u64 {
    const PAGE: usize = 4096;
    const CHUNK_PAGES: usize = 16384;
    let mut vec = [0u8; 512];
    let (mut at, end) = (start & !(PAGE - 1), start + len);
    let mut total = 0u64;
    while at < end {
        let pages = (end - at).div_ceil(PAGE).min(CHUNK_PAGES).min(vec.len());
        // SAFETY: mincore writes one byte per page of the range into `vec`, which has
        // room for `pages`; an unmapped range fails with ENOMEM and writes nothing.
        let rc = unsafe { libc::mincore(at as *mut libc::c_void, pages * PAGE, vec.as_mut_ptr()) };
        if rc == 0 {
            total += vec[..pages].iter().filter(|&&b| b & 1 != 0).count() as u64 * PAGE as u64;
        }
        at += pages * PAGE;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mapping_inside_an_arena_is_looked_at_up_to_where_it_was_touched() {
        let arena = Touched { start: 0x10_0000, len: 0x10_0000, touched_end: 0x14_0000 };
        // Wholly inside, across the touched end: cut there.
        assert_eq!(untouched_cut(0x10_0000, 0x10_0000, &[arena]), 0x4_0000);
        // Its head given up (spilled to a file): the rest up to the touched end.
        assert_eq!(untouched_cut(0x12_0000, 0xe_0000, &[arena]), 0x2_0000);
        // Wholly past it: nothing to look at.
        assert_eq!(untouched_cut(0x18_0000, 0x1000, &[arena]), 0);
        // Outside every arena, or reaching past one: as it is.
        assert_eq!(untouched_cut(0x30_0000, 0x5000, &[arena]), 0x5000);
        assert_eq!(untouched_cut(0x1f_0000, 0x2_0000, &[arena]), 0x2_0000);
        assert_eq!(untouched_cut(0x10_0000, 0x10_0000, &[]), 0x10_0000);
    }

    #[test]
    fn a_touched_mapping_is_resident_and_an_untouched_one_is_not() {
        let len = 64 << 10;
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) } as usize;
        assert_eq!(resident(p, len), 0);
        // SAFETY: the first 16 KiB of the mapping above.
        unsafe { std::ptr::write_bytes(p as *mut u8, 1, 16 << 10) };
        assert_eq!(resident(p, len), 16 << 10);
        mapped(p, len, Part::Other);
        assert!(parts_resident(&[])[Part::Other as usize] >= 16 << 10);
        unmapped(p, 4096);
        unmapped(p + 4096, len - 4096);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p as *mut libc::c_void, len) };
        assert_eq!(resident(p, len), 0);
        assert!(TABLE.iter().all(|s| s.start.load(Ordering::Relaxed) != p && s.start.load(Ordering::Relaxed) != p + 4096));
    }
}
