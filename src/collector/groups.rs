//! The collector's groups (one per stack, entry point and device), stored compactly.
//!
//! `import torch` makes 1.08M groups, nearly all of one allocation of a few hundred
//! bytes at import. Each group has a 16-byte slot, its index: its key, process
//! generation, flags and, in the small form, everything else. The small form holds a
//! group of at most one allocation exactly (its bytes; whether that block is live,
//! whether the timeline's last take saw it, and its trend: seen at reports holding the
//! block, and maybe gone since); at `import torch`'s peak 492k of its 585k groups are
//! such (one block each, still live). A group that needs more moves to a full entry
//! kept aside (40 bytes: every figure in 32 bits) and its slot points there; one whose
//! figures outgrow 32 bits (a hot loop's stack passes 4 GiB of allocations in all)
//! moves for good to a whole `GroupStats` (`wide`). Every figure stays exact: a form is
//! only used while it holds the values. Before, every group took 48 bytes (28 MB of
//! `import torch`'s peak).
//!
//! Most of those groups hold nothing for the rest of the run. A group that holds
//! nothing, never held anything at a report (no trend) and is in no list of changes can
//! be retired (`retire`): what is left of it, its key and its totals, goes into a
//! 20-byte record, or, for a group of one allocation (nearly all of them), into a token
//! of 31 bits that the collector keeps in its table by stack; its index is reused by
//! the next new group. The collector asks at timeline points, for the groups that
//! changed; `revive` gives a retired group an index again, with its totals, when its
//! stack allocates once more.
//!
//! Plain safe Rust; unit tests below.
use super::state::{GroupKey, GroupStats, Trend};
use crate::hotpath::event::Api;

/// In a slot: the group is in the list of changes (`GroupStats::changed`), any form.
const CHANGED: u8 = 1;
/// In a slot: the figures are in `Groups::full`, at the index in `Slot::word`.
const FULL: u8 = 2;
/// Small form: one allocation counted; `Slot::word` is its bytes (total and peak).
const ALLOC: u8 = 4;
/// Small form: that block is live.
const LIVE: u8 = 8;
/// Small form: `pointed_bytes` (the live bytes the timeline last took) are its bytes.
const POINTED: u8 = 16;
/// Small form: seen holding the block at a report: trend base and last its bytes,
/// `Slot::steps` reports since.
const SEEN: u8 = 32;
/// Small form, seen: the block went at a later report (trend last 0, one step down).
const GONE: u8 = 64;

/// In a full entry: its trend is seen.
const FULL_SEEN: u8 = 1;
/// In a full entry: the figures are in `Groups::wide`, at the index in `live_bytes`.
const WIDE: u8 = 2;

/// A group's place: its key, generation and changed flag in every form, and the small
/// form's figures (`FULL` clear) or the index of its full entry (`FULL`).
#[derive(Clone, Copy, Debug)]
struct Slot {
    stack: u32,
    word: u32,
    generation: u16,
    steps: u16,
    device: Option<u8>,
    api: Api,
    flags: u8,
}

const _: () = assert!(std::mem::size_of::<Slot>() == 16);

/// A group's figures in 32 bits each (or, `WIDE`, the index of its whole figures in
/// `Groups::wide`, in `live_bytes`).
#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    flags: u8,
    steps: u16,
    ups: u16,
    downs: u16,
    live_bytes: u32,
    live_blocks: u32,
    total_allocs: u32,
    total_bytes: u32,
    peak_live_bytes: u32,
    base: u32,
    last: u32,
    pointed_bytes: u32,
}

const _: () = assert!(std::mem::size_of::<Entry>() == 40);

/// Retired records at most: a token holds their index in 30 bits (see `Groups::retire`).
pub const RETIRED_MAX: usize = (1 << 30) - 1;

/// In a retired group's token (31 bits): the group made one allocation and the token is
/// all there is of it: `ONCE_CHILD` (its stack is a first Python child), its entry point
/// (`Api` below 8) and its size (below `ONCE_SIZE_LIMIT`); its stack is the place the
/// token is kept at (`stacks::shared_index`). Without `ONCE`, the token is a record's
/// index. `import torch` retires ~530k groups, nearly all of one block of a few hundred
/// bytes: 10 MB of records, which tokens hold in the table by stack itself.
const ONCE: u32 = 1 << 30;
const ONCE_CHILD: u32 = 1 << 29;
const ONCE_API_SHIFT: u32 = 26;
const ONCE_SIZE_LIMIT: u32 = 1 << ONCE_API_SHIFT;

/// The figures of `s` in 32 bits each, if they all fit.
fn narrow(s: &GroupStats) -> Option<[u32; 8]> {
    let n = |v: u64| u32::try_from(v).ok();
    Some([
        n(s.live_bytes)?,
        n(s.live_blocks)?,
        n(s.total_allocs)?,
        n(s.total_bytes)?,
        n(s.peak_live_bytes)?,
        n(s.trend.base)?,
        n(s.trend.last)?,
        n(s.pointed_bytes)?,
    ])
}

/// `s` in the small form, if it holds it exactly: its flags (without `CHANGED`), its
/// bytes and its trend's steps. `small_stats` reads it back.
fn small(s: &GroupStats) -> Option<(u8, u32, u16)> {
    let t = &s.trend;
    if s.total_allocs == 0 {
        let empty = s.total_bytes == 0 && s.live_bytes == 0 && s.live_blocks == 0 && s.peak_live_bytes == 0 && s.pointed_bytes == 0;
        return (empty && *t == Trend::default()).then_some((0, 0, 0));
    }
    let bytes = u32::try_from(s.total_bytes).ok()?;
    let b = s.total_bytes;
    if s.total_allocs != 1 || s.peak_live_bytes != b || s.live_blocks > 1 || s.live_bytes != b * s.live_blocks {
        return None;
    }
    let mut flags = ALLOC | if s.live_blocks == 1 { LIVE } else { 0 };
    if s.pointed_bytes == b {
        flags |= POINTED;
    } else if s.pointed_bytes != 0 {
        return None;
    }
    if !t.seen {
        return (*t == Trend::default()).then_some((flags, bytes, 0));
    }
    if t.base != b || t.ups != 0 {
        return None;
    }
    if t.last == 0 && t.downs == 1 {
        flags |= GONE;
    } else if t.last != b || t.downs != 0 {
        return None;
    }
    Some((flags | SEEN, bytes, t.steps))
}

/// The figures of a small-form slot (see `small`).
fn small_stats(s: &Slot) -> GroupStats {
    let (b, f) = (u64::from(s.word), s.flags);
    let (alloc, live, gone) = (f & ALLOC != 0, f & LIVE != 0, f & GONE != 0);
    GroupStats {
        live_bytes: if live { b } else { 0 },
        live_blocks: live.into(),
        total_allocs: alloc.into(),
        total_bytes: if alloc { b } else { 0 },
        peak_live_bytes: if alloc { b } else { 0 },
        generation: s.generation,
        trend: if f & SEEN != 0 {
            Trend { seen: true, base: b, last: if gone { 0 } else { b }, steps: s.steps, ups: 0, downs: gone.into() }
        } else {
            Trend::default()
        },
        pointed_bytes: if f & POINTED != 0 { b } else { 0 },
        changed: f & CHANGED != 0,
    }
}

/// What a retired group keeps: its key and its totals (see `Groups::retire`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Retired {
    stack: u32,
    total_allocs: u32,
    total_bytes: u32,
    peak_live_bytes: u32,
    api: Api,
    device: Option<u8>,
}

const _: () = assert!(std::mem::size_of::<Retired>() == 20);

/// The key of a slot that is free for reuse (no stack has this id).
const FREE_STACK: u32 = u32::MAX;

#[derive(Default)]
pub struct Groups {
    slots: Vec<Slot>,
    /// The figures of the groups that need more than the small form.
    full: Vec<Entry>,
    /// Free places in `full`.
    full_free: Vec<u32>,
    /// The whole figures of the groups that outgrew 32 bits.
    wide: Vec<GroupStats>,
    /// Indices of retired groups, reused by `push`.
    free: Vec<u32>,
    /// Retired groups (by the index `retire` returned), and the free places among them.
    retired: Vec<Retired>,
    retired_free: Vec<u32>,
    /// Groups retired into a token alone (`ONCE`).
    retired_once: usize,
}

impl Groups {
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// A new group of `key` with no figures; its index (a retired group's, if any).
    pub fn push(&mut self, key: GroupKey) -> u32 {
        let s = Self::fresh(key);
        match self.free.pop() {
            Some(g) => {
                self.slots[g as usize] = s;
                g
            }
            None => {
                self.slots.push(s);
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn fresh((stack, api, device): GroupKey) -> Slot {
        Slot { stack, word: 0, generation: 0, steps: 0, device, api, flags: 0 }
    }

    /// Frees slot `g` for the next new group, with its full entry if it has one.
    fn release(&mut self, g: u32) {
        let s = self.slots[g as usize];
        if s.flags & FULL != 0 {
            self.full[s.word as usize] = Entry::default();
            self.full_free.push(s.word);
        }
        self.slots[g as usize] = Self::fresh((FREE_STACK, s.api, None));
        self.free.push(g);
    }

    /// Retires group `g` if it holds nothing and keeps nothing but its totals: not
    /// wide, of `generation`, no live blocks, no trend (never seen holding anything at a
    /// report), nothing to tell the timeline (no bytes when it last took the changes).
    /// Its index is free for the next new group from now on, so the caller must know
    /// that nothing else refers to it (no block, no index) and drop it from the list of
    /// changes if it is there. Returns a token for `revive` (31 bits): a record's index,
    /// or (`ONCE`) the group's figures themselves, which need the place the token is
    /// kept at (its stack's `shared_index`) to name its stack again.
    pub fn retire(&mut self, g: u32, generation: u16) -> Option<u32> {
        let slot = self.slots[g as usize];
        if slot.stack == FREE_STACK || slot.generation != generation || self.is_wide(&slot) || self.retired.len() >= RETIRED_MAX {
            return None;
        }
        let s = self.get(g);
        if s.trend.seen || s.live_blocks != 0 || s.live_bytes != 0 || s.pointed_bytes != 0 {
            return None;
        }
        // Not wide: every figure fits 32 bits.
        let (total_allocs, total_bytes, peak_live_bytes) = (s.total_allocs as u32, s.total_bytes as u32, s.peak_live_bytes as u32);
        use crate::hotpath::stacks::{at_place, is_first_child, shared_index};
        let child = is_first_child(slot.stack);
        let once = total_allocs == 1 && total_bytes == peak_live_bytes && total_bytes < ONCE_SIZE_LIMIT && slot.device.is_none() && (slot.api as u32) < 8;
        // Only a stack whose place names it again.
        let placed = at_place(shared_index(slot.stack), child) == slot.stack;
        self.release(g);
        if once && placed {
            self.retired_once += 1;
            return Some(ONCE | if child { ONCE_CHILD } else { 0 } | (slot.api as u32) << ONCE_API_SHIFT | total_bytes);
        }
        let r = Retired { stack: slot.stack, total_allocs, total_bytes, peak_live_bytes, api: slot.api, device: slot.device };
        let idx = match self.retired_free.pop() {
            Some(i) => {
                self.retired[i as usize] = r;
                i
            }
            None => {
                self.retired.push(r);
                (self.retired.len() - 1) as u32
            }
        };
        Some(idx)
    }

    /// What retired token `r`, kept at `place` (its stack's `shared_index`), holds.
    fn retired(&self, r: u32, place: usize) -> Retired {
        if r & ONCE == 0 {
            return self.retired[r as usize];
        }
        let bytes = r & (ONCE_SIZE_LIMIT - 1);
        Retired {
            stack: crate::hotpath::stacks::at_place(place, r & ONCE_CHILD != 0),
            total_allocs: 1,
            total_bytes: bytes,
            peak_live_bytes: bytes,
            api: Api::from_bits(((r & !(ONCE | ONCE_CHILD)) >> ONCE_API_SHIFT) as u8),
            device: None,
        }
    }

    /// The key of retired token `r` kept at `place` (see `retire`).
    pub fn retired_key(&self, r: u32, place: usize) -> GroupKey {
        let r = self.retired(r, place);
        (r.stack, r.api, r.device)
    }

    /// The totals of retired token `r` kept at `place` (as `GroupDetails`' figures:
    /// peak, allocations, bytes).
    pub fn retired_totals(&self, r: u32, place: usize) -> (u64, u64, u64) {
        let r = self.retired(r, place);
        (r.peak_live_bytes.into(), r.total_allocs.into(), r.total_bytes.into())
    }

    /// Group `r` of the retired ones (kept at `place`) back as a group, with its totals,
    /// in `generation` 0 (only the first process retires groups); its index.
    pub fn revive(&mut self, r: u32, place: usize) -> u32 {
        let rec = self.retired(r, place);
        if r & ONCE == 0 {
            self.retired_free.push(r);
        } else {
            self.retired_once -= 1;
        }
        let g = self.push((rec.stack, rec.api, rec.device));
        let totals = GroupStats {
            total_allocs: rec.total_allocs.into(),
            total_bytes: rec.total_bytes.into(),
            peak_live_bytes: rec.peak_live_bytes.into(),
            ..GroupStats::default()
        };
        self.set(g, totals);
        g
    }

    /// Groups retired now (for tests and diagnostics).
    pub fn retired_count(&self) -> usize {
        self.retired.len() - self.retired_free.len() + self.retired_once
    }

    #[inline]
    pub fn key(&self, g: u32) -> GroupKey {
        let s = &self.slots[g as usize];
        (s.stack, s.api, s.device)
    }

    fn is_wide(&self, s: &Slot) -> bool {
        s.flags & FULL != 0 && self.full[s.word as usize].flags & WIDE != 0
    }

    /// Whether group `g` holds a live block in process generation `generation`:
    /// `get(g)`'s `live_blocks > 0 && generation == generation`, reading only the slot
    /// for a group in the small form (most of them). A report's snapshot asks this of
    /// every group before it copies the live ones (`import torch` leaves 600k groups).
    #[inline]
    pub fn holds_live(&self, g: u32, generation: u16) -> bool {
        let s = &self.slots[g as usize];
        if s.generation != generation {
            return false;
        }
        if s.flags & FULL == 0 {
            return s.flags & LIVE != 0;
        }
        let e = &self.full[s.word as usize];
        if e.flags & WIDE != 0 {
            return self.wide[e.live_bytes as usize].live_blocks > 0;
        }
        e.live_blocks > 0
    }

    /// The figures of group `g`.
    #[inline]
    pub fn get(&self, g: u32) -> GroupStats {
        let s = &self.slots[g as usize];
        if s.flags & FULL == 0 {
            return small_stats(s);
        }
        let e = &self.full[s.word as usize];
        let changed = s.flags & CHANGED != 0;
        if e.flags & WIDE != 0 {
            return GroupStats { generation: s.generation, changed, ..self.wide[e.live_bytes as usize] };
        }
        GroupStats {
            live_bytes: e.live_bytes.into(),
            live_blocks: e.live_blocks.into(),
            total_allocs: e.total_allocs.into(),
            total_bytes: e.total_bytes.into(),
            peak_live_bytes: e.peak_live_bytes.into(),
            generation: s.generation,
            trend: Trend { seen: e.flags & FULL_SEEN != 0, base: e.base.into(), last: e.last.into(), steps: e.steps, ups: e.ups, downs: e.downs },
            pointed_bytes: e.pointed_bytes.into(),
            changed,
        }
    }

    /// Sets the figures of group `g`: in the small form where it holds them, else in a
    /// full entry (a wide one stays wide).
    #[inline]
    pub fn set(&mut self, g: u32, s: GroupStats) {
        let slot = &mut self.slots[g as usize];
        slot.generation = s.generation;
        let changed = if s.changed { CHANGED } else { 0 };
        if slot.flags & FULL != 0 {
            let i = slot.word;
            if self.full[i as usize].flags & WIDE != 0 {
                slot.flags = FULL | changed;
                self.wide[self.full[i as usize].live_bytes as usize] = s;
                return;
            }
            if let Some((flags, word, steps)) = small(&s) {
                (slot.flags, slot.word, slot.steps) = (flags | changed, word, steps);
                self.full[i as usize] = Entry::default();
                self.full_free.push(i);
                return;
            }
            slot.flags = FULL | changed;
            self.set_full(i, &s);
            return;
        }
        if let Some((flags, word, steps)) = small(&s) {
            (slot.flags, slot.word, slot.steps) = (flags | changed, word, steps);
            return;
        }
        let i = match self.full_free.pop() {
            Some(i) => i,
            None => {
                self.full.push(Entry::default());
                (self.full.len() - 1) as u32
            }
        };
        (slot.flags, slot.word, slot.steps) = (FULL | changed, i, 0);
        self.set_full(i, &s);
    }

    /// Full entry `i` (not wide) holds `s` from now on: in 32 bits each if they fit,
    /// else, for good, wide.
    fn set_full(&mut self, i: u32, s: &GroupStats) {
        let e = &mut self.full[i as usize];
        let Some([live_bytes, live_blocks, total_allocs, total_bytes, peak_live_bytes, base, last, pointed_bytes]) = narrow(s) else {
            // For good: a group this large stays wide (no going back and forth).
            *e = Entry { flags: WIDE, live_bytes: self.wide.len() as u32, ..Entry::default() };
            self.wide.push(*s);
            return;
        };
        e.flags = if s.trend.seen { FULL_SEEN } else { 0 };
        (e.steps, e.ups, e.downs) = (s.trend.steps, s.trend.ups, s.trend.downs);
        (e.live_bytes, e.live_blocks, e.total_allocs, e.total_bytes) = (live_bytes, live_blocks, total_allocs, total_bytes);
        (e.peak_live_bytes, e.base, e.last, e.pointed_bytes) = (peak_live_bytes, base, last, pointed_bytes);
    }

    /// Applies `f` to group `g`'s figures.
    #[inline]
    pub fn update<R>(&mut self, g: u32, f: impl FnOnce(&mut GroupStats) -> R) -> R {
        let mut s = self.get(g);
        let r = f(&mut s);
        self.set(g, s);
        r
    }

    /// The collector's per-event steps on a group of `generation`, in place, without
    /// widening it (`get`/`set` copy every figure, a fifth of the collector's time per
    /// event in `bench/malloc_bench.c`). Each returns false, changing nothing, where the
    /// caller must take the general path (`update`): a small group the step takes out
    /// of the small form, a wide group, one of an earlier process generation, or a
    /// figure about to outgrow 32 bits.
    ///
    /// `alloc_live`: a new allocation of `size` bytes, live (counted and added).
    #[inline(always)]
    pub fn alloc_live(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((slot, size)) = self.slot_of(g, generation, size) else { return false };
        if slot.flags & FULL == 0 {
            // A group's first allocation stays small; a second one takes the general path.
            if slot.flags & !CHANGED != 0 {
                return false;
            }
            (slot.flags, slot.word) = (slot.flags | ALLOC | LIVE, size);
            return true;
        }
        let i = slot.word as usize;
        let Some(e) = Self::narrow_entry(&mut self.full, i) else { return false };
        let (Some(total), Some(allocs), Some(bytes), Some(blocks)) =
            (e.total_bytes.checked_add(size), e.total_allocs.checked_add(1), e.live_bytes.checked_add(size), e.live_blocks.checked_add(1))
        else {
            return false;
        };
        (e.total_bytes, e.total_allocs, e.live_bytes, e.live_blocks) = (total, allocs, bytes, blocks);
        e.peak_live_bytes = e.peak_live_bytes.max(bytes);
        true
    }

    /// See `alloc_live`: a block of `size` bytes live again (a failed realloc's).
    #[inline(always)]
    pub fn add_live(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((slot, size)) = self.slot_of(g, generation, size) else { return false };
        if slot.flags & FULL == 0 {
            // Its one block back: the figures it had.
            if slot.flags & (ALLOC | LIVE) != ALLOC || slot.word != size {
                return false;
            }
            slot.flags |= LIVE;
            return true;
        }
        let i = slot.word as usize;
        let Some(e) = Self::narrow_entry(&mut self.full, i) else { return false };
        let (Some(bytes), Some(blocks)) = (e.live_bytes.checked_add(size), e.live_blocks.checked_add(1)) else { return false };
        (e.live_bytes, e.live_blocks) = (bytes, blocks);
        e.peak_live_bytes = e.peak_live_bytes.max(bytes);
        true
    }

    /// See `alloc_live`: a block of `size` bytes no longer live.
    #[inline(always)]
    pub fn remove_live(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((slot, size)) = self.slot_of(g, generation, size) else { return false };
        if slot.flags & FULL == 0 {
            if slot.flags & LIVE == 0 || slot.word != size {
                return false;
            }
            slot.flags &= !LIVE;
            return true;
        }
        let i = slot.word as usize;
        let Some(e) = Self::narrow_entry(&mut self.full, i) else { return false };
        let (Some(bytes), Some(blocks)) = (e.live_bytes.checked_sub(size), e.live_blocks.checked_sub(1)) else { return false };
        (e.live_bytes, e.live_blocks) = (bytes, blocks);
        true
    }

    /// See `alloc_live`: an allocation freed before the collector took it
    /// (`EventKind::Transient`) counts as allocated, and its bytes as live for a moment.
    #[inline(always)]
    pub fn count_transient(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((slot, size)) = self.slot_of(g, generation, size) else { return false };
        if slot.flags & FULL == 0 {
            if slot.flags & !CHANGED != 0 {
                return false;
            }
            (slot.flags, slot.word) = (slot.flags | ALLOC, size);
            return true;
        }
        let i = slot.word as usize;
        let Some(e) = Self::narrow_entry(&mut self.full, i) else { return false };
        let (Some(bytes), Some(allocs), Some(momentary)) = (e.total_bytes.checked_add(size), e.total_allocs.checked_add(1), e.live_bytes.checked_add(size))
        else {
            return false;
        };
        (e.total_bytes, e.total_allocs) = (bytes, allocs);
        e.peak_live_bytes = e.peak_live_bytes.max(momentary);
        true
    }

    /// Group `g`'s slot and `size` in 32 bits, where a per-event step may work on them
    /// in place: the group is of `generation` and the size fits.
    #[inline(always)]
    fn slot_of(&mut self, g: u32, generation: u16, size: u64) -> Option<(&mut Slot, u32)> {
        let s = &mut self.slots[g as usize];
        let size = u32::try_from(size).ok()?;
        (s.generation == generation).then_some((s, size))
    }

    /// Full entry `i` unless it is wide.
    #[inline(always)]
    fn narrow_entry(full: &mut [Entry], i: usize) -> Option<&mut Entry> {
        let e = &mut full[i];
        (e.flags & WIDE == 0).then_some(e)
    }

    /// Marks group `g` changed; whether it was not already (in its slot, whatever its
    /// form: this runs for every event).
    #[inline]
    pub fn mark_changed(&mut self, g: u32) -> bool {
        let s = &mut self.slots[g as usize];
        let was = s.flags & CHANGED != 0;
        s.flags |= CHANGED;
        !was
    }

    /// Groups kept wide (for tests and diagnostics).
    #[cfg(test)]
    pub fn wide_count(&self) -> usize {
        self.wide.len()
    }

    /// Groups in a full entry now (for tests and diagnostics).
    #[cfg(test)]
    pub fn full_count(&self) -> usize {
        self.full.len() - self.full_free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hotpath::event::Api;

    /// The general path's figures for a new live block of `size` bytes.
    fn alloc_step(size: u64) -> impl Fn(&mut GroupStats) + Copy {
        move |s| {
            s.total_allocs += 1;
            s.total_bytes += size;
            s.live_bytes += size;
            s.live_blocks += 1;
            s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
        }
    }

    /// The general path's figures for a block of `size` bytes no longer live.
    fn free_step(size: u64) -> impl Fn(&mut GroupStats) + Copy {
        move |s| {
            s.live_bytes -= size;
            s.live_blocks -= 1;
        }
    }

    #[test]
    fn figures_read_back_exactly_narrow_or_wide() {
        let mut g = Groups::default();
        let a = g.push((7, Api::Malloc, None));
        let b = g.push((8, Api::CudaMalloc, Some(3)));
        assert_eq!((g.key(a), g.key(b)), ((7, Api::Malloc, None), (8, Api::CudaMalloc, Some(3))));
        let small = GroupStats {
            live_bytes: 100,
            live_blocks: 2,
            total_allocs: 5,
            total_bytes: 400,
            peak_live_bytes: 300,
            generation: 9,
            trend: Trend { seen: true, base: 10, last: 100, steps: 4, ups: 3, downs: 1 },
            pointed_bytes: 50,
            changed: true,
        };
        g.set(a, small);
        assert_eq!(g.get(a), small);
        assert_eq!(g.wide_count(), 0);
        // Past 4 GiB of allocations in all: wide, and exact.
        let big = GroupStats { total_bytes: 5 << 30, ..small };
        g.set(b, big);
        assert_eq!((g.get(b), g.get(a), g.wide_count()), (big, small, 1));
        // It stays wide, small figures or not.
        g.update(b, |s| *s = GroupStats::default());
        assert_eq!((g.get(b), g.wide_count()), (GroupStats::default(), 1));
        // Changed flags without widening.
        g.update(a, |s| s.changed = false);
        assert!(g.mark_changed(a) && !g.mark_changed(a) && g.mark_changed(b) && !g.mark_changed(b));
        assert!(g.get(a).changed && g.get(b).changed);
    }

    /// A group of one allocation retires into its token alone, any other into a record;
    /// both come back with their key and totals.
    #[test]
    fn a_group_of_one_allocation_retires_into_its_token_and_comes_back_whole() {
        use crate::hotpath::stacks::{shared_index, CHILD_BASE};
        let once = |bytes: u64| GroupStats { total_allocs: 1, total_bytes: bytes, peak_live_bytes: bytes, ..Default::default() };
        let cases = [
            ((7, Api::Calloc, None), once(40), true),
            ((CHILD_BASE + 7, Api::Malloc, None), once(ONCE_SIZE_LIMIT as u64 - 1), true),
            ((CHILD_BASE + 9, Api::Valloc, None), once(4096), true),
            ((11, Api::Pvalloc, None), once(4096), false),
            ((12, Api::CudaMalloc, Some(1)), once(512), false),
            ((13, Api::Malloc, None), once(ONCE_SIZE_LIMIT as u64), false),
            ((14, Api::Malloc, None), GroupStats { total_allocs: 2, total_bytes: 80, peak_live_bytes: 40, ..Default::default() }, false),
        ];
        let mut g = Groups::default();
        let mut tokens = Vec::new();
        for (key, stats, inline) in cases {
            let i = g.push(key);
            g.set(i, stats);
            let t = g.retire(i, 0).expect("idle");
            assert_eq!(t & ONCE != 0, inline, "{key:?}");
            assert!(t < 1 << 31);
            tokens.push((t, shared_index(key.0)));
        }
        assert_eq!((g.retired_count(), g.retired.len()), (cases.len(), 4), "three tokens hold their groups");
        for ((key, stats, _), &(t, place)) in cases.iter().zip(&tokens) {
            assert_eq!(g.retired_key(t, place), *key);
            assert_eq!(g.retired_totals(t, place), (stats.peak_live_bytes, stats.total_allocs, stats.total_bytes));
            let back = g.revive(t, place);
            assert_eq!(g.key(back), *key);
            assert_eq!(
                (g.get(back).total_allocs, g.get(back).total_bytes, g.get(back).peak_live_bytes),
                (stats.total_allocs, stats.total_bytes, stats.peak_live_bytes)
            );
        }
        assert_eq!(g.retired_count(), 0);
    }

    #[test]
    fn the_per_event_steps_agree_with_the_general_path() {
        let mut fast = Groups::default();
        let mut slow = Groups::default();
        let mut rng = crate::test_rng::TestRng::new(3);
        for _ in 0..4 {
            fast.push((1, Api::Malloc, None));
            slow.push((1, Api::Malloc, None));
        }
        for g in 0..4 {
            fast.update(g, |s| s.generation = 2);
            slow.update(g, |s| s.generation = 2);
        }
        let mut live: Vec<Vec<u64>> = vec![Vec::new(); 4];
        for _ in 0..20_000 {
            let g = rng.below(4) as u32;
            // Sizes up to 3 GiB: some groups outgrow 32 bits on the way.
            let size = if rng.below(50) == 0 { rng.below(3 << 30) } else { rng.below(4096) };
            if rng.below(3) > 0 || live[g as usize].is_empty() {
                if !fast.alloc_live(g, 2, size) {
                    // A refused step changed nothing: the general path does both.
                    fast.update(g, alloc_step(size));
                }
                slow.update(g, alloc_step(size));
                live[g as usize].push(size);
            } else {
                let size = live[g as usize].pop().unwrap();
                if !fast.remove_live(g, 2, size) {
                    fast.update(g, free_step(size));
                }
                slow.update(g, free_step(size));
            }
        }
        for g in 0..4 {
            assert_eq!(fast.get(g), slow.get(g));
        }
        assert!(fast.wide_count() > 0, "no group outgrew 32 bits");
        // Another generation's group is never touched by a step.
        assert!(!fast.add_live(0, 3, 1) && !fast.alloc_live(0, 3, 1) && !fast.remove_live(0, 3, 1) && !fast.count_transient(0, 3, 1));
    }

    /// Any figures read back exactly, and those of a group of at most one allocation
    /// (live or gone, seen at reports, taken by the timeline) take no full entry.
    #[test]
    fn the_small_form_holds_exactly_what_it_takes_and_nothing_else() {
        let mut rng = crate::test_rng::TestRng::new(11);
        let mut g = Groups::default();
        let mut id = g.push((5, Api::Malloc, None));
        let (mut small_seen, mut full_seen) = (0, 0);
        for round in 0..50_000 {
            // Figures near the small form's shapes, each bent now and then.
            let b = [0, 1, 48, 4096, u64::from(u32::MAX), 1 << 33][rng.below(6) as usize];
            let pick = |rng: &mut crate::test_rng::TestRng, usual: u64| if rng.below(8) == 0 { rng.below(3) } else { usual };
            let allocs = pick(&mut rng, 1);
            let one = rng.below(2);
            let blocks = pick(&mut rng, one);
            let seen = rng.below(2) == 0;
            let gone = rng.below(2) == 0;
            let s = GroupStats {
                live_bytes: pick(&mut rng, b * blocks),
                live_blocks: blocks,
                total_allocs: allocs,
                total_bytes: pick(&mut rng, b * allocs.min(1)),
                peak_live_bytes: pick(&mut rng, b * allocs.min(1)),
                generation: rng.below(3) as u16,
                trend: if seen {
                    Trend {
                        seen,
                        base: pick(&mut rng, b),
                        last: pick(&mut rng, if gone { 0 } else { b }),
                        steps: rng.below(5) as u16,
                        ups: pick(&mut rng, 0) as u16,
                        downs: pick(&mut rng, gone as u64) as u16,
                    }
                } else {
                    Trend::default()
                },
                pointed_bytes: {
                    let usual = [0, b][rng.below(2) as usize];
                    pick(&mut rng, usual)
                },
                changed: rng.below(2) == 0,
            };
            // One slot goes through every form and back (wide ones need a new group).
            if g.is_wide(&g.slots[id as usize]) {
                id = g.push((5, Api::Malloc, None));
            }
            g.set(id, s);
            assert_eq!(g.get(id), s, "round {round}");
            for generation in 0..3 {
                assert_eq!(g.holds_live(id, generation), s.live_blocks > 0 && s.generation == generation, "round {round}: {s:?}");
            }
            if small(&s).is_some() {
                small_seen += 1;
                assert_eq!(g.slots[id as usize].flags & FULL, 0, "{s:?}");
            } else {
                full_seen += 1;
            }
        }
        assert!(small_seen > 5_000 && full_seen > 5_000, "{small_seen} small, {full_seen} full");
        // Entries freed by groups that went back to the small form are reused.
        assert!(g.full.len() <= g.wide.len() + 1, "{} full entries", g.full.len());
        // A group of one block, seen at reports, taken by the timeline, then freed.
        let mut g = Groups::default();
        let id = g.push((9, Api::Malloc, None));
        assert!(g.alloc_live(id, 0, 300));
        g.update(id, |s| {
            s.trend.step(s.live_bytes);
            s.trend.step(s.live_bytes);
            s.pointed_bytes = s.live_bytes;
        });
        assert!(g.remove_live(id, 0, 300));
        g.update(id, |s| s.trend.step(s.live_bytes));
        let s = g.get(id);
        assert_eq!((s.total_allocs, s.peak_live_bytes, s.live_blocks, s.trend.steps, s.trend.downs), (1, 300, 0, 2, 1));
        assert_eq!(g.full_count(), 0);
        // A second allocation moves it to a full entry.
        assert!(!g.alloc_live(id, 0, 10));
        g.update(id, |s| {
            s.total_allocs += 1;
            s.total_bytes += 10;
        });
        assert_eq!((g.full_count(), g.get(id).total_bytes), (1, 310));
    }

    /// Many groups of few allocations each, in every form, through the per-event steps
    /// and the general path; the same figures as the general path alone.
    #[test]
    fn the_per_event_steps_agree_with_the_general_path_for_small_groups() {
        let mut fast = Groups::default();
        let mut slow = Groups::default();
        let mut rng = crate::test_rng::TestRng::new(5);
        const N: u32 = 64;
        for i in 0..N {
            fast.push((i, Api::Malloc, None));
            slow.push((i, Api::Malloc, None));
        }
        let mut live: Vec<Vec<u64>> = vec![Vec::new(); N as usize];
        for _ in 0..50_000 {
            let g = rng.below(u64::from(N)) as u32;
            let size = rng.below(512);
            match rng.below(16) {
                // A new block (rarely: groups stay small for a while).
                0 => {
                    let step = alloc_step(size);
                    if !fast.alloc_live(g, 0, size) {
                        fast.update(g, step);
                    }
                    slow.update(g, step);
                    live[g as usize].push(size);
                }
                // Freed before the collector took it.
                1 => {
                    let step = |s: &mut GroupStats| {
                        s.total_allocs += 1;
                        s.total_bytes += size;
                        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes + size);
                    };
                    if !fast.count_transient(g, 0, size) {
                        fast.update(g, step);
                    }
                    slow.update(g, step);
                }
                // A report's trend step, or the timeline's take.
                2 => {
                    for x in [&mut fast, &mut slow] {
                        x.update(g, |s| s.trend.step(s.live_bytes));
                    }
                }
                3 => {
                    for x in [&mut fast, &mut slow] {
                        x.update(g, |s| {
                            s.pointed_bytes = s.live_bytes;
                            s.changed = false;
                        });
                    }
                }
                4 => {
                    assert_eq!(fast.mark_changed(g), slow.mark_changed(g));
                }
                // A free, or a failed realloc's release and restore.
                _ if !live[g as usize].is_empty() => {
                    let size = *live[g as usize].last().unwrap();
                    let restore = rng.below(2) == 0;
                    let down = free_step(size);
                    let up = |s: &mut GroupStats| {
                        s.live_bytes += size;
                        s.live_blocks += 1;
                        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
                    };
                    if !fast.remove_live(g, 0, size) {
                        fast.update(g, down);
                    }
                    slow.update(g, down);
                    if restore {
                        if !fast.add_live(g, 0, size) {
                            fast.update(g, up);
                        }
                        slow.update(g, up);
                    } else {
                        live[g as usize].pop();
                    }
                }
                _ => {}
            }
            assert_eq!(fast.get(g), slow.get(g));
        }
        for g in 0..N {
            assert_eq!(fast.get(g), slow.get(g));
        }
    }

    #[test]
    fn every_figure_that_outgrows_32_bits_moves_the_group_aside() {
        for field in 0..8 {
            let mut g = Groups::default();
            let id = g.push((1, Api::Malloc, None));
            let mut s = GroupStats::default();
            let v = u64::from(u32::MAX) + 1;
            match field {
                0 => s.live_bytes = v,
                1 => s.live_blocks = v,
                2 => s.total_allocs = v,
                3 => s.total_bytes = v,
                4 => s.peak_live_bytes = v,
                5 => s.trend.base = v,
                6 => s.trend.last = v,
                _ => s.pointed_bytes = v,
            }
            g.set(id, s);
            assert_eq!((g.get(id), g.wide_count()), (s, 1), "field {field}");
        }
    }
}
