//! Who refers to a Python object: the pointer scan treats the interpreter's objects as
//! roots (it does not trace through them), so a path to a block that a Python object
//! holds ends at that object. To name the list, the dict entry and the module variable
//! behind it, the report looks for the live words that hold an object's address, a
//! round at a time for every path at once: one pass over the live objects of
//! pymalloc's arenas and the live tracked heap blocks per round (a heap block found
//! holding no address, a tensor's storage, is read by a search's first round only).
//!
//! Everything is read through copies (`process_vm_readv`, one per arena or per run of
//! neighbouring blocks, and the lists' fields and item arrays up to 1,024 to a call)
//! after the threads were let go: a block freed meanwhile reads as whatever the copy
//! found, and only live objects and blocks are ever read, so no freed block is named a
//! holder; a list freed meanwhile is read no further than fields a list can have and
//! memory that copies whole allow. Not under a seccomp filter (no copies there).
use std::collections::HashMap;

use super::mark::Memory;

/// Where a word holding a target was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A live object (or raw pymalloc block: a small dict's keys, a short list's items)
    /// in pymalloc's arenas, by its start and size class.
    Object { start: u64, size: u64 },
    /// A tracked heap block, by its index in the blocks given.
    Block(usize),
    /// A chunk of a thread's frame stack (3.11+: the frames of running functions, with
    /// their local variables), by its start and size.
    Frame { start: u64, size: u64 },
    /// The item array of a live list (at `items`): one that is not among the blocks
    /// given (reallocated since they were listed: a growing list moves its array at
    /// every ~12% of growth; or made after), or a block given that the list's word
    /// points to now. `list` is the list object.
    ListItems { items: u64, list: u64 },
}

/// One word holding a target: its address, the holder, and, when the word before it
/// points to a `str` (a dict entry's key before its value), that key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub at: u64,
    pub holder: Holder,
    pub key: Option<String>,
}

/// The largest copy made at a time.
const SPAN: u64 = 1 << 20;

/// A copy of `[base, base + 8 * words.len())`, read as memory.
struct Copied<'b> {
    base: u64,
    words: &'b [u64],
}

impl Memory for Copied<'_> {
    fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        let from = start.max(self.base).next_multiple_of(8);
        let end = start.saturating_add(len).min(self.base + 8 * self.words.len() as u64);
        let mut p = from;
        while p + 8 <= end {
            visit(p, self.words[((p - self.base) / 8) as usize]);
            p += 8;
        }
        from < end
    }
}

/// Calls `visit(copy, run, len, block_size)` for each run of live blocks in `arenas`,
/// each arena copied into `buf` in pieces of at most `SPAN` (whole pools: an arena's
/// pools are 16 KiB at most).
fn live_runs_of(arenas: &[(u64, u64)], buf: &mut [u64], mut visit: impl FnMut(&Copied, u64, u64, u64)) {
    for &(start, size) in arenas {
        let mut at = start;
        while at < start + size {
            let n = (start + size - at).min(SPAN);
            let words = copy(at, &mut buf[..(n / 8) as usize]);
            let mem = Copied { base: at, words };
            super::pymalloc::live_runs(&mem, (at, words.len() as u64 * 8), |run, len, block| visit(&mem, run, len, block));
            at += n;
        }
    }
}

/// A list's item array and the list object (`(items, list)`).
type ListAt = (u64, u64);

/// The live lists in `arenas`: their item arrays and used bytes (sorted, as
/// `pymalloc::Known` has them), and each list object with its item array
/// (`(items, list)`), as the copies found them.
fn live_lists(arenas: &[(u64, u64)], buf: &mut [u64], types: Option<&super::pymalloc::ObjectTypes>) -> (Vec<(u64, u64)>, Vec<ListAt>) {
    let (mut lists, mut list_objects) = (Vec::new(), Vec::new());
    if types.is_some() {
        live_runs_of(arenas, buf, |mem, run, len, block| lists_of_run(mem, run, len, block, types, &mut lists, &mut list_objects));
        lists.sort_unstable();
    }
    (lists, list_objects)
}

/// Adds the live lists of a run of `block`-sized blocks (`live_runs_of`) to `lists`
/// (item arrays and used bytes, unsorted) and `list_objects`; none without the types.
fn lists_of_run(
    mem: &Copied,
    run: u64,
    len: u64,
    block: u64,
    types: Option<&super::pymalloc::ObjectTypes>,
    lists: &mut Vec<(u64, u64)>,
    list_objects: &mut Vec<ListAt>,
) {
    if let Some(t) = types.filter(|_| block == super::pymalloc::LIST_BLOCK) {
        lists.reserve((len / block) as usize);
        super::pymalloc::lists_in(mem, run, run, len, t, lists, |at, items| list_objects.push((items, at - LIST_ITEM_FIELD)));
    }
}

/// Every live list in `arenas` (pymalloc's, sorted), as `(item array, list object)`,
/// the array's address read from the list now.
pub fn lists_now(arenas: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut buf = vec![0u64; (SPAN / 8) as usize];
    let types = super::arenas::object_types();
    let (_, list_objects) = live_lists(arenas, &mut buf, types.as_ref());
    list_objects.into_iter().filter_map(|(_, list)| list_fields(list).map(|(_, items)| (items, list))).collect()
}

/// How many times a list's items are read when its array moves while they are.
const LIST_READS: usize = 3;

/// A live list's length and item array, read now (`None` where the list cannot be read,
/// has no array, or has fields no list has: a length past its capacity or a capacity of
/// 2^40 items, as `pymalloc::list_items` rules when the pass finds the list). A list
/// freed and its memory reused since the pass found it may read as any words: a length
/// of ~10^12 items once had its "array" read a MiB at a time for longer than the
/// program's exit waits for the search (10 s; a 12 s script took 22 s).
fn list_fields(list: u64) -> Option<(u64, u64)> {
    let mut h = [0u64; 3];
    if super::roots::read_own_memory(list + LIST_LEN_FIELD, &mut h) != 24 {
        return None;
    }
    fields_from(h)
}

/// `list_fields` from the three words read at `LIST_LEN_FIELD`: the length, the item
/// array and the capacity.
fn fields_from([len, items, allocated]: [u64; 3]) -> Option<(u64, u64)> {
    (items != 0 && len <= allocated && allocated < 1 << 40).then_some((len, items))
}

/// `list_fields` of each of `lists`, read together (`os::copy_own_ranges`) through
/// `scratch` (three words a list).
fn fields_of(lists: impl Iterator<Item = u64>, scratch: &mut Vec<u64>) -> Vec<Option<(u64, u64)>> {
    let ranges: Vec<(u64, usize)> = lists.map(|l| (l + LIST_LEN_FIELD, 3)).collect();
    scratch.resize(3 * ranges.len(), 0);
    let got = super::roots::read_own_ranges(&ranges, scratch);
    got.iter().enumerate().map(|(k, &n)| (n == 3).then(|| fields_from([scratch[3 * k], scratch[3 * k + 1], scratch[3 * k + 2]])).flatten()).collect()
}

/// A list read alone: from its array now, up to `tries` times while the array moves
/// under the read (`read_list_items`); the array read to its end, if one was.
fn read_list_alone(list: u64, tries: usize, buf: &mut [u64], hit: &mut impl FnMut(u64, u64, u64, u64), target_of: &impl Fn(u64) -> Option<u64>) -> Option<u64> {
    for _ in 0..tries {
        let (len, items) = list_fields(list).filter(|&(len, _)| len > 0)?;
        if read_list_items(list, items, len, buf, &mut |t, at| hit(t, at, items, list), target_of) {
            return Some(items);
        }
    }
    None
}

/// Lists whose fields, or arrays, are read in one system call.
const LIST_BATCH: usize = 1024;

/// Every list of `list_objects` (`(items, list)`) read as `read_list_alone` reads one,
/// `hit(target, at, items, list)` in the lists' order, but the fields and the item
/// arrays of many lists copied in one system call each (`os::copy_own_ranges`): with
/// torch loaded a round read ~10k lists at three calls each (36 ms). A list's array is
/// copied from where its fields said, and the fields are read again after: where the
/// array moved meanwhile, the list is read alone (its other tries). A list longer than
/// one copy is read alone. Returns the arrays read to their end.
fn read_lists(list_objects: &[ListAt], buf: &mut [u64], hit: &mut impl FnMut(u64, u64, u64, u64), target_of: &impl Fn(u64) -> Option<u64>) -> Vec<u64> {
    let mut read = Vec::new();
    let (mut before, mut after) = (Vec::new(), Vec::new());
    // For the lists read alone while `buf` holds a batch's arrays: made when first needed.
    let mut alone_buf: Vec<u64> = Vec::new();
    for chunk in list_objects.chunks(LIST_BATCH) {
        let fields = fields_of(chunk.iter().map(|l| l.1), &mut before);
        let mut k = 0;
        while k < chunk.len() {
            // The next lists, in order, whose arrays fit `buf` together.
            let mut batch: Vec<(u64, u64, u64)> = Vec::new();
            let mut words = 0;
            while k < chunk.len() {
                match fields[k].filter(|&(len, _)| len > 0) {
                    None => k += 1,
                    Some((len, _)) if len * 8 > SPAN || words + len as usize > buf.len() => break,
                    Some((len, items)) => {
                        batch.push((chunk[k].1, len, items));
                        words += len as usize;
                        k += 1;
                    }
                }
            }
            if !batch.is_empty() {
                let ranges: Vec<(u64, usize)> = batch.iter().map(|&(_, len, items)| (items, len as usize)).collect();
                let got = super::roots::read_own_ranges(&ranges, buf);
                let now = fields_of(batch.iter().map(|b| b.0), &mut after);
                let mut off = 0;
                for (j, &(list, len, items)) in batch.iter().enumerate() {
                    // As `read_list_items` takes its one piece: no hits where the array
                    // moved; those that came where it did not copy whole; then the list's
                    // other tries alone.
                    let moved = now[j].is_none_or(|(_, now)| now != items);
                    if !moved {
                        for (w, &word) in buf[off..off + got[j]].iter().enumerate() {
                            if let Some(t) = target_of(word).filter(|&t| t == word) {
                                hit(t, items + 8 * w as u64, items, list);
                            }
                        }
                    }
                    if moved || got[j] < len as usize {
                        alone_buf.resize((SPAN / 8) as usize, 0);
                        read.extend(read_list_alone(list, LIST_READS - 1, &mut alone_buf, hit, target_of));
                    } else {
                        read.push(items);
                    }
                    off += len as usize;
                }
            } else if k < chunk.len() {
                // A list longer than one copy.
                read.extend(read_list_alone(chunk[k].1, LIST_READS, buf, hit, target_of));
                k += 1;
            }
        }
    }
    read
}

/// Whether a word found in an arena object (`find`'s pass over the arenas) lies in a
/// live list's item array past the list's length (`lists`: arrays and used bytes,
/// sorted), where a pass that knew the lists would not have read (`pymalloc::Known`).
/// Such an array's first word is an item's address, never a live object's count, so the
/// pass that did not know it read at least the part in use (`pymalloc::extent`).
fn past_list_lengths(h: &(u64, u64, Holder, u64, bool), lists: &[(u64, u64)]) -> bool {
    let Holder::Object { start, size } = h.2 else { return false };
    match lists.binary_search_by_key(&start, |e| e.0) {
        Ok(k) => h.1 >= start + lists[k].1.min(size),
        Err(_) => false,
    }
}

/// Which 64-byte granules of the address space a target's words may point into, as a
/// filter of 2^16 bits: a word whose granule's bit is clear holds no target, dismissed
/// with one load where a search among the targets took ~7 steps (most words of the heap
/// are addresses, and the targets span it).
struct Granules {
    bits: Vec<u64>,
}

impl Granules {
    const BITS: u32 = 16;

    fn slot(w: u64) -> usize {
        ((w >> 6).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - Self::BITS)) as usize
    }

    /// The filter of `targets` (`(start, reach)`).
    fn of(targets: &[(u64, u64)]) -> Granules {
        let mut bits = vec![0u64; (1 << Self::BITS) / 64];
        for &(t, reach) in targets {
            let (first, last) = (t >> 6, t.saturating_add(reach) >> 6);
            if last - first >= 1 << Self::BITS {
                // Reaches more granules than there are bits: every word may.
                bits.fill(u64::MAX);
                break;
            }
            for g in first..=last {
                let s = Self::slot(g << 6);
                bits[s / 64] |= 1 << (s % 64);
            }
        }
        Granules { bits }
    }

    /// False: `w` points into no target's reach.
    #[inline(always)]
    fn may_hold(&self, w: u64) -> bool {
        let s = Self::slot(w);
        self.bits[s / 64] >> (s % 64) & 1 != 0
    }
}

/// The place of a key in a sorted slice, for keys that mostly come in ascending order:
/// it moves on from the last key's place, and searches afresh for a key below it.
#[derive(Default)]
struct Cursor {
    at: usize,
    last: u64,
}

impl Cursor {
    /// The index of an entry whose key (`key_of`) is `key`, as a binary search finds one.
    #[inline(always)]
    fn find<T>(&mut self, sorted: &[T], key: u64, key_of: impl Fn(&T) -> u64) -> Option<usize> {
        if key < self.last {
            self.at = sorted.partition_point(|e| key_of(e) < key);
        } else {
            while self.at < sorted.len() && key_of(&sorted[self.at]) < key {
                self.at += 1;
            }
        }
        self.last = key;
        (self.at < sorted.len() && key_of(&sorted[self.at]) == key).then_some(self.at)
    }
}

/// Reads the `len` items of `list`'s array at `items` in pieces of `SPAN`, `hit(target,
/// word)` for each word that is a target's start (`target_of`); false where the list's
/// array moved before all were read, or a piece did not copy whole (a live list's array
/// is mapped to its end: it was freed meanwhile), and the rest is not read (the hits
/// already made stand: they were the list's items when read).
fn read_list_items(list: u64, items: u64, len: u64, buf: &mut [u64], hit: &mut impl FnMut(u64, u64), target_of: &impl Fn(u64) -> Option<u64>) -> bool {
    let mut at = items;
    let end = items.saturating_add(len.saturating_mul(8));
    while at < end {
        let n = (end - at).min(SPAN);
        let words = copy(at, &mut buf[..(n / 8) as usize]);
        if list_fields(list).is_none_or(|(_, now)| now != items) {
            return false;
        }
        for (k, &w) in words.iter().enumerate() {
            if let Some(t) = target_of(w).filter(|&t| t == w) {
                hit(t, at + 8 * k as u64);
            }
        }
        if (words.len() as u64) < n / 8 {
            return false;
        }
        at += n;
    }
    true
}

/// Copies `[start, start + 8 * buf.len())` into `buf`; the words that came.
fn copy(start: u64, buf: &mut [u64]) -> &[u64] {
    let got = super::roots::read_own_memory(start, buf) / 8;
    &buf[..got]
}

/// For each of `targets` (`(start, reach)`: an object's start, and how many bytes into
/// it a word may point and still be taken for a reference: 0 for a typed object, a few
/// words for a raw block whose owner keeps a pointer past a small prefix, as 3.11+
/// keeps an instance's attribute values), up to `MAX_HOLDERS` live words that hold it,
/// best first: a dict entry's value (its key names it) or a module, then a live object
/// of a type, then a heap block (a long list's items), then a raw block of the arenas;
/// a function's globals, a frame or a cell last (every function of a module holds the
/// module's dict). `blocks`: the live tracked heap blocks `(start, size)`, sorted.
/// `chunks`: the chunks of the threads' frame stacks (`arenas::live_frame_chunks`).
///
/// `pointer_free`: a flag per block of `blocks`. A flagged block is not read; a block
/// read whole that holds no word within the span of the arenas and blocks (where every
/// target lies) is flagged. A search passes the same flags to each of its rounds, so
/// the rounds after its first skip what holds no address: a tensor's storage, whose
/// float words never look like one (a loop beside a 2 GB embedding table read 2.3 GB a
/// round, 1.8–2.5 s). A block that comes to hold an address later in the search is
/// missed by its later rounds; the next search reads it again.
pub fn find(
    targets: &[(u64, u64)],
    arenas: &[(u64, u64)],
    chunks: &[(u64, u64)],
    blocks: &[(u64, u64)],
    minor: u8,
    pointer_free: &mut [bool],
) -> HashMap<u64, Vec<Found>> {
    let mut found: HashMap<u64, Vec<Found>> = HashMap::new();
    if targets.is_empty() {
        return found;
    }
    debug_assert_eq!(pointer_free.len(), blocks.len());
    let span = address_span(arenas, blocks);
    let mut sorted = targets.to_vec();
    sorted.sort_unstable();
    sorted.dedup_by_key(|t| t.0);
    let (lo, hi) = (sorted[0].0, sorted.iter().map(|t| t.0 + t.1).max().unwrap_or(0) + 1);
    let near = Granules::of(&sorted);
    let target_of = |w: u64| -> Option<u64> {
        if w < lo || w >= hi || !near.may_hold(w) {
            return None;
        }
        let k = sorted.partition_point(|&(t, _)| t <= w);
        let (t, reach) = sorted[k.checked_sub(1)?];
        (w - t <= reach).then_some(t)
    };
    let mut buf = vec![0u64; (SPAN / 8) as usize];
    // (target, word address, holder, previous word, whether it points at the start)
    let mut hits: Vec<(u64, u64, Holder, u64, bool)> = Vec::new();
    let mut per_target: HashMap<u64, usize> = HashMap::new();
    let mut hit = |h: (u64, u64, Holder, u64, bool)| {
        let n = per_target.entry(h.0).or_default();
        *n += 1;
        if *n <= MAX_CANDIDATES {
            hits.push(h);
        }
    };
    // Objects are read only where they can hold a reference, as the scan reads them
    // (`pymalloc::object_parts`): the lists' item arrays up to their lengths. A stale
    // word past a list's length had named the wrong holder. One pass over the arenas
    // finds the lists and the words of the objects that hold a target; the words in a
    // list's item array past its length are dropped after it (`past_list_lengths`), as a
    // pass that knew the lists first would not have read them (two passes copied the
    // arenas twice a round: 110 MB each with torch loaded).
    let types = super::arenas::object_types();
    let (mut lists, mut list_objects) = (Vec::new(), Vec::new());
    let mut object_hits: Vec<(u64, u64, Holder, u64, bool)> = Vec::new();
    let mut object_hits_per_target: HashMap<u64, usize> = HashMap::new();
    live_runs_of(arenas, &mut buf, |mem, run, len, block| {
        lists_of_run(mem, run, len, block, types.as_ref(), &mut lists, &mut list_objects);
        let known = super::pymalloc::Known { types: types.as_ref(), lists: &[] };
        super::pymalloc::object_parts(mem, run, block, run, len, known, |from, part| {
            let mut prev = 0;
            mem.words(from, part, &mut |a, w| {
                if let Some(t) = target_of(w) {
                    let start = run + (a - run) / block * block;
                    let before = if a > start && w == t { prev } else { 0 };
                    // Never an object's own words; past what `hit` keeps, with room for
                    // those that fall past a list's length.
                    let n = object_hits_per_target.entry(t).or_default();
                    if !(start..start + block).contains(&t) && *n < 2 * MAX_CANDIDATES {
                        *n += 1;
                        object_hits.push((t, a, Holder::Object { start, size: block }, before, w == t));
                    }
                }
                prev = w;
            });
        });
    });
    lists.sort_unstable();
    // Every live list's item array, read from its list now, before the passes over the
    // blocks, which take a second with torch loaded: a list that grows moves its array
    // at every ~12% of growth, and an array read where the blocks had it when they were
    // listed was gone by then (a closure appending to a list in a loop: its holder named
    // in 1 run of 3; the ints it appends "held by" pymalloc's arena table in 4 runs of
    // 12). The array's address is read again after it was copied: where it moved
    // meanwhile, the list is read again from its new array.
    let mut read_arrays = read_lists(&list_objects, &mut buf, &mut |t, at, items, list| hit((t, at, Holder::ListItems { items, list }, 0, true)), &target_of);
    read_arrays.sort_unstable();
    for h in object_hits {
        if !past_list_lengths(&h, &lists) {
            hit(h);
        }
    }
    // The running functions' frames: a local variable holds an object by its start.
    for &(start, size) in chunks {
        let n = size.min(SPAN);
        let words = copy(start, &mut buf[..(n / 8) as usize]);
        for (k, &w) in words.iter().enumerate() {
            if let Some(t) = target_of(w).filter(|&t| t == w) {
                hit((t, start + 8 * k as u64, Holder::Frame { start, size }, 0, true));
            }
        }
    }
    // A block that is a live list's item array (one its list's pass did not read) holds
    // for that list: the path goes on from the list itself, not from whatever refers to
    // the array a round later, when a growing list may have moved it (the ints a
    // closure appends: "host block (37.3 MiB) from list_resize" ended the path in 2
    // runs of 12 beside two busy loops).
    let mut array_of: Vec<ListAt> = list_objects;
    array_of.sort_unstable();
    // The blocks come in address order: each of the three sorted lists is looked up by
    // a cursor that moves on with them.
    let (mut read_cursor, mut array_cursor, mut list_cursor) = (Cursor::default(), Cursor::default(), Cursor::default());
    let mut i = 0;
    // Per block of the run being read: whether it was read, and held an address.
    let (mut read, mut addresses) = (Vec::new(), Vec::new());
    while i < blocks.len() {
        if pointer_free[i] {
            i += 1;
            continue;
        }
        // A run of neighbouring blocks, copied at once (a flagged one ends it).
        let first = i;
        let start = blocks[i].0;
        let mut end = blocks[i].0 + blocks[i].1;
        while i + 1 < blocks.len() && !pointer_free[i + 1] && blocks[i + 1].0 + blocks[i + 1].1 <= start + SPAN && blocks[i + 1].0 < end + 4096 {
            i += 1;
            end = end.max(blocks[i].0 + blocks[i].1);
        }
        i += 1;
        read.clear();
        read.resize(i - first, false);
        addresses.clear();
        addresses.resize(i - first, false);
        let mut whole = true;
        // In pieces of `SPAN` where one block is larger (a list of more than 131,072
        // items: its later items were never read, and the holder of an object there
        // not found).
        let mut at = start & !7;
        while at < end {
            let len = (end - at).min(SPAN);
            let words = copy(at, &mut buf[..len.div_ceil(8) as usize]);
            whole &= words.len() as u64 == len.div_ceil(8);
            let mem = Copied { base: at, words };
            for (k, &(b, size)) in blocks.iter().enumerate().take(i).skip(first) {
                if read_cursor.find(&read_arrays, b, |&a| a).is_some() {
                    continue;
                }
                let holder = match array_cursor.find(&array_of, b, |l| l.0) {
                    Some(x) => Holder::ListItems { items: b, list: array_of[x].1 },
                    None => Holder::Block(k),
                };
                let part = list_cursor.find(&lists, b, |e| e.0).map_or(size, |x| lists[x].1.min(size));
                let mut prev = 0;
                let mut held_address = false;
                read[k - first] |= mem.words(b, part, &mut |a, w| {
                    held_address |= span.contains(&w);
                    if let Some(t) = target_of(w) {
                        if !(b..b + size).contains(&t) {
                            hit((t, a, holder.clone(), if a > b && w == t { prev } else { 0 }, w == t));
                        }
                    }
                    prev = w;
                });
                addresses[k - first] |= held_address;
            }
            at += len;
        }
        if whole {
            for k in first..i {
                pointer_free[k] = read[k - first] && !addresses[k - first];
            }
        }
    }
    let mut ranked: HashMap<u64, Vec<(u8, Found)>> = HashMap::new();
    for (target, at, holder, before, exact) in hits {
        // A word into a target (not at its start) counts only where 3.11+ keeps one: in
        // an object's pre-header, the pointer to its attribute values.
        if !exact {
            let in_pre_header = match holder {
                Holder::Object { start, size } => object_in_block(start, size).is_some_and(|(o, _)| at < o),
                Holder::Block(_) | Holder::Frame { .. } | Holder::ListItems { .. } => false,
            };
            if !in_pre_header {
                continue;
            }
        }
        let key = (before != 0).then(|| py_str(before, minor)).flatten();
        let rank = match (&key, &holder) {
            (Some(_), _) | (None, Holder::Frame { .. }) => 0,
            (None, Holder::Block(_)) => 2,
            (None, Holder::ListItems { .. }) => 1,
            (None, Holder::Object { start, size }) => match object_in_block(*start, *size).map(|(_, t)| t) {
                Some(t) if t == "module" => 0,
                Some(t) if matches!(t.as_str(), "function" | "frame" | "cell" | "method" | "code" | "builtin_function_or_method") => 5,
                Some(_) => 1,
                // A raw block: a short list's items or a small dict's entries, but also
                // a dead frame kept for reuse (3.10's zombie frames, count 0), whose
                // slots hold what its last call left.
                None => 3,
            },
        };
        // A pointer into an object is a weaker sign than one to its start.
        ranked.entry(target).or_default().push((2 * rank + !exact as u8, Found { at, holder, key }));
    }
    for (t, mut v) in ranked {
        v.sort_by_key(|(r, f)| (*r, f.at));
        v.truncate(MAX_HOLDERS);
        found.insert(t, v.into_iter().map(|(_, f)| f).collect());
    }
    found
}

/// Where every target of a search lies: from the lowest arena or block to the end of
/// the highest.
fn address_span(arenas: &[(u64, u64)], blocks: &[(u64, u64)]) -> std::ops::Range<u64> {
    let all = || arenas.iter().chain(blocks);
    let lo = all().map(|r| r.0).min().unwrap_or(0);
    let hi = all().map(|r| r.0 + r.1).max().unwrap_or(0);
    lo..hi
}

/// Holders returned per target.
pub const MAX_HOLDERS: usize = 4;

/// Where a list object keeps its length (`ob_size`) and its item array (`ob_item`).
const LIST_LEN_FIELD: u64 = 16;
pub const LIST_ITEM_FIELD: u64 = 24;

/// How far into a target a word may point and still be taken for a reference to it.
pub const INTERIOR: u64 = 64;

/// Holders looked at per target at most (the first ones met).
const MAX_CANDIDATES: usize = 256;

/// The words of a Python object's header: `[refcount, type]`, copied.
fn header(addr: u64) -> Option<[u64; 2]> {
    let mut h = [0u64; 2];
    (super::roots::read_own_memory(addr, &mut h) == 16).then_some(h)
}

/// The name of a type object (`tp_name`).
pub fn type_name(type_addr: u64) -> Option<String> {
    let mut p = [0u64; 1];
    if type_addr == 0 || super::roots::read_own_memory(type_addr + 24, &mut p) != 8 || p[0] == 0 {
        return None;
    }
    c_string(p[0])
}

/// The type name of the object at `addr`.
pub fn object_type(addr: u64) -> Option<String> {
    let [count, ty] = header(addr)?;
    (1..1 << 32).contains(&count).then(|| type_name(ty)).flatten()
}

/// The Python object in a pymalloc block that starts at `block`: at its start (no GC
/// header), after a GC header (two words: lists, dicts, tuples, instances), or after a
/// GC header and the two words before it that 3.11+ gives objects with a managed dict.
/// `None` for a raw block (a dict's keys, a list's items, a buffer).
pub fn object_in_block(block: u64, size: u64) -> Option<(u64, String)> {
    [0u64, 16, 32].into_iter().filter(|&o| o + 16 <= size).find_map(|o| object_type(block + o).map(|t| (block + o, t)))
}

fn c_string(addr: u64) -> Option<String> {
    let mut text = [0u64; 8];
    let got = super::roots::read_own_memory(addr, &mut text);
    let bytes: Vec<u8> = text.iter().flat_map(|w| w.to_le_bytes()).take(got).collect();
    let end = bytes.iter().position(|&b| b == 0)?;
    let s = std::str::from_utf8(&bytes[..end]).ok()?;
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic())).then(|| s.to_string())
}

/// The text of a compact ASCII `str` at `addr` (at most 64 characters), or `None` for
/// anything else. `PyASCIIObject`: length at 16, state at 32 (compact and ascii bits),
/// the characters after the struct (48 bytes before 3.12, 40 since: `wstr` went).
pub fn py_str(addr: u64, minor: u8) -> Option<String> {
    py_str_up_to(addr, minor, 64)
}

/// `py_str` for a text of at most `max` characters.
fn py_str_up_to(addr: u64, minor: u8, max: u64) -> Option<String> {
    if object_type(addr)?.as_str() != "str" {
        return None;
    }
    let mut w = [0u64; 5];
    if super::roots::read_own_memory(addr, &mut w) != 40 {
        return None;
    }
    let len = w[2];
    let state = w[4] & 0xffff_ffff;
    let (compact, ascii) = (state & super::pymalloc::STR_COMPACT != 0, state & super::pymalloc::STR_ASCII != 0);
    if !compact || !ascii || len == 0 || len > max {
        return None;
    }
    let data = addr + if minor >= 12 { 40 } else { 48 };
    let mut text = vec![0u64; (len as usize).div_ceil(8)];
    let got = super::roots::read_own_memory(data, &mut text);
    let bytes: Vec<u8> = text.iter().flat_map(|w| w.to_le_bytes()).take(got.min(len as usize)).collect();
    (bytes.len() == len as usize).then(|| String::from_utf8_lossy(&bytes).into_owned())
}

/// A slot of a running function's frame (3.11+): the local variable's name (`None`
/// for a value on the frame's evaluation stack) and the function, `qualname()
/// (file:first line)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameSlot {
    pub name: Option<String>,
    pub function: String,
}

/// Where a 3.11+ `PyCodeObject` keeps the counts `frame_slot` reads besides what the
/// Python frames' layout has (`hotpath::python::code_fields`): `co_nlocalsplus` and
/// `co_stacksize` (C ints), from the headers of 3.11.7, 3.12.1 and 3.13.0.
struct SlotCounts {
    nlocalsplus: u64,
    stacksize: u64,
}

/// A frame's first slot (`localsplus`) and a code object's `co_localsplusnames`: the
/// same in 3.11 to 3.13.
const FRAME_LOCALSPLUS: u64 = 72;
const CODE_LOCALSPLUSNAMES: u64 = 96;
/// A chunk's header: the previous chunk, its size and its saved top.
const CHUNK_HEADER: u64 = 24;

fn slot_counts(minor: u8) -> Option<SlotCounts> {
    match minor {
        11 => Some(SlotCounts { nlocalsplus: 76, stacksize: 68 }),
        12 | 13 => Some(SlotCounts { nlocalsplus: 72, stacksize: 64 }),
        _ => None,
    }
}

/// The frame slot at `at` in the frame-stack chunk `(start, size)`: the nearest frame
/// below it (a word that points to a code object, at the frame's code offset) whose
/// locals and stack reach `at`. `None` where none does: a slot above the running
/// frames, which a returned call left behind.
///
/// `holds`: the address the slot was found holding while the program runs on (the
/// holder search during the run). The frames have moved on since: the slot must still
/// hold it, lie below its thread's top now, and hold it and the same code object after
/// the frame was named (the word that held a loop's list, found in the frame of the
/// closure that appends to it, was named a few hundred milliseconds later after the
/// frame that had taken its place: "local traceback of
/// `_GeneratorContextManager.__exit__()`", in 2 runs of 6).
pub fn frame_slot(at: u64, chunk: (u64, u64), minor: u8, holds: Option<u64>) -> Option<FrameSlot> {
    let counts = slot_counts(minor)?;
    let f = crate::hotpath::python::code_fields()?;
    let first = chunk.0 + CHUNK_HEADER;
    if at < first + FRAME_LOCALSPLUS || at >= chunk.0 + chunk.1 {
        return None;
    }
    let word_now = |a: u64| {
        let mut w = [0u64; 1];
        (super::roots::read_own_memory(a, &mut w) == 8).then_some(w[0])
    };
    if let Some(target) = holds {
        let mut live = [chunk];
        super::arenas::cut_frame_chunks_to_live(&mut live);
        if at + 8 > chunk.0 + live[0].1 || word_now(at) != Some(target) {
            return None;
        }
    }
    // The words below `at` (at most 64 KiB of them), copied at once.
    let from = first.max(at.saturating_sub(64 << 10));
    let mut buf = vec![0u64; ((at - from) / 8) as usize];
    let got = super::roots::read_own_memory(from, &mut buf) / 8;
    let word = |a: u64| buf[..got].get(((a - from) / 8) as usize).copied();
    let int_at = |a: u64| {
        let mut w = [0u64; 1];
        (super::roots::read_own_memory(a & !7, &mut w) == 8).then(|| (w[0] >> (8 * (a & 7))) as u32 as i32)
    };
    let mut frame = at - FRAME_LOCALSPLUS;
    loop {
        let code = word(frame + f.frame_code).filter(|&c| c > 4096 && c & 7 == 0);
        if let Some(code) = code.filter(|&c| header(c).is_some_and(|h| h[1] == f.code_type)) {
            let slot = (at - frame - FRAME_LOCALSPLUS) / 8;
            let locals = u64::try_from(int_at(code + counts.nlocalsplus)?).ok()?;
            let stack = u64::try_from(int_at(code + counts.stacksize)?).ok()?;
            if slot >= locals + stack {
                return None;
            }
            let mut w = [0u64; 1];
            let name = (slot < locals && super::roots::read_own_memory(code + CODE_LOCALSPLUSNAMES, &mut w) == 8)
                .then(|| {
                    let mut item = [0u64; 1];
                    (super::roots::read_own_memory(w[0] + 24 + 8 * slot, &mut item) == 8).then(|| py_str(item[0], minor)).flatten()
                })
                .flatten();
            let text_at = |off: u64| {
                let mut p = [0u64; 1];
                (super::roots::read_own_memory(code + off, &mut p) == 8).then(|| py_str_up_to(p[0], minor, 4096)).flatten()
            };
            let qualname = text_at(f.qualname).unwrap_or_else(|| "?".into());
            let file = text_at(f.filename).unwrap_or_else(|| "?".into());
            let file = file.rsplit('/').next().unwrap_or(&file).to_string();
            let line = int_at(code + f.firstlineno).unwrap_or(0);
            if let Some(target) = holds {
                if word_now(frame + f.frame_code) != Some(code) || word_now(at) != Some(target) {
                    return None;
                }
            }
            return Some(FrameSlot { name, function: format!("{qualname}() ({file}:{line})") });
        }
        if frame < first + 8 || frame - 8 < from {
            return None;
        }
        frame -= 8;
    }
}

/// A module object's name (`md_name`, after `md_dict`, `md_def`, `md_state` and
/// `md_weaklist`: the same from 3.8 to 3.13).
pub fn module_name(addr: u64, minor: u8) -> Option<String> {
    let mut w = [0u64; 1];
    if super::roots::read_own_memory(addr + 48, &mut w) != 8 {
        return None;
    }
    py_str(w[0], minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_reads_only_what_it_holds() {
        let words = [1u64, 2, 3, 4];
        let m = Copied { base: 0x1000, words: &words };
        let mut seen = Vec::new();
        assert!(m.words(0x1008, 16, &mut |a, w| seen.push((a, w))));
        assert_eq!(seen, vec![(0x1008, 2), (0x1010, 3)]);
        seen.clear();
        assert!(!m.words(0x2000, 16, &mut |a, w| seen.push((a, w))));
        assert!(seen.is_empty());
    }

    #[test]
    fn the_words_that_hold_an_address_are_found_in_live_blocks_only() {
        // Three heap blocks of this process; the middle one "freed" (not listed).
        let a: Box<[u64; 4]> = Box::new([0, 0, 0, 0]);
        let target = &*a as *const _ as u64;
        let holder: Box<[u64; 4]> = Box::new([7, target, 9, 0]);
        let stale: Box<[u64; 4]> = Box::new([target, 0, 0, 0]);
        let mut blocks = vec![(&*holder as *const _ as u64, 32u64), (target, 32)];
        blocks.sort_unstable();
        let found = find(&[(target, 0)], &[], &[], &blocks, 11, &mut [false; 2]);
        let f = &found.get(&target).expect("found in the live holder")[0];
        assert_eq!(f.at, &*holder as *const _ as u64 + 8);
        assert_eq!(f.key, None);
        assert!(matches!(f.holder, Holder::Block(_)));
        drop(stale);
    }

    /// A block of floats (a tensor's storage) is flagged by the round that reads it and
    /// not read by the next; a block that holds an address is not flagged; flags made
    /// afresh read the block again.
    #[test]
    fn a_block_that_holds_no_address_is_flagged_and_the_next_round_skips_it() {
        let target: Box<[u64; 4]> = Box::new([0; 4]);
        let t = &*target as *const _ as u64;
        let mut floats: Box<[f32; 64]> = Box::new([0.0; 64]);
        for (k, f) in floats.iter_mut().enumerate() {
            *f = k as f32 * 0.37 - 3.0;
        }
        let holder: Box<[u64; 4]> = Box::new([7, t, 9, 0]);
        let mut blocks = vec![(&*floats as *const _ as u64, 256u64), (&*holder as *const _ as u64, 32), (t, 32)];
        blocks.sort_unstable();
        let at = |addr: u64| blocks.iter().position(|b| b.0 == addr).unwrap();
        let mut flags = vec![false; 3];
        let found = find(&[(t, 0)], &[], &[], &blocks, 11, &mut flags);
        assert_eq!(found[&t][0].at, &*holder as *const _ as u64 + 8);
        assert!(flags[at(&*floats as *const _ as u64)], "floats hold no address");
        assert!(!flags[at(&*holder as *const _ as u64)], "the holder holds one");
        // The floats' block now holds the target: a flagged block is not read.
        let floats_at = &mut *floats as *mut [f32; 64] as *mut u64;
        // SAFETY: our own 256-byte block, written as one word.
        unsafe { floats_at.write(t) };
        let found = find(&[(t, 0)], &[], &[], &blocks, 11, &mut flags);
        assert_eq!(found[&t].len(), 1, "{:?}", found[&t]);
        // Read again with fresh flags, it is found and no longer flagged.
        let mut fresh = vec![false; 3];
        let found = find(&[(t, 0)], &[], &[], &blocks, 11, &mut fresh);
        assert_eq!(found[&t].len(), 2);
        assert!(!fresh[at(&*floats as *const _ as u64)]);
    }

    /// Lists read many at a time find what each read alone finds, in the same order:
    /// more lists than one batch, lists longer than one copy among them, empty ones,
    /// one whose fields cannot be read, and arrays that together overflow one copy.
    #[test]
    fn lists_read_together_hit_as_each_read_alone() {
        let targets = [0x5000_0000u64, 0x5000_1000, 0x6000_0000];
        let mut rng = crate::test_rng::TestRng::new(17);
        let mut arrays: Vec<Vec<u64>> = Vec::new();
        for k in 0..2500usize {
            let len = match k % 500 {
                7 => SPAN / 8 + 300,
                11 => 0,
                _ => rng.below(40_000) % 9000,
            };
            let mut a: Vec<u64> = (0..len).map(|_| rng.below(1 << 30) + 0x7000_0000).collect();
            for _ in 0..rng.below(4) {
                if len > 0 {
                    a[rng.below(len) as usize] = targets[rng.below(3) as usize];
                }
            }
            arrays.push(a);
        }
        // refcount, type, length, item array, capacity.
        let lists: Vec<Box<[u64; 5]>> = arrays.iter().map(|a| Box::new([1u64, 0, a.len() as u64, a.as_ptr() as u64, a.len() as u64])).collect();
        // SAFETY: one fresh page that nothing may read, kept until the end: a list there
        // has fields that cannot be read.
        let gone = unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            p as u64
        };
        let mut list_objects: Vec<ListAt> = lists.iter().map(|l| (l[3], &**l as *const _ as u64)).collect();
        list_objects.insert(1200, (0, gone));
        let target_of = |w: u64| targets.contains(&w).then_some(w);
        let mut buf = vec![0u64; (SPAN / 8) as usize];
        let mut together = Vec::new();
        let read = read_lists(&list_objects, &mut buf, &mut |t, at, items, list| together.push((t, at, items, list)), &target_of);
        let mut alone = Vec::new();
        let mut read_alone = Vec::new();
        for &(_, list) in &list_objects {
            read_alone.extend(read_list_alone(list, LIST_READS, &mut buf, &mut |t, at, items, list| alone.push((t, at, items, list)), &target_of));
        }
        assert!(alone.len() > 1000, "{} hits", alone.len());
        assert_eq!(together, alone);
        assert_eq!(read, read_alone);
        assert_eq!(read.len(), arrays.iter().filter(|a| !a.is_empty()).count());
        // SAFETY: the page mapped above.
        unsafe { libc::munmap(gone as *mut libc::c_void, 4096) };
    }

    #[test]
    fn the_granule_filter_passes_every_word_a_target_reaches_and_few_others() {
        let mut rng = crate::test_rng::TestRng::new(5);
        let targets: Vec<(u64, u64)> = (0..300).map(|_| (rng.below(1 << 40) << 3, [0, 8, 64][rng.below(3) as usize])).collect();
        let g = Granules::of(&targets);
        for &(t, reach) in &targets {
            for w in (t..=t + reach).step_by(8) {
                assert!(g.may_hold(w), "{w:#x} of {t:#x}+{reach}");
            }
        }
        let passed = (0..100_000).filter(|_| g.may_hold(rng.below(1 << 44) << 3)).count();
        assert!(passed < 2_000, "{passed} of 100,000 random words");
        // A reach longer than the filter: every word may.
        assert!(Granules::of(&[(0x1000, u64::MAX / 2)]).may_hold(0xdead_beef_0000));
    }

    #[test]
    fn a_cursor_finds_what_a_binary_search_finds_for_keys_in_any_order() {
        let mut rng = crate::test_rng::TestRng::new(9);
        let mut sorted: Vec<u64> = (0..2000).map(|_| rng.below(50_000) * 16).collect();
        sorted.sort_unstable();
        let mut keys: Vec<u64> = (0..20_000).map(|_| rng.below(50_000) * 16).collect();
        keys.sort_unstable();
        // Mostly ascending, with some keys out of order.
        for k in (0..keys.len()).step_by(97) {
            keys[k] = rng.below(50_000) * 16;
        }
        let mut c = Cursor::default();
        for &k in &keys {
            let found = c.find(&sorted, k, |&e| e);
            assert_eq!(found.map(|i| sorted[i]), sorted.binary_search(&k).ok().map(|i| sorted[i]), "key {k}");
        }
        assert_eq!(Cursor::default().find(&[] as &[u64], 5, |&e| e), None);
    }

    #[test]
    fn a_word_in_a_lists_array_past_its_length_is_dropped_and_no_other() {
        let lists = [(0x1000u64, 16u64), (0x2000, 0), (0x3000, 4096)];
        let at = |a: u64, start: u64, size: u64| (1u64, a, Holder::Object { start, size }, 0u64, true);
        assert!(!past_list_lengths(&at(0x1008, 0x1000, 64), &lists));
        assert!(past_list_lengths(&at(0x1010, 0x1000, 64), &lists));
        assert!(past_list_lengths(&at(0x2000, 0x2000, 32), &lists));
        // Used bytes past the block (a stale length): the block's end bounds it.
        assert!(!past_list_lengths(&at(0x3038, 0x3000, 64), &lists));
        // Not a list's array, or not an arena object.
        assert!(!past_list_lengths(&at(0x4010, 0x4000, 64), &lists));
        assert!(!past_list_lengths(&(1, 0x1010, Holder::Block(3), 0, true), &lists));
    }

    /// A list whose array moves while its items are read: the items read before the
    /// move stand, the read says it did not finish (the search reads the list again from
    /// its new array), and a list that stays put is read to its length, past the first
    /// piece.
    #[test]
    fn a_list_read_while_its_array_moves_says_so() {
        let target = 0x5000_0000u64;
        let len = SPAN / 8 + 1000;
        let mut items = vec![0u64; len as usize];
        items[3] = target;
        items[(SPAN / 8) as usize + 10] = target;
        let other = [0u64; 4];
        // refcount, type, length, item array, capacity.
        let mut list = Box::new([1u64, 0, len, items.as_ptr() as u64, len]);
        let list_at = &*list as *const _ as u64;
        let target_of = |w: u64| (w == target).then_some(w);
        let mut buf = vec![0u64; (SPAN / 8) as usize];
        let mut hits = Vec::new();
        assert_eq!(list_fields(list_at), Some((len, items.as_ptr() as u64)));
        assert!(read_list_items(list_at, items.as_ptr() as u64, len, &mut buf, &mut |t, at| hits.push((t, at)), &target_of));
        let base = items.as_ptr() as u64;
        assert_eq!(hits, vec![(target, base + 24), (target, base + SPAN + 80)]);
        // The array moves after the first piece was copied and checked.
        hits.clear();
        let list_ptr: *mut [u64; 5] = &mut *list;
        let moved = read_list_items(
            list_at,
            base,
            len,
            &mut buf,
            &mut |t, at| {
                hits.push((t, at));
                // SAFETY: the box lives to the end of the test; the read copies it through
                // the kernel, never through a reference held across this write.
                unsafe { (*list_ptr)[3] = other.as_ptr() as u64 };
            },
            &target_of,
        );
        assert!(!moved);
        assert_eq!(hits, vec![(target, base + 24)]);
        // Fields no list has are a list freed and reused: a length past the capacity, a
        // capacity of 2^40 items.
        list[2] = len + 1;
        assert_eq!(list_fields(list_at), None);
        list[2] = 1 << 40;
        list[4] = 1 << 40;
        assert_eq!(list_fields(list_at), None);
    }

    /// A list freed and its memory reused reads as whatever words are there: a length of
    /// 2^39 items whose "array" starts in a mapped page is read to that page's end, not
    /// a MiB at a time through 4 TiB (it had held a search, and the program's exit
    /// behind it, for more than 10 s).
    #[test]
    fn a_list_whose_array_does_not_copy_whole_is_read_no_further() {
        let target = 0x5000_0000u64;
        // SAFETY: two fresh pages, the second unreadable, kept mapped until the end.
        let page = unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::mprotect((p as usize + 4096) as *mut libc::c_void, 4096, libc::PROT_NONE), 0);
            *(p as *mut u64).add(100) = target;
            p as u64
        };
        let len = 1u64 << 39;
        let list = Box::new([1u64, 0, len, page, len]);
        let list_at = &*list as *const _ as u64;
        let target_of = |w: u64| (w == target).then_some(w);
        let mut buf = vec![0u64; (SPAN / 8) as usize];
        let mut hits = Vec::new();
        let started = std::time::Instant::now();
        assert!(!read_list_items(list_at, page, len, &mut buf, &mut |t, at| hits.push((t, at)), &target_of));
        assert_eq!(hits, vec![(target, page + 800)]);
        // Its tries, alone and read together with others, end as soon.
        let mut n = 0;
        assert_eq!(read_list_alone(list_at, LIST_READS, &mut buf, &mut |_, _, _, _| n += 1, &target_of), None);
        assert_eq!(n, LIST_READS);
        let mut m = 0;
        assert!(read_lists(&[(page, list_at)], &mut buf, &mut |_, _, _, _| m += 1, &target_of).is_empty());
        assert_eq!(m, LIST_READS);
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
        // SAFETY: the pages mapped above.
        unsafe { libc::munmap(page as *mut libc::c_void, 8192) };
    }
}
