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
//! - A slot is 12 bytes, the address and its value side by side: a probe that finds its
//!   key has the value in the same cache line (two slots in sixteen cross a line). The
//!   key is the address over 8 in `KEY_BITS` (an 8-byte aligned address below 2^47, as
//!   every allocator's blocks in a 4-level address space); the value is a word of
//!   `VALUE_BITS`. An address that has no key (unaligned, higher, or 0) lives in a hash
//!   map aside, and so does a value that does not fit (`Packed::pack` says so: a block of
//!   16 MiB or more, a program's 16-millionth group, a checkpoint region past the
//!   first): its slot says so. `import torch`'s peak of live blocks took 48 MiB as
//!   24-byte slots at most half full, 16 MiB as 16-byte slots at most three quarters
//!   full, 12 MiB now.
//! - Linear probing with backward-shift deletion: no tombstones, so a long run of
//!   allocations and frees never degrades the probe lengths.

use crate::hotpath::mapping::{prefetch_line, ZeroedArray};
use crate::util::FxMap;

/// Bits of a slot's key: the address over 8.
const KEY_BITS: u32 = 44;
const KEY_MASK: u64 = (1 << KEY_BITS) - 1;
/// Bits of a slot's value word.
pub const VALUE_BITS: u32 = 96 - KEY_BITS;
/// Key of an empty slot (address 0 has no key: it is kept aside).
const EMPTY: u64 = 0;
/// The value word of a slot whose value is in `AddressTable::wide`.
const WIDE: u64 = (1 << VALUE_BITS) - 1;
const MIN_CAPACITY: usize = 1024;
/// Growing to this many slots (3 MiB of new arrays) takes longer than a producer's
/// large ring lasts at full speed.
const STALLING_CAPACITY: usize = 1 << 18;
/// Tables of at most this many slots (768 KiB) are never shrunk.
const SHRINK_FROM: usize = 1 << 16;
/// The most entries per 8 slots: the table grows past three quarters full. Probe runs
/// stay short enough (the windows' granules fill consecutive slots, and a slot's value
/// is in the line its key is), and a peak just past a power of two (`import torch`'s
/// ~700k) does not double the table as "at most half full" did: 3M live blocks were
/// 7.9 s and 728 MB of a C program's run with 24-byte slots at most half full, 6.7 s
/// and 531 MB so.
const MAX_EIGHTHS: usize = 6;

/// A value the table stores in a word of `VALUE_BITS` (`None`, or a word of more bits or
/// of all ones: it does not fit, and is kept aside).
pub trait Packed: Copy {
    fn pack(self) -> Option<u64>;
    fn unpack(word: u64) -> Self;
}

/// A slot: key in bits 0..`KEY_BITS`, value word above, in three 32-bit words (12 bytes,
/// 4-byte aligned).
type Slot = [u32; 3];

/// The key of `addr`, if it has one.
#[inline(always)]
fn key_of(addr: u64) -> Option<u64> {
    (addr & 7 == 0 && addr != 0 && addr >> (KEY_BITS + 3) == 0).then_some(addr >> 3)
}

#[inline(always)]
fn slot_key(s: &Slot) -> u64 {
    (s[0] as u64 | (s[1] as u64) << 32) & KEY_MASK
}

#[inline(always)]
fn slot_word(s: &Slot) -> u64 {
    (s[1] >> (KEY_BITS - 32)) as u64 | (s[2] as u64) << (64 - KEY_BITS)
}

#[inline(always)]
fn make_slot(key: u64, word: u64) -> Slot {
    debug_assert!(key <= KEY_MASK && word <= WIDE);
    [key as u32, (key >> 32) as u32 | (word as u32) << (KEY_BITS - 32), (word >> (64 - KEY_BITS)) as u32]
}

pub struct AddressTable<V: Packed> {
    slots: ZeroedArray<Slot>,
    /// The values that did not fit a word, by address.
    pub(super) wide: FxMap<u64, V>,
    /// The entries whose address has no key.
    odd: FxMap<u64, V>,
    /// Entries in `slots` (the others are in `odd`).
    slotted: usize,
    mask: usize,
}

impl<V: Packed> Default for AddressTable<V> {
    fn default() -> Self {
        AddressTable { slots: ZeroedArray::default(), wide: FxMap::default(), odd: FxMap::default(), slotted: 0, mask: 0 }
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
        self.slotted + self.odd.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Asks the CPU to start loading the slots `addr` would be found in.
    #[inline(always)]
    pub fn prefetch(&self, addr: u64) {
        if self.slots.is_empty() {
            return;
        }
        prefetch_line(&self.slots[home(addr, self.mask)]);
    }

    /// The slot holding `key` (`addr`'s), if present.
    #[inline]
    fn find(&self, addr: u64, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = home(addr, self.mask);
        loop {
            let k = slot_key(&self.slots[i]);
            if k == key {
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
        match value.pack().filter(|&w| w < WIDE) {
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
        let Some(key) = key_of(addr) else {
            return self.odd.get(&addr).copied();
        };
        self.find(addr, key).and_then(|i| self.value(addr, slot_word(&self.slots[i])))
    }

    /// Stores `value` under `addr`; returns the value it replaces.
    #[inline]
    pub fn insert(&mut self, addr: u64, value: V) -> Option<V> {
        let Some(key) = key_of(addr) else {
            return self.odd.insert(addr, value);
        };
        if (self.slotted + 1) * 8 > self.slots.len() * MAX_EIGHTHS {
            self.grow();
        }
        let mut i = home(addr, self.mask);
        loop {
            let slot = self.slots[i];
            let k = slot_key(&slot);
            if k == key {
                let old = self.take(addr, slot_word(&slot));
                let word = self.word(addr, value);
                self.slots[i] = make_slot(key, word);
                return old;
            }
            if k == EMPTY {
                let word = self.word(addr, value);
                self.slots[i] = make_slot(key, word);
                self.slotted += 1;
                return None;
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Removes `addr`; returns its value.
    #[inline]
    pub fn remove(&mut self, addr: u64) -> Option<V> {
        let Some(key) = key_of(addr) else {
            return self.odd.remove(&addr);
        };
        let mut hole = self.find(addr, key)?;
        let value = self.take(addr, slot_word(&self.slots[hole]));
        self.slotted -= 1;
        // Backward shift: pull later members of the probe run into the hole when their
        // home slot is not after the hole (cyclically), so every key stays reachable
        // from its home without tombstones.
        let mut j = hole;
        loop {
            j = (j + 1) & self.mask;
            let k = slot_key(&self.slots[j]);
            if k == EMPTY {
                break;
            }
            let h = home(k << 3, self.mask);
            let wraps_past_hole = if hole <= j { h <= hole || h > j } else { h <= hole && h > j };
            if wraps_past_hole {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = [0; 3];
        value
    }

    #[cold]
    fn grow(&mut self) {
        let capacity = (self.slots.len() * 2).max(MIN_CAPACITY);
        // Producers whose rings fill meanwhile move to larger ones instead of waiting.
        let _stall = (capacity >= STALLING_CAPACITY).then(crate::hotpath::channel::ConsumerStall::begin);
        self.rebuild(capacity);
    }

    /// Gives back what a peak left: a table at most an eighth full moves to one a
    /// quarter of its size (at most half full). Called between drains (reports and
    /// timeline points), never per event, so that a program whose live blocks rise and
    /// fall every step does not rebuild the table every step. `import torch` leaves 89k
    /// live blocks in the 1M slots its peak of 633k needed. Returns whether it moved.
    pub fn shrink_if_sparse(&mut self) -> bool {
        let capacity = self.slots.len();
        if capacity <= SHRINK_FROM || self.slotted * 8 >= capacity {
            return false;
        }
        self.rebuild((capacity / 4).max(MIN_CAPACITY));
        true
    }

    /// `shrink_if_sparse` for a table whose blocks are going (a program's teardown,
    /// which frees most of them while the process's peak is still ahead): a table at
    /// most three eighths full moves to one half its size (at most three quarters full),
    /// on every call, so that it follows the frees down. Returns whether it moved.
    pub fn halve_if_sparse(&mut self) -> bool {
        let capacity = self.slots.len();
        if capacity <= SHRINK_FROM || self.slotted * 8 >= capacity * 3 {
            return false;
        }
        self.rebuild(capacity / 2);
        true
    }

    /// Moves every slotted entry to a new array of `capacity` slots (a power of two, room
    /// for them within the load limit).
    ///
    /// Only a growth tells the producers that the consumer stalls (`grow`): a thread
    /// whose large ring fills then moves to a huge one (8 MiB) instead of waiting. A
    /// smaller table is made when the blocks are going, mostly in a program's teardown,
    /// whose end is the process's peak: a DDP rank's main thread had moved to a huge ring
    /// during the teardown's halvings and held 7.2 MB of it at its final report, more
    /// than the halving it waited on gave back. A shrink makes a table half or a quarter
    /// the size; its producers wait for it.
    fn rebuild(&mut self, capacity: usize) {
        debug_assert!(capacity.is_power_of_two() && capacity * MAX_EIGHTHS >= 8 * self.slotted);
        let old = std::mem::replace(&mut self.slots, ZeroedArray::populated(capacity));
        self.mask = capacity - 1;
        // Each move is a miss in the new array: start loading the home slots of the keys
        // a little ahead, so that the misses overlap (the collector stops taking events
        // while it grows, and producers fill their rings meanwhile).
        const AHEAD: usize = 16;
        for (n, slot) in old.iter().enumerate() {
            if let Some(ahead) = old.get(n + AHEAD).map(slot_key) {
                if ahead != EMPTY {
                    prefetch_line(&self.slots[home(ahead << 3, self.mask)]);
                }
            }
            let k = slot_key(slot);
            if k == EMPTY {
                continue;
            }
            let mut i = home(k << 3, self.mask);
            while slot_key(&self.slots[i]) != EMPTY {
                i = (i + 1) & self.mask;
            }
            self.slots[i] = *slot;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, V)> + '_ {
        let odd = self.odd.iter().map(|(&a, &v)| (a, v));
        odd.chain(self.slots.iter().filter(|s| slot_key(s) != EMPTY).filter_map(|s| {
            let addr = slot_key(s) << 3;
            Some((addr, self.value(addr, slot_word(s))?))
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Values past 2^31 do not fit (to test the values kept aside); a check field above
    /// each one (the value's complement, to the word's last bit) catches a slot read
    /// that was never written or a word cut short.
    impl Packed for u32 {
        fn pack(self) -> Option<u64> {
            (self < 1 << 31).then_some(self as u64 | (!(self as u64) & CHECK) << 31)
        }

        fn unpack(w: u64) -> u32 {
            assert_eq!(w >> 31, !w & CHECK, "a value read from a slot never written");
            (w & 0x7fff_ffff) as u32
        }
    }

    const CHECK: u64 = (1 << (VALUE_BITS - 31)) - 1;

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
    fn a_slot_holds_every_bit_of_its_key_and_word() {
        for (key, word) in [(1, 0), (KEY_MASK, WIDE), (KEY_MASK, 0), (1, WIDE), (0x5_5555_5555 & KEY_MASK, 0xa_aaaa_aaaa_aaaa & WIDE)] {
            let s = make_slot(key, word);
            assert_eq!((slot_key(&s), slot_word(&s)), (key, word));
        }
        assert_eq!(std::mem::size_of::<Slot>(), 12);
    }

    /// Addresses without a key (0, not 8-byte aligned, past 2^47) are kept aside and act
    /// as any other: inserted, replaced, listed, removed; and a word that does not fit a
    /// slot (too wide, or all ones) is kept aside too.
    #[test]
    fn addresses_without_a_key_and_words_too_wide_are_kept_aside() {
        let mut t = AddressTable::new();
        let odd = [0u64, 0x1004, 0x1001, 1 << 47, (1 << 47) + 16, !15];
        for (i, &a) in odd.iter().enumerate() {
            assert_eq!(t.insert(a, i as u32), None);
        }
        t.insert(0x1000, 100);
        t.insert(0x1008, 101);
        assert_eq!((t.len(), t.slotted), (odd.len() + 2, 2));
        for (i, &a) in odd.iter().enumerate() {
            assert_eq!(t.get(a), Some(i as u32));
            assert_eq!(t.insert(a, i as u32 + 50), Some(i as u32));
        }
        assert_eq!((t.get(0x1000), t.get(0x1008)), (Some(100), Some(101)));
        let mut seen: Vec<(u64, u32)> = t.iter().collect();
        seen.sort_unstable();
        let mut want: Vec<(u64, u32)> = odd.iter().enumerate().map(|(i, &a)| (a, i as u32 + 50)).chain([(0x1000, 100), (0x1008, 101)]).collect();
        want.sort_unstable();
        assert_eq!(seen, want);
        for (i, &a) in odd.iter().enumerate() {
            assert_eq!(t.remove(a), Some(i as u32 + 50));
            assert_eq!(t.get(a), None);
        }
        assert_eq!((t.len(), t.slotted), (2, 2));

        #[derive(Clone, Copy, Debug, PartialEq)]
        struct Raw(u64);
        impl Packed for Raw {
            fn pack(self) -> Option<u64> {
                Some(self.0)
            }
            fn unpack(w: u64) -> Raw {
                Raw(w)
            }
        }
        let mut r = AddressTable::new();
        let values = [0, 1, WIDE - 1, WIDE, WIDE + 1, u64::MAX];
        for (n, &v) in values.iter().enumerate() {
            r.insert(0x10_0000 + n as u64 * 16, Raw(v));
        }
        for (n, &v) in values.iter().enumerate() {
            assert_eq!(r.get(0x10_0000 + n as u64 * 16), Some(Raw(v)));
        }
        assert_eq!(r.wide.len(), 3);
        assert_eq!(r.remove(0x10_0000 + 3 * 16), Some(Raw(WIDE)));
        assert_eq!(r.wide.len(), 2);
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
            let mut addr = (window << 24) | (granule << 4) | if step > 150_000 { 0 } else { ((x >> 32) % 64) << 12 };
            // One address in 64 has no key (unaligned, or past 2^47) and is kept aside.
            match (x >> 40) % 128 {
                0 => addr |= 4,
                1 => addr |= 1 << 47,
                _ => {}
            }
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
        assert_eq!(t.wide.len(), m.iter().filter(|&(&a, &v)| v >= 1 << 31 && key_of(a).is_some()).count());
        assert_eq!(t.odd.len(), m.keys().filter(|&&a| key_of(a).is_none()).count());
        assert!(t.odd.len() > 100, "{} addresses without a key", t.odd.len());
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
        assert!(!small.halve_if_sparse());
    }

    /// A table whose blocks go halves as they do, each time at most three quarters full
    /// after, down to the size below which nothing shrinks; every entry kept. Its growth
    /// past `STALLING_CAPACITY` told the producers the consumer stalls; its halvings do
    /// not (a producer would move to a huge ring in the program's teardown).
    #[test]
    fn a_table_whose_blocks_go_halves_as_they_do() {
        use crate::hotpath::channel::stalls_begun_here;
        let mut t = AddressTable::new();
        let n = 200_000u64;
        let addr = |i: u64| 0x7f00_0000_0000 + i * 64;
        let before = stalls_begun_here();
        for i in 0..n {
            t.insert(addr(i), i as u32);
        }
        assert!(t.slots.len() > STALLING_CAPACITY, "{}", t.slots.len());
        assert!(stalls_begun_here() > before, "growing past STALLING_CAPACITY stalls the consumer");
        let grown = stalls_begun_here();
        let mut sizes = vec![t.slots.len()];
        for i in 0..n {
            assert_eq!(t.remove(addr(i)), Some(i as u32));
            if t.halve_if_sparse() {
                sizes.push(t.slots.len());
                assert!(t.slotted * 8 <= t.slots.len() * MAX_EIGHTHS);
            }
            if i % 1000 == 0 {
                let j = i + 1 + i % 7;
                assert_eq!(t.get(addr(j)), Some(j as u32));
            }
        }
        assert!(sizes.windows(2).all(|w| w[1] == w[0] / 2), "{sizes:?}");
        assert!(sizes[1] >= STALLING_CAPACITY, "a halving to a table that size would have stalled: {sizes:?}");
        assert_eq!(*sizes.last().unwrap(), SHRINK_FROM, "{sizes:?}");
        assert_eq!(stalls_begun_here(), grown, "no halving stalls the consumer");
        assert!(t.is_empty());
    }
}
