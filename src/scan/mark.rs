//! The mark phase. Any aligned word that points anywhere inside a block (start or
//! interior) keeps that block: this is conservative, as in LSan and valgrind.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub start: u64,
    pub size: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A root (global, stack, register, TLS) leads to it.
    Reachable,
    /// Only other leaked blocks point to it.
    Indirect,
    /// Nothing points to it.
    Definite,
}

/// Blocks sorted by start; answers "which block contains this address" quickly.
pub struct BlockIndex<'a> {
    blocks: &'a [Block],
    lo: u64,
    hi: u64,
}

impl<'a> BlockIndex<'a> {
    /// `blocks` must be sorted by `start` and not overlap.
    pub fn new(blocks: &'a [Block]) -> BlockIndex<'a> {
        let lo = blocks.first().map(|b| b.start).unwrap_or(u64::MAX);
        let hi = blocks.iter().map(|b| b.start.saturating_add(b.size.max(1))).max().unwrap_or(0);
        BlockIndex { blocks, lo, hi }
    }

    #[inline]
    pub fn find(&self, word: u64) -> Option<usize> {
        // Most words are small integers or other non-heap values.
        if word < self.lo || word >= self.hi {
            return None;
        }
        let i = self.blocks.partition_point(|b| b.start <= word);
        if i == 0 {
            return None;
        }
        let b = &self.blocks[i - 1];
        // A zero-sized block is still an allocation: its address counts.
        (word < b.start.saturating_add(b.size.max(1))).then_some(i - 1)
    }
}

/// Reads the aligned words of `[start, start + len)`; returns false where the memory
/// cannot be read (the range is then skipped).
pub trait Memory {
    fn words(&self, start: u64, len: u64, visit: &mut dyn FnMut(u64)) -> bool;
}

/// Working memory for `classify_into`, allocated before other threads are stopped
/// (one of them may hold the allocator's lock).
pub struct Scratch {
    pub verdicts: Vec<Verdict>,
    reached: Vec<bool>,
    indirect: Vec<bool>,
    work: Vec<usize>,
}

impl Scratch {
    pub fn new(blocks: usize) -> Scratch {
        Scratch {
            verdicts: vec![Verdict::Definite; blocks],
            reached: vec![false; blocks],
            indirect: vec![false; blocks],
            // Each block is pushed at most once: this never grows.
            work: Vec::with_capacity(blocks),
        }
    }
}

/// Classifies every block given the root ranges `(start, len)`, without allocating.
pub fn classify_into(blocks: &[Block], roots: &[(u64, u64)], mem: &dyn Memory, s: &mut Scratch) {
    let index = BlockIndex::new(blocks);
    let Scratch { verdicts, reached, indirect, work } = s;
    let mark_from = |start: u64, len: u64, reached: &mut Vec<bool>, work: &mut Vec<usize>| {
        mem.words(start, len, &mut |w| {
            if let Some(i) = index.find(w) {
                if !reached[i] {
                    reached[i] = true;
                    work.push(i);
                }
            }
        });
    };
    for &(start, len) in roots {
        mark_from(start, len, reached, work);
    }
    while let Some(i) = work.pop() {
        mark_from(blocks[i].start, blocks[i].size, reached, work);
    }
    // Every block a leaked block points to (other than itself) is an indirect leak.
    for (i, b) in blocks.iter().enumerate() {
        if reached[i] {
            continue;
        }
        mem.words(b.start, b.size, &mut |w| {
            if let Some(j) = index.find(w) {
                if j != i && !reached[j] {
                    indirect[j] = true;
                }
            }
        });
    }
    for i in 0..blocks.len() {
        verdicts[i] = if reached[i] {
            Verdict::Reachable
        } else if indirect[i] {
            Verdict::Indirect
        } else {
            Verdict::Definite
        };
    }
}

/// Classifies every block given the root ranges `(start, len)`.
pub fn classify(blocks: &[Block], roots: &[(u64, u64)], mem: &dyn Memory) -> Vec<Verdict> {
    let mut s = Scratch::new(blocks.len());
    classify_into(blocks, roots, mem, &mut s);
    s.verdicts
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Sparse fake memory: address -> word.
    struct Fake(BTreeMap<u64, u64>);

    impl Memory for Fake {
        fn words(&self, start: u64, len: u64, visit: &mut dyn FnMut(u64)) -> bool {
            let first = (start + 7) & !7;
            for (_, w) in self.0.range(first..start + len) {
                visit(*w);
            }
            true
        }
    }

    fn blocks() -> Vec<Block> {
        (0..8).map(|i| Block { start: 0x1000 + i * 0x100, size: 0x40 }).collect()
    }

    #[test]
    fn roots_lists_interior_pointers_cycles_and_orphans() {
        let b = blocks();
        let mut m = BTreeMap::new();
        // Root (a global at 0x10) -> block 0; block 0 -> block 1 (a list).
        m.insert(0x10, 0x1000);
        m.insert(0x1008, 0x1100);
        // A root pointing into the middle of block 2.
        m.insert(0x18, 0x1220);
        // Blocks 3 <-> 4: a leaked cycle: both indirect.
        m.insert(0x1300, 0x1400);
        m.insert(0x1400, 0x1300);
        // Block 5 (leaked) -> block 6: 5 definite, 6 indirect.
        m.insert(0x1508, 0x1600);
        // Block 7 points only to itself: definite.
        m.insert(0x1700, 0x1700);
        // Noise: a word that is just past block 1's end, and a small integer.
        m.insert(0x20, 0x1140);
        m.insert(0x28, 42);
        let v = classify(&b, &[(0x10, 0x20)], &Fake(m));
        use Verdict::*;
        assert_eq!(v, vec![Reachable, Reachable, Reachable, Indirect, Indirect, Definite, Indirect, Definite]);
    }

    #[test]
    fn zero_sized_blocks_and_empty_inputs() {
        let b = vec![Block { start: 0x100, size: 0 }, Block { start: 0x200, size: 8 }];
        let mut m = BTreeMap::new();
        m.insert(0x8, 0x100);
        assert_eq!(classify(&b, &[(0, 0x10)], &Fake(m)), vec![Verdict::Reachable, Verdict::Definite]);
        assert!(classify(&[], &[(0, 0x10)], &Fake(BTreeMap::new())).is_empty());
        let idx = BlockIndex::new(&b);
        assert_eq!(idx.find(0x100), Some(0));
        assert_eq!(idx.find(0x101), None);
        assert_eq!(idx.find(0x207), Some(1));
        assert_eq!(idx.find(0x208), None);
        assert_eq!(idx.find(u64::MAX), None);
    }
}
