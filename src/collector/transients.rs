//! Transient allocations (an allocation its own thread freed before the collector took
//! its event: `EventKind::Transient`), summed per group key before they reach their
//! group.
//!
//! A loop that allocates and frees at once makes nearly all of its events transients:
//! the bash loop of `scripts/bench.sh`, 1.64M of them in 20,000 iterations. Each one
//! used to find its group (`Collector::group_of`), step its figures and note it
//! changed: ~180 instructions on the collector thread, a quarter of that loop's CPU time
//! under the library went to the collector. Here a transient is a compare and three
//! additions in a small direct-mapped table by key; its group takes the sum later, once.
//!
//! Exactness. A group's totals take the sums before anything reads them (the collector
//! settles the table before every read: `Collector::settle_transients`). A transient
//! counts its bytes as live for a moment, on top of its group's live bytes then, in the
//! group's peak: its group's live bytes must be the same when the sum is applied as
//! when each transient came. So the collector applies a key's sum before any change to
//! that group's live bytes (`take`), and the largest transient of the sum stands for
//! all of them. The totals by kind of memory do not wait: the collector counts them per
//! event (no lookup).
//!
//! Plain safe Rust; unit tests below.
use super::state::GroupKey;

/// Entries in the table (a power of two): 16 KiB. A loop's transients come from a few
/// dozen stacks; a Python program's from more, and an entry taken by another key is
/// applied and replaced, not lost.
const ENTRIES: usize = 512;

/// A key's transients not yet applied to its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pending {
    pub key: GroupKey,
    pub count: u64,
    pub bytes: u64,
    /// The largest of them (the group's peak takes it on top of its live bytes).
    pub largest: u64,
}

#[derive(Default)]
pub struct Transients {
    /// `ENTRIES` places once the first transient came (`None`: free).
    entries: Vec<Option<Pending>>,
    /// Places in use.
    used: usize,
}

#[inline(always)]
fn index(key: &GroupKey) -> usize {
    let mixed = key.0.wrapping_mul(0x9e37_79b1) ^ ((key.1 as u32) << 3) ^ u32::from(key.2.map_or(0, |d| d.wrapping_add(1)));
    (mixed.rotate_left(9) as usize) & (ENTRIES - 1)
}

impl Transients {
    /// Counts a transient of `size` bytes under `key`. Returns the sum its place held for
    /// another key, which the caller applies now.
    #[inline(always)]
    pub fn add(&mut self, key: GroupKey, size: u64) -> Option<Pending> {
        if self.entries.is_empty() {
            self.entries = vec![None; ENTRIES];
        }
        let place = &mut self.entries[index(&key)];
        match place {
            Some(p) if p.key == key => {
                p.count += 1;
                p.bytes += size;
                p.largest = p.largest.max(size);
                None
            }
            _ => {
                let before = place.replace(Pending { key, count: 1, bytes: size, largest: size });
                if before.is_none() {
                    self.used += 1;
                }
                before
            }
        }
    }

    /// The sum waiting under `key`, taken out (its group's live bytes are about to change).
    #[inline(always)]
    pub fn take(&mut self, key: &GroupKey) -> Option<Pending> {
        if self.used == 0 {
            return None;
        }
        let place = &mut self.entries[index(key)];
        if place.as_ref().is_some_and(|p| p.key == *key) {
            self.used -= 1;
            place.take()
        } else {
            None
        }
    }

    /// Takes every waiting sum out, one at a time (`None` once empty).
    pub fn take_any(&mut self) -> Option<Pending> {
        if self.used == 0 {
            return None;
        }
        let p = self.entries.iter_mut().find_map(|e| e.take())?;
        self.used -= 1;
        Some(p)
    }

    pub fn is_empty(&self) -> bool {
        self.used == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hotpath::event::Api;

    #[test]
    fn transients_of_one_key_add_up_and_come_out_once() {
        let mut t = Transients::default();
        let k = (7, Api::Malloc, None);
        assert_eq!(t.add(k, 10), None);
        assert_eq!(t.add(k, 30), None);
        assert_eq!(t.add(k, 20), None);
        assert!(!t.is_empty());
        assert_eq!(t.take(&(7, Api::Calloc, None)), None, "another key");
        assert_eq!(t.take(&k), Some(Pending { key: k, count: 3, bytes: 60, largest: 30 }));
        assert_eq!(t.take(&k), None);
        assert!(t.is_empty());
        assert_eq!(t.take_any(), None);
    }

    #[test]
    fn a_key_that_takes_a_place_hands_back_what_the_place_held_and_nothing_is_lost() {
        let mut t = Transients::default();
        let mut out: std::collections::HashMap<GroupKey, (u64, u64)> = Default::default();
        let mut want: std::collections::HashMap<GroupKey, (u64, u64)> = Default::default();
        let add = |o: &mut std::collections::HashMap<GroupKey, (u64, u64)>, p: Pending| {
            let e = o.entry(p.key).or_default();
            e.0 += p.count;
            e.1 += p.bytes;
        };
        // More keys than places: every place is taken over many times.
        for i in 0..20_000u64 {
            let key = ((i * 7919 % 3001) as u32, if i % 3 == 0 { Api::PyObject } else { Api::Malloc }, None);
            let w = want.entry(key).or_default();
            w.0 += 1;
            w.1 += i % 100;
            if let Some(p) = t.add(key, i % 100) {
                add(&mut out, p);
            }
        }
        while let Some(p) = t.take_any() {
            add(&mut out, p);
        }
        assert!(t.is_empty());
        assert_eq!(out, want);
    }
}
