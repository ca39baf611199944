//! The mark phase. Any aligned word that points anywhere inside a block (start or
//! interior) keeps that block: this is conservative, as in LSan and valgrind.

/// A live block as the scan sees it: where it is and how it is read, in 16 bytes (a
/// process at exit has as many of them as live blocks: 660k at the end of `import
/// torch`, 21 MB as five fields in 32 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub start: u64,
    /// The size (`SIZE`) and the `OPAQUE`, `CUDA`, `IN_GLIBC_CHUNK` and `MAPPING` bits.
    bits: u64,
}

const _: () = assert!(std::mem::size_of::<Block>() == 16);

/// Its contents are not read (device memory): it can be reached, but points nowhere.
const OPAQUE: u64 = 1 << 63;
/// A CUDA allocation: the CUDA libraries' own bookkeeping (`runtime_roots`, and what
/// only they reach) does not keep it; only the program's memory does.
const CUDA: u64 = 1 << 62;
/// A chunk of glibc's malloc: the next chunk's header, where it lies inside the block,
/// does not keep it (`glibc_next_chunk_header`).
const IN_GLIBC_CHUNK: u64 = 1 << 61;
/// A mapping the program made itself (`mmap`): read only on its written pages
/// (`Roots::mapped_written`), copied as root memory is. What a custom allocator's heap
/// (gcc's collected memory, an arena, a coroutine's stack) holds keeps its blocks, as
/// valgrind says; read as opaque, their only references went unseen and they read as
/// leaks (gcc's `cc1`: 8 blocks that valgrind calls reachable).
const MAPPING: u64 = 1 << 60;
/// The size's bits (1 EiB: no block is larger).
const SIZE: u64 = MAPPING - 1;

impl Block {
    /// A block of `size` bytes at `start`, read whole; whatever points inside keeps it.
    pub const fn new(start: u64, size: u64) -> Block {
        Block { start, bits: if size > SIZE { SIZE } else { size } }
    }

    /// The same block, not read (device memory, a mapping that may be reserved only).
    pub const fn opaque(self) -> Block {
        Block { start: self.start, bits: self.bits | OPAQUE }
    }

    /// The same block, a CUDA allocation.
    pub const fn cuda(self) -> Block {
        Block { start: self.start, bits: self.bits | CUDA }
    }

    /// The same block, a chunk of glibc's malloc.
    pub const fn in_glibc_chunk(self) -> Block {
        Block { start: self.start, bits: self.bits | IN_GLIBC_CHUNK }
    }

    /// The same block, a mapping of the program's (read on its written pages only).
    pub const fn mapping(self) -> Block {
        Block { start: self.start, bits: self.bits | MAPPING }
    }

    #[inline(always)]
    pub fn is_mapping(&self) -> bool {
        self.bits & MAPPING != 0
    }

    #[inline(always)]
    pub fn size(&self) -> u64 {
        self.bits & SIZE
    }

    #[inline(always)]
    pub fn is_opaque(&self) -> bool {
        self.bits & OPAQUE != 0
    }

    #[inline(always)]
    pub fn is_cuda(&self) -> bool {
        self.bits & CUDA != 0
    }

    /// An address inside the block that does not keep it (0: none): see
    /// `glibc_next_chunk_header`.
    #[inline(always)]
    pub fn not_a_reference(&self) -> u64 {
        if self.bits & IN_GLIBC_CHUNK != 0 {
            glibc_next_chunk_header(self.start, self.size())
        } else {
            0
        }
    }
}

/// Where glibc's malloc puts the header of the chunk that follows a block of `size`
/// bytes at `start`, when that header lies inside the block: a request that fills its
/// chunk exactly (2008 bytes in a 2016-byte chunk) shares its last 8 bytes with the next
/// chunk's `prev_size` field. glibc's own words point to chunk headers (the arena's top
/// chunk, its free lists, stale copies in fresh memory), and read as interior pointers
/// they kept such blocks alive: a block leaked just before the top chunk was "reachable".
pub fn glibc_next_chunk_header(start: u64, size: u64) -> u64 {
    let chunk = (size.saturating_add(8 + 15) & !15).max(32);
    let next = start.wrapping_sub(16).wrapping_add(chunk);
    if next >= start && next < start.saturating_add(size) {
        next
    } else {
        0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A root (global, stack, register, TLS) leads to it.
    Reachable,
    /// Only other leaked blocks point to it.
    Indirect,
    /// Nothing points to it.
    Definite,
}

/// Blocks of at most this size are found through the page directory; larger ones
/// (few, but each would fill many directory entries) by a search of their own list.
const DIRECTORY_MAX_BLOCK: u64 = 64 << 10;
const PAGE_SHIFT: u32 = 12;
/// The directory has one table of pages per 1 GiB region that holds blocks.
const REGION_SHIFT: u32 = 30;
const PAGES_PER_REGION: usize = 1 << (REGION_SHIFT - PAGE_SHIFT);

/// Blocks sorted by start; answers "which block contains this address" quickly. Every
/// word of the roots and of each reached block is asked, so a lookup is one read of a
/// page directory (page -> the blocks that overlap it) and a search among those few,
/// instead of a binary search over every block, each step a cache miss on a large heap.
pub struct BlockIndex<'a> {
    blocks: &'a [Block],
    lo: u64,
    hi: u64,
    /// Regions (address >> 30) that hold directory-sized blocks, ascending, each with
    /// its page table: per page, the index range of the blocks that overlap it.
    regions: Vec<(u64, Vec<(u32, u32)>)>,
    /// The larger blocks by start: `(start, end, index)`, kept dense so that the search
    /// (asked for every in-range word the directory does not answer: pointers into
    /// libraries, stacks, the allocator's own pages) reads no block records.
    large: Vec<(u64, u64, u32)>,
}

impl<'a> BlockIndex<'a> {
    /// `blocks` must be sorted by `start` and not overlap. Allocates (build it before
    /// threads are stopped).
    pub fn new(blocks: &'a [Block]) -> BlockIndex<'a> {
        let lo = blocks.first().map(|b| b.start).unwrap_or(u64::MAX);
        let hi = blocks.iter().map(|b| b.start.saturating_add(b.size().max(1))).max().unwrap_or(0);
        let mut regions: Vec<(u64, Vec<(u32, u32)>)> = Vec::new();
        let mut large = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            let i = i as u32;
            if b.size() > DIRECTORY_MAX_BLOCK {
                large.push((b.start, b.start.saturating_add(b.size()), i));
                continue;
            }
            let last = b.start.saturating_add(b.size().max(1) - 1);
            for page in (b.start >> PAGE_SHIFT)..=(last >> PAGE_SHIFT) {
                let region = page >> (REGION_SHIFT - PAGE_SHIFT);
                // Blocks come by address: a region is always the last one or a new one.
                if regions.last().map(|r| r.0) != Some(region) {
                    regions.push((region, vec![(0, 0); PAGES_PER_REGION]));
                }
                let table = &mut regions.last_mut().expect("pushed above").1;
                let e = &mut table[page as usize & (PAGES_PER_REGION - 1)];
                if e.1 == 0 {
                    e.0 = i;
                }
                e.1 = i + 1;
            }
        }
        BlockIndex { blocks, lo, hi, regions, large }
    }

    /// The block that contains `word`, if any. Runs once per word scanned.
    #[inline(always)]
    pub fn find(&self, word: u64) -> Option<usize> {
        // Most words are small integers or other non-heap values: this test stays in the
        // caller's loop, and only the rest is a call.
        if !self.in_range(word) {
            return None;
        }
        self.find_out_of_line(word)
    }

    #[inline(never)]
    fn find_out_of_line(&self, word: u64) -> Option<usize> {
        self.find_in_range(word)
    }

    /// Whether `word` lies between the lowest block's start and the highest block's end
    /// (`find`'s first test).
    #[inline(always)]
    fn in_range(&self, word: u64) -> bool {
        word >= self.lo && word < self.hi
    }

    /// `find` for a word `in_range`.
    #[inline(always)]
    fn find_in_range(&self, word: u64) -> Option<usize> {
        let contains = |i: usize| {
            let b = &self.blocks[i];
            // A zero-sized block is still an allocation: its address counts.
            word >= b.start && word < b.start.saturating_add(b.size().max(1))
        };
        let region = word >> REGION_SHIFT;
        let r = self.regions.partition_point(|r| r.0 < region);
        if let Some((_, table)) = self.regions.get(r).filter(|r| r.0 == region) {
            let (first, end) = table[(word >> PAGE_SHIFT) as usize & (PAGES_PER_REGION - 1)];
            if end > 0 {
                let range = &self.blocks[first as usize..end as usize];
                let k = range.partition_point(|b| b.start <= word);
                if k > 0 && contains(first as usize + k - 1) {
                    return Some(first as usize + k - 1);
                }
            }
        }
        let k = self.large.partition_point(|&(start, _, _)| start <= word);
        let &(_, end, i) = self.large.get(k.checked_sub(1)?)?;
        (word < end).then_some(i as usize)
    }
}

/// Reads the aligned words of `[start, start + len)`, each with its address; returns
/// false where the memory cannot be read (the range is then skipped).
pub trait Memory {
    /// Generic, not `dyn`: the visitor runs once per word of the heap (tens of millions
    /// in a large process) and must inline into the loop that reads the words.
    fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool;

    /// Like `words`, for root memory (module data, stacks, TLS): memory that is not a
    /// tracked block, which a thread the scan cannot hold (or the C library acting for
    /// one) may unmap while it is read. The default reads it as `words` does.
    fn root_words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        self.words(start, len, visit)
    }

    /// Like `words`, for a heap block, which its owner may free (and the allocator
    /// unmap) while the scan reads it when the owner is a thread the scan cannot hold.
    /// The default reads it as `words` does.
    fn block_words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        self.words(start, len, visit)
    }
}

/// Working memory for `classify_into`, allocated before other threads are stopped
/// (one of them may hold the allocator's lock).
pub struct Scratch<'a> {
    index: BlockIndex<'a>,
    pub verdicts: Vec<Verdict>,
    /// For each indirect block, the definite block whose leak it is part of (the first,
    /// by address, that reaches it); `NO_OWNER` for every other block. A suppressed leak
    /// hides the indirect leaks it owns, as in LeakSanitizer.
    pub owners: Vec<u32>,
    /// How each reachable block was first reached: the block that holds the reference
    /// (`FROM_ROOT`: a root; `FROM_FREED`: a block freed meanwhile, never read) and the
    /// address of the word that holds it. One path to a root per block, for "held by"
    /// (`paths`); 12 bytes a block.
    pub parent: Vec<u32>,
    pub via: Vec<u64>,
    reached: Vec<bool>,
    indirect: Vec<bool>,
    work: Vec<usize>,
    /// The live lists' item arrays and the bytes of each in use (`pymalloc::list_items`),
    /// found in the arenas first: such a block is read up to its list's length only.
    /// Its capacity is set before the threads are stopped (`reserve_lists`); lists past
    /// it have their arrays read whole.
    lists: Vec<(u64, u64)>,
}

pub const NO_OWNER: u32 = u32::MAX;
/// `Scratch::parent` of a block reached from a root's word.
pub const FROM_ROOT: u32 = u32::MAX;
/// `Scratch::parent` of a block freed after the live set was taken (reachable, no path).
pub const FROM_FREED: u32 = u32::MAX - 1;

impl<'a> Scratch<'a> {
    pub fn new(blocks: &'a [Block]) -> Scratch<'a> {
        let index = BlockIndex::new(blocks);
        let blocks = blocks.len();
        Scratch {
            index,
            verdicts: vec![Verdict::Definite; blocks],
            owners: vec![NO_OWNER; blocks],
            parent: vec![FROM_ROOT; blocks],
            via: vec![0; blocks],
            reached: vec![false; blocks],
            indirect: vec![false; blocks],
            // Each block is pushed at most once: this never grows.
            work: Vec::with_capacity(blocks),
            lists: Vec::new(),
        }
    }

    /// Room for `n` lists' item arrays (see `lists`).
    pub fn reserve_lists(&mut self, n: usize) {
        self.lists.reserve_exact(n);
    }
}

/// The path from reachable block `i` out to a root, as `classify_into` found it: each
/// step the holding block's index (or `FROM_ROOT`/`FROM_FREED` last) and the address of
/// the word that refers to the step before. At most `limit` steps: a long chain (a
/// linked list of ten thousand nodes) keeps its first `limit / 2` steps and its last
/// ones, and says how many it left out between them.
pub fn path(parent: &[u32], via: &[u64], i: usize, limit: usize) -> (Vec<(u32, u64)>, usize) {
    let mut steps = Vec::new();
    let mut at = i;
    // A parent was reached before its child: the chain ends, and never loops.
    for _ in 0..parent.len() + 1 {
        let p = parent[at];
        steps.push((p, via[at]));
        if p == FROM_ROOT || p == FROM_FREED {
            break;
        }
        at = p as usize;
    }
    if steps.len() <= limit {
        return (steps, 0);
    }
    let head = limit / 2;
    let tail = limit - head;
    let left_out = steps.len() - limit;
    let mut kept: Vec<(u32, u64)> = steps[..head].to_vec();
    kept.extend_from_slice(&steps[steps.len() - tail..]);
    (kept, left_out)
}

/// The mark phase's state, borrowed apart from the verdicts.
struct Marks<'s> {
    reached: &'s mut Vec<bool>,
    work: &'s mut Vec<usize>,
    parent: &'s mut Vec<u32>,
    via: &'s mut Vec<u64>,
}

/// The ranges of memory a scan classifies against: `(start, len)` each. `Default`: none.
#[derive(Default)]
pub struct Roots<'r> {
    /// The program's: module data, stacks, registers, TLS.
    pub program: &'r [(u64, u64)],
    /// The CUDA libraries' data: keeps host blocks but never, directly or through host
    /// blocks only it keeps, a CUDA allocation (the driver's own table of allocations is
    /// no reference of the program's).
    pub runtime: &'r [(u64, u64)],
    /// In a forked child, the blocks allocated by the parent (sorted, disjoint): the
    /// parent's to account for, so not classified, and taken as reachable. Only their
    /// parts on `changed_since_fork` pages (sorted, disjoint) are read: the rest holds
    /// what the parent wrote before the fork, no address of a block the child made.
    pub inherited: &'r crate::spans::Spans,
    pub changed_since_fork: &'r [(u64, u64)],
    /// CPython's object arenas (start, size): their live objects are program roots
    /// (`scan::pymalloc`).
    pub python_arenas: &'r [(u64, u64)],
    /// In a forked child, the parts of the arenas on pages that may have changed since
    /// the fork (sorted, disjoint): only there can an object hold the address of a block
    /// the child made. `None`: the arenas are read whole.
    pub python_changed: Option<&'r [(u64, u64)]>,
    /// How the interpreter keeps an int: a live int in the arenas whose value is an
    /// address is read as a reference to it (a pointer kept as a Python int, as ctypes
    /// returns one and as PyTorch's weak storage references keep one). `None`: ints are
    /// not read.
    pub python_ints: Option<super::pymalloc::IntLayout>,
    /// The interpreter's built-in types, when known: their objects are read only where
    /// they can hold a reference (`pymalloc::object_parts`).
    pub python_types: Option<super::pymalloc::ObjectTypes>,
    /// Addresses of blocks freed after the live set was taken and before the threads
    /// were stopped (`hotpath::channel::unapplied_frees`): such a block is no leak,
    /// whether or not something still points to it; it counts as reachable, and is not
    /// read (it may be unmapped meanwhile; what only it pointed to is lost with it).
    pub freed_meanwhile: &'r [u64],
    /// The written parts of the program's own mappings (`Block::mapping`; sorted,
    /// disjoint): only there can a mapping hold an address. A page never touched is zero,
    /// and a large reservation is mostly such pages.
    pub mapped_written: &'r [(u64, u64)],
}

/// Calls `f(start, len)` for each part of `[start, start + len)` inside `ranges` (sorted,
/// disjoint).
#[inline]
fn for_each_within(ranges: &[(u64, u64)], start: u64, len: u64, mut f: impl FnMut(u64, u64)) {
    let end = start.saturating_add(len);
    let first = ranges.partition_point(|&(a, l)| a.saturating_add(l) <= start);
    for &(a, l) in ranges[first..].iter().take_while(|r| r.0 < end) {
        let (from, to) = (a.max(start), a.saturating_add(l).min(end));
        if from < to {
            f(from, to - from);
        }
    }
}

/// How deep inside a block a word of a Python object may point and still count as a
/// reference to it. An object that owns a buffer holds its start (it must, to free it);
/// a pointer into the middle of a large block from a small Python object is what an
/// object kept from before that memory was freed and reused (a bytes object's raw
/// contents, a cached address). Under `pytest --leaktrace` such words kept a 50 KB
/// buffer that a test leaked "reachable" in 14 runs of 30 (offsets 20-24 KiB into it);
/// within 4 KiB, a word 2,816 bytes into it still did in 1 of 16 to 1 of 3 runs (at
/// +120 of an object in a dict of `platformdirs`), and within 1 KiB, words 288 and 624
/// bytes into it in 3 of 16 runs beside two busy loops (at +136 of a function object:
/// the slack of its pymalloc block, which is cleared only up to the request). The
/// interior pointers CPython itself keeps are its object headers' (16-48 bytes: a GC
/// header, the managed dict's words); 256 bytes leaves room for a C extension's own.
/// Pointers from every other root (stacks, globals, the heap) count anywhere inside a
/// block, as LeakSanitizer counts them.
pub const PYTHON_INTERIOR: u64 = 256;

/// Reads the words of block `b`: a heap block through `block_words` (its owner may free
/// it, and the allocator unmap it, meanwhile), a CUDA host allocation in place as before
/// (page-locked memory the driver may map in a way a copy cannot read).
#[inline(always)]
fn read_block(mem: &impl Memory, b: &Block, mapped_written: &[(u64, u64)], visit: &mut impl FnMut(u64, u64)) {
    read_block_prefix(mem, b, b.size(), mapped_written, visit);
}

/// `read_block` for the first `len` bytes of `b` only; a mapping's written pages among
/// them (`mapped_written`: sorted, disjoint) only.
#[inline(always)]
fn read_block_prefix(mem: &impl Memory, b: &Block, len: u64, mapped_written: &[(u64, u64)], visit: &mut impl FnMut(u64, u64)) {
    if b.is_mapping() {
        for_each_within(mapped_written, b.start, len, |start, n| {
            mem.root_words(start, n, visit);
        });
    } else if b.is_cuda() {
        mem.words(b.start, len, visit);
    } else {
        mem.block_words(b.start, len, visit);
    }
}

/// What a word read by the scan keeps: the blocks and their index.
struct Keeper<'a> {
    index: &'a BlockIndex<'a>,
    blocks: &'a [Block],
}

impl Keeper<'_> {
    /// A word keeps the block it points into when it lies within `within` bytes of the
    /// block's start (everywhere but in Python objects: anywhere inside). `at`: the
    /// word's address; `from`: the block it is in, or `FROM_ROOT`. Inlined into every
    /// loop over words, so that a word outside the blocks' range (most of them) costs
    /// its two comparisons there, not a call (design.md, "Finding the block under a
    /// word").
    #[inline(always)]
    fn keep(&self, w: u64, at: u64, from: u32, m: &mut Marks, keeps_cuda: bool, within: u64) {
        if self.index.in_range(w) {
            self.mark(w, at, from, m, keeps_cuda, within);
        }
    }

    /// `keep` for a word inside the blocks' range: one call, which finds the block and
    /// marks it.
    #[inline(never)]
    fn mark(&self, w: u64, at: u64, from: u32, m: &mut Marks, keeps_cuda: bool, within: u64) {
        let Some(i) = self.index.find_in_range(w) else { return };
        let b = &self.blocks[i];
        if !m.reached[i] && (keeps_cuda || !b.is_cuda()) && w - b.start < within && w != b.not_a_reference() {
            m.reached[i] = true;
            m.parent[i] = from;
            m.via[i] = at;
            m.work.push(i);
        }
    }
}

/// Classifies every block against `roots`, without allocating.
pub fn classify_into(blocks: &[Block], roots: &Roots, mem: &impl Memory, s: &mut Scratch) {
    let Scratch { index, verdicts, owners, parent, via, reached, indirect, work, lists } = s;
    let index = &*index;
    let mut marks = Marks { reached, work, parent, via };
    let keeper = Keeper { index, blocks };
    let mark_within = |start: u64, len: u64, m: &mut Marks, keeps_cuda: bool, within: u64| {
        mem.words(start, len, &mut |at, w| keeper.keep(w, at, FROM_ROOT, m, keeps_cuda, within));
    };
    let mark_from = |start: u64, len: u64, m: &mut Marks, keeps_cuda: bool| {
        mem.block_words(start, len, &mut |at, w| keeper.keep(w, at, FROM_ROOT, m, keeps_cuda, u64::MAX));
    };
    let mark_root = |start: u64, len: u64, m: &mut Marks, keeps_cuda: bool| {
        mem.root_words(start, len, &mut |at, w| keeper.keep(w, at, FROM_ROOT, m, keeps_cuda, u64::MAX));
    };
    for &addr in roots.freed_meanwhile {
        if let Some(i) = index.find(addr) {
            if blocks[i].start == addr {
                // Not read: its memory may be unmapped under the scan (a large block is
                // its own mapping), and what only it pointed to is lost with it.
                marks.reached[i] = true;
                marks.parent[i] = FROM_FREED;
            }
        }
    }
    // The lists' item arrays, before anything is read: see `Scratch::lists`. A heap
    // block that is a live list's item array is marked from that list here, before any
    // other object's words are read: its path names the list (and through it the
    // variable a user would clear), not an earlier block of the arenas whose stale word
    // holds the same address (`a_list_of_numpy_arrays_and_an_lru_cache_of_tensors_name_their_container`
    // named "a Python object (+48)" once in a full test run; which came first had
    // depended on the arenas' layout).
    lists.clear();
    if let Some(t) = roots.python_types.as_ref() {
        for &arena in roots.python_arenas {
            super::pymalloc::live_runs(mem, arena, |start, len, block_size| {
                if block_size != super::pymalloc::LIST_BLOCK {
                    return;
                }
                let mut find = |from: u64, n: u64| {
                    super::pymalloc::lists_in(mem, start, from, n, t, lists, |at, items| keeper.keep(items, at, FROM_ROOT, &mut marks, true, PYTHON_INTERIOR))
                };
                match roots.python_changed {
                    None => find(start, len),
                    Some(changed) => for_each_within(changed, start, len, &mut find),
                }
            });
        }
        lists.sort_unstable();
    }
    let lists = &lists[..];
    let trace = |m: &mut Marks, keeps_cuda: bool| {
        while let Some(i) = m.work.pop() {
            if !blocks[i].is_opaque() {
                let b = &blocks[i];
                read_block_prefix(mem, b, super::pymalloc::list_part(b.start, b.size(), lists), roots.mapped_written, &mut |at, w| {
                    keeper.keep(w, at, i as u32, m, keeps_cuda, u64::MAX)
                });
            }
        }
    };
    // Python objects (at most 512 bytes each) in pymalloc's arenas: a word pointing deep
    // inside a block is taken for stale data, not a reference (see `PYTHON_INTERIOR`).
    for &arena in roots.python_arenas {
        super::pymalloc::live_runs(mem, arena, |start, len, block_size| {
            let mut read = |from: u64, n: u64| {
                let known = super::pymalloc::Known { types: roots.python_types.as_ref(), lists };
                super::pymalloc::object_parts(mem, start, block_size, from, n, known, |a, l| mark_within(a, l, &mut marks, true, PYTHON_INTERIOR));
            };
            match roots.python_changed {
                None => read(start, len),
                Some(changed) => for_each_within(changed, start, len, &mut read),
            }
            // An address kept as a Python int is in 30-bit digits, no word of which is
            // the address: read the int's value instead. Every such int is in the
            // 32-byte size class; in a forked child, only those on changed pages.
            let Some(ints) = roots.python_ints else { return };
            if block_size != super::pymalloc::INT_BLOCK {
                return;
            }
            let mut read_ints = |from: u64, n: u64| {
                let first = start + (from - start).next_multiple_of(block_size);
                let mut b = first;
                while b + block_size <= from + n {
                    let (mut w, mut k) = ([0u64; 4], 0);
                    mem.words(b, block_size, &mut |_, v| {
                        if k < 4 {
                            w[k] = v;
                            k += 1;
                        }
                    });
                    if let Some(v) = (k == 4).then(|| super::pymalloc::int_value(w, ints)).flatten() {
                        // Its block's start only: an int is a number as often as an
                        // address (a timestamp, the `id` of a dead object), and one
                        // that happens to fall inside a leaked block must not keep it.
                        keeper.keep(v, b, FROM_ROOT, &mut marks, true, 1);
                    }
                    b += block_size;
                }
            };
            match roots.python_changed {
                None => read_ints(start, len),
                Some(changed) => for_each_within(changed, start, len, &mut read_ints),
            }
        });
    }
    // The program's globals, stacks and TLS after the Python objects: a block that both
    // hold directly is held by the object (its path names the module variable, the
    // list, the dict entry), not by whatever interpreter static keeps a copy of its
    // address (a cache slot, a free list's stale word); which of the two came first
    // had depended on the heap's layout.
    for &(start, len) in roots.program {
        mark_root(start, len, &mut marks, true);
    }
    trace(&mut marks, true);
    // The changed parts of inherited blocks (the parent's, or those from before an
    // attach) last: what the program's own roots hold is named by them, not by a stale
    // word in a block from before (a free chunk of glibc's that read as in use).
    // Both lists are sorted, so one pass.
    let changed = roots.changed_since_fork;
    let mut w = 0;
    for (start, size) in roots.inherited.iter() {
        let end = start.saturating_add(size);
        while w < changed.len() && changed[w].0.saturating_add(changed[w].1) <= start {
            w += 1;
        }
        for &(c, len) in changed[w..].iter().take_while(|c| c.0 < end) {
            let (from, to) = (c.max(start), c.saturating_add(len).min(end));
            if from < to {
                mark_from(from, to - from, &mut marks, true);
            }
        }
    }
    trace(&mut marks, true);
    for &(start, len) in roots.runtime {
        mark_root(start, len, &mut marks, false);
    }
    trace(&mut marks, false);
    let Marks { reached, work, .. } = marks;
    // Every block a leaked block points to (other than itself) is an indirect leak.
    for (i, b) in blocks.iter().enumerate() {
        if reached[i] || b.is_opaque() {
            continue;
        }
        read_block(mem, b, roots.mapped_written, &mut |_, w| {
            if let Some(j) = index.find(w) {
                if j != i && !reached[j] && w != blocks[j].not_a_reference() {
                    indirect[j] = true;
                }
            }
        });
    }
    for i in 0..blocks.len() {
        verdicts[i] = if reached[i] {
            Verdict::Reachable
        } else if indirect[i] {
            Verdict::Indirect
        } else {
            Verdict::Definite
        };
    }
    // Each indirect block belongs to the first definite block (by address) that leads
    // to it. `reached` marks what is owned from here on.
    for d in 0..blocks.len() {
        if verdicts[d] != Verdict::Definite || blocks[d].is_opaque() {
            continue;
        }
        work.push(d);
        while let Some(i) = work.pop() {
            if blocks[i].is_opaque() {
                continue;
            }
            read_block(mem, &blocks[i], roots.mapped_written, &mut |_, w| {
                if let Some(j) = index.find(w) {
                    if verdicts[j] == Verdict::Indirect && !reached[j] && w != blocks[j].not_a_reference() {
                        reached[j] = true;
                        owners[j] = d as u32;
                        work.push(j);
                    }
                }
            });
        }
    }
}

/// Classifies every block given the program's and the CUDA libraries' root ranges.
pub fn classify(blocks: &[Block], roots: &[(u64, u64)], runtime_roots: &[(u64, u64)], mem: &impl Memory) -> Vec<Verdict> {
    classify_with_owners(blocks, roots, runtime_roots, mem).0
}

/// `classify`, with the owner of each indirect block (`Scratch::owners`).
pub fn classify_with_owners(blocks: &[Block], roots: &[(u64, u64)], runtime_roots: &[(u64, u64)], mem: &impl Memory) -> (Vec<Verdict>, Vec<u32>) {
    let mut s = Scratch::new(blocks);
    classify_into(blocks, &Roots { program: roots, runtime: runtime_roots, ..Default::default() }, mem, &mut s);
    (s.verdicts, s.owners)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Sparse fake memory: address -> word.
    struct Fake(BTreeMap<u64, u64>);

    impl Memory for Fake {
        fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
            let first = (start + 7) & !7;
            for (a, w) in self.0.range(first..start + len) {
                visit(*a, *w);
            }
            true
        }
    }

    fn blocks() -> Vec<Block> {
        (0..8).map(|i| Block::new(0x1000 + i * 0x100, 0x40)).collect()
    }

    /// Plain blocks at `(start, size)`.
    fn blocks_at(spans: &[(u64, u64)]) -> Vec<Block> {
        spans.iter().map(|&(start, size)| Block::new(start, size)).collect()
    }

    /// A pymalloc pool header at `pool` (size class 1, 32-byte objects): `count` as its
    /// count word, `objects` blocks handed out before its next offset.
    fn pool_header(m: &mut BTreeMap<u64, u64>, pool: u64, count: u64, objects: u64) {
        for (i, w) in [count, 0, 0, 0, 1 << 32, 48 + objects * 32].into_iter().enumerate() {
            m.insert(pool + 8 * i as u64, w);
        }
    }

    #[test]
    fn roots_lists_interior_pointers_cycles_and_orphans() {
        let b = blocks();
        let mut m = BTreeMap::new();
        // Root (a global at 0x10) -> block 0; block 0 -> block 1 (a list).
        m.insert(0x10, 0x1000);
        m.insert(0x1008, 0x1100);
        // A root pointing into the middle of block 2.
        m.insert(0x18, 0x1220);
        // Blocks 3 <-> 4: a leaked cycle: both indirect.
        m.insert(0x1300, 0x1400);
        m.insert(0x1400, 0x1300);
        // Block 5 (leaked) -> block 6: 5 definite, 6 indirect.
        m.insert(0x1508, 0x1600);
        // Block 7 points only to itself: definite.
        m.insert(0x1700, 0x1700);
        // Noise: a word that is just past block 1's end, and a small integer.
        m.insert(0x20, 0x1140);
        m.insert(0x28, 42);
        let (v, owners) = classify_with_owners(&b, &[(0x10, 0x20)], &[], &Fake(m));
        use Verdict::*;
        assert_eq!(v, vec![Reachable, Reachable, Reachable, Indirect, Indirect, Definite, Indirect, Definite]);
        // Block 6 hangs from leaked block 5; the cycle 3 <-> 4 hangs from no definite leak.
        let n = NO_OWNER;
        assert_eq!(owners, vec![n, n, n, n, n, n, 5, n]);
    }

    #[test]
    fn a_chain_of_indirect_blocks_belongs_to_the_definite_block_at_its_head() {
        let b = blocks();
        let mut m = BTreeMap::new();
        // 0 (definite) -> 1 -> 2 -> 3; 4 (definite) -> 3 as well: 3 stays 0's.
        m.insert(0x1000, 0x1100);
        m.insert(0x1100, 0x1200);
        m.insert(0x1200, 0x1300);
        m.insert(0x1400, 0x1300);
        let (v, owners) = classify_with_owners(&b[..5], &[], &[], &Fake(m));
        use Verdict::*;
        assert_eq!(v, vec![Definite, Indirect, Indirect, Indirect, Definite]);
        assert_eq!(owners, vec![NO_OWNER, 0, 0, 0, NO_OWNER]);
    }

    #[test]
    fn the_next_chunks_header_in_a_blocks_last_bytes_keeps_nothing() {
        // 2008 bytes fill a 2016-byte chunk: the next header is at start + 2000.
        assert_eq!(glibc_next_chunk_header(0x10010, 2008), 0x10010 + 2000);
        // 2000 bytes leave the header outside the block.
        assert_eq!(glibc_next_chunk_header(0x10010, 2000), 0);
        assert_eq!(glibc_next_chunk_header(0x10010, 0), 0);
        let b = vec![Block::new(0x10010, 2008).in_glibc_chunk()];
        let mut m = BTreeMap::new();
        // A root holding the next chunk's header address (glibc's top pointer, say).
        m.insert(0x10, 0x10010 + 2000);
        assert_eq!(classify(&b, &[(0x10, 8)], &[], &Fake(m.clone())), vec![Verdict::Definite]);
        // Any other interior pointer still keeps it.
        m.insert(0x18, 0x10010 + 1999);
        assert_eq!(classify(&b, &[(0x10, 16)], &[], &Fake(m)), vec![Verdict::Reachable]);
    }

    #[test]
    fn opaque_blocks_are_reached_but_never_read() {
        // Block 0 is device memory whose bytes happen to look like a pointer to block 1:
        // they are not host memory and must not keep block 1.
        let mut b = blocks();
        b.truncate(3);
        b[0] = b[0].opaque();
        let mut m = BTreeMap::new();
        m.insert(0x10, 0x1000);
        m.insert(0x1000, 0x1100);
        // Block 2 (leaked, host) points to block 0: it makes it indirect.
        m.insert(0x1200, 0x1000);
        use Verdict::*;
        assert_eq!(classify(&b, &[(0x10, 8)], &[], &Fake(m.clone())), vec![Reachable, Definite, Definite]);
        assert_eq!(classify(&b, &[], &[], &Fake(m)), vec![Indirect, Definite, Definite]);
    }

    #[test]
    fn a_mapping_of_the_programs_keeps_what_its_written_pages_point_to() {
        // Block 0 is a mapping the program made (a custom allocator's heap): its written
        // part [0x1000, 0x1010) holds block 1's address, its unwritten rest a word that
        // looks like block 2's (read, it would keep block 2).
        let mut b = blocks();
        b.truncate(4);
        b[0] = b[0].mapping();
        let mut m = BTreeMap::new();
        m.insert(0x10, 0x1020);
        m.insert(0x1008, 0x1100);
        m.insert(0x1030, 0x1200);
        let written = [(0x1000, 0x10)];
        let run = |b: &[Block], roots: &[(u64, u64)], written: &[(u64, u64)]| {
            let mut s = Scratch::new(b);
            let r = Roots { program: roots, mapped_written: written, ..Default::default() };
            classify_into(b, &r, &Fake(m.clone()), &mut s);
            s.verdicts
        };
        use Verdict::*;
        // A global points into the mapping: what its written page holds is reachable.
        assert_eq!(run(&b, &[(0x10, 8)], &written), vec![Reachable, Reachable, Definite, Definite]);
        // Nothing points to the mapping: it is lost, and what it holds with it.
        assert_eq!(run(&b, &[], &written), vec![Definite, Indirect, Definite, Definite]);
        // Written whole, its last word keeps block 2 as well.
        assert_eq!(run(&b, &[(0x10, 8)], &[(0x1000, 0x40)]), vec![Reachable, Reachable, Reachable, Definite]);
        // As opaque (device memory) it keeps nothing.
        b[0] = Block::new(0x1000, 0x40).opaque();
        assert_eq!(run(&b, &[(0x10, 8)], &[(0x1000, 0x40)]), vec![Reachable, Definite, Definite, Definite]);
    }

    #[test]
    fn the_cuda_libraries_own_tables_keep_host_blocks_but_no_device_memory() {
        // Blocks: 0 device memory, 1 a host block of the driver's, 2 pinned host memory.
        let mut b = blocks();
        b.truncate(3);
        b[0] = b[0].cuda().opaque();
        b[2] = b[2].cuda();
        let mut m = BTreeMap::new();
        // The driver's global table (a runtime root) lists every allocation and its own
        // host block, which lists them again.
        m.insert(0x40, 0x1000);
        m.insert(0x48, 0x1100);
        m.insert(0x50, 0x1200);
        m.insert(0x1100, 0x1000);
        m.insert(0x1108, 0x1200);
        use Verdict::*;
        assert_eq!(classify(&b, &[], &[(0x40, 0x18)], &Fake(m.clone())), vec![Definite, Reachable, Definite]);
        // The program holds the device pointer in a global: reachable.
        m.insert(0x10, 0x1000);
        assert_eq!(classify(&b, &[(0x10, 8)], &[(0x40, 0x18)], &Fake(m)), vec![Reachable, Reachable, Definite]);
    }

    #[test]
    fn the_page_directory_finds_what_a_search_of_every_block_finds() {
        // Small, page-straddling, zero-sized and large blocks, with gaps, from a fixed
        // pseudo-random sequence.
        let mut rng = crate::test_rng::TestRng::new(0x2545_f491_4f6c_dd1d);
        let mut next = move || rng.next_u64();
        let mut blocks = Vec::new();
        let mut at = 0x5555_0000_0000u64;
        for _ in 0..5000 {
            at += (next() % 3) * 16 + 16;
            let size = match next() % 50 {
                0 => 0,
                1 => 64 << 10,
                2 => (64 << 10) + 16 + next() % (1 << 20),
                3 => 4096 * (1 + next() % 5),
                _ => 16 * (1 + next() % 40),
            };
            blocks.push(Block::new(at, size));
            at += size.max(1);
        }
        let idx = BlockIndex::new(&blocks);
        let naive = |w: u64| blocks.iter().position(|b| w >= b.start && w < b.start + b.size().max(1));
        let (lo, hi) = (blocks[0].start - 64, at + 64);
        for _ in 0..200_000 {
            let w = lo + next() % (hi - lo);
            assert_eq!(idx.find(w), naive(w), "{w:#x}");
        }
        for (i, b) in blocks.iter().enumerate() {
            assert_eq!(idx.find(b.start), Some(i));
            assert_eq!(idx.find(b.start + b.size().max(1) - 1), Some(i));
        }
    }

    #[test]
    fn zero_sized_blocks_and_empty_inputs() {
        let b = vec![Block::new(0x100, 0), Block::new(0x200, 8)];
        let mut m = BTreeMap::new();
        m.insert(0x8, 0x100);
        assert_eq!(classify(&b, &[(0, 0x10)], &[], &Fake(m)), vec![Verdict::Reachable, Verdict::Definite]);
        assert!(classify(&[], &[(0, 0x10)], &[], &Fake(BTreeMap::new())).is_empty());
        let idx = BlockIndex::new(&b);
        assert_eq!(idx.find(0x100), Some(0));
        assert_eq!(idx.find(0x101), None);
        assert_eq!(idx.find(0x207), Some(1));
        assert_eq!(idx.find(0x208), None);
        assert_eq!(idx.find(u64::MAX), None);
    }

    #[test]
    fn inherited_blocks_are_read_only_where_changed_since_fork() {
        // Inherited blocks at 0x1000 (on a changed page) and 0x2000 (on a page still
        // shared with the parent); blocks 0, 1 and 2 allocated by the child.
        let b: Vec<Block> = [0x5000, 0x5100, 0x5200].iter().map(|&start| Block::new(start, 0x40)).collect();
        let inherited: crate::spans::Spans = [(0x1000, 0x100), (0x2000, 0x100)].into_iter().collect();
        let mut m = BTreeMap::new();
        // The inherited block on a changed page points to block 0: reachable through
        // it, though nothing reaches the inherited block (the parent's, assumed so).
        m.insert(0x1010, 0x5000);
        // The one on a shared page is never read: what it seems to hold here
        // (impossible in a real child) keeps nothing.
        m.insert(0x2010, 0x5100);
        // Block 2 points to block 0: nothing reaches 2.
        m.insert(0x5200, 0x5000);
        let mut s = Scratch::new(&b);
        let changed = [(0x1000, 0x1000)];
        classify_into(&b, &Roots { inherited: &inherited, changed_since_fork: &changed, ..Default::default() }, &Fake(m), &mut s);
        use Verdict::*;
        assert_eq!(s.verdicts, vec![Reachable, Definite, Definite]);
    }

    #[test]
    fn a_python_object_keeps_a_block_by_its_start_not_by_a_word_deep_inside_it() {
        let b = blocks_at(&[(0x20_0000, 0x8000), (0x30_0000, 0x8000), (0x40_0000, 0x100)]);
        // One pymalloc pool at the start of a 256 KiB arena: three live 32-byte objects.
        let base = 0x10_0000u64;
        let mut m = BTreeMap::new();
        pool_header(&mut m, base, 1, 3);
        m.insert(base + 48, 0x20_0000 + 0x10); // near the start: a reference
        m.insert(base + 80, 0x30_0000 + 0x5000); // 20 KiB inside: stale data
        m.insert(base + 112, 0x40_0000 + 0x80); // inside a small block: a reference
        let arenas = [(base, 256 << 10)];
        let mut s = Scratch::new(&b);
        classify_into(&b, &Roots { python_arenas: &arenas, ..Default::default() }, &Fake(m.clone()), &mut s);
        use Verdict::*;
        assert_eq!(s.verdicts, vec![Reachable, Definite, Reachable]);
        // The same word in a global is a reference, as LeakSanitizer has it.
        m.insert(0x9000, 0x30_0000 + 0x5000);
        let mut s = Scratch::new(&b);
        let globals = [(0x9000, 8)];
        classify_into(&b, &Roots { program: &globals, python_arenas: &arenas, ..Default::default() }, &Fake(m), &mut s);
        assert_eq!(s.verdicts, vec![Reachable, Reachable, Reachable]);
    }

    /// An address kept as a Python int (ctypes' `c_void_p` result in a list, PyTorch's
    /// weak storage reference) keeps its block: the int's value is read from its 30-bit
    /// digits, in both layouts; a negative int, another 32-byte object whose words spell
    /// the same digits, an int that points inside a block, or ints with the layout
    /// unknown keep nothing.
    #[test]
    fn an_address_kept_as_a_python_int_keeps_its_block() {
        let b = blocks_at(&[(0x55d2_3a4b_9c60, 0x60), (0x55d2_3a4c_0000, 0x60), (0x55d2_3a4d_0000, 0x60)]);
        let long_type = 0x7f00_0000_1000u64;
        let digits = |a: u64| (a & 0x3fff_ffff) | (a >> 30) << 32;
        for tagged in [false, true] {
            let size_word = |n: u64, negative: bool| {
                if tagged {
                    n << 3 | if negative { 2 } else { 0 }
                } else if negative {
                    (-(n as i64)) as u64
                } else {
                    n
                }
            };
            let base = 0x10_0000u64;
            let mut m = BTreeMap::new();
            // A pool of 32-byte blocks (szidx 1) with three live objects.
            pool_header(&mut m, base, 3, 3);
            let int_at = |m: &mut BTreeMap<u64, u64>, at: u64, ty: u64, size: u64, value: u64| {
                for (k, w) in [1, ty, size, digits(value)].into_iter().enumerate() {
                    m.insert(at + 8 * k as u64, w);
                }
            };
            int_at(&mut m, base + 48, long_type, size_word(2, false), b[0].start);
            int_at(&mut m, base + 80, long_type, size_word(2, true), b[1].start);
            int_at(&mut m, base + 112, long_type + 64, size_word(2, false), b[2].start);
            // An int 16 bytes into block 2 (a number, as far as anyone knows).
            pool_header(&mut m, base, 4, 4);
            int_at(&mut m, base + 144, long_type, size_word(2, false), b[2].start + 16);
            let arenas = [(base, 256 << 10)];
            let verdicts = |ints: Option<super::super::pymalloc::IntLayout>| {
                let mut s = Scratch::new(&b);
                let roots = Roots { python_arenas: &arenas, python_ints: ints, ..Default::default() };
                classify_into(&b, &roots, &Fake(m.clone()), &mut s);
                s.verdicts
            };
            use Verdict::*;
            let layout = super::super::pymalloc::IntLayout { type_addr: long_type, tagged };
            assert_eq!(verdicts(Some(layout)), vec![Reachable, Definite, Definite], "tagged {tagged}");
            assert_eq!(verdicts(None), vec![Definite, Definite, Definite]);
        }
    }

    /// In a forked child only the arena pages changed since the fork are read: an
    /// object elsewhere holds what the parent wrote, no address of the child's blocks.
    #[test]
    fn a_forked_childs_python_objects_count_only_on_pages_changed_since_the_fork() {
        let b = blocks_at(&[(0x20_0000, 0x100), (0x40_0000, 0x100)]);
        // Two pools of a 256 KiB arena, each with one live 32-byte object.
        let base = 0x10_0000u64;
        let mut m = BTreeMap::new();
        for pool in [base, base + 0x1000] {
            pool_header(&mut m, pool, 1, 1);
        }
        m.insert(base + 48, 0x20_0000);
        m.insert(base + 0x1000 + 48, 0x40_0000);
        let arenas = [(base, 256 << 10)];
        let classify = |changed: Option<&[(u64, u64)]>| {
            let mut s = Scratch::new(&b);
            let roots = Roots { python_arenas: &arenas, python_changed: changed, ..Default::default() };
            classify_into(&b, &roots, &Fake(m.clone()), &mut s);
            s.verdicts
        };
        use Verdict::*;
        assert_eq!(classify(None), vec![Reachable, Reachable]);
        assert_eq!(classify(Some(&[(base + 0x1000, 0x1000)])), vec![Definite, Reachable]);
        assert_eq!(classify(Some(&[(base + 40, 16), (base + 0x3000, 0x1000)])), vec![Reachable, Definite]);
        assert_eq!(classify(Some(&[])), vec![Definite, Definite]);
    }

    /// A block that a Python object and a global both point to is held by the object:
    /// its path names the module variable behind it, not the interpreter static that
    /// keeps a copy of the address (the first path had depended on the heap's layout).
    #[test]
    fn a_block_that_a_python_object_and_a_global_hold_is_held_by_the_object() {
        let b = blocks_at(&[(0x20_0000, 0x100), (0x40_0000, 0x100)]);
        // A pool with one live 32-byte object holding block 0; block 0 holds block 1.
        let base = 0x10_0000u64;
        let mut m = BTreeMap::new();
        pool_header(&mut m, base, 1, 1);
        m.insert(base + 48, 0x20_0000);
        m.insert(0x20_0000 + 8, 0x40_0000);
        // A global holding block 0 too, and one holding block 1.
        m.insert(0x9000, 0x20_0000);
        m.insert(0x9008, 0x40_0000);
        let arenas = [(base, 256 << 10)];
        let globals = [(0x9000, 16)];
        let mut s = Scratch::new(&b);
        classify_into(&b, &Roots { program: &globals, python_arenas: &arenas, ..Default::default() }, &Fake(m), &mut s);
        assert_eq!(s.verdicts, vec![Verdict::Reachable, Verdict::Reachable]);
        // Block 0 from the object's word; block 1 from the global (a root comes before
        // a path through a block).
        assert_eq!((s.parent[0], s.via[0]), (FROM_ROOT, base + 48));
        assert_eq!((s.parent[1], s.via[1]), (FROM_ROOT, 0x9008));
    }

    /// A heap block that is a live list's item array is held by the list, though a
    /// block earlier in the arenas holds its address too (a stale word of a raw block):
    /// its path names the list whatever the layout.
    #[test]
    fn a_lists_item_array_is_held_by_the_list_not_by_a_stale_word_before_it() {
        use super::super::pymalloc::{ObjectTypes, LIST_ITEMS_WORD};
        let b = blocks_at(&[(0x20_0000, 0x100), (0x30_0000, 0x40)]);
        let t = ObjectTypes { list: 0x7f00_0000_3000, ..Default::default() };
        let base = 0x10_0000u64;
        let mut m = BTreeMap::new();
        // A pool of 64-byte blocks (szidx 3) with two blocks handed out: a raw block
        // whose word at +48 holds the item array's address, then the list.
        for (i, w) in [2, 0, 0, 0, 3 << 32, 48 + 2 * 64].into_iter().enumerate() {
            m.insert(base + 8 * i as u64, w);
        }
        let (raw, list) = (base + 48, base + 112);
        m.insert(raw + 48, 0x20_0000);
        for (i, w) in [0, 0, 1, t.list, 1, 0x20_0000, 4].into_iter().enumerate() {
            m.insert(list + 8 * i as u64, w);
        }
        m.insert(0x20_0000, 0x30_0000);
        let arenas = [(base, 256 << 10)];
        let roots = Roots { python_arenas: &arenas, python_types: Some(t), ..Default::default() };
        let mut s = Scratch::new(&b);
        s.reserve_lists(8);
        classify_into(&b, &roots, &Fake(m), &mut s);
        assert_eq!(s.verdicts, vec![Verdict::Reachable, Verdict::Reachable]);
        assert_eq!((s.parent[0], s.via[0]), (FROM_ROOT, list + LIST_ITEMS_WORD));
        assert_eq!((s.parent[1], s.via[1]), (0, 0x20_0000));
    }

    /// A list's slots past its length keep what they held before a `pop`: they keep
    /// nothing, whether its item array is a heap block or a block in the arenas; with no
    /// room reserved for the lists, their arrays are read whole as before.
    #[test]
    fn a_lists_slots_past_its_length_keep_nothing() {
        use super::super::pymalloc::ObjectTypes;
        let b = blocks_at(&[(0x20_0000, 0x100), (0x30_0000, 0x40), (0x40_0000, 0x40), (0x50_0000, 0x40), (0x60_0000, 0x40)]);
        let t = ObjectTypes { list: 0x7f00_0000_3000, ..Default::default() };
        let base = 0x10_0000u64;
        let mut m = BTreeMap::new();
        // Two pools of 64-byte blocks (szidx 3): two lists, then one raw item array.
        let pool = |m: &mut BTreeMap<u64, u64>, at: u64, objects: u64| {
            for (i, w) in [objects, 0, 0, 0, 3 << 32, 48 + objects * 64].into_iter().enumerate() {
                m.insert(at + 8 * i as u64, w);
            }
        };
        pool(&mut m, base, 2);
        pool(&mut m, base + 4096, 1);
        let mut put = |at: u64, words: &[u64]| {
            for (i, w) in words.iter().enumerate() {
                m.insert(at + 8 * i as u64, *w);
            }
        };
        // A list of 1 in a heap array of 4 (block 0), a list of 1 in an arena array of 3.
        put(base + 48, &[0, 0, 1, t.list, 1, 0x20_0000, 4]);
        put(base + 112, &[0, 0, 1, t.list, 1, base + 4096 + 48, 3]);
        put(0x20_0000, &[0x30_0000, 0x60_0000]);
        put(base + 4096 + 48, &[0x40_0000, 0x50_0000]);
        let arenas = [(base, 256 << 10)];
        let roots = Roots { python_arenas: &arenas, python_types: Some(t), ..Default::default() };
        let mem = Fake(m);
        use Verdict::*;
        let mut s = Scratch::new(&b);
        s.reserve_lists(8);
        classify_into(&b, &roots, &mem, &mut s);
        assert_eq!(s.verdicts, vec![Reachable, Reachable, Reachable, Definite, Definite]);
        let mut s = Scratch::new(&b);
        classify_into(&b, &roots, &mem, &mut s);
        assert_eq!(s.verdicts, vec![Reachable; 5]);
    }
}
