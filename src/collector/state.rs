//! The collector's model of the process: the live set and per-stack aggregates.
//! Plain safe Rust, fed one event at a time in ticket order.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::hotpath::event::{Api, Event, EventKind};

/// A multiplicative hasher: keys are addresses and small ids, already well spread.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(v as u64);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub size: u64,
    /// Index into `Collector::groups` (one per stack and api).
    pub group: u32,
    /// Allocated by the parent before this (forked) process existed.
    pub inherited: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub total_allocs: u64,
    pub total_bytes: u64,
    pub peak_live_bytes: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub total_allocs: u64,
    pub total_frees: u64,
    pub peak_live_bytes: u64,
    pub inherited_live_bytes: u64,
    pub inherited_live_blocks: u64,
    pub inherited_frees: u64,
    /// Frees of addresses never seen allocated (allocated before tracking started, or by
    /// the library itself): ignored.
    pub unknown_frees: u64,
    pub events: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    pub stack: u32,
    pub api: Api,
    pub stats: GroupStats,
}

#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub totals: Totals,
    /// Groups with live blocks, largest first.
    pub groups: Vec<GroupSnapshot>,
}

#[derive(Default)]
pub struct Collector {
    live: FxMap<u64, LiveBlock>,
    /// Per (stack, api) statistics; a free finds its group by index, without hashing.
    groups: Vec<(u32, Api, GroupStats)>,
    group_index: FxMap<(u32, Api), u32>,
    /// Blocks between a realloc's release and its outcome, by thread.
    realloc_in_flight: FxMap<u32, (u64, LiveBlock)>,
    totals: Totals,
}

impl Collector {
    pub fn new() -> Collector {
        Collector::default()
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    fn group_of(&mut self, stack: u32, api: Api) -> u32 {
        let next = self.groups.len() as u32;
        let idx = *self.group_index.entry((stack, api)).or_insert(next);
        if idx == next {
            self.groups.push((stack, api, GroupStats::default()));
        }
        idx
    }

    fn add_live(&mut self, addr: u64, block: LiveBlock) {
        if let Some(old) = self.live.insert(addr, block) {
            // A free we never saw (made from an untracked context): forget the old block.
            self.remove_accounting(&old);
        }
        if block.inherited {
            self.totals.inherited_live_bytes += block.size;
            self.totals.inherited_live_blocks += 1;
            return;
        }
        let g = &mut self.groups[block.group as usize].2;
        g.live_bytes += block.size;
        g.live_blocks += 1;
        g.peak_live_bytes = g.peak_live_bytes.max(g.live_bytes);
        self.totals.live_bytes += block.size;
        self.totals.live_blocks += 1;
        self.totals.peak_live_bytes = self.totals.peak_live_bytes.max(self.totals.live_bytes);
    }

    fn remove_accounting(&mut self, block: &LiveBlock) {
        if block.inherited {
            self.totals.inherited_live_bytes -= block.size;
            self.totals.inherited_live_blocks -= 1;
            return;
        }
        let g = &mut self.groups[block.group as usize].2;
        g.live_bytes -= block.size;
        g.live_blocks -= 1;
        self.totals.live_bytes -= block.size;
        self.totals.live_blocks -= 1;
    }

    fn count_free(&mut self, block: &LiveBlock) {
        if block.inherited {
            self.totals.inherited_frees += 1;
        } else {
            self.totals.total_frees += 1;
        }
    }

    fn take_live(&mut self, addr: u64) -> Option<LiveBlock> {
        let block = self.live.remove(&addr)?;
        self.remove_accounting(&block);
        Some(block)
    }

    pub fn apply(&mut self, ev: &Event) {
        self.totals.events += 1;
        match ev.kind {
            EventKind::Alloc => {
                if ev.api.is_realloc() {
                    if let Some((_, old)) = self.realloc_in_flight.remove(&ev.tid) {
                        self.count_free(&old);
                    }
                }
                let group = self.group_of(ev.stack, ev.api);
                let block = LiveBlock { size: ev.size, group, inherited: false };
                let g = &mut self.groups[group as usize].2;
                g.total_allocs += 1;
                g.total_bytes += ev.size;
                self.totals.total_allocs += 1;
                self.add_live(ev.addr, block);
            }
            EventKind::Free => match self.take_live(ev.addr) {
                Some(block) => self.count_free(&block),
                None => self.totals.unknown_frees += 1,
            },
            EventKind::ReallocRelease => {
                if let Some(block) = self.take_live(ev.addr) {
                    self.realloc_in_flight.insert(ev.tid, (ev.addr, block));
                }
            }
            EventKind::ReallocRestore => {
                if let Some((addr, block)) = self.realloc_in_flight.remove(&ev.tid) {
                    self.add_live(addr, block);
                }
            }
            EventKind::ReallocFreed => {
                if let Some((_, block)) = self.realloc_in_flight.remove(&ev.tid) {
                    self.count_free(&block);
                }
            }
        }
    }

    /// Called in a forked child once the parent's events are consumed: everything live
    /// now belongs to the parent's history, not to the child.
    pub fn fork_boundary(&mut self) {
        for block in self.live.values_mut() {
            block.inherited = true;
        }
        // A realloc in flight in another thread of the parent will never complete here.
        self.realloc_in_flight.clear();
        let events = self.totals.events;
        self.totals = Totals {
            inherited_live_bytes: self.live.values().map(|b| b.size).sum(),
            inherited_live_blocks: self.live.len() as u64,
            events,
            ..Totals::default()
        };
        // Keep the indices (inherited blocks still carry them); restart the statistics.
        for g in self.groups.iter_mut() {
            g.2 = GroupStats::default();
        }
    }

    /// Every outstanding block `(address, size, stack, api, inherited)`, sorted by address.
    pub fn live_blocks(&self) -> Vec<(u64, u64, u32, Api, bool)> {
        let mut v: Vec<(u64, u64, u32, Api, bool)> = self
            .live
            .iter()
            .map(|(&addr, b)| {
                let (stack, api, _) = self.groups[b.group as usize];
                (addr, b.size, stack, api, b.inherited)
            })
            .collect();
        v.sort_unstable_by_key(|b| b.0);
        v
    }

    pub fn snapshot(&self) -> Snapshot {
        let mut groups: Vec<GroupSnapshot> = self
            .groups
            .iter()
            .filter(|(_, _, s)| s.live_blocks > 0)
            .map(|&(stack, api, stats)| GroupSnapshot { stack, api, stats })
            .collect();
        groups.sort_by(|a, b| {
            b.stats
                .live_bytes
                .cmp(&a.stats.live_bytes)
                .then(b.stats.live_blocks.cmp(&a.stats.live_blocks))
                .then(a.stack.cmp(&b.stack))
                .then(a.api.cmp(&b.api))
        });
        Snapshot { totals: self.totals, groups }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: EventKind, api: Api, tid: u32, stack: u32, addr: u64, size: u64) -> Event {
        Event { kind, api, tid, stack, addr, size }
    }
    fn alloc(addr: u64, size: u64, stack: u32) -> Event {
        ev(EventKind::Alloc, Api::Malloc, 1, stack, addr, size)
    }
    fn free(addr: u64) -> Event {
        ev(EventKind::Free, Api::Malloc, 1, 0, addr, 0)
    }

    #[test]
    fn alloc_free_accounting_and_groups() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 100, 1));
        c.apply(&alloc(0x20, 50, 1));
        c.apply(&alloc(0x30, 7, 2));
        c.apply(&free(0x20));
        c.apply(&free(0x999));
        let s = c.snapshot();
        assert_eq!(s.totals.live_bytes, 107);
        assert_eq!(s.totals.live_blocks, 2);
        assert_eq!(s.totals.total_allocs, 3);
        assert_eq!(s.totals.total_frees, 1);
        assert_eq!(s.totals.peak_live_bytes, 157);
        assert_eq!(s.totals.unknown_frees, 1);
        assert_eq!(s.groups.len(), 2);
        assert_eq!((s.groups[0].stack, s.groups[0].stats.live_bytes, s.groups[0].stats.peak_live_bytes), (1, 100, 150));
        assert_eq!((s.groups[1].stack, s.groups[1].stats.live_blocks), (2, 1));
        assert_eq!(s.totals.total_allocs - s.totals.total_frees, s.totals.live_blocks);
    }

    #[test]
    fn address_reuse_after_free_is_a_new_block() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 8, 1));
        c.apply(&free(0x10));
        c.apply(&alloc(0x10, 16, 2));
        let s = c.snapshot();
        assert_eq!(s.groups.len(), 1);
        assert_eq!((s.groups[0].stack, s.groups[0].stats.live_bytes), (2, 16));
    }

    #[test]
    fn realloc_moved_in_place_failed_and_zero() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 8, 1));
        // moved
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x10, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 3, 0x40, 64));
        // failed: block stays as it was
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x40, 0));
        c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 1, 0, 0x40, 0));
        let s = c.snapshot();
        assert_eq!((s.totals.live_blocks, s.totals.live_bytes), (1, 64));
        assert_eq!((s.totals.total_allocs, s.totals.total_frees), (2, 1));
        assert_eq!((s.groups[0].stack, s.groups[0].api), (3, Api::Realloc));
        // realloc(p, 0) freed it
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x40, 0));
        c.apply(&ev(EventKind::ReallocFreed, Api::Realloc, 1, 0, 0x40, 0));
        let s = c.snapshot();
        assert_eq!((s.totals.live_blocks, s.totals.total_allocs, s.totals.total_frees), (0, 2, 2));
        assert!(s.groups.is_empty());
    }

    #[test]
    fn realloc_of_unknown_block_counts_only_the_new_one() {
        let mut c = Collector::new();
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 5, 0, 0x10, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 5, 3, 0x40, 64));
        let t = c.totals();
        assert_eq!((t.live_blocks, t.total_allocs, t.total_frees), (1, 1, 0));
    }

    #[test]
    fn interleaved_reallocs_of_two_threads_stay_apart() {
        let mut c = Collector::new();
        c.apply(&ev(EventKind::Alloc, Api::Malloc, 1, 1, 0x10, 8));
        c.apply(&ev(EventKind::Alloc, Api::Malloc, 2, 2, 0x20, 8));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x10, 0));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 2, 0, 0x20, 0));
        c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 2, 0, 0, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 9, 0x30, 32));
        let s = c.snapshot();
        let mut live: Vec<_> = s.groups.iter().map(|g| (g.stack, g.stats.live_bytes)).collect();
        live.sort();
        assert_eq!(live, vec![(2, 8), (9, 32)]);
    }

    #[test]
    fn fork_boundary_moves_everything_to_inherited() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 100, 1));
        c.apply(&alloc(0x20, 20, 1));
        c.fork_boundary();
        let s = c.snapshot();
        assert!(s.groups.is_empty());
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_live_blocks), (120, 2));
        c.apply(&free(0x10));
        c.apply(&alloc(0x30, 5, 4));
        let s = c.snapshot();
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_frees), (20, 1));
        assert_eq!((s.totals.live_bytes, s.totals.total_allocs, s.totals.total_frees), (5, 1, 0));
        assert_eq!(s.groups.len(), 1);
    }
}
