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
    let Some(mem) = crate::hotpath::mapping::map_zeroed(std::mem::size_of::<Table>(), crate::os::own::Part::Other) else { return false };
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

/// The pymalloc block that holds `addr` in the arena `[arena, arena + len)`: its start
/// and size (its pool's size class), read with `process_vm_readv` (call only where
/// `roots::copies_allowed`); `None` where the pool header does not read as one.
pub fn block_at(addr: u64, arena: u64, len: u64) -> Option<(u64, u64)> {
    use crate::scan::pymalloc::POOL_OVERHEAD;
    let pool_size = crate::scan::pymalloc::pool_size(len);
    let pool = addr / pool_size * pool_size;
    let mut h = [0u64; 6];
    if pool < arena || crate::scan::roots::read_own_memory(pool, &mut h) != 48 {
        return None;
    }
    let size = crate::scan::pymalloc::pool_block_size(h[4])?;
    if addr < pool + POOL_OVERHEAD {
        return None;
    }
    Some((pool + POOL_OVERHEAD + (addr - pool - POOL_OVERHEAD) / size * size, size))
}

pub fn set_layouts(int_layout: u64, types: [u64; 6], code_adaptive: u64) {
    INT_LAYOUT.store(int_layout, Ordering::Relaxed);
    for (slot, v) in OBJECT_TYPES.iter().zip(types) {
        slot.store(v, Ordering::Relaxed);
    }
    CODE_ADAPTIVE.store(code_adaptive, Ordering::Relaxed);
}

/// `note`, unless the arena is in the table already (one found after the library was
/// loaded late, which the hooks may have noted meanwhile).
pub fn note_if_new(addr: u64, size: u64) {
    let Some(t) = table() else { return };
    let high = HIGH.load(Ordering::Acquire);
    if !t.addr[..high].iter().any(|a| a.load(Ordering::Acquire) == addr) {
        note(addr, size);
    }
}

/// The size of the interpreter's arenas (256 KiB before 3.10, 1 MiB since); 0 unknown.
static ARENA_SIZE: AtomicU64 = AtomicU64::new(0);

pub fn set_arena_size(size: u64) {
    ARENA_SIZE.store(size, Ordering::Relaxed);
}

pub fn arena_size() -> u64 {
    ARENA_SIZE.load(Ordering::Relaxed)
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
/// besides int (`INT_LAYOUT`): tuple, list, float, bytes, str, code; stored only for an
/// interpreter whose layouts are known (3.8 to 3.13).
static OBJECT_TYPES: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
/// Where a code object's bytecode starts (`ObjectTypes::code_adaptive`); 0 when unknown.
static CODE_ADAPTIVE: AtomicU64 = AtomicU64::new(0);

/// The built-in types found at `install` (`None` before, or for an unknown version);
/// the int's and the str headers' sizes follow from the int layout (3.12 changed both).
pub fn object_types() -> Option<crate::scan::pymalloc::ObjectTypes> {
    let int = int_layout()?;
    let [tuple, list, float, bytes, str, code] = std::array::from_fn(|i| OBJECT_TYPES[i].load(Ordering::Relaxed));
    let (str_ascii_header, str_compact_header) = if int.tagged { (40, 56) } else { (48, 72) };
    let code_adaptive = CODE_ADAPTIVE.load(Ordering::Relaxed);
    Some(crate::scan::pymalloc::ObjectTypes { tuple, list, float, int: int.type_addr, bytes, str, str_ascii_header, str_compact_header, code, code_adaptive })
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
    live_mappings(out, true);
}

/// Appends the live chunks of the interpreter's frame stacks (start, size), as
/// `live_arenas` does the arenas.
pub fn live_frame_chunks(out: &mut Vec<(u64, u64)>) {
    live_mappings(out, false);
}

/// Whether a mapping the interpreter asked its arena allocator for is an arena (256 KiB
/// before 3.10, 1 MiB since), not a chunk of a thread's frame stack: from 3.11 the
/// interpreter maps those through the same allocator (`_PyObject_VirtualAlloc`), 16
/// KiB first and twice as large for each deeper one, never an arena's size (that would
/// take a single frame of over 128 KiB). Read as pools, such a chunk named a function's
/// locals "an attribute of a tuple object" when it named them at all.
pub fn is_arena_size(size: u64) -> bool {
    size == 256 << 10 || size == 1 << 20
}

/// `PyInterpreterState_Head`, `_Next` and `_ThreadHead` (0: not found), and where a
/// thread state keeps its frame stack's current chunk and top (`datastack_chunk`,
/// `datastack_top`: from the headers of 3.11.7, 3.12.1 and 3.13.0; 0: not known).
static THREAD_WALK: [AtomicU64; 4] = [const { AtomicU64::new(0) }; 4];

pub fn set_thread_walk(head: Option<usize>, next: Option<usize>, thread_head: Option<usize>, minor: Option<u8>) {
    let chunk = match minor {
        Some(11) => 296,
        Some(12 | 13) => 232,
        _ => 0,
    };
    let (Some(head), Some(next), Some(thread_head)) = (head, next, thread_head) else { return };
    for (slot, v) in THREAD_WALK.iter().zip([head as u64, next as u64, thread_head as u64, chunk]) {
        slot.store(v, Ordering::Relaxed);
    }
}

/// Cuts each frame-stack chunk of `chunks` to its live part, in place, without
/// allocating: a thread's current chunk up to its `datastack_top`, an older chunk of
/// the thread up to the top it saved (`_PyStackChunk.top`, in words after the 24-byte
/// header) when the next was pushed. What lies above is what returned calls left: a
/// stale slot of `site.main()`'s frame, which had held a list since freed, read as the
/// holder of a list made later at its address. A chunk no thread has is cut to nothing.
/// Left whole where the threads cannot be walked (an unknown version, copies refused).
pub fn cut_frame_chunks_to_live(chunks: &mut [(u64, u64)]) {
    let [head, next, thread_head, chunk_off] = std::array::from_fn(|i| THREAD_WALK[i].load(Ordering::Relaxed));
    if chunks.is_empty() || head == 0 || chunk_off == 0 || !crate::scan::roots::copies_allowed() {
        return;
    }
    let word = |a: u64| {
        let mut w = [0u64; 1];
        (a != 0 && crate::scan::roots::read_own_memory(a, &mut w) == 8).then_some(w[0])
    };
    // SAFETY: the interpreter's exported getters of these signatures: each returns a
    // field of the runtime or of an interpreter state (no lock, no allocation).
    let (head, next, thread_head) = unsafe {
        (
            std::mem::transmute::<usize, extern "C" fn() -> u64>(head as usize),
            std::mem::transmute::<usize, extern "C" fn(u64) -> u64>(next as usize),
            std::mem::transmute::<usize, extern "C" fn(u64) -> u64>(thread_head as usize),
        )
    };
    let mut live_end = |start: u64, end: u64| {
        if let Some(c) = chunks.iter_mut().find(|c| c.0 == start) {
            c.1 = end.saturating_sub(start).min(c.1);
            // Marked: found live (a length of exactly 0 is never one: the header).
            c.1 |= 1 << 63;
        }
    };
    let mut interp = head();
    for _ in 0..64 {
        if interp == 0 {
            break;
        }
        let mut t = thread_head(interp);
        for _ in 0..4096 {
            if t == 0 {
                break;
            }
            let (Some(mut chunk), Some(top)) = (word(t + chunk_off), word(t + chunk_off + 8)) else { break };
            let mut end = top;
            for _ in 0..64 {
                if chunk == 0 {
                    break;
                }
                live_end(chunk, end);
                let (Some(previous), Some(saved)) = (word(chunk), word(chunk + 16)) else { break };
                if previous != 0 {
                    end = previous + 24 + saved.saturating_mul(8);
                }
                chunk = previous;
            }
            t = word(t + 8).unwrap_or(0);
        }
        interp = next(interp);
    }
    for c in chunks.iter_mut() {
        c.1 = if c.1 & 1 << 63 != 0 { c.1 & !(1 << 63) } else { 0 };
    }
}

/// How many frame-stack chunks there are now.
pub fn frame_chunks_now() -> usize {
    let Some(t) = table() else { return 0 };
    let high = HIGH.load(Ordering::Acquire);
    (0..high)
        .filter(|&i| {
            let a = t.addr[i].load(Ordering::Acquire);
            a != 0 && a != u64::MAX && !is_arena_size(t.size[i].load(Ordering::Relaxed))
        })
        .count()
}

fn live_mappings(out: &mut Vec<(u64, u64)>, arenas: bool) {
    let Some(t) = table() else { return };
    let high = HIGH.load(Ordering::Acquire);
    for i in 0..high {
        let a = t.addr[i].load(Ordering::Acquire);
        if a != 0 && a != u64::MAX && out.len() < out.capacity() {
            let size = t.size[i].load(Ordering::Relaxed);
            if is_arena_size(size) == arenas {
                out.push((a, size));
            }
        }
    }
}

/// What pymalloc's arenas hold: the bytes of live objects (the used blocks of their
/// pools) and the arenas' size in all. Each arena's pool headers are copied with one
/// `process_vm_readv` (an arena may be unmapped meanwhile: the copy then fails, it does
/// not fault), so only where `copy_allowed` (no seccomp filter, `scan::roots`). In a
/// forked child (`forked`), one `pread` of `/proc/self/mem` each (`os::OwnMemory`): its
/// arenas are the parent's pages, which `process_vm_readv` pins at 2.5-3x the cost
/// (11-25 ms of CPU in each DataLoader worker's exit report). `None` when no arena is
/// known.
pub fn usage(copy_allowed: bool, forked: bool) -> Option<(u64, u64)> {
    if !copy_allowed || !open_now() {
        return None;
    }
    let mut arenas = Vec::with_capacity(capacity());
    live_arenas(&mut arenas);
    let own = forked.then(crate::os::OwnMemory::open).flatten();
    if let Some(m) = &own {
        let sums = sum_pools(&arenas, |first, pool, out| read_headers(m, first, pool, out));
        if m.still_open() {
            return Some(sums);
        }
    }
    Some(sum_pools(&arenas, copy_headers))
}

/// The used bytes and the size in all of `arenas`, their pool headers read with `read`
/// (`copy_headers`'s contract).
fn sum_pools(arenas: &[(u64, u64)], mut read: impl FnMut(u64, u64, &mut [[u32; POOL_HEADER_WORDS]]) -> usize) -> (u64, u64) {
    let (mut used, mut total) = (0u64, 0u64);
    let mut headers = vec![[0u32; POOL_HEADER_WORDS]; 256];
    for &(start, size) in arenas {
        total += size;
        // 256 KiB arenas (up to 3.9) have 4 KiB pools; 1 MiB arenas (3.10+) 16 KiB ones.
        let pool = if size <= 256 << 10 { 4096 } else { 16384 };
        let first = (start + pool - 1) & !(pool - 1);
        let pools = ((start + size).saturating_sub(first) / pool).min(headers.len() as u64) as usize;
        let got = read(first, pool, &mut headers[..pools]);
        for h in &headers[..got] {
            used += pool_used(h, pool);
        }
    }
    (used, total)
}

/// `copy_headers` through `/proc/self/mem`: the headers that came whole, from the first.
fn read_headers(mem: &crate::os::OwnMemory, first: u64, pool: u64, out: &mut [[u32; POOL_HEADER_WORDS]]) -> usize {
    for (i, h) in out.iter_mut().enumerate() {
        if mem.copy(first + i as u64 * pool, &mut h[..]) != POOL_HEADER_WORDS * 4 {
            return i;
        }
    }
    out.len()
}

/// `struct pool_header` (x86-64): `ref.count` (the used blocks) at word 0, `szidx` at
/// word 9 (byte 36).
const POOL_HEADER_WORDS: usize = 10;

/// The bytes of a pool's used blocks: `count` blocks of `(szidx + 1) * 16` bytes (the
/// 16-byte alignment of 3.8+). A header that cannot be one (a pool never carved holds
/// zeros) counts nothing.
fn pool_used(h: &[u32; POOL_HEADER_WORDS], pool: u64) -> u64 {
    let (count, szidx) = (h[0] as u64, h[9] as u64);
    let block = (szidx + 1) * 16;
    if szidx >= 64 || count * block > pool {
        return 0;
    }
    count * block
}

/// Copies the header of each of `out.len()` pools from `first` on; returns how many
/// came whole.
fn copy_headers(first: u64, pool: u64, out: &mut [[u32; POOL_HEADER_WORDS]]) -> usize {
    let local: Vec<libc::iovec> =
        out.iter_mut().map(|h| libc::iovec { iov_base: h.as_mut_ptr() as *mut libc::c_void, iov_len: POOL_HEADER_WORDS * 4 }).collect();
    let remote: Vec<libc::iovec> =
        (0..out.len() as u64).map(|i| libc::iovec { iov_base: (first + i * pool) as *mut libc::c_void, iov_len: POOL_HEADER_WORDS * 4 }).collect();
    // SAFETY: writes at most `POOL_HEADER_WORDS * 4` bytes into each header of `out`;
    // the kernel checks the remote ranges and fails rather than faulting.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), local.as_ptr(), local.len() as u64, remote.as_ptr(), remote.len() as u64, 0) };
    (n.max(0) as usize) / (POOL_HEADER_WORDS * 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pool headers read through `/proc/self/mem` give the sums those copied with
    /// `process_vm_readv` give, and both stop at an arena's unmapped part.
    #[test]
    fn headers_read_either_way_sum_to_the_same() {
        const POOL: u64 = 16384;
        const SIZE: u64 = 3 << 20;
        // SAFETY: a fresh mapping of ours, from which three 1 MiB "arenas" of 16 KiB pools
        // start at a pool boundary; their headers are written below, and the last four
        // pools unmapped again.
        let (raw, base) = unsafe {
            let p =
                libc::mmap(std::ptr::null_mut(), (SIZE + POOL) as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            (p as u64, (p as u64).next_multiple_of(POOL))
        };
        let pools = SIZE / POOL;
        let mut expected = 0u64;
        for k in 0..pools {
            let h = (base + k * POOL) as *mut u32;
            let (count, szidx) = ((k * 7 % 40) as u32, (k % 30) as u32);
            // SAFETY: the header's ten words lie inside the mapping.
            unsafe {
                *h = count;
                *h.add(9) = szidx;
            }
            if k < pools - 4 {
                expected += pool_used(&[count, 0, 0, 0, 0, 0, 0, 0, 0, szidx], POOL);
            }
        }
        assert!(expected > 0);
        // SAFETY: the last four pools of the mapping above.
        unsafe { libc::munmap((base + SIZE - 4 * POOL) as *mut libc::c_void, (4 * POOL) as usize) };
        let arenas = [(base, 1 << 20), (base + (1 << 20), 1 << 20), (base + (2 << 20), 1 << 20)];
        let copied = sum_pools(&arenas, copy_headers);
        let mem = crate::os::OwnMemory::open().expect("/proc/self/mem");
        let read = sum_pools(&arenas, |first, pool, out| read_headers(&mem, first, pool, out));
        assert_eq!(copied, (expected, SIZE));
        assert_eq!(read, copied);
        // SAFETY: the parts of the mapping still mapped.
        unsafe {
            libc::munmap(raw as *mut libc::c_void, (base + SIZE - 4 * POOL - raw) as usize);
            if raw + SIZE + POOL > base + SIZE {
                libc::munmap((base + SIZE) as *mut libc::c_void, (raw + SIZE + POOL - base - SIZE) as usize);
            }
        }
    }
}
