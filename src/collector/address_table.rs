//! The live heap blocks by address: an open-addressing table built for the collector's
//! access pattern, where a general hash map costs a cache miss per event.
//!
//! - Neighbouring addresses land in neighbouring slots: the 64 granules (16 bytes) of a
//!   1 KiB window map to 64 consecutive slots and windows are scattered. Blocks that are
//!   allocated together are mostly freed together, so one cache line serves several
//!   events in a row.
//! - The slot of an address is known before the event is applied, so the drain loop can
//!   `prefetch` the slots of the events it will apply next and their misses overlap
//!   instead of coming one after another.
//! - Keys and values live in separate arrays: a probe walks 8 keys per cache line.
//! - Linear probing with backward-shift deletion: no tombstones, so a long run of
//!   allocations and frees never degrades the probe lengths.

use crate::hotpath::mapping::{prefetch_line, ZeroedArray};

/// Key of an empty slot. Address 0 is never a live block; it gets its own slot anyway
/// so that the table is total.
const EMPTY: u64 = 0;
const MIN_CAPACITY: usize = 1024;
/// Growing to this many slots (6 MiB of new arrays) takes longer than a producer's
/// large ring lasts at full speed.
const STALLING_CAPACITY: usize = 1 << 18;
/// Tables of at most this many slots (1.5 MiB) are never shrunk.
const SHRINK_FROM: usize = 1 << 16;

/// A value the table stores, as two words: the arrays then start as zero pages the
/// kernel hands out as they are touched (`ZeroedArray`), where `Option<V>` slots had to
/// be written one by one each time the table grew. An empty slot's value is never read.
pub trait Packed: Copy {
    fn pack(self) -> [u64; 2];
    fn unpack(words: [u64; 2]) -> Self;
}

pub struct AddressTable<V: Packed> {
    keys: ZeroedArray<u64>,
    /// `values[i]` is meaningful where `keys[i]` is not `EMPTY`.
    values: ZeroedArray<[u64; 2]>,
    /// The value stored under address 0.
    zero: Option<V>,
    len: usize,
    mask: usize,
}

impl<V: Packed> Default for AddressTable<V> {
    fn default() -> Self {
        AddressTable { keys: ZeroedArray::default(), values: ZeroedArray::default(), zero: None, len: 0, mask: 0 }
    }
}

/// The preferred slot of `addr` in a table of `mask + 1` slots.
#[inline(always)]
fn home(addr: u64, mask: usize) -> usize {
    let mut window = addr >> 10;
    window ^= window >> 31;
    window = window.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    window ^= window >> 29;
    (((window << 6) | ((addr >> 4) & 63)) as usize) & mask
}

impl<V: Packed> AddressTable<V> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Asks the CPU to start loading the slots `addr` would be found in.
    #[inline(always)]
    pub fn prefetch(&self, addr: u64) {
        if self.keys.is_empty() {
            return;
        }
        let i = home(addr, self.mask);
        prefetch_line(&self.keys[i]);
        prefetch_line(&self.values[i]);
    }

    /// The slot holding `addr`, if present.
    #[inline]
    fn find(&self, addr: u64) -> Option<usize> {
        if self.keys.is_empty() {
            return None;
        }
        let mut i = home(addr, self.mask);
        loop {
            let k = self.keys[i];
            if k == addr {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    pub fn get(&self, addr: u64) -> Option<V> {
        if addr == EMPTY {
            return self.zero;
        }
        self.find(addr).map(|i| V::unpack(self.values[i]))
    }

    /// Stores `value` under `addr`; returns the value it replaces.
    #[inline]
    pub fn insert(&mut self, addr: u64, value: V) -> Option<V> {
        if addr == EMPTY {
            let old = self.zero.replace(value);
            if old.is_none() {
                self.len += 1;
            }
            return old;
        }
        // At most half full: probe runs stay short even where windows crowd together.
        if (self.len + 1) * 2 > self.keys.len() {
            self.grow();
        }
        let mut i = home(addr, self.mask);
        loop {
            let k = self.keys[i];
            if k == addr {
                return Some(V::unpack(std::mem::replace(&mut self.values[i], value.pack())));
            }
            if k == EMPTY {
                self.keys[i] = addr;
                self.values[i] = value.pack();
                self.len += 1;
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes `addr`; returns its value.
    #[inline]
    pub fn remove(&mut self, addr: u64) -> Option<V> {
        if addr == EMPTY {
            let old = self.zero.take();
            if old.is_some() {
                self.len -= 1;
            }
            return old;
        }
        let mut hole = self.find(addr)?;
        let value = V::unpack(self.values[hole]);
        self.len -= 1;
        // Backward shift: pull later members of the probe run into the hole when their
        // home slot is not after the hole (cyclically), so every key stays reachable
        // from its home without tombstones.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let k = self.keys[j];
            if k == EMPTY {
                break;
            }
            let h = home(k, self.mask);
            let wraps_past_hole = if hole <= j { h <= hole || h > j } else { h <= hole && h > j };
            if wraps_past_hole {
                self.keys[hole] = k;
                self.values[hole] = self.values[j];
                hole = j;
            }
        }
        self.keys[hole] = EMPTY;
        Some(value)
    }

    #[cold]
    fn grow(&mut self) {
        self.rebuild((self.keys.len() * 2).max(MIN_CAPACITY));
    }

    /// Gives back what a peak left: a table at most an eighth full moves to one a
    /// quarter of its size (at most half full, as after a growth). Called between
    /// drains (reports and timeline points), never per event, so that a program whose
    /// live blocks rise and fall every step does not rebuild the table every step.
    /// `import torch` leaves 89k live blocks in the 2M slots (48 MiB) its peak of 633k
    /// needed. Returns whether it moved.
    pub fn shrink_if_sparse(&mut self) -> bool {
        let capacity = self.keys.len();
        if capacity <= SHRINK_FROM || self.len * 8 >= capacity {
            return false;
        }
        self.rebuild((capacity / 4).max(MIN_CAPACITY));
        true
    }

    /// Moves every entry to new arrays of `capacity` slots (a power of two, more than
    /// twice `len`).
    fn rebuild(&mut self, capacity: usize) {
        debug_assert!(capacity.is_power_of_two() && capacity >= 2 * self.len);
        // Producers whose rings fill meanwhile move to larger ones instead of waiting.
        let _stall = (capacity >= STALLING_CAPACITY).then(crate::hotpath::channel::ConsumerStall::begin);
        let old_keys = std::mem::replace(&mut self.keys, ZeroedArray::populated(capacity));
        let old_values = std::mem::replace(&mut self.values, ZeroedArray::populated(capacity));
        self.mask = capacity - 1;
        // Each move is a miss in the new arrays: start loading the home slots of the
        // keys a little ahead, so that the misses overlap (the collector stops taking
        // events while it grows, and producers fill their rings meanwhile).
        const AHEAD: usize = 16;
        for (n, (&k, &v)) in old_keys.iter().zip(old_values.iter()).enumerate() {
            if let Some(&ahead) = old_keys.get(n + AHEAD) {
                if ahead != EMPTY {
                    let h = home(ahead, self.mask);
                    prefetch_line(&self.keys[h]);
                    prefetch_line(&self.values[h]);
                }
            }
            if k == EMPTY {
                continue;
            }
            let mut i = home(k, self.mask);
            while self.keys[i] != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.keys[i] = k;
            self.values[i] = v;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let zero = self.zero.map(|v| (EMPTY, v));
        zero.into_iter().chain(self.keys.iter().zip(self.values.iter()).filter(|(k, _)| **k != EMPTY).map(|(&k, &v)| (k, V::unpack(v))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    impl Packed for u32 {
        fn pack(self) -> [u64; 2] {
            [self as u64, !(self as u64)]
        }

        fn unpack([v, check]: [u64; 2]) -> u32 {
            assert_eq!(check, !v, "a value read from a slot never written");
            v as u32
        }
    }

    impl Packed for usize {
        fn pack(self) -> [u64; 2] {
            (self as u32).pack()
        }

        fn unpack(words: [u64; 2]) -> usize {
            u32::unpack(words) as usize
        }
    }

    #[test]
    fn insert_get_remove_and_zero_address() {
        let mut t = AddressTable::new();
        assert_eq!(t.insert(0x1000, 1u32), None);
        assert_eq!(t.insert(0x1000, 2), Some(1));
        assert_eq!(t.insert(0, 7), None);
        assert_eq!(t.len(), 2);
        assert_eq!(t.get(0x1000), Some(2));
        assert_eq!(t.get(0), Some(7));
        assert_eq!(t.remove(0x1000), Some(2));
        assert_eq!(t.remove(0x1000), None);
        assert_eq!(t.remove(0), Some(7));
        assert!(t.is_empty());
        assert_eq!(t.iter().count(), 0);
    }

    #[test]
    fn dense_windows_and_wraparound_survive_deletes() {
        // Every granule of a few windows: long probe runs that wrap the table's end.
        let mut t = AddressTable::new();
        let addrs: Vec<u64> = (0..4u64).flat_map(|w| (0..64u64).map(move |g| (w << 30) | (g << 4))).collect();
        for (i, &a) in addrs.iter().enumerate() {
            t.insert(a, i);
        }
        for (i, &a) in addrs.iter().enumerate().step_by(3) {
            assert_eq!(t.remove(a), Some(i));
        }
        for (i, &a) in addrs.iter().enumerate() {
            let expect = if i % 3 == 0 { None } else { Some(i) };
            assert_eq!(t.get(a), expect, "address {a:#x}");
        }
    }

    /// The table agrees with a HashMap over a long pseudo-random run of inserts and
    /// removes, with addresses drawn from a few crowded windows so that probe runs
    /// collide, shift back and wrap, and the table grows several times.
    #[test]
    fn agrees_with_a_hash_map() {
        let mut t = AddressTable::new();
        let mut m = HashMap::new();
        let mut rng = crate::test_rng::TestRng::new(0x2545_f491_4f6c_dd1d);
        for step in 0..200_000u32 {
            let x = rng.next_u64();
            let window = (x >> 8) % 6;
            let granule = (x >> 16) % 256;
            let addr = (window << 24) | (granule << 4) | if step > 150_000 { 0 } else { ((x >> 32) % 64) << 12 };
            if x % 5 < 3 {
                assert_eq!(t.insert(addr, step), m.insert(addr, step));
            } else {
                assert_eq!(t.remove(addr), m.remove(&addr));
            }
            assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(*v));
        }
        // It never stalled the consumer: the channel's tests count on their rings filling.
        assert!(t.keys.len() < STALLING_CAPACITY);
        let mut seen: Vec<(u64, u32)> = t.iter().collect();
        seen.sort_unstable();
        let mut want: Vec<(u64, u32)> = m.into_iter().collect();
        want.sort_unstable();
        assert_eq!(seen, want);
    }

    /// A table left sparse by a peak shrinks, keeps every entry, and grows again.
    #[test]
    fn a_sparse_table_shrinks_and_keeps_its_entries() {
        let mut t = AddressTable::new();
        let n = 100_000u64;
        for i in 0..n {
            t.insert(0x7f00_0000_0000 + i * 48, i as u32);
        }
        let big = t.keys.len();
        assert!(big >= 2 * n as usize);
        assert!(!t.shrink_if_sparse(), "a full table stays");
        for i in (0..n).filter(|i| i % 16 != 0) {
            assert_eq!(t.remove(0x7f00_0000_0000 + i * 48), Some(i as u32));
        }
        assert!(t.shrink_if_sparse());
        assert_eq!(t.keys.len(), big / 4);
        assert_eq!(t.len(), (n / 16) as usize);
        for i in 0..n {
            let want = (i % 16 == 0).then_some(i as u32);
            assert_eq!(t.get(0x7f00_0000_0000 + i * 48), want);
        }
        for i in 0..n {
            t.insert(0x7f10_0000_0000 + i * 32, i as u32);
        }
        assert_eq!(t.get(0x7f10_0000_0000 + 32), Some(1));
        assert_eq!(t.len(), (n + n / 16) as usize);
        // Small tables are left alone.
        let mut small = AddressTable::new();
        small.insert(16, 1u32);
        assert!(!small.shrink_if_sparse());
    }
}
