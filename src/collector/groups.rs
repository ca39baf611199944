//! The collector's groups (one per stack, entry point and device), stored compactly.
//!
//! `import torch` makes 1.08M groups, nearly all of one allocation of a few hundred
//! bytes at import, and few of them hold anything by its end. As a plain `(GroupKey,
//! GroupStats)` each took 88 bytes (95 MB). Here a group whose figures all fit 32 bits
//! is 48 bytes; one that outgrows them (a hot loop's stack passes 4 GiB of allocations in
//! all) moves for good to a full `GroupStats` kept aside, and its entry points there.
//! Every figure stays exact: the compact form is only used while it holds the values.
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

const CHANGED: u8 = 1;
const SEEN: u8 = 2;
const WIDE: u8 = 4;

/// One group: its key, flags, and its figures in 32 bits each, or (`WIDE`) the index of
/// its full figures in `Groups::wide` (in `live_bytes`).
#[derive(Clone, Copy, Debug)]
struct Entry {
    stack: u32,
    api: crate::hotpath::event::Api,
    device: Option<u8>,
    flags: u8,
    generation: u16,
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

const _: () = assert!(std::mem::size_of::<Entry>() == 48);

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

/// What a retired group keeps: its key and its totals (see `Groups::retire`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Retired {
    stack: u32,
    total_allocs: u32,
    total_bytes: u32,
    peak_live_bytes: u32,
    api: crate::hotpath::event::Api,
    device: Option<u8>,
}

const _: () = assert!(std::mem::size_of::<Retired>() == 20);

/// The key of an entry that is free for reuse (no stack has this id).
const FREE_STACK: u32 = u32::MAX;

#[derive(Default)]
pub struct Groups {
    entries: Vec<Entry>,
    /// The full figures of the groups that outgrew 32 bits.
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
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A new group of `key` with no figures; its index (a retired group's, if any).
    pub fn push(&mut self, key: GroupKey) -> u32 {
        let e = Self::fresh(key);
        match self.free.pop() {
            Some(g) => {
                self.entries[g as usize] = e;
                g
            }
            None => {
                self.entries.push(e);
                (self.entries.len() - 1) as u32
            }
        }
    }

    fn fresh((stack, api, device): GroupKey) -> Entry {
        Entry {
            stack,
            api,
            device,
            flags: 0,
            generation: 0,
            steps: 0,
            ups: 0,
            downs: 0,
            live_bytes: 0,
            live_blocks: 0,
            total_allocs: 0,
            total_bytes: 0,
            peak_live_bytes: 0,
            base: 0,
            last: 0,
            pointed_bytes: 0,
        }
    }

    /// Retires group `g` if it holds nothing and keeps nothing but its totals: compact,
    /// of `generation`, no live blocks, no trend (never seen holding anything at a
    /// report), nothing to tell the timeline (no bytes when it last took the changes).
    /// Its index is free for the next new group from now on, so the caller must know
    /// that nothing else refers to it (no block, no index) and drop it from the list of
    /// changes if it is there. Returns a token for `revive` (31 bits): a record's index,
    /// or (`ONCE`) the group's figures themselves, which need the place the token is
    /// kept at (its stack's `shared_index`) to name its stack again.
    pub fn retire(&mut self, g: u32, generation: u16) -> Option<u32> {
        let e = self.entries[g as usize];
        let idle = e.flags & !CHANGED == 0 && e.generation == generation && e.live_blocks == 0 && e.live_bytes == 0 && e.pointed_bytes == 0;
        // The retired record's index shares a word with a flag in the collector's table
        // by stack (`Collector::group_of`).
        if !idle || e.stack == FREE_STACK || self.retired.len() >= RETIRED_MAX {
            return None;
        }
        use crate::hotpath::stacks::{at_place, is_first_child, shared_index};
        let child = is_first_child(e.stack);
        let once = e.total_allocs == 1 && e.total_bytes == e.peak_live_bytes && e.total_bytes < ONCE_SIZE_LIMIT && e.device.is_none() && (e.api as u32) < 8;
        // Only a stack whose place names it again.
        let placed = at_place(shared_index(e.stack), child) == e.stack;
        if once && placed {
            self.entries[g as usize] = Self::fresh((FREE_STACK, e.api, None));
            self.free.push(g);
            self.retired_once += 1;
            return Some(ONCE | if child { ONCE_CHILD } else { 0 } | (e.api as u32) << ONCE_API_SHIFT | e.total_bytes);
        }
        let r = Retired {
            stack: e.stack,
            total_allocs: e.total_allocs,
            total_bytes: e.total_bytes,
            peak_live_bytes: e.peak_live_bytes,
            api: e.api,
            device: e.device,
        };
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
        self.entries[g as usize] = Self::fresh((FREE_STACK, e.api, None));
        self.free.push(g);
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
            api: crate::hotpath::event::Api::from_bits(((r & !(ONCE | ONCE_CHILD)) >> ONCE_API_SHIFT) as u8),
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
        let e = &mut self.entries[g as usize];
        (e.total_allocs, e.total_bytes, e.peak_live_bytes) = (rec.total_allocs, rec.total_bytes, rec.peak_live_bytes);
        g
    }

    /// Groups retired now (for tests and diagnostics).
    pub fn retired_count(&self) -> usize {
        self.retired.len() - self.retired_free.len() + self.retired_once
    }

    #[inline]
    pub fn key(&self, g: u32) -> GroupKey {
        let e = &self.entries[g as usize];
        (e.stack, e.api, e.device)
    }

    /// The figures of group `g`.
    #[inline]
    pub fn get(&self, g: u32) -> GroupStats {
        let e = &self.entries[g as usize];
        if e.flags & WIDE != 0 {
            return self.wide[e.live_bytes as usize];
        }
        GroupStats {
            live_bytes: e.live_bytes.into(),
            live_blocks: e.live_blocks.into(),
            total_allocs: e.total_allocs.into(),
            total_bytes: e.total_bytes.into(),
            peak_live_bytes: e.peak_live_bytes.into(),
            generation: e.generation,
            trend: Trend { seen: e.flags & SEEN != 0, base: e.base.into(), last: e.last.into(), steps: e.steps, ups: e.ups, downs: e.downs },
            pointed_bytes: e.pointed_bytes.into(),
            changed: e.flags & CHANGED != 0,
        }
    }

    /// Sets the figures of group `g`.
    #[inline]
    pub fn set(&mut self, g: u32, s: GroupStats) {
        let e = &mut self.entries[g as usize];
        if e.flags & WIDE != 0 {
            self.wide[e.live_bytes as usize] = s;
            return;
        }
        let Some([live_bytes, live_blocks, total_allocs, total_bytes, peak_live_bytes, base, last, pointed_bytes]) = narrow(&s) else {
            // For good: a group this large stays wide (no going back and forth).
            e.flags |= WIDE;
            e.live_bytes = self.wide.len() as u32;
            self.wide.push(s);
            return;
        };
        e.flags = if s.changed { CHANGED } else { 0 } | if s.trend.seen { SEEN } else { 0 };
        e.generation = s.generation;
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

    /// The collector's per-event steps on a compact group of `generation`, without
    /// widening it (`get`/`set` copy every figure, a fifth of the collector's time per
    /// event in `bench/malloc_bench.c`). Each returns false, changing nothing, where the
    /// caller must take the general path (`update`): a wide group, one of an earlier
    /// process generation, or a figure about to outgrow 32 bits.
    #[inline(always)]
    pub fn add_live(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((e, size)) = self.compact_entry(g, generation, size) else { return false };
        let (Some(bytes), Some(blocks)) = (e.live_bytes.checked_add(size), e.live_blocks.checked_add(1)) else { return false };
        (e.live_bytes, e.live_blocks) = (bytes, blocks);
        e.peak_live_bytes = e.peak_live_bytes.max(bytes);
        true
    }

    /// See `add_live`.
    #[inline(always)]
    pub fn remove_live(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((e, size)) = self.compact_entry(g, generation, size) else { return false };
        let (Some(bytes), Some(blocks)) = (e.live_bytes.checked_sub(size), e.live_blocks.checked_sub(1)) else { return false };
        (e.live_bytes, e.live_blocks) = (bytes, blocks);
        true
    }

    /// See `add_live`.
    #[inline(always)]
    pub fn count_alloc(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((e, size)) = self.compact_entry(g, generation, size) else { return false };
        let (Some(bytes), Some(allocs)) = (e.total_bytes.checked_add(size), e.total_allocs.checked_add(1)) else { return false };
        (e.total_bytes, e.total_allocs) = (bytes, allocs);
        true
    }

    /// See `add_live`: an allocation freed before the collector took it
    /// (`EventKind::Transient`) counts as allocated, and its bytes as live for a moment.
    #[inline(always)]
    pub fn count_transient(&mut self, g: u32, generation: u16, size: u64) -> bool {
        let Some((e, size)) = self.compact_entry(g, generation, size) else { return false };
        let (Some(bytes), Some(allocs), Some(momentary)) = (e.total_bytes.checked_add(size), e.total_allocs.checked_add(1), e.live_bytes.checked_add(size))
        else {
            return false;
        };
        (e.total_bytes, e.total_allocs) = (bytes, allocs);
        e.peak_live_bytes = e.peak_live_bytes.max(momentary);
        true
    }

    /// Group `g`'s compact entry and `size` in 32 bits, where a per-event step may work
    /// on them in place: the group is compact and of `generation`, the size fits.
    #[inline(always)]
    fn compact_entry(&mut self, g: u32, generation: u16, size: u64) -> Option<(&mut Entry, u32)> {
        let e = &mut self.entries[g as usize];
        let size = u32::try_from(size).ok()?;
        (e.flags & WIDE == 0 && e.generation == generation).then_some((e, size))
    }

    /// Marks group `g` changed; whether it was not already (without widening it: this
    /// runs for every event).
    #[inline]
    pub fn mark_changed(&mut self, g: u32) -> bool {
        let e = &mut self.entries[g as usize];
        if e.flags & WIDE != 0 {
            let s = &mut self.wide[e.live_bytes as usize];
            return !std::mem::replace(&mut s.changed, true);
        }
        let was = e.flags & CHANGED != 0;
        e.flags |= CHANGED;
        !was
    }

    /// Groups kept wide (for tests and diagnostics).
    #[cfg(test)]
    pub fn wide_count(&self) -> usize {
        self.wide.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hotpath::event::Api;

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
                if !(fast.count_alloc(g, 2, size) && fast.add_live(g, 2, size)) {
                    // A refused step changed nothing: the general path does both.
                    fast.update(g, |s| {
                        s.total_allocs += 1;
                        s.total_bytes += size;
                        s.live_bytes += size;
                        s.live_blocks += 1;
                        s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
                    });
                }
                slow.update(g, |s| {
                    s.total_allocs += 1;
                    s.total_bytes += size;
                    s.live_bytes += size;
                    s.live_blocks += 1;
                    s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
                });
                live[g as usize].push(size);
            } else {
                let size = live[g as usize].pop().unwrap();
                if !fast.remove_live(g, 2, size) {
                    fast.update(g, |s| {
                        s.live_bytes -= size;
                        s.live_blocks -= 1;
                    });
                }
                slow.update(g, |s| {
                    s.live_bytes -= size;
                    s.live_blocks -= 1;
                });
            }
        }
        for g in 0..4 {
            assert_eq!(fast.get(g), slow.get(g));
        }
        assert!(fast.wide_count() > 0, "no group outgrew 32 bits");
        // Another generation's group is never touched by a step.
        assert!(!fast.add_live(0, 3, 1) && !fast.count_alloc(0, 3, 1) && !fast.remove_live(0, 3, 1));
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
