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
//! - A slot is 16 bytes, the address and its value in one word side by side: a probe
//!   that finds its key has the value in the same cache line. A value that does not fit
//!   a word (`Packed::pack` says so: a block of 64 GiB, a program's 16-millionth group,
//!   a checkpoint region past the first) lives in a hash map aside, and its slot says so.
//!   `import torch`'s peak of live blocks took 48 MiB as 24-byte slots at most half
//!   full; now 16 MiB, at most three quarters full.
//! - Linear probing with backward-shift deletion: no tombstones, so a long run of
//!   allocations and frees never degrades the probe lengths.

use crate::hotpath::mapping::{prefetch_line, ZeroedArray};
use crate::util::FxMap;

/// Key of an empty slot. Address 0 is never a live block; it gets its own slot anyway
/// so that the table is total.
const EMPTY: u64 = 0;
/// The value word of a slot whose value is in `AddressTable::wide`.
const WIDE: u64 = u64::MAX;
const MIN_CAPACITY: usize = 1024;
/// Growing to this many slots (4 MiB of new arrays) takes longer than a producer's
/// large ring lasts at full speed.
const STALLING_CAPACITY: usize = 1 << 18;
/// Tables of at most this many slots (1 MiB) are never shrunk.
const SHRINK_FROM: usize = 1 << 16;
/// The most entries per 8 slots: the table grows past three quarters full. Probe runs
/// stay short enough (the windows' granules fill consecutive slots, and a slot's value
/// is in the line its key is), and a peak just past a power of two (`import torch`'s
/// ~700k) does not double the table as "at most half full" did: 3M live blocks were
/// 7.9 s and 728 MB of a C program's run with 24-byte slots at most half full, 6.7 s
/// and 531 MB so.
const MAX_EIGHTHS: usize = 6;

/// A value the table stores in one word (`None`: it does not fit, and is kept aside).
/// `pack` never returns `Some(u64::MAX)`.
pub trait Packed: Copy {
    fn pack(self) -> Option<u64>;
    fn unpack(word: u64) -> Self;
}

pub struct AddressTable<V: Packed> {
    /// `[address, value word]`; the value is meaningful where the address is not `EMPTY`.
    slots: ZeroedArray<[u64; 2]>,
    /// The values that did not fit a word, by address.
    pub(super) wide: FxMap<u64, V>,
    /// The value stored under address 0.
    zero: Option<V>,
    len: usize,
    mask: usize,
}

impl<V: Packed> Default for AddressTable<V> {
    fn default() -> Self {
        AddressTable { slots: ZeroedArray::default(), wide: FxMap::default(), zero: None, len: 0, mask: 0 }
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
        if self.slots.is_empty() {
            return;
        }
        prefetch_line(&self.slots[home(addr, self.mask)]);
    }

    /// The slot holding `addr`, if present.
    #[inline]
    fn find(&self, addr: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = home(addr, self.mask);
        loop {
            let k = self.slots[i][0];
            if k == addr {
                return Some(i);
            }
            if k == EMPTY {
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// The value of a slot's word (`addr`'s).
    #[inline(always)]
    fn value(&self, addr: u64, word: u64) -> Option<V> {
        if word == WIDE {
            self.wide.get(&addr).copied()
        } else {
            Some(V::unpack(word))
        }
    }

    /// The word to store for `value` under `addr` (kept aside if it does not fit).
    #[inline(always)]
    fn word(&mut self, addr: u64, value: V) -> u64 {
        match value.pack() {
            Some(w) => w,
            None => {
                self.wide.insert(addr, value);
                WIDE
            }
        }
    }

    /// Forgets what a replaced or removed slot of `addr` kept aside.
    #[inline(always)]
    fn take(&mut self, addr: u64, word: u64) -> Option<V> {
        if word == WIDE {
            self.wide.remove(&addr)
        } else {
            Some(V::unpack(word))
        }
    }

    pub fn get(&self, addr: u64) -> Option<V> {
        if addr == EMPTY {
            return self.zero;
        }
        self.find(addr).and_then(|i| self.value(addr, self.slots[i][1]))
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
        if (self.len + 1) * 8 > self.slots.len() * MAX_EIGHTHS {
            self.grow();
        }
        let mut i = home(addr, self.mask);
        loop {
            let [k, old] = self.slots[i];
            if k == addr {
                let old = self.take(addr, old);
                self.slots[i][1] = self.word(addr, value);
                return old;
            }
            if k == EMPTY {
                self.slots[i] = [addr, self.word(addr, value)];
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
        let value = self.take(addr, self.slots[hole][1]);
        self.len -= 1;
        // Backward shift: pull later members of the probe run into the hole when their
        // home slot is not after the hole (cyclically), so every key stays reachable
        // from its home without tombstones.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let k = self.slots[j][0];
            if k == EMPTY {
                break;
            }
            let h = home(k, self.mask);
            let wraps_past_hole = if hole <= j { h <= hole || h > j } else { h <= hole && h > j };
            if wraps_past_hole {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = [EMPTY, 0];
        value
    }

    #[cold]
    fn grow(&mut self) {
        self.rebuild((self.slots.len() * 2).max(MIN_CAPACITY));
    }

    /// Gives back what a peak left: a table at most an eighth full moves to one a
    /// quarter of its size (at most half full). Called between drains (reports and
    /// timeline points), never per event, so that a program whose live blocks rise and
    /// fall every step does not rebuild the table every step. `import torch` leaves 89k
    /// live blocks in the 1M slots its peak of 633k needed. Returns whether it moved.
    pub fn shrink_if_sparse(&mut self) -> bool {
        let capacity = self.slots.len();
        if capacity <= SHRINK_FROM || self.len * 8 >= capacity {
            return false;
        }
        self.rebuild((capacity / 4).max(MIN_CAPACITY));
        true
    }

    /// Moves every entry to a new array of `capacity` slots (a power of two, room for
    /// `len` within the load limit).
    fn rebuild(&mut self, capacity: usize) {
        debug_assert!(capacity.is_power_of_two() && capacity * MAX_EIGHTHS >= 8 * self.len);
        // Producers whose rings fill meanwhile move to larger ones instead of waiting.
        let _stall = (capacity >= STALLING_CAPACITY).then(crate::hotpath::channel::ConsumerStall::begin);
        let old = std::mem::replace(&mut self.slots, ZeroedArray::populated(capacity));
        self.mask = capacity - 1;
        // Each move is a miss in the new array: start loading the home slots of the keys
        // a little ahead, so that the misses overlap (the collector stops taking events
        // while it grows, and producers fill their rings meanwhile).
        const AHEAD: usize = 16;
        for (n, &slot) in old.iter().enumerate() {
            if let Some(&[ahead, _]) = old.get(n + AHEAD) {
                if ahead != EMPTY {
                    prefetch_line(&self.slots[home(ahead, self.mask)]);
                }
            }
            if slot[0] == EMPTY {
                continue;
            }
            let mut i = home(slot[0], self.mask);
            while self.slots[i][0] != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.slots[i] = slot;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let zero = self.zero.map(|v| (EMPTY, v));
        zero.into_iter().chain(self.slots.iter().filter(|s| s[0] != EMPTY).filter_map(|&[k, w]| Some((k, self.value(k, w)?))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Values past 2^31 do not fit (to test the values kept aside); a check word above
    /// each one catches a slot read that was never written.
    impl Packed for u32 {
        fn pack(self) -> Option<u64> {
            (self < 1 << 31).then_some(self as u64 | (!(self as u64) & 0xffff_ffff) << 32)
        }

        fn unpack(w: u64) -> u32 {
            assert_eq!(w >> 32, !w & 0xffff_ffff, "a value read from a slot never written");
            w as u32
        }
    }

    impl Packed for usize {
        fn pack(self) -> Option<u64> {
            (self as u32).pack()
        }

        fn unpack(word: u64) -> usize {
            u32::unpack(word) as usize
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
            // One value in seven does not fit a word and is kept aside.
            let value = if x.is_multiple_of(7) { step | 1 << 31 } else { step };
            if x % 5 < 3 {
                assert_eq!(t.insert(addr, value), m.insert(addr, value));
            } else {
                assert_eq!(t.remove(addr), m.remove(&addr));
            }
            assert_eq!(t.len(), m.len());
        }
        for (k, v) in &m {
            assert_eq!(t.get(*k), Some(*v));
        }
        // Nothing is kept aside for a slot that no longer holds it.
        assert_eq!(t.wide.len(), m.values().filter(|&&v| v >= 1 << 31).count());
        // It never stalled the consumer: the channel's tests count on their rings filling.
        assert!(t.slots.len() < STALLING_CAPACITY);
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
        let big = t.slots.len();
        assert!(big * MAX_EIGHTHS >= 8 * n as usize);
        assert!(!t.shrink_if_sparse(), "a full table stays");
        for i in (0..n).filter(|i| i % 16 != 0) {
            assert_eq!(t.remove(0x7f00_0000_0000 + i * 48), Some(i as u32));
        }
        assert!(t.shrink_if_sparse());
        assert_eq!(t.slots.len(), big / 4);
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
