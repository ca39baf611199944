//! The glibc heap as it stands, chunk by chunk: the blocks a process allocated before
//! leaktrace recorded anything (issue 53: a process switched on from standby, or
//! attached to). They are read by the scan as a forked child's inherited blocks are
//! (`ScanInput::inherited`): never classified, so never called a leak, but the words in
//! them are references, so that a list made before the attach that grows after it holds
//! what it grows by.
//!
//! glibc keeps no list of its allocated chunks; their headers do: each chunk starts with
//! `prev_size` and `size` (the low bits `PREV_INUSE` 1, `IS_MMAPPED` 2, `NON_MAIN_ARENA`
//! 4), chunks of an arena lie end to end, and a chunk is in use when the next one's
//! `PREV_INUSE` is set. Three places hold them:
//! - the main arena: `[heap]`, from its start to its top chunk, the last;
//! - the other arenas' heaps: 64 MiB-aligned anonymous mappings that start with a
//!   `heap_info` (`ar_ptr`, `prev`, `size`, …), the first of an arena followed by the
//!   arena itself; a heap that is not its arena's newest ends with two fenceposts (a
//!   16-byte chunk, then a chunk of size 0). Where the chunks start depends on the
//!   glibc version (the sizes of `heap_info` and of the arena): it is found, not assumed,
//!   as the 16-byte-aligned offset from which the walk ends exactly at `heap + size`;
//! - chunks of their own mapping (`IS_MMAPPED`, at or above the mmap threshold): a
//!   mapping (or a run of them the kernel merged) whose chunk starts at `prev_size`
//!   bytes in (0, or the lead an aligned allocation left: PyTorch's 64-byte-aligned
//!   tensors), and ends on a page boundary.
//!
//! What it cannot tell: a chunk in a thread's tcache or a fastbin keeps `PREV_INUSE` set
//! in the next chunk, so those free chunks read as in use. They then count as memory from
//! before the attach, whose words may hold stale addresses: a block lost after the
//! attach that such a word points to reads reachable, never the other way round (no leak
//! is invented). The program runs on while the heap is read: a walk that meets a header
//! that cannot be (a size under 32 bytes or past the region) is read again, up to three
//! times, and keeps what it found before the header otherwise.
use super::roots::read_own_memory;

/// Non-main arenas' heaps are this large and aligned to it (64-bit glibc:
/// `2 * DEFAULT_MMAP_THRESHOLD_MAX`).
const HEAP_MAX: u64 = 64 << 20;
/// Where the chunks of a non-main heap may start, at most (`heap_info` and the arena).
const MAX_FIRST_CHUNK: u64 = 8192;
const PAGE: u64 = 4096;
const MIN_CHUNK: u64 = 32;
const SIZE_BITS: u64 = 7;
const PREV_INUSE: u64 = 1;
const IS_MMAPPED: u64 = 2;

/// Times a region's walk is read again when it meets a header that cannot be.
const WALK_TRIES: usize = 3;

/// A mapping of /proc/self/maps this walk looks at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Region {
    start: u64,
    end: u64,
    kind: RegionKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegionKind {
    /// `[heap]`: the main arena.
    MainHeap,
    /// Anonymous, readable and writable: a non-main heap, mmapped chunks, or neither.
    Anonymous,
}

/// The in-use chunks of this process's glibc heap now: `(address, usable size)` of each,
/// the address as `malloc` returned it, sorted by address.
pub fn in_use_chunks() -> Vec<(u64, u64)> {
    let maps = crate::os::anchor::read_proc_string("self/maps").unwrap_or_default();
    let ours = crate::os::own::ranges();
    let pagemap = crate::os::anchor::open_proc("self/pagemap", libc::O_RDONLY).unwrap_or(-1);
    let mut out = Vec::new();
    for r in regions(&maps).into_iter().flat_map(|r| outside(r, &ours)) {
        match r.kind {
            RegionKind::MainHeap => walk_with_retries(r.start, r.end, &mut out),
            RegionKind::Anonymous => anonymous(r, pagemap, &mut out),
        }
    }
    if pagemap >= 0 {
        // SAFETY: the descriptor opened above.
        unsafe { libc::close(pagemap) };
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The parts of `r` outside `ours` (the library's own mappings, sorted).
fn outside(r: Region, ours: &[(u64, u64)]) -> Vec<Region> {
    let mut out = Vec::new();
    let mut at = r.start;
    for &(start, len) in ours.iter().filter(|&&(s, l)| s < r.end && s + l > r.start) {
        if start > at {
            out.push(Region { start: at, end: start, kind: r.kind });
        }
        at = at.max(start + len);
    }
    if at < r.end {
        out.push(Region { start: at, end: r.end, kind: r.kind });
    }
    out
}

/// The anonymous, readable and writable mappings (`[heap]` left out) of the text of
/// /proc/self/maps, as (start, end): where pymalloc's arenas lie too.
pub fn anonymous_regions(maps: &str) -> Vec<(u64, u64)> {
    regions(maps).into_iter().filter(|r| r.kind == RegionKind::Anonymous).map(|r| (r.start, r.end)).collect()
}

/// The mappings the chunks may lie in, from the text of /proc/self/maps.
fn regions(maps: &str) -> Vec<Region> {
    maps.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (range, perms, _offset, _dev, inode) = (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
            let name = it.next().unwrap_or("");
            if !perms.starts_with("rw") || inode != "0" {
                return None;
            }
            let kind = match name {
                "[heap]" => RegionKind::MainHeap,
                "" => RegionKind::Anonymous,
                _ => return None,
            };
            let (a, b) = range.split_once('-')?;
            Some(Region { start: u64::from_str_radix(a, 16).ok()?, end: u64::from_str_radix(b, 16).ok()?, kind })
        })
        .collect()
}

/// Words of this process's memory read through copies, a window at a time.
struct Words {
    at: u64,
    buf: Vec<u64>,
    got: usize,
}

impl Words {
    fn new() -> Words {
        Words { at: 0, buf: vec![0; 8192], got: 0 }
    }

    /// The word at `addr` (8-aligned), or `None` where it cannot be read.
    fn get(&mut self, addr: u64) -> Option<u64> {
        let in_window = addr >= self.at && addr + 8 <= self.at + 8 * self.got as u64;
        if !in_window {
            self.at = addr;
            self.got = read_own_memory(addr, &mut self.buf) / 8;
        }
        let k = ((addr - self.at) / 8) as usize;
        (k < self.got).then(|| self.buf[k])
    }
}

/// How a walk of a region's chunks ended.
#[derive(Debug, PartialEq, Eq)]
enum Walked {
    /// At the region's end (its top chunk), or at a heap's closing fencepost.
    Whole,
    /// At a header that cannot be, or memory that could not be read.
    Broken,
}

/// Walks the chunks from `first` to `end`, pushing the in-use ones.
fn walk(words: &mut Words, first: u64, end: u64, out: &mut Vec<(u64, u64)>) -> Walked {
    let mut at = first;
    let mut fencepost = false;
    while at < end {
        let Some(head) = words.get(at + 8) else { return Walked::Broken };
        let size = head & !SIZE_BITS;
        if fencepost {
            // The closing fencepost of a heap that is not its arena's newest, right
            // after the first.
            return if size == 0 && head & PREV_INUSE != 0 { Walked::Whole } else { Walked::Broken };
        }
        if size == 16 && at > first {
            // The first fencepost: a header alone.
            fencepost = true;
            at += 16;
            continue;
        }
        if size < MIN_CHUNK || !size.is_multiple_of(16) || at + size > end {
            return Walked::Broken;
        }
        let next = at + size;
        if next == end {
            // The top chunk: free.
            return Walked::Whole;
        }
        let Some(next_head) = words.get(next + 8) else { return Walked::Broken };
        if next_head & PREV_INUSE != 0 {
            // The usable size runs into the next chunk's `prev_size`.
            out.push((at + 16, size - 8));
        }
        at = next;
    }
    Walked::Broken
}

/// `walk`, read again from the start while it breaks (the program runs on meanwhile);
/// the longest broken walk's chunks where none ends whole.
fn walk_with_retries(first: u64, end: u64, out: &mut Vec<(u64, u64)>) {
    let mut words = Words::new();
    let mut best: Vec<(u64, u64)> = Vec::new();
    for _ in 0..WALK_TRIES {
        let mut found = Vec::new();
        if walk(&mut words, first, end, &mut found) == Walked::Whole {
            out.extend(found);
            return;
        }
        if found.len() > best.len() {
            best = found;
        }
        words = Words::new();
    }
    out.extend(best);
}

/// The chunks of an anonymous writable mapping: the non-main heaps in it, each at a
/// `HEAP_MAX` boundary (the kernel merges a heap's writable part with a writable
/// mapping just below it, a thread's stack or another heap grown to its end, so a heap
/// need not start the mapping: the full suite's allocator tests met one so, its heap
/// missed), and the mmapped chunks in the rest.
fn anonymous(r: Region, pagemap: i32, out: &mut Vec<(u64, u64)>) {
    let mut at = r.start;
    let mut boundary = r.start.next_multiple_of(HEAP_MAX);
    while boundary < r.end {
        match non_main_heap(Region { start: boundary, end: r.end, kind: r.kind }, out) {
            Some(end) => {
                if at < boundary {
                    mmapped_chunks(Region { start: at, end: boundary, kind: r.kind }, pagemap, out);
                }
                at = end;
                boundary = end.next_multiple_of(HEAP_MAX);
            }
            None => boundary += HEAP_MAX,
        }
    }
    if at < r.end {
        mmapped_chunks(Region { start: at, end: r.end, kind: r.kind }, pagemap, out);
    }
}

/// A non-main arena's heap at `r.start`: its chunks, when its `heap_info` reads as one
/// (`size` within the mapping) and a walk from some offset ends exactly at its end.
/// Returns that end.
fn non_main_heap(r: Region, out: &mut Vec<(u64, u64)>) -> Option<u64> {
    let mut words = Words::new();
    let size = words.get(r.start + 16)?;
    if !(PAGE..=HEAP_MAX).contains(&size) || r.start + size > r.end {
        return None;
    }
    let end = r.start + size;
    for _ in 0..WALK_TRIES {
        for first in (MIN_CHUNK..MAX_FIRST_CHUNK).step_by(16).map(|o| r.start + o) {
            let mut found = Vec::new();
            if walk(&mut words, first, end, &mut found) == Walked::Whole {
                out.extend(found);
                return Some(end);
            }
        }
        words = Words::new();
    }
    None
}

/// The chunks that have a mapping of their own in `r` (the kernel merges neighbours with
/// the same permissions into one mapping, a thread's stack beside a chunk): at a page
/// boundary, a header `prev_size` bytes in, with `IS_MMAPPED` alone, ending on a page
/// boundary; one read of each written page that holds none (`pagemap`: the page map's
/// descriptor, or -1 to read every page).
fn mmapped_chunks(r: Region, pagemap: i32, out: &mut Vec<(u64, u64)>) {
    let mut words = Words::new();
    let mut at = r.start;
    let mut entries = [0u64; 512];
    let (mut entries_from, mut entries_len) = (0u64, 0usize);
    while at < r.end {
        // A page never written holds no header, and reading it would map it: only the
        // pages the page map says are there (or swapped out) are read.
        let page = at / PAGE;
        if page < entries_from || page >= entries_from + entries_len as u64 {
            entries_len = ((r.end - at) / PAGE).min(entries.len() as u64) as usize;
            entries_from = page;
            if !crate::os::pagemap::read(pagemap, page, &mut entries[..entries_len]) {
                entries[..entries_len].fill(crate::os::pagemap::PRESENT);
            }
        }
        let entry = entries[(page - entries_from) as usize];
        if entry & (crate::os::pagemap::PRESENT | crate::os::pagemap::SWAPPED) == 0 {
            at += PAGE;
            continue;
        }
        // The header: within the first page. An aligned allocation's sits `lead` bytes
        // in, after the mapping's own first header, which stays: the last one counts.
        let mut chunk = None;
        for lead in (0..PAGE).step_by(16) {
            let Some(prev) = words.get(at + lead) else { return };
            if prev != lead {
                continue;
            }
            let Some(head) = words.get(at + lead + 8) else { return };
            let size = head & !SIZE_BITS;
            if head & SIZE_BITS == IS_MMAPPED && size >= PAGE && (lead + size).is_multiple_of(PAGE) && at + lead + size <= r.end {
                chunk = Some((lead, size));
            }
        }
        match chunk {
            Some((lead, size)) => {
                out.push((at + lead + 16, size - 16));
                at += lead + size;
            }
            // Not a chunk's first page (a thread's stack, pymalloc's arenas): the next.
            None => at += PAGE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_librarys_own_mappings_are_cut_out_of_a_region() {
        let r = Region { start: 0x1000, end: 0x9000, kind: RegionKind::Anonymous };
        let part = |start, end| Region { start, end, kind: RegionKind::Anonymous };
        assert_eq!(outside(r, &[]), vec![r]);
        assert_eq!(outside(r, &[(0x0, 0x2000), (0x4000, 0x1000), (0x8000, 0x4000)]), vec![part(0x2000, 0x4000), part(0x5000, 0x8000)]);
        assert!(outside(r, &[(0x1000, 0x8000)]).is_empty());
    }

    #[test]
    fn the_maps_give_the_main_heap_and_anonymous_writable_mappings_only() {
        let maps = "\
55d0c000-55d2d000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000021000 rw-p 00000000 00:00 0 
7f0000021000-7f0004000000 ---p 00000000 00:00 0 
7f1000000000-7f1000001000 rw-p 00002000 08:01 1234               /usr/lib/libc.so.6
7ffd0000-7ffd1000 rw-p 00000000 00:00 0                          [stack]
";
        let r = regions(maps);
        assert_eq!(
            r,
            vec![
                Region { start: 0x55d0c000, end: 0x55d2d000, kind: RegionKind::MainHeap },
                Region { start: 0x7f0000000000, end: 0x7f0000021000, kind: RegionKind::Anonymous },
            ]
        );
    }

    /// A heap whose writable part the kernel merged with a writable mapping just below
    /// it (a thread's stack, another heap grown to its end): the heap starts inside the
    /// mapping, at a `HEAP_MAX` boundary, and is found there; the part before it is
    /// looked at for mmapped chunks.
    #[test]
    fn a_heap_that_does_not_start_its_mapping_is_found_at_its_boundary() {
        // SAFETY: a fresh reservation of our own, unmapped below; nothing else uses it.
        let reserve = unsafe {
            libc::mmap(std::ptr::null_mut(), (3 * HEAP_MAX) as usize, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0)
        };
        assert_ne!(reserve, libc::MAP_FAILED);
        let boundary = (reserve as u64).next_multiple_of(HEAP_MAX) + HEAP_MAX;
        let (start, heap_size) = (boundary - 4 * PAGE, 16 * PAGE);
        // One writable mapping: four pages below the boundary, the heap's 16 above.
        // SAFETY: inside the reservation made above.
        let rw = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                (4 * PAGE + heap_size) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_eq!(rw as u64, start);
        let put = |addr: u64, v: u64| {
            // SAFETY: inside the writable mapping made above, aligned.
            unsafe { (addr as *mut u64).write(v) }
        };
        // heap_info: ar_ptr, prev, size; then chunks from +64: 96 in use, 48 in use, top.
        put(boundary + 16, heap_size);
        let first = boundary + 64;
        put(first + 8, 96 | PREV_INUSE);
        put(first + 96 + 8, 48 | PREV_INUSE);
        put(first + 144 + 8, (heap_size - 64 - 144) | PREV_INUSE);
        let mut out = Vec::new();
        anonymous(Region { start, end: boundary + heap_size, kind: RegionKind::Anonymous }, -1, &mut out);
        assert_eq!(out, vec![(first + 16, 88), (first + 96 + 16, 40)]);
        // SAFETY: the reservation made above, whole.
        unsafe { libc::munmap(reserve, (3 * HEAP_MAX) as usize) };
    }

    /// A walk over a heap laid out in this test's own memory: in-use and free chunks, a
    /// fencepost pair, a top chunk; a broken header stops it.
    #[test]
    fn a_walk_reads_in_use_chunks_from_the_next_headers_bit() {
        let mut mem = vec![0u64; 64];
        let base = mem.as_ptr() as u64;
        let head = |mem: &mut Vec<u64>, off: usize, v: u64| mem[off / 8 + 1] = v;
        // 0: 48 bytes in use (next has PREV_INUSE), 48: 64 free (next lacks it),
        // 112: 32 in use, 144: 16-byte fencepost, 160: size 0 fencepost.
        head(&mut mem, 0, 48 | PREV_INUSE);
        head(&mut mem, 48, 64 | PREV_INUSE);
        head(&mut mem, 112, 32);
        head(&mut mem, 144, 16 | PREV_INUSE);
        head(&mut mem, 160, PREV_INUSE);
        let mut out = Vec::new();
        assert_eq!(walk(&mut Words::new(), base, base + 512, &mut out), Walked::Whole);
        assert_eq!(out, vec![(base + 16, 40), (base + 128, 24)]);
        // A top chunk ends it too.
        head(&mut mem, 144, (512 - 144) | PREV_INUSE);
        out.clear();
        assert_eq!(walk(&mut Words::new(), base, base + 512, &mut out), Walked::Whole);
        assert_eq!(out, vec![(base + 16, 40), (base + 128, 24)]);
        // A size that cannot be: broken, with what came before it.
        head(&mut mem, 112, 24 | PREV_INUSE);
        out.clear();
        assert_eq!(walk(&mut Words::new(), base, base + 512, &mut out), Walked::Broken);
        assert_eq!(out, vec![(base + 16, 40), (base + 64, 56)]);
        drop(mem);
    }

    /// This test process's own heap (the test harness's threads allocate meanwhile):
    /// blocks of the main arena, of another thread's arena, mmapped ones and an aligned
    /// mmapped one are found at the addresses malloc returned, with at least their
    /// sizes; blocks freed into the unsorted bin are not (at their size).
    #[test]
    fn every_live_block_of_this_process_is_found_and_freed_large_ones_are_not() {
        crate::os::procfs::open(false);
        let sizes = [24usize, 100, 1000, 5000, 100_000, 300_000, 3 << 20];
        // SAFETY: plain malloc/free/posix_memalign of this test's own blocks.
        let kept: Vec<(u64, usize)> = sizes.iter().map(|&n| (unsafe { libc::malloc(n) } as u64, n)).collect();
        let mut aligned: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: as above.
        assert_eq!(unsafe { libc::posix_memalign(&mut aligned, 64, 4 << 20) }, 0);
        let other: Vec<(u64, usize)> = std::thread::spawn(move || {
            // SAFETY: as above; the blocks outlive the thread on purpose.
            sizes.iter().map(|&n| (unsafe { libc::malloc(n) } as u64, n)).collect()
        })
        .join()
        .unwrap();
        // Beyond the tcache (1032 bytes at most) and the fastbins: freed into the
        // unsorted bin, their next chunk's PREV_INUSE cleared. Kept apart by live ones.
        // SAFETY: as above.
        let pairs: Vec<(u64, u64)> = (0..8).map(|_| unsafe { (libc::malloc(2000) as u64, libc::malloc(2000) as u64) }).collect();
        for &(freed, _) in &pairs {
            // SAFETY: freed once; its neighbour stays live.
            unsafe { libc::free(freed as *mut libc::c_void) };
        }
        let all_kept: Vec<(u64, usize)> =
            kept.iter().chain(&other).copied().chain([(aligned as u64, 4 << 20)]).chain(pairs.iter().map(|p| (p.1, 2000))).collect();
        // The harness's other threads allocate as this runs, some in this thread's arena
        // (two cores: arenas are shared past 16 threads' worth): a broken walk is read
        // again (within `in_use_chunks`); and here, after a pause, while it raced — the
        // other tests end, and a walk that never succeeds still fails the test.
        let mut missing = Vec::new();
        let mut wrongly = Vec::new();
        for attempt in 0..20 {
            if attempt > 0 {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let chunks = in_use_chunks();
            let found = |addr: u64| chunks.binary_search_by_key(&addr, |c| c.0).ok().map(|i| chunks[i].1);
            missing = all_kept.iter().filter(|&&(a, n)| found(a).is_none_or(|size| size < n as u64)).copied().collect();
            // (An allocation made since, this walk's own included, may have been carved
            // from the start of a freed one: smaller.)
            wrongly = pairs.iter().filter(|p| found(p.0).is_some_and(|size| size >= 2000)).map(|p| p.0).collect();
            if missing.is_empty() && wrongly.is_empty() {
                break;
            }
        }
        assert!(missing.is_empty(), "live blocks not found (address, size): {missing:x?}");
        assert!(wrongly.is_empty(), "freed blocks found in use: {wrongly:x?}");
        for &(a, _) in all_kept.iter() {
            // SAFETY: each freed once.
            unsafe { libc::free(a as *mut libc::c_void) };
        }
    }
}
