//! The live objects in pymalloc's arenas (`interpose::pymalloc`), as root ranges.
//!
//! An arena is cut into pools (4 KiB in 256 KiB arenas before Python 3.10, 16 KiB in
//! 1 MiB arenas since); each pool in use starts with a header (`struct pool_header`,
//! the same from 3.9 to 3.13) and holds blocks of one size class. The blocks between the
//! header and `nextoffset` have been handed out; the free ones among them are on the
//! pool's `freeblock` list. Only the others are read: a freed object still holds the
//! addresses it held when alive, and would keep a block that leaked since "reachable".
use super::mark::Memory;

/// `sizeof(struct pool_header)` rounded to the 16-byte alignment.
pub const POOL_OVERHEAD: u64 = 48;
/// pymalloc's alignment and size-class step on 64-bit (3.8+).
const ALIGNMENT: u64 = 16;
const MAX_POOL: u64 = 16 << 10;
const BITMAP_WORDS: usize = (MAX_POOL / ALIGNMENT / 64) as usize;

/// The pool size of an arena of `arena_size` bytes.
pub fn pool_size(arena_size: u64) -> u64 {
    if arena_size >= 1 << 20 {
        16 << 10
    } else {
        4 << 10
    }
}

fn word(mem: &impl Memory, addr: u64) -> Option<u64> {
    let mut v = None;
    mem.words(addr, 8, &mut |_, w| v = Some(w));
    v
}

/// Where CPython keeps an int's value (`PyLongObject`), for reading the addresses a
/// program keeps as Python ints (`scan::mark`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntLayout {
    /// `&PyLong_Type`.
    pub type_addr: u64,
    /// 3.12 and later: the third word is `lv_tag` (sign in bits 0–1, digit count from
    /// bit 3); before, `ob_size` (the digit count, negative for a negative int).
    pub tagged: bool,
}

/// The size class of an int of one or two 30-bit digits (24 bytes of header and
/// `ob_size`/`lv_tag`, then the digits): every address a program can hold fits in two.
pub const INT_BLOCK: u64 = 32;

/// The value of the object whose first four words are `w` when it is a live,
/// non-negative int of one or two digits, as an address is; `None` for anything else.
/// The reference count must be one a live object has: pymalloc also hands out raw
/// buffers (`PyMem_Malloc`), and one that holds a copy of an int's words after some
/// other pointer (seen in a pytest run: `[&…, &PyLong_Type, 2, digits]`) is no int.
pub fn int_value(w: [u64; 4], l: IntLayout) -> Option<u64> {
    if w[1] != l.type_addr || w[0] == 0 || w[0] >= 1 << 32 {
        return None;
    }
    let digits = if l.tagged {
        if w[2] & 3 != 0 {
            // Zero or negative.
            return None;
        }
        w[2] >> 3
    } else {
        w[2]
    };
    let (d0, d1) = (w[3] & 0x3fff_ffff, (w[3] >> 32) & 0x3fff_ffff);
    match digits {
        1 => Some(d0),
        2 => Some(d0 | d1 << 30),
        _ => None,
    }
}

/// The interpreter's built-in types whose objects the scan reads only where they can
/// hold a reference (`object_parts`), by the address of each type object; 0 for one not
/// found. Known for CPython 3.8 to 3.13.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectTypes {
    /// Objects with a GC header (two words), then the reference count and the type.
    pub tuple: u64,
    pub list: u64,
    /// Objects without one: the reference count, then the type.
    pub float: u64,
    pub int: u64,
    pub bytes: u64,
    pub str: u64,
    /// Where a compact str's characters start, which no pointer follows: after
    /// `PyASCIIObject` for an ASCII one (48 bytes before 3.12, with `wstr`; 40 from
    /// 3.12), after `PyCompactUnicodeObject` for another (72; 56), whose `utf8` (and
    /// `wstr`) buffers are the pointers it may hold.
    pub str_ascii_header: u64,
    pub str_compact_header: u64,
    /// Code objects (3.11+; no GC header): what they hold comes before their bytecode,
    /// `co_code_adaptive`, which starts `code_adaptive` bytes in (184 in 3.11, 192 in
    /// 3.12, 200 in 3.13; 0: unknown, read whole). The bytecode's inline caches keep
    /// borrowed addresses (a method's descriptor, a type) that may be stale: in a pytest
    /// run one kept a leaked `c_void_p` block "reachable" (2 runs in 107).
    pub code: u64,
    pub code_adaptive: u64,
}

/// `PyASCIIObject.state`'s `compact` and `ascii` bits (3.8 to 3.13).
pub const STR_COMPACT: u64 = 1 << 5;
pub const STR_ASCII: u64 = 1 << 6;

/// Where a tuple's items start in its block: the GC header, the reference count, the
/// type and the length.
const TUPLE_ITEMS: u64 = 40;
/// A list's words: the GC header, the reference count, the type, the length, the items
/// pointer and the capacity.
const LIST_BYTES: u64 = 56;
/// Where a list's items pointer is in its block (after the GC header, the reference
/// count, the type and the length).
pub const LIST_ITEMS_WORD: u64 = 40;
/// The size class of a list object (its 56 bytes rounded up to the alignment).
pub const LIST_BLOCK: u64 = 64;

/// What the scan knows of the objects in the arenas: the built-in types (`None`: every
/// block is read whole) and the lists' item arrays (`lists_in`, sorted).
#[derive(Clone, Copy, Default)]
pub struct Known<'a> {
    pub types: Option<&'a ObjectTypes>,
    pub lists: &'a [(u64, u64)],
}

/// What of one block `object_parts` reads.
#[derive(Debug, PartialEq, Eq)]
enum Extent {
    Whole,
    Nothing,
    /// The first `n` bytes.
    Prefix(u64),
    /// A tuple's GC header and its `n` items.
    Tuple(u64),
}

/// The part of a block whose first five words are `h` that can hold a reference. A live
/// object of a type listed in `t` holds none past its own end: the rest of its block is
/// whatever an earlier occupant left there (a 2-tuple fills 56 of its 64 bytes, a float
/// 24 of 32), and a float, an int or a bytes object holds none at all (an int's value is
/// read as an address apart, see `int_value`).
///
/// Live means a reference count of 1 to 2^32 - 1 (3.12's immortal objects have the
/// latter) where the type's objects keep it. Anything else is read whole: a block whose
/// object was freed and handed out again as a raw buffer (a list's items, a dict's
/// entries) keeps the old object's type and a count of 0 where its new owner has not
/// written — a first version that skipped "freed" objects lost a buffer's references to
/// a 582-byte str in `import torch` — and a raw array of object pointers may hold a
/// type's address where an object has its type, after a pointer where it has its count.
fn extent(h: &[u64; 5], block_size: u64, t: &ObjectTypes) -> Extent {
    let live = |count: u64| (1..1 << 32).contains(&count);
    let header_type = h[1];
    if header_type != 0 && live(h[0]) {
        if header_type == t.float || header_type == t.int || header_type == t.bytes {
            return Extent::Nothing;
        }
        if header_type == t.code && t.code_adaptive != 0 {
            return Extent::Prefix(t.code_adaptive.min(block_size));
        }
        if header_type == t.str {
            // A legacy (not compact) str keeps its characters elsewhere: read whole.
            let state = h[4] & 0xff;
            let header = if state & STR_COMPACT == 0 {
                block_size
            } else if state & STR_ASCII != 0 {
                t.str_ascii_header
            } else {
                t.str_compact_header
            };
            return Extent::Prefix(header.min(block_size));
        }
    }
    let gc_type = h[3];
    if gc_type == 0 || !live(h[2]) {
        return Extent::Whole;
    }
    if gc_type == t.tuple {
        let items = h[4];
        if items <= block_size.saturating_sub(TUPLE_ITEMS) / 8 {
            return Extent::Tuple(items);
        }
    } else if gc_type == t.list && block_size >= LIST_BYTES {
        return Extent::Prefix(LIST_BYTES);
    }
    Extent::Whole
}

/// Calls `visit(start, len)` for the parts of the blocks in `[from, from + len)` — of a
/// run of live `block_size` blocks that starts at `run` — that can hold a reference
/// (see `extent`): every block whole when the types are unknown. In `torchrun` workers
/// under load, the stale words after a 2-tuple's items and after a str's characters
/// kept leaked 8 KiB buffers "reachable" (1 to 3 of 20 in 6 runs of 16). A block only
/// partly in the range is read as it is.
///
/// `known.lists`: the item arrays of the live lists (`list_items`, sorted by address): a
/// block that is one is read up to the list's length only.
pub fn object_parts(mem: &impl Memory, run: u64, block_size: u64, from: u64, len: u64, known: Known, mut visit: impl FnMut(u64, u64)) {
    let Known { types, lists } = known;
    let Some(t) = types else {
        visit(from, len);
        return;
    };
    let end = from.saturating_add(len);
    let mut b = run + from.saturating_sub(run) / block_size * block_size;
    // Blocks come in address order: one search, then a cursor.
    let mut k = lists.partition_point(|e| e.0 < b);
    while b < end {
        let (lo, hi) = (b.max(from), (b + block_size).min(end));
        while k < lists.len() && lists[k].0 < b {
            k += 1;
        }
        if lo != b || hi != b + block_size {
            if lo < hi {
                visit(lo, hi - lo);
            }
        } else if let Some(&(_, used)) = lists.get(k).filter(|e| e.0 == b) {
            if used > 0 {
                visit(b, used.min(block_size));
            }
        } else if block_size < 32 {
            // No object of these types (but maybe a short list's items: the one slot
            // of a 16-byte block, then its slack, found above).
            visit(b, block_size);
        } else {
            let (mut h, mut n) = ([0u64; 5], 0);
            mem.words(b, 40.min(block_size), &mut |_, w| {
                if n < 5 {
                    h[n] = w;
                    n += 1;
                }
            });
            match if n >= 4 { extent(&h, block_size, t) } else { Extent::Whole } {
                Extent::Whole => visit(b, block_size),
                Extent::Nothing => {}
                Extent::Prefix(n) => visit(b, n),
                Extent::Tuple(items) => {
                    visit(b, 16);
                    if items > 0 {
                        visit(b + TUPLE_ITEMS, items * 8);
                    }
                }
            }
        }
        b += block_size;
    }
}

/// A live list's item array and the bytes of it in use (its length), for a block whose
/// first seven words are `h`: the GC header, the reference count, the type, the length,
/// the items pointer and the capacity. `None` for anything else.
///
/// A list's slots past its length keep what they held: `pop` and `del` only shorten
/// it, and a slot is written again only when the list grows back. Past its capacity,
/// the array's block has the size class's slack, which holds what the block's last
/// occupant left there: such a word after the one slot of `importlib.resources.__path__`
/// kept a leaked block "reachable" (through a 4.5 KiB block the stale address had come
/// to point into) 2 runs in 20.
pub fn list_items(h: &[u64; 7], t: &ObjectTypes) -> Option<(u64, u64)> {
    let [_, _, count, ty, len, items, allocated] = *h;
    let live = (1..1 << 32).contains(&count);
    (ty == t.list && live && items != 0 && len <= allocated && allocated < 1 << 40).then_some((items, len * 8))
}

/// The bytes of the block `[start, start + size)` that can hold a reference: a list's
/// item array (`lists`, sorted: see `lists_in`) up to the list's length, any other
/// block whole.
#[inline(always)]
pub fn list_part(start: u64, size: u64, lists: &[(u64, u64)]) -> u64 {
    match lists.binary_search_by_key(&start, |e| e.0) {
        Ok(k) => lists[k].1.min(size),
        Err(_) => size,
    }
}

/// Appends to `out`, while it has spare capacity (it never grows), the item array and
/// used bytes (`list_items`) of each live list among the `LIST_BLOCK` blocks in
/// `[from, from + len)` of a run that starts at `run`; `held(at, items)` for each one
/// appended, with the address of the list's word that holds its item array.
pub fn lists_in(mem: &impl Memory, run: u64, from: u64, len: u64, t: &ObjectTypes, out: &mut Vec<(u64, u64)>, mut held: impl FnMut(u64, u64)) {
    let mut b = run + from.saturating_sub(run).next_multiple_of(LIST_BLOCK);
    while b + LIST_BLOCK <= from.saturating_add(len) && out.len() < out.capacity() {
        let (mut h, mut k) = ([0u64; 7], 0);
        mem.words(b, 56, &mut |_, w| {
            if k < 7 {
                h[k] = w;
                k += 1;
            }
        });
        if let Some(e) = (k == 7).then(|| list_items(&h, t)).flatten() {
            out.push(e);
            held(b + LIST_ITEMS_WORD, e.0);
        }
        b += LIST_BLOCK;
    }
}

/// Calls `visit(start, len, block_size)` for each run of live blocks in the arena
/// `(start, size)`.
pub fn live_runs(mem: &impl Memory, arena: (u64, u64), mut visit: impl FnMut(u64, u64, u64)) {
    let (start, size) = arena;
    let pool = pool_size(size);
    let end = start.saturating_add(size);
    let mut p = start.next_multiple_of(pool);
    while p + pool <= end {
        pool_runs(mem, p, pool, &mut visit);
        p += pool;
    }
}

/// The block size of a pool whose header's fifth word (`arenaindex`, then `szidx` in its
/// high half) is `word`; `None` for a size class pymalloc does not have.
pub fn pool_block_size(word: u64) -> Option<u64> {
    let szidx = word >> 32;
    (szidx < 64).then_some((szidx + 1) * ALIGNMENT)
}

fn pool_runs(mem: &impl Memory, p: u64, pool: u64, visit: &mut impl FnMut(u64, u64, u64)) {
    let mut h = [0u64; 6];
    let mut n = 0;
    mem.words(p, POOL_OVERHEAD, &mut |_, w| {
        if n < 6 {
            h[n] = w;
            n += 1;
        }
    });
    if n < 6 {
        return;
    }
    let count = h[0] as u32;
    let freeblock = h[1];
    let nextoffset = h[5] as u32 as u64;
    let Some(bsize) = pool_block_size(h[4]) else { return };
    if count == 0 || nextoffset < POOL_OVERHEAD || nextoffset > pool {
        return;
    }
    let nblocks = ((nextoffset - POOL_OVERHEAD) / bsize) as usize;
    let first = p + POOL_OVERHEAD;
    let mut free = [0u64; BITMAP_WORDS];
    let mut f = freeblock;
    for _ in 0..nblocks {
        if f < first || f >= first + nblocks as u64 * bsize || !(f - first).is_multiple_of(bsize) {
            break;
        }
        let i = ((f - first) / bsize) as usize;
        if free[i / 64] & 1 << (i % 64) != 0 {
            break;
        }
        free[i / 64] |= 1 << (i % 64);
        match word(mem, f) {
            Some(next) => f = next,
            None => break,
        }
    }
    let mut run: Option<u64> = None;
    for i in 0..nblocks {
        let is_free = free[i / 64] & 1 << (i % 64) != 0;
        let b = first + i as u64 * bsize;
        match (run, is_free) {
            (None, false) => run = Some(b),
            (Some(s), true) => {
                visit(s, b - s, bsize);
                run = None;
            }
            _ => {}
        }
    }
    if let Some(s) = run {
        visit(s, first + nblocks as u64 * bsize - s, bsize);
    }
}

// ---- arenas mapped before the library was loaded (attach) ---------------------------

/// Whether the six header words `h` at a pool of `pool` bytes are those of a pool in use:
/// pymalloc sets `maxnextoffset` to the pool size less the block size when it starts a
/// pool, and `nextoffset` moves from the header by whole blocks up to one past it.
pub fn is_pool_header(h: &[u64; 6], pool: u64) -> bool {
    let Some(size) = pool_block_size(h[4]) else { return false };
    let (count, next, max_next) = (h[0] as u32, h[5] as u32 as u64, h[5] >> 32);
    count > 0 && max_next + size == pool && next >= POOL_OVERHEAD + size && next <= max_next + size && (next - POOL_OVERHEAD).is_multiple_of(size)
}

/// Words of one `struct arena_object` (3.8 to 3.13): `address`, `pool_address`,
/// `nfreepools` and `ntotalpools`, `freepools`, `nextarena`, `prevarena`.
const ARENA_OBJECT_WORDS: usize = 6;

/// The live arenas listed in `table`, the words of pymalloc's array of arena objects,
/// if it is that array: its entry `index` holds the arena of a pool found at `pool`.
/// An entry whose address is 0 has no arena; the others must look like one.
pub fn arenas_in_table(table: &[u64], pool: u64, index: usize, arena_size: u64) -> Option<Vec<(u64, u64)>> {
    let entry = |k: usize| table.get(k * ARENA_OBJECT_WORDS..(k + 1) * ARENA_OBJECT_WORDS);
    let plausible = |e: &[u64]| {
        let (address, pool_address, free, total) = (e[0], e[1], e[2] as u32 as u64, e[2] >> 32);
        address != 0
            && address.is_multiple_of(4096)
            && (address..=address + arena_size).contains(&pool_address)
            && free <= total
            && total <= arena_size / pool_size(arena_size)
    };
    let own = entry(index)?;
    if !plausible(own) || !(own[0]..own[0] + arena_size).contains(&pool) {
        return None;
    }
    let mut out = Vec::new();
    for k in 0..table.len() / ARENA_OBJECT_WORDS {
        let e = entry(k)?;
        if e[0] != 0 && plausible(e) {
            out.push((e[0], arena_size));
        }
    }
    Some(out)
}

/// The arenas pymalloc had mapped before this library was loaded (`leaktrace attach`):
/// a pool in use is found in the process's anonymous memory by its header, and the
/// array of arena objects among the heap's blocks `chunks` by that pool's arena index.
/// Empty when the interpreter's layout does not read as expected.
pub fn existing_arenas(chunks: &[(u64, u64)], arena_size: u64) -> Vec<(u64, u64)> {
    let pool = pool_size(arena_size);
    let maps = crate::os::anchor::read_proc_string("self/maps").unwrap_or_default();
    let ours = crate::os::own::ranges();
    let mut tried = 0;
    for (lo, hi) in super::glibc_heap::anonymous_regions(&maps) {
        let mut p = lo.next_multiple_of(pool);
        while p + pool <= hi {
            if ours.iter().any(|&(s, l)| p >= s && p < s + l) {
                p += pool;
                continue;
            }
            let mut h = [0u64; 6];
            if crate::os::copy_own(p, &mut h) == 48 && is_pool_header(&h, pool) {
                if let Some(found) = table_of(chunks, p, (h[4] as u32) as usize, arena_size) {
                    return found;
                }
                tried += 1;
                if tried >= 16 {
                    return Vec::new();
                }
            }
            p += pool;
        }
    }
    Vec::new()
}

/// The arenas listed by the heap block among `chunks` that is pymalloc's array of arena
/// objects for a pool at `pool` of arena `index`.
fn table_of(chunks: &[(u64, u64)], pool: u64, index: usize, arena_size: u64) -> Option<Vec<(u64, u64)>> {
    let at = (index * ARENA_OBJECT_WORDS * 8) as u64;
    for &(addr, size) in chunks.iter().filter(|&&(_, size)| size >= at + (ARENA_OBJECT_WORDS * 8) as u64) {
        let mut e = [0u64; 2];
        if crate::os::copy_own(addr + at, &mut e) != 16 || e[0] > pool || pool >= e[0] + arena_size {
            continue;
        }
        let mut table = vec![0u64; (size / 8).min(1 << 22) as usize];
        let n = crate::os::copy_own(addr, &mut table[..]);
        table.truncate(n / 8);
        if let Some(found) = arenas_in_table(&table, pool, index, arena_size) {
            return Some(found);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake address space: one buffer at `base`.
    struct Fake {
        base: u64,
        words: Vec<u64>,
    }

    impl Memory for Fake {
        fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
            let mut p = start;
            while p + 8 <= start + len {
                match p.checked_sub(self.base).map(|o| (o / 8) as usize).and_then(|i| self.words.get(i)) {
                    Some(&w) => visit(p, w),
                    None => return false,
                }
                p += 8;
            }
            true
        }
    }

    #[test]
    fn free_blocks_are_not_read() {
        // One 256 KiB arena, 4 KiB pools; pool 0 holds 32-byte blocks (szidx 1), five
        // handed out, the 2nd and 4th freed; pool 1 is empty (count 0).
        let base = 0x10_0000u64;
        let mut words = vec![0u64; (256 << 10) / 8];
        let first = base + 48;
        let block = |i: u64| first + i * 32;
        words[0] = 3; // count
        words[1] = block(3); // freeblock → 3 → 1 → null
        words[((block(3) - base) / 8) as usize] = block(1);
        words[((block(1) - base) / 8) as usize] = 0;
        words[4] = 1 << 32; // arenaindex 0, szidx 1
        words[5] = 48 + 5 * 32; // nextoffset
        let mem = Fake { base, words };
        let mut runs = Vec::new();
        live_runs(&mem, (base, 256 << 10), |s, l, b| runs.push((s, l, b)));
        assert_eq!(runs, vec![(block(0), 32, 32), (block(2), 32, 32), (block(4), 32, 32)]);
    }

    #[test]
    fn ints_of_one_or_two_digits_give_their_value_in_both_layouts() {
        let t = 0x7f00_0000_1000;
        let addr: u64 = 0x55d2_3a4b_9c60;
        let digits = (addr & 0x3fff_ffff) | (addr >> 30) << 32;
        let old = IntLayout { type_addr: t, tagged: false };
        let new = IntLayout { type_addr: t, tagged: true };
        // 3.9–3.11: ob_size; 3.12+: lv_tag = digits << 3 | sign.
        assert_eq!(int_value([1, t, 2, digits], old), Some(addr));
        assert_eq!(int_value([1, t, 2 << 3, digits], new), Some(addr));
        assert_eq!(int_value([1, t, 1, 12345], old), Some(12345));
        assert_eq!(int_value([1, t, 1 << 3, 12345], new), Some(12345));
        // Negative, zero, three digits, another type: not an address.
        assert_eq!(int_value([1, t, (-2i64) as u64, digits], old), None);
        assert_eq!(int_value([1, t, 2 << 3 | 2, digits], new), None);
        assert_eq!(int_value([1, t, 1, 0], new), None);
        assert_eq!(int_value([1, t, 3, digits], old), None);
        assert_eq!(int_value([1, t + 8, 2, digits], old), None);
        // Not a live object's reference count: a raw buffer, or a freed block.
        assert_eq!(int_value([0x7f9d_9544_6f00, t, 2, digits], old), None);
        assert_eq!(int_value([0, t, 2 << 3, digits], new), None);
    }

    #[test]
    fn live_builtin_objects_are_read_up_to_their_end_and_other_blocks_whole() {
        let types = ObjectTypes {
            tuple: 0x7f00_0000_2000,
            list: 0x7f00_0000_3000,
            float: 0x7f00_0000_4000,
            int: 0x7f00_0000_5000,
            bytes: 0x7f00_0000_6000,
            str: 0x7f00_0000_7000,
            str_ascii_header: 40,
            str_compact_header: 56,
            code: 0x7f00_0000_8000,
            code_adaptive: 184,
        };
        let base = 0x30_0000u64;
        // 64-byte blocks: a live 2-tuple with a stale word after its items, a block
        // whose tuple was freed (read whole: it may be a raw buffer now), another object,
        // a live list (stale word at its end), a float, a str (its characters, then a
        // stale word), a freed bytes object's block.
        let t = &types;
        let blocks: [[u64; 8]; 7] = [
            [0, 0, 1, t.tuple, 2, 0xa1, 0xa2, 0x5a1e],
            [0, 0, 0, t.tuple, 2, 0xb1, 0xb2, 0xb3],
            [0xc0, 0xc1, 0xc2, 0xc3, 0xc4, 0xc5, 0xc6, 0xc7],
            [0, 0, 1, t.list, 3, 0xd1, 8, 0x5a1e],
            [2, t.float, 0x4009_21fb_5444_2d18, 0x5a1e, 0x5a1e, 0x5a1e, 0x5a1e, 0x5a1e],
            [1, t.str, 3, 0x1234, 0xe4, 0x0063_6261, 0x5a1e, 0x5a1e],
            [0, t.bytes, 0xe4, 0xf0, 0xf1, 0xf2, 0xf3, 0xf4],
        ];
        let mem = Fake { base, words: blocks.concat() };
        let read = |from: u64, len: u64, types: Option<&ObjectTypes>| {
            let mut got = Vec::new();
            object_parts(&mem, base, 64, from, len, Known { types, lists: &[] }, |s, l| {
                mem.words(s, l, &mut |_, w| got.push(w));
            });
            got
        };
        let all = read(base, 7 * 64, Some(t));
        assert_eq!(all.iter().filter(|&&w| w == 0x5a1e).count(), 0, "{all:x?}");
        for w in [0xa1, 0xa2, 0xb1, 0xb3, 0xc7, 0xd1, 0xe4, 0xf1, 0xf4] {
            assert!(all.contains(&w), "{w:x}: {all:x?}");
        }
        // Without the types every word is read; a block only partly in the range is
        // read as it is.
        assert_eq!(read(base, 7 * 64, None).len(), 56);
        assert_eq!(read(base + 48, 96, Some(t)), vec![0xa2, 0x5a1e, 0, 0, 0, t.tuple, 2, 0xb1, 0xb2, 0xb3, 0xc0, 0xc1]);
        // A raw array of object pointers that holds a type's address where an object
        // has its type is read whole.
        let mem = Fake { base, words: vec![0x7f00_1234_5678, t.float, 0x7f00_1234_9999, t.tuple, 0x55aa_0000_0010, 1, 2, 3] };
        let mut n = 0;
        object_parts(&mem, base, 64, base, 64, Known { types: Some(t), lists: &[] }, |s, l| {
            mem.words(s, l, &mut |_, _| n += 1);
        });
        assert_eq!(n, 8);
        // A length that does not fit its block is no tuple's: read whole.
        let mem = Fake { base, words: vec![0, 0, 1, t.tuple, 9, 1, 2, 3] };
        let mut n = 0;
        object_parts(&mem, base, 64, base, 64, Known { types: Some(t), lists: &[] }, |s, l| {
            mem.words(s, l, &mut |_, _| n += 1);
        });
        assert_eq!(n, 8);
    }

    #[test]
    fn a_looping_free_list_ends() {
        let base = 0x20_0000u64;
        let mut words = vec![0u64; (16 << 10) / 8];
        let first = base + 48;
        words[0] = 1;
        words[1] = first + 16;
        words[((first + 16 - base) / 8) as usize] = first + 16; // points to itself
        words[4] = 0; // szidx 0: 16-byte blocks
        words[5] = 48 + 3 * 16;
        let mem = Fake { base, words };
        let mut runs = Vec::new();
        pool_runs(&mem, base, 16 << 10, &mut |s, l, b| runs.push((s, l, b)));
        assert_eq!(runs, vec![(first, 16, 16), (first + 32, 16, 16)]);
        assert_eq!(pool_size(1 << 20), 16 << 10);
        assert_eq!(pool_size(256 << 10), 4 << 10);
    }

    /// A live code object is read up to its bytecode (whose inline caches keep borrowed,
    /// maybe stale, addresses); a list found by `lists_in` has its item array read up to
    /// its length, and only while there is room to note it.
    #[test]
    fn a_code_objects_bytecode_and_a_lists_spare_slots_are_not_read() {
        let t = ObjectTypes { list: 0x7f00_0000_3000, code: 0x7f00_0000_8000, code_adaptive: 24, ..Default::default() };
        let base = 0x40_0000u64;
        let blocks: [[u64; 8]; 4] = [
            [0, 0, 1, t.list, 2, base + 128, 4, 0],
            [1, t.code, 0xc0de, 0x5a1e, 0x5a1e, 0x5a1e, 0x5a1e, 0x5a1e],
            [0xa1, 0xa2, 0x5a1e, 0x5a1e, 0, 0, 0, 0],
            // A full list: its array read up to its length too.
            [0, 0, 1, t.list, 4, 0x77_0000, 4, 0],
        ];
        let mem = Fake { base, words: blocks.concat() };
        let mut lists = Vec::with_capacity(4);
        let mut held = Vec::new();
        lists_in(&mem, base, base, 4 * 64, &t, &mut lists, |at, items| held.push((at, items)));
        assert_eq!(lists, vec![(base + 128, 16), (0x77_0000, 32)]);
        assert_eq!(held, vec![(base + LIST_ITEMS_WORD, base + 128), (base + 3 * 64 + LIST_ITEMS_WORD, 0x77_0000)]);
        let mut got = Vec::new();
        object_parts(&mem, base, 64, base, 4 * 64, Known { types: Some(&t), lists: &lists }, |s, l| {
            mem.words(s, l, &mut |_, w| got.push(w));
        });
        assert!(!got.contains(&0x5a1e), "{got:x?}");
        for w in [base + 128, 0xc0de, 0xa1, 0xa2, 0x77_0000] {
            assert!(got.contains(&w), "{w:x}: {got:x?}");
        }
        // A list of one in a 16-byte block: its slot, not the slack after it.
        let mem16 = Fake { base, words: vec![0xa1, 0x5a1e, 0xb1, 0xb2] };
        let mut got = Vec::new();
        object_parts(&mem16, base, 16, base, 32, Known { types: Some(&t), lists: &[(base, 8)] }, |s, l| {
            mem16.words(s, l, &mut |_, w| got.push(w));
        });
        assert_eq!(got, vec![0xa1, 0xb1, 0xb2]);
        // No room: nothing noted, the array read whole.
        let mut none = Vec::new();
        lists_in(&mem, base, base, 4 * 64, &t, &mut none, |_, _| panic!("no list was noted"));
        assert!(none.is_empty());
    }

    #[test]
    fn a_pool_in_use_is_told_by_its_header() {
        let pool = 16 << 10;
        // A pool of 64-byte blocks (szidx 3), 5 handed out: nextoffset 48 + 5 * 64.
        let h = [5, 0, 0, 0, 7 | 3 << 32, (48 + 5 * 64) | (pool - 64) << 32];
        assert!(is_pool_header(&h, pool));
        let mut wrong = h;
        wrong[5] = (48 + 5 * 64) | (pool - 48) << 32;
        assert!(!is_pool_header(&wrong, pool));
        let mut empty = h;
        empty[0] = 0;
        assert!(!is_pool_header(&empty, pool));
        let mut between = h;
        between[5] = (48 + 5 * 64 + 8) | (pool - 64) << 32;
        assert!(!is_pool_header(&between, pool));
        assert!(!is_pool_header(&[0; 6], pool));
    }

    #[test]
    fn the_array_of_arena_objects_lists_the_live_arenas() {
        let mb = 1u64 << 20;
        let arena = |a: u64| [a, a + 0x4000, 3 | 63 << 32, 0, 0, 0];
        // Entry 0 and 2 live, 1 unassociated (address 0).
        let table: Vec<u64> = [arena(0x7f00_0010_0000), [0; 6], arena(0x7f00_0030_0000)].concat();
        let found = arenas_in_table(&table, 0x7f00_0030_8000, 2, mb).unwrap();
        assert_eq!(found, vec![(0x7f00_0010_0000, mb), (0x7f00_0030_0000, mb)]);
        // The pool is not in the entry its header names: not this array.
        assert_eq!(arenas_in_table(&table, 0x7f00_0030_8000, 0, mb), None);
        assert_eq!(arenas_in_table(&table, 0x7f00_0030_8000, 1, mb), None);
        assert_eq!(arenas_in_table(&table, 0x7f00_0030_8000, 9, mb), None);
    }
}
