//! The library's own heap: the small blocks that the library's own threads (the
//! collector, the holder search) allocate, from mappings of its own
//! that give their memory back when emptied.
//!
//! In the program's malloc those blocks lived in the arena of the thread that made them,
//! and what a report freed stayed there: after `import torch` the collector's arena held
//! 27 MB of which 18 MB free chunks that malloc never returns (an arena other than the
//! main one shrinks only from its top), and the report's memory summary counted them as
//! the program's ("malloc keeps … freed"). Here blocks of one size class share 64 KiB
//! spans; a span whose last block is freed goes back to its chunk, and past a small
//! reserve of such spans kept resident its pages go back to the system
//! (`MADV_DONTNEED`).
//!
//! - Chunks of 4 MiB, aligned to their size, mapped as needed (`MAX_CHUNKS` at most: past
//!   that, or when the kernel refuses, the caller falls back to malloc), never unmapped.
//!   A lock-free index of their bases answers `owns` for any thread.
//! - Blocks up to `SLAB_MAX` share a span of their size class (8 classes of 16 bytes to
//!   128, then 4 a doubling); larger ones (below `MAX_BLOCK`) take whole units of their
//!   own.
//! - One lock for the allocating side, taken only by the library's own threads, which
//!   the scan never stops (they block every signal) and which take no other lock under
//!   it. A block freed by any other thread (a program thread dropping what a report
//!   made) is pushed on a lock-free list that the next allocation takes back, so that
//!   no program thread ever waits here, nor holds this lock while the scan stops it.
//! - fork: the forking thread takes the lock in `prepare` and releases it in both
//!   processes; a child made by a raw clone that ran no handler may find it held by a
//!   thread it does not have, and then abandons this heap (`after_fork_child`): its
//!   blocks stay where they are, new ones come from malloc.
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};

use super::lock::SpinLock;

/// A chunk: `UNITS` units of `UNIT` bytes, aligned to its size.
pub const CHUNK: usize = 4 << 20;
/// A span's unit (and a slab span's size).
pub const UNIT: usize = 64 << 10;
const UNITS: usize = CHUNK / UNIT;
/// Chunks at most (1 GiB of address space).
const MAX_CHUNKS: usize = 256;
/// Slots of the index of chunk bases (a quarter full at most).
const INDEX_SLOTS: usize = 1024;
/// Blocks larger than this take units of their own.
pub const SLAB_MAX: usize = 16 << 10;
/// The largest block this heap takes: the library's larger ones are mappings of their
/// own (`hotpath::mapping::OWN_MAPPING_MIN`).
pub const MAX_BLOCK: usize = 128 << 10;
/// Size classes of slab spans: 16..=128 by 16, then four a doubling up to `SLAB_MAX`.
const CLASSES: usize = 36;
/// Empty units kept resident for the next spans (1 MiB); beyond, their pages go back.
const KEEP_RESIDENT_UNITS: u32 = 16;
/// A span's `class` when it holds one large block.
const LARGE: u8 = 0xfe;

/// The size class of a block of `size` bytes (1..=`SLAB_MAX`).
pub fn class_of(size: usize) -> usize {
    debug_assert!((1..=SLAB_MAX).contains(&size));
    if size <= 128 {
        return size.div_ceil(16) - 1;
    }
    let s = size - 1;
    let lg = (usize::BITS - 1 - s.leading_zeros()) as usize;
    8 + (lg - 7) * 4 + ((s >> (lg - 2)) & 3)
}

/// The block size of class `c`.
pub fn class_size(c: usize) -> usize {
    if c < 8 {
        return 16 * (c + 1);
    }
    let k = c - 8;
    let lg = 7 + k / 4;
    (1 << lg) + (k % 4 + 1) * (1 << (lg - 2))
}

const _: () = assert!(CLASSES == 36);

/// A span's record, kept on its first unit's place (out of the span's memory, so that a
/// span's pages can go back whole).
#[derive(Clone, Copy)]
struct Span {
    /// Size class + 1, `LARGE`, or 0 for a unit that starts no span (all-zero records
    /// keep the heap's static in `.bss`).
    class: u8,
    /// Units of the span.
    units: u8,
    /// Whether the span is on its class's list of spans with room.
    listed: bool,
    used: u16,
    /// Offset + 1 of the first block on the span's free list (0: none); each free block
    /// holds the next one's offset + 1 in its first 4 bytes.
    free: u32,
    /// Offset of the first block never handed out.
    bump: u32,
    /// The class list's neighbours, span ids + 1 (0: none).
    next: u32,
    prev: u32,
}

const NO_SPAN: Span = Span { class: 0, units: 0, listed: false, used: 0, free: 0, bump: 0, next: 0, prev: 0 };

#[derive(Clone, Copy)]
struct Chunk {
    base: usize,
    /// A bit per unit: free (in no span).
    free: u64,
    /// A bit per unit: its pages may be resident (touched since its last `MADV_DONTNEED`).
    dirty: u64,
}

struct Heap {
    chunks: [Chunk; MAX_CHUNKS],
    spans: [[Span; UNITS]; MAX_CHUNKS],
    count: usize,
    /// Per class, the first span with room (span id + 1; 0: none).
    with_room: [u32; CLASSES],
    /// Free units whose pages may be resident.
    resident_free: u32,
    /// Bytes of the blocks handed out and not freed (the report's `heap` counts them by
    /// the pages instead; kept for the tests and the diagnostics).
    live_bytes: usize,
}

static HEAP: SpinLock<Heap> = SpinLock::new(Heap {
    chunks: [Chunk { base: 0, free: 0, dirty: 0 }; MAX_CHUNKS],
    spans: [[NO_SPAN; UNITS]; MAX_CHUNKS],
    count: 0,
    with_room: [0; CLASSES],
    resident_free: 0,
    live_bytes: 0,
});

/// Chunk bases, each `base | (index + 1)` (a base's low 22 bits are zero); 0: empty.
static INDEX: [AtomicUsize; INDEX_SLOTS] = [const { AtomicUsize::new(0) }; INDEX_SLOTS];
/// Blocks freed by threads that do not take the lock, linked through their first word.
static REMOTE: AtomicPtr<usize> = AtomicPtr::new(std::ptr::null_mut());
/// Set in a child that found the lock held by a thread it does not have.
static ABANDONED: AtomicBool = AtomicBool::new(false);

#[inline]
fn index_slot(base: usize) -> usize {
    ((base >> 22).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) & (INDEX_SLOTS - 1)
}

/// The index of the chunk holding `p`, if it is one of ours. Lock-free: slots are only
/// ever filled, never cleared.
#[inline]
fn chunk_of(p: usize) -> Option<usize> {
    let base = p & !(CHUNK - 1);
    let mut i = index_slot(base);
    loop {
        let v = INDEX[i].load(Ordering::Acquire);
        if v == 0 {
            return None;
        }
        if v & !(CHUNK - 1) == base {
            return Some((v & (CHUNK - 1)) - 1);
        }
        i = (i + 1) & (INDEX_SLOTS - 1);
    }
}

/// Set once the first chunk is mapped: until then (a short process, whose library
/// threads allocated nothing), `owns` answers without reading the index's pages.
static ANY_CHUNK: AtomicBool = AtomicBool::new(false);

/// Whether `p` is a block of this heap.
#[inline]
pub fn owns(p: *const u8) -> bool {
    ANY_CHUNK.load(Ordering::Acquire) && chunk_of(p as usize).is_some()
}

/// A block of `size` bytes (1..=`MAX_BLOCK`), aligned to 16; `None` where this heap
/// cannot give one (abandoned, out of chunks, the kernel refused): the caller uses
/// malloc. For the library's own threads only (see the module's notes).
pub fn alloc(size: usize) -> Option<*mut u8> {
    if size == 0 || size > MAX_BLOCK || ABANDONED.load(Ordering::Relaxed) {
        return None;
    }
    let mut h = HEAP.lock();
    h.take_remote();
    let p = if size <= SLAB_MAX { h.alloc_small(class_of(size)) } else { h.alloc_large(size.div_ceil(UNIT)) }?;
    h.live_bytes += h.block_size(p);
    Some(p as *mut u8)
}

/// Frees a block of this heap (`owns(p)`). `may_lock`: the caller is one of the
/// library's own threads; any other pushes the block for the next allocation to free.
pub fn free(p: *mut u8, may_lock: bool) {
    if ABANDONED.load(Ordering::Relaxed) {
        return;
    }
    if !may_lock {
        push_remote(p as *mut usize);
        return;
    }
    let mut h = HEAP.lock();
    h.take_remote();
    h.free(p as usize);
}

/// Whether a block of `old` bytes of this heap also holds `new` bytes as it is (the
/// same class, or as many units): a reallocation between them keeps the block. Decided
/// by the sizes alone, so that any thread may ask without the lock.
pub fn same_block(old: usize, new: usize) -> bool {
    match (old, new) {
        (1..=SLAB_MAX, 1..=SLAB_MAX) => class_of(old) == class_of(new),
        (o, n) if o > SLAB_MAX && n > SLAB_MAX && o <= MAX_BLOCK && n <= MAX_BLOCK => o.div_ceil(UNIT) == n.div_ceil(UNIT),
        _ => false,
    }
}

fn push_remote(p: *mut usize) {
    let mut head = REMOTE.load(Ordering::Relaxed);
    loop {
        // SAFETY: `p` is a freed block of ours, at least 16 bytes and 16-aligned: its
        // first word is ours to write until the list is taken.
        unsafe { p.write(head as usize) };
        match REMOTE.compare_exchange_weak(head, p, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => return,
            Err(h) => head = h,
        }
    }
}

/// Bytes of blocks handed out and not freed.
#[cfg(test)]
pub fn live_bytes() -> usize {
    HEAP.lock().live_bytes
}

/// fork `prepare`: the forking thread holds the lock across the fork.
pub fn fork_prepare() {
    if !ABANDONED.load(Ordering::Relaxed) {
        HEAP.lock_raw();
    }
}

/// fork `parent`.
pub fn fork_parent() {
    if !ABANDONED.load(Ordering::Relaxed) {
        HEAP.unlock_raw();
    }
}

/// In a child: released if this thread parked it for the fork; abandoned if another
/// thread, one that the child does not have, held it (a raw clone ran no handler).
pub fn after_fork_child() {
    if HEAP.held_by_me() {
        HEAP.unlock_raw();
    } else if HEAP.try_lock().is_none() {
        ABANDONED.store(true, Ordering::Relaxed);
    }
}

impl Heap {
    fn take_remote(&mut self) {
        if REMOTE.load(Ordering::Relaxed).is_null() {
            return;
        }
        let mut p = REMOTE.swap(std::ptr::null_mut(), Ordering::Acquire);
        while !p.is_null() {
            // SAFETY: pushed by `push_remote`, which wrote the next block's address in
            // the first word; nothing else touches a block on the list.
            let next = unsafe { p.read() } as *mut usize;
            self.free(p as usize);
            p = next;
        }
    }

    fn head_unit(&self, c: usize, mut unit: usize) -> usize {
        // A large span's later units have no record of their own: walk back to its head.
        while unit > 0 && self.spans[c][unit].class == 0 {
            unit -= 1;
        }
        unit
    }

    fn block_size(&self, p: usize) -> usize {
        let Some(c) = chunk_of(p) else { return 0 };
        let unit = (p - self.chunks[c].base) / UNIT;
        let s = self.spans[c][self.head_unit(c, unit)];
        if s.class == LARGE {
            s.units as usize * UNIT
        } else {
            class_size(s.class as usize - 1)
        }
    }

    fn alloc_small(&mut self, class: usize) -> Option<usize> {
        let size = class_size(class) as u32;
        let id = match self.with_room[class] {
            0 => {
                let id = self.new_span(1)?;
                let s = self.span_mut(id);
                *s = Span { class: class as u8 + 1, units: 1, ..NO_SPAN };
                self.list(class, id);
                id
            }
            n => n - 1,
        };
        let base = self.span_base(id);
        let s = self.span_mut(id);
        let off = if s.free != 0 {
            let off = s.free - 1;
            // SAFETY: `off` is a free block of this span, whose first 4 bytes hold the
            // next free block's offset + 1 (written by `free`).
            s.free = unsafe { ((base + off as usize) as *const u32).read() };
            off
        } else {
            let off = s.bump;
            s.bump += size;
            off
        };
        s.used += 1;
        let full = s.free == 0 && s.bump as usize + size as usize > UNIT;
        if full {
            self.unlist(class, id);
        }
        Some(base + off as usize)
    }

    fn alloc_large(&mut self, units: usize) -> Option<usize> {
        let id = self.new_span(units)?;
        *self.span_mut(id) = Span { class: LARGE, units: units as u8, used: 1, ..NO_SPAN };
        Some(self.span_base(id))
    }

    fn free(&mut self, p: usize) {
        let Some(c) = chunk_of(p) else { return };
        let unit = self.head_unit(c, (p - self.chunks[c].base) / UNIT);
        let id = (c * UNITS + unit) as u32;
        let s = self.spans[c][unit];
        if s.class == 0 {
            // No span here: not a block handed out (never reached by a correct caller).
            return;
        }
        self.live_bytes -= self.block_size(p);
        if s.class == LARGE {
            self.release(id);
            return;
        }
        let class = s.class as usize - 1;
        let base = self.span_base(id);
        let off = (p - base) as u32;
        let s = self.span_mut(id);
        // SAFETY: `p` is a block of this span being freed: its first 4 bytes now hold
        // the free list's link.
        unsafe { (p as *mut u32).write(s.free) };
        s.free = off + 1;
        s.used -= 1;
        let (used, listed) = (s.used, s.listed);
        if !listed {
            self.list(class, id);
        }
        // An empty span goes back, unless it is its class's only one with room (a block
        // freed and allocated again and again at a span's edge would map a span each time).
        let only = self.with_room[class] == id + 1 && self.span(id).next == 0;
        if used == 0 && !only {
            self.unlist(class, id);
            self.release(id);
        }
    }

    fn span(&self, id: u32) -> &Span {
        &self.spans[id as usize / UNITS][id as usize % UNITS]
    }

    fn span_mut(&mut self, id: u32) -> &mut Span {
        &mut self.spans[id as usize / UNITS][id as usize % UNITS]
    }

    fn span_base(&self, id: u32) -> usize {
        self.chunks[id as usize / UNITS].base + (id as usize % UNITS) * UNIT
    }

    fn list(&mut self, class: usize, id: u32) {
        let head = self.with_room[class];
        if head != 0 {
            self.span_mut(head - 1).prev = id + 1;
        }
        let s = self.span_mut(id);
        s.next = head;
        s.prev = 0;
        s.listed = true;
        self.with_room[class] = id + 1;
    }

    fn unlist(&mut self, class: usize, id: u32) {
        let s = *self.span(id);
        if s.prev != 0 {
            self.span_mut(s.prev - 1).next = s.next;
        } else {
            self.with_room[class] = s.next;
        }
        if s.next != 0 {
            self.span_mut(s.next - 1).prev = s.prev;
        }
        let s = self.span_mut(id);
        s.listed = false;
        s.next = 0;
        s.prev = 0;
    }

    /// `units` contiguous free units (preferring ones still resident), from a new chunk
    /// if none has them.
    fn new_span(&mut self, units: usize) -> Option<u32> {
        let run = |free: u64| {
            let mut m = free;
            for k in 1..units {
                m &= free >> k;
            }
            m
        };
        let mut pick = None;
        for c in 0..self.count {
            let ch = self.chunks[c];
            let m = run(ch.free);
            if m == 0 {
                continue;
            }
            let warm = m & run(ch.dirty);
            if warm != 0 {
                pick = Some((c, warm.trailing_zeros() as usize));
                break;
            }
            if pick.is_none() {
                pick = Some((c, m.trailing_zeros() as usize));
            }
        }
        let (c, unit) = match pick {
            Some(p) => p,
            None => (self.new_chunk()?, 0),
        };
        let bits = (((1u128 << units) - 1) as u64) << unit;
        let ch = &mut self.chunks[c];
        let warm = (ch.dirty & bits).count_ones();
        ch.free &= !bits;
        ch.dirty |= bits;
        self.resident_free -= warm;
        Some((c * UNITS + unit) as u32)
    }

    fn new_chunk(&mut self) -> Option<usize> {
        if self.count >= MAX_CHUNKS {
            return None;
        }
        let base = map_aligned_chunk()?;
        let c = self.count;
        self.chunks[c] = Chunk { base, free: u64::MAX, dirty: 0 };
        self.spans[c] = [NO_SPAN; UNITS];
        self.count += 1;
        let mut i = index_slot(base);
        while INDEX[i].load(Ordering::Relaxed) != 0 {
            i = (i + 1) & (INDEX_SLOTS - 1);
        }
        INDEX[i].store(base | (c + 1), Ordering::Release);
        ANY_CHUNK.store(true, Ordering::Release);
        Some(c)
    }

    /// A span goes back to its chunk; past the reserve, its pages go back to the system.
    fn release(&mut self, id: u32) {
        let units = self.span(id).units as usize;
        let (c, unit) = (id as usize / UNITS, id as usize % UNITS);
        for u in unit..unit + units {
            self.spans[c][u] = NO_SPAN;
        }
        let bits = (((1u128 << units) - 1) as u64) << unit;
        self.chunks[c].free |= bits;
        self.resident_free += units as u32;
        if self.resident_free > KEEP_RESIDENT_UNITS {
            let start = self.span_base(id);
            // SAFETY: the span's units belong to no block any more; their pages read as
            // zeros from now on.
            if unsafe { libc::madvise(start as *mut libc::c_void, units * UNIT, libc::MADV_DONTNEED) } == 0 {
                self.chunks[c].dirty &= !bits;
                self.resident_free -= units as u32;
            }
        }
    }
}

/// A fresh chunk aligned to `CHUNK`, registered as the library's heap.
fn map_aligned_chunk() -> Option<usize> {
    let _errno = super::ErrnoGuard::save();
    let len = CHUNK * 2;
    // SAFETY: a fresh private anonymous mapping; its unaligned head and tail are unmapped
    // below and nothing else refers to them.
    unsafe {
        let raw = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
        if raw == libc::MAP_FAILED {
            return None;
        }
        let raw = raw as usize;
        let start = (raw + CHUNK - 1) & !(CHUNK - 1);
        if start > raw {
            libc::munmap(raw as *mut libc::c_void, start - raw);
        }
        let tail = raw + len - (start + CHUNK);
        if tail > 0 {
            libc::munmap((start + CHUNK) as *mut libc::c_void, tail);
        }
        super::own::mapped(start, CHUNK, super::own::Part::Heap);
        Some(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The heap is one per process: the tests that change it take turns.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn every_size_has_a_class_that_holds_it_and_the_classes_rise() {
        let mut last = 0;
        for c in 0..CLASSES {
            let s = class_size(c);
            assert!(s > last && s.is_multiple_of(16), "class {c}: {s}");
            assert_eq!(class_of(s), c);
            assert_eq!(class_of(last + 1), c, "the smallest size of class {c}");
            last = s;
        }
        assert_eq!(last, SLAB_MAX);
        for size in 1..=SLAB_MAX {
            let s = class_size(class_of(size));
            // Within a quarter of the size (16 bytes for the smallest).
            assert!(s >= size && s - size <= (size / 4).max(15), "{size} -> {s}");
        }
    }

    fn fill(p: *mut u8, n: usize, v: u8) {
        // SAFETY: a live block of at least `n` bytes.
        unsafe { std::ptr::write_bytes(p, v, n) };
    }

    fn holds(p: *mut u8, n: usize, v: u8) -> bool {
        // SAFETY: a live block of at least `n` bytes.
        unsafe { std::slice::from_raw_parts(p, n) }.iter().all(|&b| b == v)
    }

    #[test]
    fn blocks_of_every_size_are_distinct_aligned_and_keep_their_contents() {
        let _s = SERIAL.lock().unwrap();
        let before = live_bytes();
        let sizes = [1, 15, 16, 17, 100, 128, 129, 500, 4096, 5000, 16384, 16385, 65536, 70000, MAX_BLOCK];
        let mut blocks = Vec::new();
        for round in 0..40u8 {
            for &n in &sizes {
                let p = alloc(n).expect("a block");
                assert!((p as usize).is_multiple_of(16));
                assert!(owns(p));
                assert!(same_block(n, n) && !same_block(n, MAX_BLOCK + 1));
                fill(p, n, round);
                blocks.push((p, n, round));
            }
        }
        for &(p, n, v) in &blocks {
            assert!(holds(p, n, v), "a block of {n} overwritten");
        }
        for (p, _, _) in blocks {
            free(p, true);
        }
        assert_eq!(live_bytes(), before);
        let x = 0u64;
        assert!(!owns(&x as *const u64 as *const u8));
    }

    #[test]
    fn emptied_spans_give_their_pages_back() {
        let _s = SERIAL.lock().unwrap();
        // 32 MiB of 1 KiB blocks: 512 spans.
        let blocks: Vec<*mut u8> = (0..32 * 1024).map(|_| alloc(1000).expect("a block")).collect();
        for &p in &blocks {
            fill(p, 1000, 7);
        }
        let resident_full = heap_resident();
        for p in blocks {
            free(p, true);
        }
        let resident_empty = heap_resident();
        assert!(resident_full >= 32 << 20, "{resident_full}");
        // The reserve and the other tests' blocks at most.
        assert!(resident_empty < resident_full - (28 << 20), "{resident_full} -> {resident_empty}");
    }

    fn heap_resident() -> u64 {
        let h = HEAP.lock();
        (0..h.count).map(|c| super::super::own::resident(h.chunks[c].base, CHUNK)).sum()
    }

    #[test]
    fn blocks_freed_by_other_threads_come_back_at_the_next_allocation() {
        let _s = SERIAL.lock().unwrap();
        let before = live_bytes();
        let blocks: Vec<usize> = (0..1000).map(|i| alloc(16 + i % 300).expect("a block") as usize).collect();
        let threads: Vec<_> = blocks
            .chunks(250)
            .map(|part| {
                let part = part.to_vec();
                std::thread::spawn(move || {
                    for p in part {
                        free(p as *mut u8, false);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(live_bytes() > before);
        let p = alloc(16).expect("a block");
        free(p, true);
        assert_eq!(live_bytes(), before);
    }

    #[test]
    fn a_child_that_finds_the_lock_held_by_a_thread_it_lacks_uses_malloc_from_then_on() {
        let _s = SERIAL.lock().unwrap();
        let kept = alloc(100).expect("a block");
        // As a raw clone's child would see it: another thread holds the lock.
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let g = HEAP.lock();
            held_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            drop(g);
        });
        held_rx.recv().unwrap();
        after_fork_child();
        assert!(ABANDONED.load(Ordering::Relaxed));
        assert!(alloc(100).is_none(), "the caller falls back to malloc");
        // Its blocks stay where they are: a free is a no-op, never a wait on the lock.
        free(kept, true);
        fork_prepare();
        fork_parent();
        done_tx.send(()).unwrap();
        holder.join().unwrap();
        ABANDONED.store(false, Ordering::Relaxed);
        // The forking thread's own parked lock is simply released in the child.
        fork_prepare();
        after_fork_child();
        assert!(!ABANDONED.load(Ordering::Relaxed));
        let p = alloc(100).expect("a block");
        free(p, true);
    }

    #[test]
    fn a_span_at_its_class_edge_is_kept_not_mapped_again_each_time() {
        let _s = SERIAL.lock().unwrap();
        let n = class_size(20);
        let per_span = UNIT / n;
        let blocks: Vec<*mut u8> = (0..per_span).map(|_| alloc(n).expect("a block")).collect();
        // One more opens a second span; freeing it empties that span, which goes back
        // (the first still has room after the next free).
        let extra = alloc(n).expect("a block");
        free(extra, true);
        let again = alloc(n).expect("a block");
        free(again, true);
        for p in blocks {
            free(p, true);
        }
        let h = HEAP.lock();
        assert!(h.with_room[20] != 0, "the class keeps one span");
    }
}
