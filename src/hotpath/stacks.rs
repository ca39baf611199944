//! Stack interning: the hot path turns a captured stack (raw return addresses) into a
//! 32-bit id with a lock-free, insert-only hash table, so an event carries an id and
//! not 64 addresses. Id 0 means "no stack" (capture impossible or table full).
//!
//! Storage is three anonymous `MAP_NORESERVE` mappings made once: the frame arena, the
//! per-id records, and the open-addressing index. Nothing is ever removed. The frame
//! arena and the records are written in order and never again: past 16 MiB their
//! written heads move to a file mapped at the same addresses (`SpilledArena`,
//! `os::spill`), out of RSS but for the pages read again.
//!
//! **Shared outer frames.** A new stack usually differs from the thread's previous one
//! only in its innermost frames (a Python program: 5 new frames out of 47 on average,
//! 900k distinct stacks in `import torch`). When the unwinder took a stack's outer part
//! from an earlier stack, the record keeps only its own frames and a reference to the
//! earlier stack's frames it shares. Chains are at most `MAX_CHAIN` records long, so
//! reading a stack back stays cheap; identity is still the whole frame list (hash, then
//! frame by frame). Where the earlier stack's chain is full, the record refers to the
//! first record of that chain instead, taking on as its own the frames of the records
//! passed over (at most `REBASE_GROWTH` more). Before, it kept all its frames: in
//! `import torch` 94k of 880k native stacks kept 45 frames where 4 were new, and the
//! frame arena held 41.6 MB; now 30.2 MB.
//!
//! **Four indexes, one probe sequence.** A stack's probes go first to a window of
//! `TINY_PROBES` slots in a tiny index (8 KiB), then of `FIRST_PROBES` in a small one
//! (256 KiB), then to a window of `MAX_PROBES` in the large one (8 MiB), then, only
//! where that window is full, to the overflow index (16 MiB, untouched until then). A
//! short program (`git --version`: ~70 stacks) stays in the tiny index: spread over the
//! small one, its stacks faulted in 37 of its 64 pages, two page faults each (a read
//! maps the zero page, the claim copies it), ~0.25 ms of a 1.4 ms run. A program with a
//! few thousand stacks (a Python interpreter starting up: 14k) never touches the large
//! index: spread over it, its stacks had faulted in 3,300 pages of it, two page faults
//! each. Once on huge pages the
//! large index is all resident: `import torch`'s 1.2M records fill 57% of its 2M slots
//! (a 4M-slot index, 16 MiB resident, was 29% full; an 8M-slot one 14%). A window of
//! 64 slots is full for no stack at that load, and for 1 in 1,000 at 80% (a simulation
//! of random hashes): a program with more stacks than fit grows into the overflow
//! instead of losing them. The three together are one linear-probing
//! sequence whose slots only ever go from empty to filled, so concurrent interning still
//! agrees on ids.
//!
//! **Python children.** A stack with Python frames is `[PY_STACK, native, python]`
//! (`unwind::with_python_frames`). The first such stack of each native stack has no
//! record at all: its id is `CHILD_BASE + native`, and the native stack's word in the
//! `children` array holds its Python part. `import torch` makes ~1M stacks with Python
//! frames, nearly all the first of their native stack; as records they were 60 MB of
//! records, frames and index slots to fault in and zero (on the collector, which then
//! fell behind and made the program wait), and an index probe each that missed the
//! cache. Other combinations of the same native stack are records, through the index,
//! as any stack: each combination still has exactly one id. In an array by stack, a
//! native stack and its first child share a place (`shared_index`).
//!
//! **Tagged slots.** A slot holds a stack id in its low `ID_BITS` and ten bits of the
//! stack's hash above them: a probe that meets another stack's slot tells it apart
//! without reading that stack's record (a cache miss in the record array).
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::mapping::HUGE_PAGE;

const ID_BITS: u32 = 22;
const ID_MASK: u32 = (1 << ID_BITS) - 1;
const MAX_STACKS: usize = 1 << ID_BITS;
const TINY_INDEX_SLOTS: usize = 1 << 11;
/// Probes in the tiny index before the small one: one or two cache lines.
const TINY_PROBES: usize = 16;
const FIRST_INDEX_SLOTS: usize = 1 << 16;
/// Probes in the small index before the large one: one or two cache lines.
const FIRST_PROBES: usize = 16;
const INDEX_SLOTS: usize = 1 << 21;
/// Slots of the overflow index, probed only past a full window of the large one.
const OVERFLOW_SLOTS: usize = 1 << 22;
/// Bytes of the frame arena (frames take 1 to 10 bytes each: `encode_frames`).
const FRAME_BYTES: usize = 1 << 30;
/// Probes in the large index.
const MAX_PROBES: usize = 64;
/// Where the probes of the small index, and those of the large one, end.
const SMALL_END: usize = TINY_PROBES + FIRST_PROBES;
const LARGE_END: usize = SMALL_END + MAX_PROBES;
/// Longest run of records that refer to one another for their outer frames.
const MAX_CHAIN: u64 = 8;
/// The most frames a record takes on as its own to share a tail past a full chain
/// (`Tables::checked_tail`); more, and it keeps all its frames.
const REBASE_GROWTH: usize = 16;
/// The most frames a stack can have (the unwinder's limit).
const MAX_FRAMES: usize = super::unwind::MAX_DEPTH;
/// The most bytes a record's own frames take (a `[PY_STACK, native, python]` stack has
/// three).
const MAX_ENCODED: usize = (MAX_FRAMES + 3) * 10;

/// 16 bytes a stack (`import torch` has 1.1M records; 24 bytes each were 27 MB).
struct Record {
    /// Own frames' byte offset in the arena (`OFF_BITS`) | their bytes (`BYTES_BITS`) |
    /// their number (8 bits) | `HASH_BITS` of the stack's hash (`check_bits`) | the
    /// ready bit (63).
    /// With the index slot's tag, the hash bits tell stacks apart before their frames
    /// are compared.
    location: AtomicU64,
    /// The stack whose frames follow the own ones (`ID_BITS`; 0: none) | which of its
    /// frames: the first (8 bits), how many (8 bits) | the chain's length (4 bits) | the
    /// dlclose epoch the stack was captured in (`EPOCH_BITS`).
    link: AtomicU64,
}

const OFF_BITS: u32 = 30;
const BYTES_BITS: u32 = 11;
const HASH_SHIFT: u32 = OFF_BITS + BYTES_BITS + 8;
const HASH_BITS: u32 = 12;
const LINK_FIRST: u32 = ID_BITS;
const LINK_COUNT: u32 = LINK_FIRST + 8;
const LINK_CHAIN: u32 = LINK_COUNT + 8;
const LINK_EPOCH: u32 = LINK_CHAIN + 4;
const EPOCH_BITS: u32 = 64 - LINK_EPOCH;
/// Stacks captured after this many `dlclose` calls get no record (id 0, as a full
/// table): their epoch would not fit one.
pub const MAX_EPOCH: u32 = (1 << EPOCH_BITS) - 1;

const _: () = assert!(
    std::mem::size_of::<Record>() == 16
        && MAX_FRAMES + 3 <= 255
        && FRAME_BYTES <= 1 << OFF_BITS
        && MAX_ENCODED < 1 << BYTES_BITS
        && HASH_SHIFT + HASH_BITS < 63
        && MAX_CHAIN < 16
        && EPOCH_BITS >= 20
);

/// The `HASH_BITS` of hash `h` a record keeps: mixed from all of its bits. Its low bits
/// are not of use there: the stacks a probe meets in one window of an index share them
/// (the slot is the hash's low bits plus the probe), and so do the high ones (the
/// slot's tag) and those from 24 on (the overflow index's slot).
#[inline(always)]
fn check_bits(h: u64) -> u64 {
    // splitmix64's finalizer.
    let z = (h ^ h >> 30).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (z ^ z >> 27).wrapping_mul(0x94d0_49bb_1331_11eb) >> (64 - HASH_BITS)
}

impl Record {
    /// Whether this (ready) record's hash bits are those of hash `h`.
    #[inline(always)]
    fn hash_matches(location: u64, h: u64) -> bool {
        (location >> HASH_SHIFT) & ((1 << HASH_BITS) - 1) == check_bits(h)
    }

    fn epoch(&self) -> u32 {
        (self.link.load(Ordering::Relaxed) >> LINK_EPOCH) as u32
    }
}

/// A record's own frames as the arena keeps them: each frame's difference from the one
/// before it (the first one's from `base`: its parent's base, see `Tables::base_of`),
/// zigzag-encoded, in 7-bit groups, low first (the LEB128 of protocol buffers). Return
/// addresses of one stack lie close together: after `import torch` its 8M frames took
/// 3.7 bytes each on average against 8 as plain words. Returns the number of bytes
/// written to `out`.
fn encode_frames(frames: &[u64], base: u64, out: &mut [u8; MAX_ENCODED]) -> usize {
    let mut n = 0;
    let mut prev = base;
    for &f in frames.iter().take(MAX_FRAMES + 3) {
        let d = f.wrapping_sub(prev) as i64;
        let mut z = ((d << 1) ^ (d >> 63)) as u64;
        while z >= 0x80 {
            out[n] = z as u8 | 0x80;
            z >>= 7;
            n += 1;
        }
        out[n] = z as u8;
        n += 1;
        prev = f;
    }
    n
}

/// The frames of `encode_frames`'s bytes, `left` of them.
#[derive(Clone)]
struct Decoded {
    bytes: &'static [u8],
    at: usize,
    prev: u64,
    left: usize,
}

impl Iterator for Decoded {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let mut z = 0u64;
        let mut shift = 0;
        loop {
            // A record's bytes are whole (written before its READY bit): `get` only
            // guards against a torn read ending the iteration early.
            let b = *self.bytes.get(self.at)?;
            self.at += 1;
            z |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 || shift >= 63 {
                break;
            }
            shift += 7;
        }
        let d = (z >> 1) as i64 ^ -((z & 1) as i64);
        self.prev = self.prev.wrapping_add(d as u64);
        Some(self.prev)
    }
}

const READY: u64 = 1 << 63;

/// The number of own frames of a record with `location`.
#[inline(always)]
fn own_count(location: u64) -> usize {
    ((location >> (OFF_BITS + BYTES_BITS)) & 0xff) as usize
}

/// A record as read back: its own frames, then `count` frames of stack `parent` from
/// its frame `first` (none when `parent` is 0), `chain` records deep.
struct Parts {
    own: Decoded,
    /// How many frames `own` holds.
    own_len: usize,
    parent: u32,
    first: usize,
    count: usize,
    chain: u64,
}

impl Parts {
    /// How many frames the stack has.
    fn len(&self) -> usize {
        self.own_len + if self.parent == 0 { 0 } else { self.count }
    }
}

/// A new stack's outer frames, as found in an earlier stack: `frames[own..]` are
/// `count` frames of stack `parent` from its frame `first`.
#[derive(Clone, Copy, Debug)]
pub struct SharedTail {
    pub own: usize,
    pub parent: u32,
    pub first: usize,
    pub count: usize,
}

struct Tables {
    records: *const Record,
    /// Per stack id: the Python part of its first Python child (0: none yet).
    children: *const AtomicU32,
    /// First children handed out.
    child_count: AtomicU64,
    /// The tiny index, followed in the same mapping by the small one (`first_index`).
    tiny_index: *const AtomicU32,
    first_index: *const AtomicU32,
    index: *const AtomicU32,
    frames: *mut u8,
    next_id: AtomicU32,
    next_frame: AtomicU64,
    /// Bytes of the frame arena written so far (reserved ones count once written, or
    /// once given up): equal to `next_frame`, every reserved byte below it is written.
    frames_written: AtomicU64,
    /// Records written so far (id 0, never written, counts): as `frames_written`, for
    /// `next_id`.
    records_written: AtomicU32,
    overflows: AtomicU64,
    /// Stacks whose slot is in the small index.
    in_first_index: AtomicU32,
    /// Stacks whose slot is in the large index.
    in_large_index: AtomicU32,
    /// Stacks past a full window of the large index, in the overflow index.
    overflow: *const AtomicU32,
    in_overflow: AtomicU32,
}

// SAFETY: every shared field is atomic or points into mappings that live forever and
// whose cells are atomics (records, index) or written once before being published.
unsafe impl Sync for Tables {}
unsafe impl Send for Tables {}

static TABLES: AtomicPtr<Tables> = AtomicPtr::new(std::ptr::null_mut());

use super::mapping::{map_zeroed as map_anonymous, Part};

fn tables() -> Option<&'static Tables> {
    published_tables().or_else(init_tables)
}

/// The tables if some thread made them already (never makes them).
fn published_tables() -> Option<&'static Tables> {
    let t = TABLES.load(Ordering::Acquire);
    // SAFETY: once published the tables are never freed.
    (!t.is_null()).then(|| unsafe { &*t })
}

#[cold]
fn init_tables() -> Option<&'static Tables> {
    let records = map_anonymous(MAX_STACKS * std::mem::size_of::<Record>(), Part::StackTable)?;
    let children = map_anonymous(MAX_STACKS * 4, Part::StackTable)?;
    let tiny_index = map_anonymous((TINY_INDEX_SLOTS + FIRST_INDEX_SLOTS) * 4, Part::StackTable)? as *const AtomicU32;
    // SAFETY: the small index follows the tiny one inside the same mapping.
    let first_index = unsafe { tiny_index.add(TINY_INDEX_SLOTS) };
    let index = super::mapping::map_zeroed_aligned(INDEX_SLOTS * 4, Part::StackTable)?;
    let overflow = super::mapping::map_zeroed_aligned(OVERFLOW_SLOTS * 4, Part::StackTable)?;
    let frames = map_anonymous(FRAME_BYTES, Part::StackFrames)?;
    let header = map_anonymous(std::mem::size_of::<Tables>(), Part::StackTable)? as *mut Tables;
    // SAFETY: `header` is a fresh, writable, suitably aligned (page) mapping.
    unsafe {
        header.write(Tables {
            records: records as *const Record,
            children: children as *const AtomicU32,
            child_count: AtomicU64::new(0),
            tiny_index,
            first_index,
            index: index as *const AtomicU32,
            frames,
            // id 0 is reserved for "no stack".
            next_id: AtomicU32::new(1),
            next_frame: AtomicU64::new(0),
            frames_written: AtomicU64::new(0),
            records_written: AtomicU32::new(1),
            overflows: AtomicU64::new(0),
            in_first_index: AtomicU32::new(0),
            in_large_index: AtomicU32::new(0),
            overflow: overflow as *const AtomicU32,
            in_overflow: AtomicU32::new(0),
        });
    }
    match TABLES.compare_exchange(std::ptr::null_mut(), header, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: we just published it.
        Ok(_) => Some(unsafe { &*header }),
        // Lost the race (only possible before the library is initialised): use the
        // winner's tables; the few MiB of untouched reserve we made stay unused.
        // SAFETY: the winner's pointer is published and never freed.
        Err(winner) => Some(unsafe { &*winner }),
    }
}

/// Stacks in the large index past which it moves to huge pages. By then a third of its
/// 4 KiB pages are touched and its probes start to miss the cache (`import torch`
/// interns 880k stacks); a program that fits the small index never touches it.
const HUGE_INDEX_AT: u32 = 4096;
/// Collapses tried so far; the kernel may refuse a region that a thread is writing at
/// that moment, so a few later calls try again.
static INDEX_PROMOTIONS: AtomicU32 = AtomicU32::new(0);
const MAX_PROMOTIONS: u32 = 8;
/// Set once a collapse succeeded (or the tries ran out).
static INDEX_PROMOTED: AtomicBool = AtomicBool::new(false);
/// The same for the overflow index.
static OVERFLOW_PROMOTIONS: AtomicU32 = AtomicU32::new(0);
static OVERFLOW_PROMOTED: AtomicBool = AtomicBool::new(false);

/// The record array and the frame arena are written in order: once either holds this
/// much, the collector faults it in ahead of its writers (`populate_range`), in small
/// pages (`import torch` writes ~28 MB of records and ~50 MB of frames). They were on
/// 2 MiB pages from here, one fault each instead of 512; but a huge page must be
/// zeroed whole, and on a virtual machine whose host backs a guest's huge page only
/// when it is first touched (and takes back the free ones the guest reports), that
/// cost 0.16–0.59 s of `import torch`'s CPU in `MADV_POPULATE_WRITE` against
/// 0.03–0.09 s for the same 80 MB in small pages (`strace -T`, docs/design.md). The
/// arenas are read back a record, or a stack's frames, at a time, so small pages add
/// few TLB misses there; the index, whose every probe is a random read, keeps its huge
/// pages.
const POPULATE_FROM: usize = 4 << 20;
static RECORDS_ADVISED: AtomicBool = AtomicBool::new(false);
static FRAMES_ADVISED: AtomicBool = AtomicBool::new(false);

/// Once an arena is that large, the collector keeps this much of it past the write
/// position faulted in ahead of the writers: otherwise the first write to each page
/// faults and zeroes it on the thread that interns (on huge pages, ~0.25 s of `import
/// torch`'s main thread for ~80 MB on a virtual machine), and the collector is often
/// idle then. What is faulted in ahead stays resident once the writers stop (nothing
/// may give it back: a writer that reserved its place a moment before would lose what
/// it wrote there), so it is kept short: the collector tops it up on every turn (every
/// 0.2–2 ms), and `import torch`'s arenas grow by ~20 MB a second at most, 40 KB a
/// turn. 8 MiB ahead in 2 MiB pieces left ~12 MB of zero pages resident after `import
/// torch` (peak RSS 756 → 744 MB at 1 MiB); `bench/new_stacks.c`'s CPU time the same
/// within its noise (medians of 11: 1.76 s at 8 MiB, 1.68 at 1 MiB, 1.78 with none).
const POPULATE_AHEAD: usize = 1 << 20;
/// The pieces `populate_range` faults in: a quarter of `POPULATE_AHEAD`.
const POPULATE_STEP: usize = POPULATE_AHEAD / 4;
/// Bytes of each arena faulted in so far; `usize::MAX` once the kernel refused.
static RECORDS_POPULATED: AtomicUsize = AtomicUsize::new(0);
static FRAMES_POPULATED: AtomicUsize = AtomicUsize::new(0);

/// The range of an arena (`capacity` bytes) to fault in now, `used` bytes of it being
/// written and `populated` already faulted in: from the piece the writers are in (or
/// where the last call stopped) to `POPULATE_AHEAD` past them, in whole
/// `POPULATE_STEP` pieces, or nothing while the writers are more than half that far
/// from the end of it.
fn populate_range(used: usize, populated: usize, capacity: usize) -> Option<(usize, usize)> {
    if used < POPULATE_FROM || populated == usize::MAX || populated >= used.saturating_add(POPULATE_AHEAD / 2) {
        return None;
    }
    let start = populated.max(used / POPULATE_STEP * POPULATE_STEP);
    let end = used.saturating_add(POPULATE_AHEAD).div_ceil(POPULATE_STEP).saturating_mul(POPULATE_STEP).min(capacity);
    (end > start).then_some((start, end))
}

/// An arena's head moves to a file once this much of it is written (`os::spill`): a
/// program with fewer stacks keeps them in memory.
const SPILL_FROM: usize = 16 << 20;
/// And again each time this much more is (a huge page; the file's copies are merged
/// into one mapping by the kernel).
const SPILL_CHUNK: usize = HUGE_PAGE;

/// One of the two arenas written in order and never again (the frames, the records),
/// with its head in a spill file: `import torch` leaves 44 MB of frames and 29 MB of
/// records, most of them never read again, which the kernel can now keep out of RSS.
struct SpilledArena {
    spill: crate::os::spill::Spill,
    /// Bytes of the arena in the file so far (whole 2 MiB pages from its start);
    /// `usize::MAX` once spilling failed or was refused (a seccomp filter).
    spilled: AtomicUsize,
}

static FRAMES_SPILL: SpilledArena = SpilledArena::new();
static RECORDS_SPILL: SpilledArena = SpilledArena::new();

impl SpilledArena {
    const fn new() -> SpilledArena {
        SpilledArena { spill: crate::os::spill::Spill::new(), spilled: AtomicUsize::new(0) }
    }

    /// Moves the arena's written head (at `base`, `capacity` bytes) to the file when
    /// enough more was written since the last time: `written` bytes of it are, and
    /// `reserved` (read after `written`) are handed out; equal, no write is pending
    /// below them. The collector's, between drains.
    fn advance(&self, base: *mut u8, written: usize, reserved: usize, capacity: usize, part: Part) {
        let spilled = self.spilled.load(Ordering::Relaxed);
        if spilled == usize::MAX || written < SPILL_FROM || written < spilled + SPILL_CHUNK || written != reserved {
            return;
        }
        let to = (written / HUGE_PAGE * HUGE_PAGE).min(capacity);
        // SAFETY: `base` is one of our arenas, written in order: `[spilled, to)` is
        // written (`written == reserved`) and never written again.
        if !crate::os::procfs::unfiltered_now() || !unsafe { self.spill.spill(base, spilled, to) } {
            self.spilled.store(usize::MAX, Ordering::Relaxed);
            return;
        }
        let at = base as usize;
        crate::os::own::unmapped(at + spilled, to - spilled);
        if spilled > 0 {
            crate::os::own::unmapped(at, spilled);
        }
        crate::os::own::mapped_file(at, to, part);
        self.spilled.store(to, Ordering::Relaxed);
    }

    /// Gives back the spilled pages that reads mapped again since (they stay in the
    /// page cache). Not under a seccomp filter (the caller checks).
    fn release(&self, base: *mut u8) {
        let spilled = self.spilled.load(Ordering::Relaxed);
        if spilled != 0 && spilled != usize::MAX {
            // SAFETY: the spilled head of our own arena, a shared file mapping: dropping
            // its pages loses nothing, the next read maps them again from the file.
            unsafe { libc::madvise(base as *mut libc::c_void, spilled, libc::MADV_DONTNEED) };
        }
    }

    fn active(&self) -> bool {
        let spilled = self.spilled.load(Ordering::Relaxed);
        spilled != 0 && spilled != usize::MAX
    }

    /// The bytes of this process's own file (`Spill::own_bytes`).
    fn file_bytes(&self) -> u64 {
        if self.active() {
            self.spill.own_bytes()
        } else {
            0
        }
    }
}

/// The stack table's arenas, for `os::own::parts_resident` to look at only where they
/// were touched. Each is written from its start up (the records and the frames by
/// `next_id` and `next_frame`; the first-children array by stack id, below `next_id`),
/// the records and frames also faulted in ahead (`populate_range`) in whole
/// `POPULATE_STEP` pieces, and the first 4 MiB possibly on huge pages (a kernel whose
/// transparent huge pages are `always` fills around a written page): nothing lies past
/// the larger extent rounded up to 2 MiB. An arena whose populating failed part-way is not cut.
pub fn touched_arenas() -> Vec<crate::os::own::Touched> {
    let Some(t) = published_tables() else { return Vec::new() };
    let stacks = (t.next_id.load(Ordering::Acquire) as usize).min(MAX_STACKS);
    let arena = |base: *const u8, len: usize, used: usize, populated: usize| {
        let start = base as usize;
        let extent = if populated == usize::MAX { len } else { used.max(populated) };
        let touched_end = (start.saturating_add(extent)).div_ceil(HUGE_PAGE).saturating_mul(HUGE_PAGE).min(start + len);
        crate::os::own::Touched { start, len, touched_end }
    };
    // An index (2 MiB aligned) is used whole once a stack is filed there.
    let index = |base: *const AtomicU32, slots: usize, count: &AtomicU32| arena(base as *const u8, slots * 4, if filed(count) { slots * 4 } else { 0 }, 0);
    let record = std::mem::size_of::<Record>();
    vec![
        arena(t.records as *const u8, MAX_STACKS * record, stacks * record, RECORDS_POPULATED.load(Ordering::Relaxed)),
        arena(t.frames, FRAME_BYTES, (t.next_frame.load(Ordering::Acquire) as usize).min(FRAME_BYTES), FRAMES_POPULATED.load(Ordering::Relaxed)),
        arena(t.children as *const u8, MAX_STACKS * 4, stacks * 4, 0),
        // The large index and the overflow, untouched until a stack is filed there
        // (a short process files none): not looked at.
        index(t.index, INDEX_SLOTS, &t.in_large_index),
        index(t.overflow, OVERFLOW_SLOTS, &t.in_overflow),
    ]
}

/// The size of this process's stack table spill files now (`memory.tracer_files`):
/// page cache that leaktrace's RSS does not show.
pub fn spill_file_bytes() -> u64 {
    FRAMES_SPILL.file_bytes() + RECORDS_SPILL.file_bytes()
}

/// Moves the written heads of the frame arena and the record array to their spill
/// files (`SpilledArena::advance`).
fn spill_arenas(t: &Tables) {
    let record = std::mem::size_of::<Record>();
    // Written first: equal to the reservations read after it, nothing below is pending.
    let written = t.frames_written.load(Ordering::Acquire) as usize;
    FRAMES_SPILL.advance(t.frames, written, t.next_frame.load(Ordering::Acquire) as usize, FRAME_BYTES, Part::StackFrames);
    let written = (t.records_written.load(Ordering::Acquire) as usize).min(MAX_STACKS) * record;
    let reserved = (t.next_id.load(Ordering::Acquire) as usize).min(MAX_STACKS) * record;
    RECORDS_SPILL.advance(t.records as *mut u8, written, reserved, MAX_STACKS * record, Part::StackTable);
}

/// Gives back the pages of the spilled frames and records that lookups mapped again
/// since (they stay in the page cache). The collector's, after timeline points.
pub fn release_spilled() {
    let Some(t) = published_tables() else { return };
    // Not under a seccomp filter, which may answer `madvise` with SIGSYS.
    if !(FRAMES_SPILL.active() || RECORDS_SPILL.active()) || !crate::os::procfs::unfiltered_now() {
        return;
    }
    let _errno = crate::os::ErrnoGuard::save();
    FRAMES_SPILL.release(t.frames);
    RECORDS_SPILL.release(t.records as *mut u8);
}

/// Whether a stack was ever filed in the index whose count is `count` (the large one,
/// the overflow): until then none of its pages was written.
fn filed(count: &AtomicU32) -> bool {
    count.load(Ordering::Acquire) != 0
}

/// At the final report of a process that exits, once every event it reports is
/// drained: the indexes that find a stack by its frames go back to the system (8 MiB
/// of `import torch`'s peak, which comes in that report: its scan and names are then
/// made with them gone). Nothing reads a stack by its frames after tracking stopped:
/// the report reads records by id. A thread still inside a hook then finds no stack
/// and files its stack again under a new id; its event comes after the drain, in no
/// report. An index nothing was filed in (the large one and the overflow of a short
/// process) holds no page: it is left alone (four `madvise` calls of every exit report,
/// two of which changed the mappings' flags).
pub fn release_index() {
    let Some(t) = published_tables() else { return };
    // Not under a seccomp filter, which may answer `madvise` with SIGSYS.
    if !crate::os::procfs::unfiltered_now() {
        return;
    }
    let _errno = crate::os::ErrnoGuard::save();
    let indexes = [
        (t.tiny_index, TINY_INDEX_SLOTS + FIRST_INDEX_SLOTS, true),
        (t.index, INDEX_SLOTS, filed(&t.in_large_index)),
        (t.overflow, OVERFLOW_SLOTS, filed(&t.in_overflow)),
    ];
    for (base, slots, used) in indexes {
        if !used {
            continue;
        }
        let (start, len) = (base as usize, slots * 4);
        // Small pages from now on, so that a straggler's filing faults in 4 KiB, not a
        // huge page (a mapping smaller than one never has one).
        if len >= HUGE_PAGE {
            super::mapping::advise_small_pages(start as *mut u8, len);
        }
        // SAFETY: whole mappings of ours (page-aligned, `slots * 4` bytes long) whose
        // cells are atomics read as zero afterwards: an empty slot.
        unsafe { super::mapping::give_back_pages(start, start + len) };
    }
}

/// Called by the collector between drains (never on the hot path: the collapse copies
/// the touched pages and takes a few milliseconds). A forked child inherits the tables,
/// huge pages and all, and the flags.
pub fn promote_tables_if_large() {
    let Some(t) = published_tables() else { return };
    // An arena written in order (`used` of its `bytes`): past 4 MiB, faulted in ahead
    // of its writers, in small pages even where huge ones are the kernel's default.
    let arena = |advised: &AtomicBool, populated: &AtomicUsize, used: usize, base: *mut u8, bytes: usize| {
        if used >= POPULATE_FROM && !advised.swap(true, Ordering::Relaxed) {
            super::mapping::advise_small_pages(base, bytes);
        }
        if let Some((start, end)) = populate_range(used, populated.load(Ordering::Relaxed), bytes) {
            // SAFETY: [start, end) lies inside the arena's mapping (`end <= bytes`).
            let ok = super::mapping::populate_writable(unsafe { base.add(start) }, end - start);
            populated.store(if ok { end } else { usize::MAX }, Ordering::Relaxed);
        }
    };
    let records = (t.next_id.load(Ordering::Relaxed) as usize).min(MAX_STACKS) * std::mem::size_of::<Record>();
    arena(&RECORDS_ADVISED, &RECORDS_POPULATED, records, t.records as *mut u8, MAX_STACKS * std::mem::size_of::<Record>());
    let frames = (t.next_frame.load(Ordering::Relaxed) as usize).min(FRAME_BYTES);
    arena(&FRAMES_ADVISED, &FRAMES_POPULATED, frames, t.frames, FRAME_BYTES);
    spill_arenas(t);
    let index = |promoted: &AtomicBool, promotions: &AtomicU32, stacks: &AtomicU32, base: *const AtomicU32, slots: usize| {
        if promoted.load(Ordering::Relaxed) || stacks.load(Ordering::Relaxed) < HUGE_INDEX_AT {
            return;
        }
        let tries = promotions.fetch_add(1, Ordering::Relaxed) + 1;
        if super::mapping::promote_to_huge_pages(base as *mut u8, slots * 4) || tries >= MAX_PROMOTIONS {
            promoted.store(true, Ordering::Relaxed);
        }
    };
    index(&INDEX_PROMOTED, &INDEX_PROMOTIONS, &t.in_large_index, t.index, INDEX_SLOTS);
    index(&OVERFLOW_PROMOTED, &OVERFLOW_PROMOTIONS, &t.in_overflow, t.overflow, OVERFLOW_SLOTS);
}

/// A stack's hash folds its frames from the outermost in: the state after each frame is
/// then a function of that frame and the ones outside it, so an unwind that took an
/// earlier stack's outer frames also takes their states and hashes only its own frames.
#[inline]
pub fn hash_start(epoch: u32) -> u64 {
    0x9e37_79b9_7f4a_7c15 ^ epoch as u64
}

/// The state once frame `f` (the next one inwards) is folded into state `h`.
#[inline(always)]
pub fn hash_step(h: u64, f: u64) -> u64 {
    (h.rotate_left(5) ^ f).wrapping_mul(0x517c_c1b7_2722_0a95)
}

/// The hash of a stack whose innermost frame left the state `h`.
#[inline(always)]
pub fn hash_finish(h: u64) -> u64 {
    (h ^ (h >> 29)) | 1
}

#[inline]
pub fn hash_frames(epoch: u32, frames: &[u64]) -> u64 {
    hash_finish(frames.iter().rev().fold(hash_start(epoch), |h, &f| hash_step(h, f)))
}

impl Tables {
    fn record(&self, id: u32) -> &Record {
        // SAFETY: id < MAX_STACKS is checked by callers; the mapping holds MAX_STACKS records.
        unsafe { &*self.records.add(id as usize) }
    }

    /// Probe `k` of the sequence of hash `h`: the tiny index's window, the small
    /// index's, then the large index's, then the overflow index's (from other bits of
    /// the hash: the stacks that come there share a window of the large index).
    fn probe(&self, h: u64, k: usize) -> &AtomicU32 {
        if k < TINY_PROBES {
            let i = (h as usize).wrapping_add(k) & (TINY_INDEX_SLOTS - 1);
            // SAFETY: i < TINY_INDEX_SLOTS, the tiny index's length.
            unsafe { &*self.tiny_index.add(i) }
        } else if k < SMALL_END {
            let i = (h as usize).wrapping_add(k - TINY_PROBES) & (FIRST_INDEX_SLOTS - 1);
            // SAFETY: i < FIRST_INDEX_SLOTS, the small index's length.
            unsafe { &*self.first_index.add(i) }
        } else if k < LARGE_END {
            let i = (h as usize).wrapping_add(k - SMALL_END) & (INDEX_SLOTS - 1);
            // SAFETY: i < INDEX_SLOTS, the large index's length.
            unsafe { &*self.index.add(i) }
        } else {
            let i = ((h >> 24) as usize).wrapping_add(k - LARGE_END) & (OVERFLOW_SLOTS - 1);
            // SAFETY: i < OVERFLOW_SLOTS, the overflow index's length.
            unsafe { &*self.overflow.add(i) }
        }
    }

    /// The own frames of a record with `location`, whose first frame is kept as its
    /// difference from `base`.
    fn frames_of(&self, location: u64, base: u64) -> Decoded {
        let off = ((location & ((1 << OFF_BITS) - 1)) as usize).min(FRAME_BYTES);
        let bytes = (((location >> OFF_BITS) & ((1 << BYTES_BITS) - 1)) as usize).min(FRAME_BYTES - off);
        // SAFETY: [off, off+bytes) lies in the arena (clamped above); it was reserved by
        // fetch_add and fully written before the record's READY bit was published with
        // Release, and is never written again.
        let bytes = unsafe { std::slice::from_raw_parts(self.frames.add(off), bytes) };
        Decoded { bytes, at: 0, prev: base, left: own_count(location) }
    }

    /// A ready record, decoded; its own frames as if its base (`base_of`) were 0: the
    /// caller sets `own.prev` to the base before reading them.
    fn parts(&self, id: u32) -> Option<Parts> {
        let rec = self.record(id);
        let loc = rec.location.load(Ordering::Acquire);
        if loc & READY == 0 {
            return None;
        }
        let link = rec.link.load(Ordering::Relaxed);
        Some(Parts {
            own: self.frames_of(loc, 0),
            own_len: own_count(loc),
            parent: (link & ID_MASK as u64) as u32,
            first: ((link >> LINK_FIRST) & 0xff) as usize,
            count: ((link >> LINK_COUNT) & 0xff) as usize,
            chain: (link >> LINK_CHAIN) & 0xf,
        })
    }

    /// The base of stack `id`'s record: the first of its own frames, or, with none, its
    /// parent's base (0 past the chain's first record). A record keeps its first own
    /// frame as its difference from its parent's base: stacks that share their outer
    /// frames were mostly allocated from the same place, and that difference takes ~1.7
    /// bytes where the address itself took ~6 (`import torch`'s 1.1M records, 2026-12-06).
    /// `None` if a record on the way is not ready.
    fn base_of(&self, id: u32) -> Option<u64> {
        let mut base = 0u64;
        let mut id = id;
        // The chain's first record has no parent; the bound only guards against a torn
        // record. Each first own frame is the sum of the differences up the chain.
        for _ in 0..=MAX_CHAIN {
            if id == 0 {
                return Some(base);
            }
            let mut p = self.parts(id)?;
            if p.own_len > 0 {
                base = base.wrapping_add(p.own.next()?);
            }
            id = p.parent;
        }
        (id == 0).then_some(base)
    }

    /// Frames `[skip, skip + len)` of stack `id`, handed to `f` in order, without
    /// allocating. Returns false if a record of its chain is not ready.
    fn visit(&self, id: u32, mut skip: usize, mut len: usize, f: &mut impl FnMut(u64)) -> bool {
        let Some(mut p) = self.parts(id) else { return false };
        // What the record's own frames are read against: its parent's base. Up the
        // chain, each parent's own parent's base is the parent's less its first frame's
        // difference.
        let Some(mut base) = self.base_of(p.parent) else { return false };
        for _ in 0..=MAX_CHAIN {
            let Parts { mut own, own_len, parent, first, count, .. } = p;
            if skip < own_len {
                own.prev = base;
                let take = (own_len - skip).min(len);
                own.skip(skip).take(take).for_each(&mut *f);
                len -= take;
                skip = 0;
            } else {
                skip -= own_len;
            }
            if len == 0 || parent == 0 || skip >= count {
                return true;
            }
            len = len.min(count - skip);
            skip += first;
            let Some(next) = self.parts(parent) else { return false };
            if next.own_len > 0 {
                let Some(difference) = next.own.clone().next() else { return false };
                base = base.wrapping_sub(difference);
            }
            p = next;
        }
        true
    }

    /// `tail` of a new stack of `len` frames as its record will share it, and the record's
    /// chain length; `None` where it is not what it claims to be, or where sharing it
    /// would cost more than `REBASE_GROWTH` more frames (then the record keeps all its
    /// frames, and starts a chain). A parent whose chain is already `MAX_CHAIN` long is
    /// passed over for the first record of its chain (`rebase_past`, one record at a
    /// time).
    fn checked_tail(&self, tail: SharedTail, len: usize) -> Option<(SharedTail, u64)> {
        if tail.count == 0 || tail.own + tail.count != len {
            return None;
        }
        let mut s = tail;
        // A parent's chain is its own parent's plus one: the bound only guards against
        // a torn record.
        for _ in 0..=MAX_CHAIN {
            if s.parent == 0 || s.parent as usize >= MAX_STACKS {
                return None;
            }
            let parent = self.parts(s.parent)?;
            if s.first + s.count > parent.len() {
                return None;
            }
            if parent.chain < MAX_CHAIN && (s.parent == tail.parent || parent.chain == 0) {
                return Some((s, parent.chain + 1));
            }
            s = rebase_past(s, &parent)?;
            if s.own > tail.own + REBASE_GROWTH {
                return None;
            }
        }
        None
    }

    /// Whether stack `id` is exactly `frames`.
    fn equals(&self, id: u32, frames: &[u64]) -> bool {
        self.parts(id).map(|p| p.len()) == Some(frames.len()) && self.reads_as(id, 0, frames)
    }

    /// Whether stack `id`, from its frame `skip` on, reads back as `expect` (its
    /// `expect.len()` frames from there, all of them readable).
    fn reads_as(&self, id: u32, skip: usize, expect: &[u64]) -> bool {
        let mut i = 0;
        let mut same = true;
        let complete = self.visit(id, skip, expect.len(), &mut |ip| {
            same &= expect.get(i) == Some(&ip);
            i += 1;
        });
        complete && same && i == expect.len()
    }
}

/// The same tail, taken from `parent`'s own parent instead of `parent` (whose parts
/// are given): the frames of the tail that are `parent`'s own become the new stack's own
/// ones. `None` where the tail lies wholly in `parent`'s own frames, or `parent` shares
/// none.
fn rebase_past(s: SharedTail, parent: &Parts) -> Option<SharedTail> {
    if parent.parent == 0 {
        return None;
    }
    // The tail's frames [first, first + count) of `parent`: those below `own_len` are its
    // own; frame `own_len + k` is frame `parent.first + k` of its parent.
    let from_own = parent.own_len.saturating_sub(s.first);
    let count = s.count.checked_sub(from_own).filter(|&c| c > 0)?;
    let first = parent.first + (s.first + from_own - parent.own_len);
    (first + count <= parent.first + parent.count).then_some(SharedTail { own: s.own + from_own, parent: parent.parent, first, count })
}

/// Starts loading the index line that `intern_hashed` with hash `h` probes first: for a
/// new stack that probe is a memory miss (a random line of a large index), which the
/// caller overlaps with the rest of its work.
#[inline]
pub fn prefetch_index(h: u64) {
    if let Some(t) = tables() {
        super::mapping::prefetch_line(t.probe(h, 0));
        if t.in_first_index.load(Ordering::Relaxed) != 0 {
            super::mapping::prefetch_line(t.probe(h, TINY_PROBES));
        }
        if t.in_large_index.load(Ordering::Relaxed) != 0 {
            super::mapping::prefetch_line(t.probe(h, SMALL_END));
        }
    }
}

/// The tag bits a slot of a stack with hash `h` carries above its id.
#[inline(always)]
fn tag_of(h: u64) -> u32 {
    ((h >> 54) as u32) << ID_BITS
}

/// Tests: the id of `frames` (captured in dlclose `epoch`), inserting it if new.
#[cfg(test)]
pub fn intern(epoch: u32, frames: &[u64]) -> u32 {
    intern_hashed(epoch, frames, None, hash_frames(epoch, frames))
}

/// Returns the id of `frames` (captured in dlclose `epoch`, with hash `h` as
/// `hash_frames` gives it), inserting it if new. With `tail`, the stack's outer frames
/// are those of an earlier one: a new record then stores only its own frames.
#[inline]
pub fn intern_hashed(epoch: u32, frames: &[u64], tail: Option<SharedTail>, h: u64) -> u32 {
    let Some(t) = tables() else { return 0 };
    let tag = tag_of(h);
    let mut new_id = 0u32;
    for k in 0..LARGE_END + MAX_PROBES {
        let slot = t.probe(h, k);
        // A slot goes from empty to filled once: a failed claim reads it again.
        loop {
            let cur = slot.load(Ordering::Acquire);
            if cur != 0 {
                let id = cur & ID_MASK;
                if cur & !ID_MASK == tag {
                    let rec = t.record(id);
                    if Record::hash_matches(rec.location.load(Ordering::Relaxed), h) && rec.epoch() == epoch && t.equals(id, frames) {
                        return id;
                    }
                }
                break;
            }
            if new_id == 0 {
                match make_record(t, h, epoch, frames, tail) {
                    Some(id) => new_id = id,
                    None => {
                        t.overflows.fetch_add(1, Ordering::Relaxed);
                        return 0;
                    }
                }
            }
            if slot.compare_exchange(0, new_id | tag, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                if k >= LARGE_END {
                    t.in_overflow.fetch_add(1, Ordering::Relaxed);
                } else if k >= SMALL_END {
                    t.in_large_index.fetch_add(1, Ordering::Relaxed);
                } else if k >= TINY_PROBES {
                    t.in_first_index.fetch_add(1, Ordering::Relaxed);
                }
                return new_id;
            }
        }
    }
    t.overflows.fetch_add(1, Ordering::Relaxed);
    0
}

/// Ids from here on are first Python children: `CHILD_BASE + native`.
pub const CHILD_BASE: u32 = MAX_STACKS as u32;

/// The id of `[PY_STACK, native, python]` (a stack with Python frames, see
/// `unwind::with_python_frames`), inserting it if new: `CHILD_BASE + native` when
/// `python` is, or now becomes, `native`'s first Python part, else a record as any
/// stack (hashed only then).
#[inline]
pub fn intern_child(epoch: u32, native: u32, python: u32) -> u32 {
    let frames = [super::python::PY_STACK, native as u64, python as u64];
    let as_record = || intern_hashed(epoch, &frames, None, hash_frames(epoch, &frames));
    let Some(t) = tables() else { return 0 };
    if native == 0 || python == 0 || native >= CHILD_BASE {
        return as_record();
    }
    // SAFETY: native < MAX_STACKS, the children array's length.
    let word = unsafe { &*t.children.add(native as usize) };
    let first = match word.load(Ordering::Acquire) {
        0 => match word.compare_exchange(0, python, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                t.child_count.fetch_add(1, Ordering::Relaxed);
                python
            }
            // Another thread gave this native stack its first child meanwhile.
            Err(won) => won,
        },
        first => first,
    };
    if first == python {
        CHILD_BASE + native
    } else {
        as_record()
    }
}

/// A place for stack `id` in an array indexed by stack, proportional to the records
/// handed out: a stack with a record has its id's place, and its first Python child
/// (`CHILD_BASE + id`) shares it. The two seldom both need one (a native stack with no
/// Python frame is allocated from where the interpreter does not run, its first child
/// where it does): an array of them tells the two apart (`is_first_child`) and keeps
/// the second one aside. `import torch`'s 1.2M records and 1M first children took 2.4M
/// places apart, 9.6 MB for each table of 32 bits by stack.
#[inline]
pub fn shared_index(id: u32) -> usize {
    if id >= CHILD_BASE {
        (id - CHILD_BASE) as usize
    } else {
        id as usize
    }
}

/// Whether `id` is a first Python child (record-less: see the module's comment).
#[inline]
pub fn is_first_child(id: u32) -> bool {
    id >= CHILD_BASE
}

/// The stack at `place` (`shared_index`'s inverse): its first Python child, or the stack
/// with a record.
#[inline]
pub fn at_place(place: usize, first_child: bool) -> u32 {
    place as u32 | if first_child { CHILD_BASE } else { 0 }
}

/// `[PY_STACK, native, python]` of a first Python child, and `native`'s epoch; `None`
/// while `native`'s record is still being written.
fn child_frames(t: &Tables, id: u32) -> Option<(Vec<u64>, u32)> {
    let native = id - CHILD_BASE;
    if native as usize >= MAX_STACKS {
        return Some((Vec::new(), 0));
    }
    t.parts(native)?;
    // SAFETY: native < MAX_STACKS, the children array's length.
    let python = unsafe { &*t.children.add(native as usize) }.load(Ordering::Acquire);
    Some((vec![super::python::PY_STACK, native as u64, python as u64], t.record(native).epoch()))
}

fn make_record(t: &Tables, h: u64, epoch: u32, frames: &[u64], tail: Option<SharedTail>) -> Option<u32> {
    if epoch > MAX_EPOCH {
        return None;
    }
    let id = t.next_id.fetch_add(1, Ordering::Relaxed);
    if id as usize >= MAX_STACKS {
        t.records_written.fetch_add(1, Ordering::Release);
        return None;
    }
    let tail = tail.and_then(|s| t.checked_tail(s, frames.len()));
    debug_assert!(tail.is_none_or(|(s, _)| t.reads_as(s.parent, s.first, &frames[s.own..])));
    // The own frames are kept against the parent's base; a parent whose chain cannot be
    // read through is not shared (the record keeps all its frames, from 0).
    let (tail, base) = match tail.map_or(Some(0), |(s, _)| t.base_of(s.parent)) {
        Some(base) => (tail, base),
        None => (None, 0),
    };
    let own = tail.map_or(frames.len(), |(s, _)| s.own).min(MAX_FRAMES + 3);
    let mut encoded = [0u8; MAX_ENCODED];
    let bytes = encode_frames(&frames[..own], base, &mut encoded);
    let off = t.next_frame.fetch_add(bytes as u64, Ordering::Relaxed);
    if off as usize + bytes > FRAME_BYTES {
        t.frames_written.fetch_add(bytes as u64, Ordering::Release);
        // Mark the id as an empty, ready record so readers do not wait for it.
        t.record(id).location.store(READY, Ordering::Release);
        t.records_written.fetch_add(1, Ordering::Release);
        return None;
    }
    // SAFETY: [off, off+bytes) is ours alone (fetch_add) and inside the mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(encoded.as_ptr(), t.frames.add(off as usize), bytes);
    }
    t.frames_written.fetch_add(bytes as u64, Ordering::Release);
    let rec = t.record(id);
    // First, count and chain fit their bits: a stack has at most MAX_FRAMES + 3 frames,
    // a chain at most MAX_CHAIN links (checked above).
    let shared = tail.map_or(0, |(s, chain)| s.parent as u64 | (s.first as u64) << LINK_FIRST | (s.count as u64) << LINK_COUNT | chain << LINK_CHAIN);
    rec.link.store(shared | (epoch as u64) << LINK_EPOCH, Ordering::Relaxed);
    let hash = check_bits(h) << HASH_SHIFT;
    rec.location.store(off | (bytes as u64) << OFF_BITS | (own as u64) << (OFF_BITS + BYTES_BITS) | hash | READY, Ordering::Release);
    t.records_written.fetch_add(1, Ordering::Release);
    Some(id)
}

/// First Python children handed out so far (ids without a record).
pub fn children() -> u64 {
    published_tables().map_or(0, |t| t.child_count.load(Ordering::Relaxed))
}

/// Number of ids handed out so far (some may not be ready yet).
pub fn count() -> u32 {
    // Never makes the tables: a process that recorded nothing (the exit report of
    // `/bin/true`) has interned nothing.
    published_tables().map(|t| t.next_id.load(Ordering::Acquire).min(MAX_STACKS as u32)).unwrap_or(1)
}

/// The frames of a stack, or `None` while its record is still being written.
pub fn frames(id: u32) -> Option<Vec<u64>> {
    frames_and_epoch(id).map(|(frames, _)| frames)
}

/// The frames of a stack and the dlclose epoch it was captured in, or `None` while its
/// record is still being written.
pub fn frames_and_epoch(id: u32) -> Option<(Vec<u64>, u32)> {
    if id >= CHILD_BASE {
        return child_frames(published_tables()?, id);
    }
    if id == 0 {
        return Some((Vec::new(), 0));
    }
    let t = published_tables()?;
    let len = t.parts(id)?.len().min(MAX_FRAMES);
    let mut out = Vec::with_capacity(len);
    t.visit(id, 0, len, &mut |ip| out.push(ip)).then_some(())?;
    Some((out, t.record(id).epoch()))
}

/// The innermost frame of a stack, without reading the rest.
pub fn innermost(id: u32) -> Option<u64> {
    if id >= CHILD_BASE {
        return innermost(id - CHILD_BASE);
    }
    if id == 0 {
        return None;
    }
    let t = published_tables()?;
    let mut two = [None; 2];
    let mut n = 0;
    t.visit(id, 0, 2, &mut |ip| {
        two[n] = Some(ip);
        n += 1;
    });
    match two {
        // A stack with Python frames: the innermost native frame is its native stack's.
        [Some(super::python::PY_STACK), Some(native)] => innermost(native as u32),
        [first, _] => first,
    }
}

/// How many stacks could not be interned (table full); their events carry id 0.
pub fn overflows() -> u64 {
    published_tables().map(|t| t.overflows.load(Ordering::Relaxed)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_of_the_arenas_is_resident_past_where_they_were_touched() {
        for k in 0..2_000u64 {
            assert_ne!(intern(0, &[0x5eed_0000 + k, k, 7]), 0);
        }
        let arenas: Vec<_> = touched_arenas().iter().map(|a| (a.start, a.len)).collect();
        assert_eq!(arenas.len(), 5);
        // The whole reservations first, the cut ones after: other tests may intern
        // meanwhile, which only adds pages (nothing is spilled at this size).
        let whole: Vec<u64> = arenas.iter().map(|&(s, l)| crate::os::own::resident(s, l)).collect();
        // The large index and the overflow: whole once a stack was filed there (their
        // counts only grow; another test may file one at any time), else not at all.
        let t = tables().unwrap();
        let filed = [t.in_large_index.load(Ordering::Relaxed), t.in_overflow.load(Ordering::Relaxed)];
        let cut = touched_arenas();
        for (a, filed) in cut[3..].iter().zip(filed) {
            assert!(a.touched_end == a.start || a.touched_end == a.start + a.len, "{a:?}");
            assert!(filed == 0 || a.touched_end == a.start + a.len, "{filed} filed: {a:?}");
        }
        for (k, a) in cut[..3].iter().enumerate() {
            assert_eq!((a.start, a.len), arenas[k]);
            assert!(a.touched_end > a.start && a.touched_end <= a.start + a.len, "{a:?}");
            assert!(crate::os::own::resident(a.start, a.touched_end - a.start) >= whole[k], "arena {k}: {a:?}");
        }
        // The frame arena's 1 GiB reservation is looked at for a few MiB at most here.
        assert!(cut[1].touched_end - cut[1].start <= 64 << 20, "{:?}", cut[1]);
    }

    #[test]
    fn same_frames_same_id_different_epoch_different_id() {
        let a = [1u64, 2, 3, 0xdead_beef];
        let id1 = intern(0, &a);
        let id2 = intern(0, &a);
        assert_ne!(id1, 0);
        assert_eq!(id1, id2);
        assert_eq!(frames(id1).unwrap(), a);
        let id3 = intern(1, &a);
        assert_ne!(id3, id1);
        let b = [1u64, 2, 4];
        assert_ne!(intern(0, &b), id1);
        assert!(count() > id3);
        // The largest epoch a record holds reads back; past it, no record (id 0).
        let high = intern(MAX_EPOCH, &a);
        assert!(high != 0 && high != id1 && high != id3);
        assert_eq!(frames_and_epoch(high), Some((a.to_vec(), MAX_EPOCH)));
        assert_eq!(intern(MAX_EPOCH, &a), high);
        assert_eq!(intern(MAX_EPOCH + 1, &a), 0);
    }

    #[test]
    fn a_records_hash_bits_tell_apart_stacks_that_share_a_window_and_a_tag() {
        // Hashes of one probe window of the large index (low 21 bits), one tag (high 10)
        // and one overflow slot (bits 24..46): the record's bits still differ.
        // The 11 bits left free (21..24 and 46..54) take all their 2,048 values; into
        // 4,096 values at random, ~1,600 distinct.
        let fixed = 0xab00_0000_0000_0000u64 | 0x0000_3fff_ff00_0000 | 0x15_5555;
        let distinct: std::collections::HashSet<u64> = (0..2048u64).map(|v| check_bits(fixed | (v & 7) << 21 | (v >> 3) << 46)).collect();
        assert!(distinct.len() > 1500, "{} of 2048", distinct.len());
    }

    #[test]
    fn a_record_reads_back_its_largest_fields() {
        // A parent of MAX_FRAMES + 3 frames, a child taking its last frames from the
        // farthest one, in the highest epoch: every field at its widest.
        let parent_frames: Vec<u64> = (0..MAX_FRAMES as u64 + 3).map(|i| 0x7300_0000_0000 + i * 0x1_0000_0000).collect();
        let parent = intern(MAX_EPOCH, &parent_frames);
        assert_ne!(parent, 0);
        let first = parent_frames.len() - 1;
        // (A stack reads back as at most MAX_FRAMES frames.)
        let mut whole = vec![0x5300_0000u64; MAX_FRAMES - 1];
        whole.push(parent_frames[first]);
        let tail = SharedTail { own: MAX_FRAMES - 1, parent, first, count: 1 };
        let id = intern_hashed(MAX_EPOCH, &whole, Some(tail), hash_frames(MAX_EPOCH, &whole));
        assert_eq!(frames_and_epoch(id), Some((whole.clone(), MAX_EPOCH)));
        let t = tables().unwrap();
        let p = t.parts(id).unwrap();
        assert_eq!((p.parent, p.first, p.count, p.chain, p.own_len), (parent, first, 1, 1, MAX_FRAMES - 1));
        assert_eq!(t.parts(parent).unwrap().len(), MAX_FRAMES + 3);
        assert_eq!(frames_and_epoch(parent), Some((parent_frames[..MAX_FRAMES].to_vec(), MAX_EPOCH)));
    }

    #[test]
    fn the_index_moves_to_huge_pages_once_large_and_keeps_every_id() {
        // Enough stacks of our own to pass the threshold whatever the other tests
        // interned; another thread keeps interning while the kernel collapses the index.
        // The tiny and small indexes hold at most TINY_INDEX_SLOTS + FIRST_INDEX_SLOTS of them.
        let stack = |i: u64| [0x7000_0000 + i, 0x7100_0000 + i * 3, 0xfeed_0000];
        let n = (TINY_INDEX_SLOTS + FIRST_INDEX_SLOTS + HUGE_INDEX_AT as usize + 100) as u64;
        let ids: Vec<u32> = (0..n).map(|i| intern(7, &stack(i))).collect();
        assert!(tables().unwrap().in_large_index.load(Ordering::Relaxed) >= HUGE_INDEX_AT);
        assert!(ids.iter().all(|&id| id != 0));
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..20_000u64 {
                    assert_ne!(intern(8, &stack(i)), 0);
                }
            });
            for _ in 0..MAX_PROMOTIONS {
                promote_tables_if_large();
            }
        });
        assert!(INDEX_PROMOTED.load(Ordering::Relaxed), "a collapse succeeded or the tries ran out");
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(intern(7, &stack(i as u64)), id, "stack {i} after the move");
        }
    }

    #[test]
    fn stacks_past_a_full_window_of_the_large_index_go_to_the_overflow_and_are_found_again() {
        // Hashes equal in their low 24 bits: one window of the tiny, the small and the
        // large index for all of them; the overflow's slot comes from the bits above.
        let h = hash_frames(11, &[0xdef]) & !((1u64 << 54) - 1);
        let n = (LARGE_END + 40) as u64;
        let stacks: Vec<[u64; 2]> = (0..n).map(|i| [0x5151_0000, i]).collect();
        let hash = |i: u64| h | 0x00ab_cdef | (i << 24);
        let before = tables().map_or(0, |t| t.in_overflow.load(Ordering::Relaxed));
        let ids: Vec<u32> = stacks.iter().enumerate().map(|(i, f)| intern_hashed(11, f, None, hash(i as u64))).collect();
        assert!(ids.iter().all(|&id| id != 0), "no stack lost");
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ids.len());
        assert!(tables().unwrap().in_overflow.load(Ordering::Relaxed) >= before + 40);
        for (i, f) in stacks.iter().enumerate() {
            assert_eq!(intern_hashed(11, f, None, hash(i as u64)), ids[i], "stack {i} found again");
            assert_eq!(frames(ids[i]).unwrap(), f.to_vec());
        }
    }

    /// The probe sequence's windows, in order: the tiny index (its first pages only, for
    /// a program with a few hundred stacks), the small, the large, the overflow.
    #[test]
    fn probes_go_to_the_tiny_index_first_then_the_small_large_and_overflow_ones() {
        let t = tables().unwrap();
        let within = |p: &AtomicU32, base: *const AtomicU32, slots: usize| {
            let (a, b) = (p as *const AtomicU32 as usize, base as usize);
            a >= b && a < b + slots * 4
        };
        for h in [1u64, 0x7ff, 0x1234_5678_9abc_def1, u64::MAX] {
            for k in 0..LARGE_END + MAX_PROBES {
                let p = t.probe(h, k);
                let want = if k < TINY_PROBES {
                    within(p, t.tiny_index, TINY_INDEX_SLOTS)
                } else if k < SMALL_END {
                    within(p, t.first_index, FIRST_INDEX_SLOTS)
                } else if k < LARGE_END {
                    within(p, t.index, INDEX_SLOTS)
                } else {
                    within(p, t.overflow, OVERFLOW_SLOTS)
                };
                assert!(want, "probe {k} of {h:#x}");
            }
        }
        // 8 KiB: two pages hold every slot a short program's stacks take.
        assert_eq!(TINY_INDEX_SLOTS * 4, 2 * 4096);
    }

    #[test]
    fn stacks_that_share_a_tag_and_a_window_are_told_apart_by_their_frames() {
        // Hashes equal in the bits that pick the slot and the tag: only the record's
        // full hash and frames tell these stacks apart, in the tiny index and past it.
        let h = hash_frames(9, &[0xabc]) & !(((1u64 << 54) - 1) ^ ((1 << 23) - 1));
        let stacks: Vec<[u64; 2]> = (0..SMALL_END as u64 + 8).map(|i| [0x4242_0000, i]).collect();
        let ids: Vec<u32> = stacks.iter().enumerate().map(|(i, f)| intern_hashed(9, f, None, h | (i as u64) << 23)).collect();
        let mut distinct = ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ids.len());
        for (i, (f, &id)) in stacks.iter().zip(&ids).enumerate() {
            assert_ne!(id, 0);
            assert_eq!(intern_hashed(9, f, None, h | (i as u64) << 23), id, "stack {i} found again");
            assert_eq!(frames(id).unwrap(), f);
        }
    }

    /// The `VmFlags` line of the mapping of this process that holds `addr`.
    fn vm_flags_of(addr: usize) -> Option<String> {
        let smaps = crate::os::anchor::read_proc_string("self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                        inside = lo <= addr && addr < hi;
                        continue;
                    }
                }
            }
            if inside && line.starts_with("VmFlags:") {
                return Some(line.to_string());
            }
        }
        None
    }

    #[test]
    fn arenas_are_faulted_in_a_short_way_ahead_of_their_writers_in_whole_pieces() {
        const K: usize = 1 << 10;
        const MB: usize = 1 << 20;
        assert_eq!((POPULATE_AHEAD, POPULATE_STEP), (MB, 256 * K));
        let cap = 1024 * MB;
        // Small arenas are left to the kernel's faults.
        assert_eq!(populate_range(POPULATE_FROM - 1, 0, cap), None);
        // First call: from the writers' piece to POPULATE_AHEAD past them.
        assert_eq!(populate_range(5 * MB + 10 * K, 0, cap), Some((5 * MB, 6 * MB + 256 * K)));
        // Nothing while at least half of it is still ahead of them.
        assert_eq!(populate_range(5 * MB + 700 * K, 6 * MB + 256 * K, cap), None);
        // Then from where the last call stopped.
        assert_eq!(populate_range(5 * MB + 800 * K, 6 * MB + 256 * K, cap), Some((6 * MB + 256 * K, 7 * MB)));
        // Never behind the writers (they faulted that in), never past the arena, and
        // nothing more once it is all in.
        assert_eq!(populate_range(cap - 100 * K, cap - 4 * MB, cap), Some((cap - 256 * K, cap)));
        assert_eq!(populate_range(cap - 100 * K, cap, cap), None);
        // A kernel that refused is not asked again.
        assert_eq!(populate_range(20 * MB, usize::MAX, cap), None);
    }

    #[test]
    fn the_record_array_stays_on_small_pages_once_it_is_large() {
        // Enough records (16 bytes each) to pass the threshold whatever others interned.
        let n = (POPULATE_FROM / std::mem::size_of::<Record>()) as u64 + 1000;
        for i in 0..n {
            assert_ne!(intern(11, &[0x5100_0000 + i, 0xbeef]), 0);
        }
        promote_tables_if_large();
        assert!(RECORDS_ADVISED.load(Ordering::Relaxed));
        let t = tables().unwrap();
        // Checked where the kernel has transparent huge pages (elsewhere there is no
        // advice to give, nor a huge page to get).
        if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            let flags = vm_flags_of(t.records as usize).expect("the record array is mapped");
            assert!(flags.split_whitespace().any(|f| f == "nh") && !flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
    }

    #[test]
    fn concurrent_interning_agrees_on_ids() {
        let ids: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|_| s.spawn(|| (0..2000u64).map(|i| intern(7, &[i, i * 3, 0x1000 + i])).collect::<Vec<_>>())).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for v in &ids[1..] {
            assert_eq!(v, &ids[0]);
        }
        for (i, id) in ids[0].iter().enumerate() {
            let i = i as u64;
            assert_eq!(frames(*id).unwrap(), [i, i * 3, 0x1000 + i]);
        }
    }

    #[test]
    fn python_children_have_one_id_per_combination_under_concurrency() {
        const MARK: u64 = super::super::python::PY_STACK;
        let natives: Vec<u32> = (0..300u64).map(|i| intern(9, &[0xaa00 + i, 0xbb])).collect();
        let parts: Vec<u32> = (0..3u64).map(|i| intern(9, &[0xcc00 + i])).collect();
        let child = |n: u32, p: u32| intern_child(9, n, p);
        let ids: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8usize)
                .map(|k| {
                    let (natives, parts) = (&natives, &parts);
                    // Each thread meets the Python parts in another order, so that
                    // threads race for the first child of a stack with different ones.
                    s.spawn(move || natives.iter().flat_map(|&n| (0..3).map(move |j| child(n, parts[(j + k) % 3]))).collect::<Vec<_>>())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let by_pair = |k: usize| -> std::collections::BTreeMap<(u32, u32), u32> {
            let mut m = std::collections::BTreeMap::new();
            for (i, &n) in natives.iter().enumerate() {
                for j in 0..3 {
                    m.insert((n, parts[(j + k) % 3]), ids[k][i * 3 + j]);
                }
            }
            m
        };
        let first = by_pair(0);
        for k in 1..8 {
            assert_eq!(by_pair(k), first, "thread {k} got other ids");
        }
        let distinct: std::collections::BTreeSet<u32> = first.values().copied().collect();
        assert_eq!(distinct.len(), 900);
        // Each native stack's first child is the record-less id; the other two are records.
        for (i, &n) in natives.iter().enumerate() {
            let kids: Vec<u32> = parts.iter().map(|&p| first[&(n, p)]).collect();
            assert_eq!(kids.iter().filter(|&&id| id == CHILD_BASE + n).count(), 1, "{kids:?}");
            assert!(kids.iter().all(|&id| id == CHILD_BASE + n || id < CHILD_BASE));
            assert_eq!(innermost(CHILD_BASE + n), Some(0xaa00 + i as u64));
        }
        // A native stack and its first child share a place; no other two do.
        let places: std::collections::BTreeSet<(usize, bool)> = first.values().chain(&natives).map(|&id| (shared_index(id), is_first_child(id))).collect();
        assert_eq!(places.len(), 1200, "places with their tags never collide");
        for &n in &natives {
            assert_eq!((shared_index(CHILD_BASE + n), shared_index(n)), (n as usize, n as usize));
            assert_eq!((at_place(n as usize, true), at_place(n as usize, false)), (CHILD_BASE + n, n));
        }
        for (&(n, p), &id) in &first {
            assert_eq!(frames(id).unwrap(), [MARK, n as u64, p as u64]);
            assert_eq!(child(n, p), id, "found again");
        }
    }

    #[test]
    fn a_first_own_frame_is_kept_against_the_parents_base_down_a_whole_chain() {
        // A chain of MAX_CHAIN records, each allocating from next to its parent's first
        // frame, and one record whose own frames are none (its base is its parent's):
        // each reads back whole, and each one's first frame takes a byte or two.
        let root: Vec<u64> = (0..12u64).map(|i| 0x7f3a_1234_5000 - i * 0x1_0000).collect();
        let mut parent = intern(3, &root);
        let mut whole = root.clone();
        assert_ne!(parent, 0);
        let t = tables().unwrap();
        for k in 1..=MAX_CHAIN {
            let first_of_parent = whole[0];
            let mut next = vec![first_of_parent + 8 * k, first_of_parent + 0x40 * k];
            let tail = SharedTail { own: next.len(), parent, first: 0, count: whole.len() };
            next.extend_from_slice(&whole);
            let id = intern_hashed(3, &next, Some(tail), hash_frames(3, &next));
            let p = t.parts(id).unwrap();
            assert_eq!((p.parent, p.chain, p.own_len), (parent, k, 2), "step {k}");
            let loc = t.record(id).location.load(Ordering::Relaxed);
            let bytes = (loc >> OFF_BITS) & ((1 << BYTES_BITS) - 1);
            assert!(bytes <= 4, "step {k}: {bytes} bytes for two frames near the parent's first");
            assert_eq!(frames(id).unwrap(), next, "step {k}");
            assert_eq!(innermost(id), Some(next[0]));
            assert_eq!(t.base_of(id), Some(next[0]));
            (parent, whole) = (id, next);
        }
        // The chain is full: a new stack sharing it goes back to its first record.
        let mut past = vec![whole[0] + 16];
        let tail = SharedTail { own: 1, parent, first: 0, count: whole.len() };
        past.extend_from_slice(&whole);
        let id = intern_hashed(3, &past, Some(tail), hash_frames(3, &past));
        assert_eq!(frames(id).unwrap(), past);
        assert!(t.parts(id).unwrap().chain < MAX_CHAIN);
        // A stack that is its parent's frames from the second on: no own frame at all.
        let inner = intern(4, &[0x5000_0000, 0x6000_0000, 0x7000_0000]);
        let suffix = [0x6000_0000u64, 0x7000_0000];
        let id = intern_hashed(4, &suffix, Some(SharedTail { own: 0, parent: inner, first: 1, count: 2 }), hash_frames(4, &suffix));
        let p = t.parts(id).unwrap();
        assert_eq!((p.own_len, p.parent), (0, inner));
        assert_eq!(t.base_of(id), Some(0x5000_0000), "the parent's base");
        assert_eq!(frames(id).unwrap(), suffix);
        let below = [0x5000_0040u64, 0x6000_0000, 0x7000_0000];
        let child = intern_hashed(4, &below, Some(SharedTail { own: 1, parent: id, first: 0, count: 2 }), hash_frames(4, &below));
        assert_eq!(t.parts(child).unwrap().parent, id);
        assert_eq!(frames(child).unwrap(), below);
        assert_eq!(intern(4, &below), child, "found again by its frames");
    }

    #[test]
    fn frames_read_back_as_written_whatever_their_values() {
        let mut rng = crate::test_rng::TestRng::new(7);
        let special = [0u64, 1, u64::MAX, u64::MAX - 1, 1 << 63, (1 << 63) - 1, 0x7fff_ffff_f000, 0x5555_5555_0000];
        for round in 0..2000 {
            let n = 1 + rng.below(MAX_FRAMES as u64 + 3) as usize;
            let frames: Vec<u64> = (0..n)
                .map(|_| match rng.below(4) {
                    0 => special[rng.below(special.len() as u64) as usize],
                    1 => rng.next_u64(),
                    _ => 0x7f00_0000_0000 + rng.below(1 << 32),
                })
                .collect();
            let mut out = [0u8; MAX_ENCODED];
            let bytes = encode_frames(&frames, 0, &mut out);
            let out: &'static [u8] = Box::leak(out[..bytes].to_vec().into_boxed_slice());
            let back: Vec<u64> = Decoded { bytes: out, at: 0, prev: 0, left: n }.collect();
            assert_eq!(back, frames, "round {round}");
        }
        // Return addresses of one library: a few bytes each.
        let near: Vec<u64> = (0..40).map(|i| 0x7f12_3456_0000 + i * 0x1_2345).collect();
        let mut out = [0u8; MAX_ENCODED];
        assert!(encode_frames(&near, 0, &mut out) <= 7 + 39 * 3);
    }

    #[test]
    fn shared_tails_read_back_whole_and_compare_by_frames() {
        // A 40-frame stack, then stacks that take its outer frames (from several
        // offsets, some cut short) after a few of their own, each from the previous one.
        let base: Vec<u64> = (0..40).map(|i| 0x7000_0000 + i * 16).collect();
        let mut parent = intern(3, &base);
        let mut parent_frames = base.clone();
        for step in 0..30u64 {
            let own: Vec<u64> = (0..(step % 4 + 1)).map(|j| 0x5000_0000 + step * 64 + j).collect();
            let first = (step % 3) as usize;
            let count = parent_frames.len() - first - (step % 2) as usize;
            let mut whole = own.clone();
            whole.extend_from_slice(&parent_frames[first..first + count]);
            let tail = SharedTail { own: own.len(), parent, first, count };
            let id = intern_hashed(3, &whole, Some(tail), hash_frames(3, &whole));
            assert_eq!(frames(id).unwrap(), whole, "step {step}");
            assert_eq!(innermost(id), Some(whole[0]));
            // The same frames interned flat, or with a different parent, are the same stack.
            assert_eq!(intern(3, &whole), id);
            (parent, parent_frames) = (id, whole);
        }
        // Chains stay short: some records were stored whole again.
        let t = tables().unwrap();
        assert!(t.parts(parent).unwrap().chain <= MAX_CHAIN);
        // A tail that does not match the frames it claims to describe is not trusted.
        let bogus = SharedTail { own: 1, parent, first: 0, count: 500 };
        let id = intern_hashed(3, &[1, 2, 3], Some(bogus), hash_frames(3, &[1, 2, 3]));
        assert_eq!(frames(id).unwrap(), [1, 2, 3]);
    }

    #[test]
    fn a_stack_past_a_full_chain_shares_the_chains_first_record() {
        // Each stack takes the previous one's outer frames after its own: either all of
        // them (the tail starts in the parent's own frames) or past the parent's own.
        let mut rng = crate::test_rng::TestRng::new(11);
        let t = tables().unwrap();
        let (mut rebased, mut kept_parent) = (0, 0);
        for round in 0..20u64 {
            let base: Vec<u64> = (0..30).map(|i| 0x7200_0000 + round * 0x10_0000 + i * 16).collect();
            let mut parent = intern(5, &base);
            let mut parent_frames = base.clone();
            let mut parent_own = base.len();
            for step in 0..40u64 {
                let own: Vec<u64> = (0..1 + rng.below(3)).map(|j| 0x5200_0000 + round * 0x10_0000 + step * 64 + j).collect();
                // From the parent's own frames on or past them; never more than it has.
                let first = (rng.below(parent_own as u64 + 1) as usize).min(parent_frames.len() - 1);
                let mut whole = own.clone();
                whole.extend_from_slice(&parent_frames[first..]);
                whole.truncate(MAX_FRAMES);
                let tail = SharedTail { own: own.len(), parent, first, count: whole.len() - own.len() };
                let id = intern_hashed(5, &whole, Some(tail), hash_frames(5, &whole));
                assert_eq!(frames(id).unwrap(), whole, "round {round} step {step}");
                let p = t.parts(id).unwrap();
                assert!(p.chain <= MAX_CHAIN, "round {round} step {step}: chain {}", p.chain);
                // Its own frames: its new ones and at most `REBASE_GROWTH` more, or all.
                assert!(p.own_len <= own.len() + REBASE_GROWTH || (p.parent == 0 && p.own_len == whole.len()), "round {round} step {step}");
                // Rebased: sharing the frames of an earlier record of the parent's chain.
                rebased += (p.parent != 0 && p.parent != parent) as u32;
                kept_parent += (p.parent == parent) as u32;
                assert_eq!(intern(5, &whole), id);
                (parent, parent_frames, parent_own) = (id, whole, p.own_len);
            }
        }
        assert!(rebased > 50 && kept_parent > 400, "{rebased} rebased, {kept_parent} on their parent");
    }
}
