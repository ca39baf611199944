//! Address ranges `(start, len)` kept sorted by start in 8 bytes each: a forked child's
//! inherited blocks and the blocks from before an attach, which the scan reads but never
//! classifies. A PyTorch DataLoader worker inherits ~700k blocks, and its collector
//! gathers and sorts them 5 ms after the fork so that its exit does not (`agent::
//! collector_thread::prepare_inherited`): as `(u64, u64)` pairs that list held 11.3 MB of
//! the worker's RSS for its whole life, and its peak is at its exit.
//!
//! A range whose start is below 2^47 (all of user space without 5-level page tables)
//! and whose length is below 2^17 is one word, start above length, so that words sort
//! as their ranges do; others (large blocks, few) are kept whole beside them. Every
//! figure is exact: the scan reads a block's words up to its length and no further.
//!
//! Plain safe Rust; unit tests below.

const LEN_BITS: u32 = 17;
const LEN_LIMIT: u64 = 1 << LEN_BITS;
const START_LIMIT: u64 = 1 << (64 - LEN_BITS);

#[derive(Clone, Debug)]
pub struct Spans {
    /// `start << LEN_BITS | len`.
    packed: Vec<u64>,
    /// Ranges that do not fit a word.
    wide: Vec<(u64, u64)>,
}

#[inline]
fn unpack(w: u64) -> (u64, u64) {
    (w >> LEN_BITS, w & (LEN_LIMIT - 1))
}

/// No ranges (where a borrowed list is wanted and there is none).
pub static EMPTY: Spans = Spans::new();

impl Default for &Spans {
    fn default() -> Self {
        &EMPTY
    }
}

impl Spans {
    pub const fn new() -> Spans {
        Spans { packed: Vec::new(), wide: Vec::new() }
    }

    /// Room for `n` more ranges (words: a few wide ones grow as needed).
    pub fn reserve_exact(&mut self, n: usize) {
        self.packed.reserve_exact(n);
    }

    /// Adds a range; `sort` puts them in order once all are in.
    #[inline]
    pub fn push(&mut self, start: u64, len: u64) {
        if start < START_LIMIT && len < LEN_LIMIT {
            self.packed.push(start << LEN_BITS | len);
        } else {
            self.wide.push((start, len));
        }
    }

    /// Sorts by start (the ranges must not overlap for `holder_of`).
    pub fn sort(&mut self) {
        self.packed.sort_unstable();
        self.wide.sort_unstable_by_key(|r| r.0);
    }

    pub fn len(&self) -> usize {
        self.packed.len() + self.wide.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ranges in order of start (sorted ones).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut words = self.packed.iter().map(|&w| unpack(w)).peekable();
        let mut wide = self.wide.iter().copied().peekable();
        std::iter::from_fn(move || match (words.peek(), wide.peek()) {
            (Some(a), Some(b)) if b.0 < a.0 => wide.next(),
            (Some(_), _) => words.next(),
            (None, _) => wide.next(),
        })
    }

    /// Keeps the ranges `keep` says yes to, asked in order of start (sorted ranges): a
    /// filter may walk another sorted list beside them.
    pub fn retain(&mut self, mut keep: impl FnMut(&(u64, u64)) -> bool) {
        let (packed, wide) = (&mut self.packed, &self.wide);
        let mut wide_kept = Vec::with_capacity(wide.len());
        let mut j = 0;
        packed.retain(|&w| {
            let r = unpack(w);
            while j < wide.len() && wide[j].0 < r.0 {
                wide_kept.push(keep(&wide[j]));
                j += 1;
            }
            keep(&r)
        });
        while j < wide.len() {
            wide_kept.push(keep(&wide[j]));
            j += 1;
        }
        let mut kept = wide_kept.into_iter();
        self.wide.retain(|_| kept.next().unwrap_or(true));
    }

    /// The range that holds `addr`: the last one starting at or below it, if it reaches
    /// that far (sorted, disjoint ranges).
    pub fn holder_of(&self, addr: u64) -> Option<(u64, u64)> {
        let last = |v: Option<(u64, u64)>| v.filter(|&(start, _)| start <= addr);
        // Every word whose start is at most `addr` is below the first word of start
        // `addr + 1` (its length 0).
        let i = if addr < START_LIMIT - 1 { self.packed.partition_point(|&w| w < (addr + 1) << LEN_BITS) } else { self.packed.len() };
        let from_words = last(i.checked_sub(1).map(|i| unpack(self.packed[i])));
        let j = self.wide.partition_point(|&(start, _)| start <= addr);
        let from_wide = last(j.checked_sub(1).map(|j| self.wide[j]));
        let best = match (from_words, from_wide) {
            (Some(a), Some(b)) => Some(if a.0 >= b.0 { a } else { b }),
            (a, b) => a.or(b),
        };
        best.filter(|&(start, len)| addr - start < len)
    }

    /// The ranges as pairs, in order (tests, diagnostics).
    pub fn to_vec(&self) -> Vec<(u64, u64)> {
        self.iter().collect()
    }
}

impl Default for Spans {
    fn default() -> Spans {
        Spans::new()
    }
}

impl FromIterator<(u64, u64)> for Spans {
    /// The ranges, sorted.
    fn from_iter<I: IntoIterator<Item = (u64, u64)>>(iter: I) -> Spans {
        let mut s = Spans::new();
        for (start, len) in iter {
            s.push(start, len);
        }
        s.sort();
        s
    }
}

impl PartialEq for Spans {
    fn eq(&self, other: &Spans) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Spans {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_rng::TestRng as Rng;

    #[test]
    fn ranges_come_back_exactly_and_in_order() {
        let ranges =
            [(0x7f00_0000_1000, 24), (0x10, 0), (0x20, LEN_LIMIT - 1), (0x5000, LEN_LIMIT), (START_LIMIT, 8), (u64::MAX - 10, 4), (0x40_0000, 1 << 30)];
        let s: Spans = ranges.iter().copied().collect();
        let mut want = ranges.to_vec();
        want.sort_unstable();
        assert_eq!(s.to_vec(), want);
        assert_eq!(s.len(), ranges.len());
        assert_eq!(s.wide.len(), 4, "{:?}", s.wide);
    }

    #[test]
    fn a_pair_takes_one_word() {
        let mut s = Spans::new();
        s.reserve_exact(1000);
        for i in 0..1000u64 {
            s.push(0x7fff_0000_0000 + i * 64, 48);
        }
        assert_eq!((s.packed.len(), s.wide.len()), (1000, 0));
        assert_eq!(std::mem::size_of_val(&s.packed[0]), 8);
    }

    /// Random sorted, disjoint ranges, some wide: `holder_of` agrees with a search of
    /// the pairs, at starts, ends, gaps and inside; `retain` and `iter` with the pairs'.
    #[test]
    fn lookups_and_filters_agree_with_pairs() {
        let mut rng = Rng::new(0x5ba5);
        for round in 0..200 {
            let mut pairs = Vec::new();
            let mut at = rng.below(1 << 20) * 8;
            if round % 7 == 0 {
                at += START_LIMIT - (1 << 24);
            }
            for _ in 0..rng.below(60) {
                let len = match rng.below(10) {
                    0 => LEN_LIMIT + rng.below(1 << 20),
                    1 => 0,
                    _ => 1 + rng.below(4096),
                };
                pairs.push((at, len));
                at += len.max(16) + rng.below(3) * 16;
            }
            let mut s = Spans::new();
            let mut shuffled = pairs.clone();
            for i in (1..shuffled.len()).rev() {
                shuffled.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for &(a, l) in &shuffled {
                s.push(a, l);
            }
            s.sort();
            assert_eq!(s.to_vec(), pairs);
            let pair_holder = |addr: u64| {
                let i = pairs.partition_point(|&(start, _)| start <= addr);
                let &(start, len) = pairs.get(i.checked_sub(1)?)?;
                (addr - start < len).then_some((start, len))
            };
            for &(a, l) in &pairs {
                for addr in [a.saturating_sub(1), a, a + l / 2, (a + l).saturating_sub(1), a + l, a + l + 8] {
                    assert_eq!(s.holder_of(addr), pair_holder(addr), "round {round} addr {addr:#x}");
                }
            }
            let cut = rng.below(4);
            let mut kept = s.clone();
            let mut last = None;
            kept.retain(|r| {
                assert!(last < Some(r.0), "asked out of order");
                last = Some(r.0);
                (r.0 / 8) % 4 != cut || r.1 > 100
            });
            let want: Vec<_> = pairs.iter().copied().filter(|r| (r.0 / 8) % 4 != cut || r.1 > 100).collect();
            assert_eq!(kept.to_vec(), want);
        }
    }

    #[test]
    fn the_top_of_the_address_space_is_looked_up_too() {
        let s: Spans = [(u64::MAX - 100, 50), (START_LIMIT - 16, 16)].into_iter().collect();
        assert_eq!(s.holder_of(u64::MAX - 60), Some((u64::MAX - 100, 50)));
        assert_eq!(s.holder_of(u64::MAX - 40), None);
        assert_eq!(s.holder_of(START_LIMIT - 1), Some((START_LIMIT - 16, 16)));
        assert_eq!(s.holder_of(START_LIMIT), None);
        assert_eq!(s.holder_of(0), None);
    }
}
