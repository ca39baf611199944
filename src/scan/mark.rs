//! The mark phase. Any aligned word that points anywhere inside a block (start or
//! interior) keeps that block: this is conservative, as in LSan and valgrind.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub start: u64,
    pub size: u64,
    /// Its contents are not read (device memory): it can be reached, but points nowhere.
    pub opaque: bool,
    /// A CUDA allocation: the CUDA libraries' own bookkeeping (`runtime_roots`, and what
    /// only they reach) does not keep it; only the program's memory does.
    pub cuda: bool,
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
/// `runtime_roots` (the CUDA libraries' data) keep host blocks but never, directly or
/// through host blocks only they keep, a CUDA allocation: the driver's own table of
/// allocations is no reference of the program's.
pub fn classify_into(blocks: &[Block], roots: &[(u64, u64)], runtime_roots: &[(u64, u64)], mem: &dyn Memory, s: &mut Scratch) {
    let index = BlockIndex::new(blocks);
    let Scratch { verdicts, reached, indirect, work } = s;
    let mark_from = |start: u64, len: u64, reached: &mut Vec<bool>, work: &mut Vec<usize>, keeps_cuda: bool| {
        mem.words(start, len, &mut |w| {
            if let Some(i) = index.find(w) {
                if !reached[i] && (keeps_cuda || !blocks[i].cuda) {
                    reached[i] = true;
                    work.push(i);
                }
            }
        });
    };
    let trace = |reached: &mut Vec<bool>, work: &mut Vec<usize>, keeps_cuda: bool| {
        while let Some(i) = work.pop() {
            if !blocks[i].opaque {
                mark_from(blocks[i].start, blocks[i].size, reached, work, keeps_cuda);
            }
        }
    };
    for &(start, len) in roots {
        mark_from(start, len, reached, work, true);
    }
    trace(reached, work, true);
    for &(start, len) in runtime_roots {
        mark_from(start, len, reached, work, false);
    }
    trace(reached, work, false);
    // Every block a leaked block points to (other than itself) is an indirect leak.
    for (i, b) in blocks.iter().enumerate() {
        if reached[i] || b.opaque {
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
pub fn classify(blocks: &[Block], roots: &[(u64, u64)], runtime_roots: &[(u64, u64)], mem: &dyn Memory) -> Vec<Verdict> {
    let mut s = Scratch::new(blocks.len());
    classify_into(blocks, roots, runtime_roots, mem, &mut s);
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
        (0..8).map(|i| Block { start: 0x1000 + i * 0x100, size: 0x40, opaque: false, cuda: false }).collect()
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
        let v = classify(&b, &[(0x10, 0x20)], &[], &Fake(m));
        use Verdict::*;
        assert_eq!(v, vec![Reachable, Reachable, Reachable, Indirect, Indirect, Definite, Indirect, Definite]);
    }

    #[test]
    fn opaque_blocks_are_reached_but_never_read() {
        // Block 0 is device memory whose bytes happen to look like a pointer to block 1:
        // they are not host memory and must not keep block 1.
        let mut b = blocks();
        b.truncate(3);
        b[0].opaque = true;
        let mut m = BTreeMap::new();
        m.insert(0x10, 0x1000);
        m.insert(0x1000, 0x1100);
        // Block 2 (leaked, host) points to block 0: it makes it indirect.
        m.insert(0x1200, 0x1000);
        use Verdict::*;
        assert_eq!(classify(&b, &[(0x10, 8)], &[], &Fake(m.clone())), vec![Reachable, Definite, Definite]);
        assert_eq!(classify(&b, &[], &[], &Fake(m)), vec![Indirect, Definite, Definite]);
    }

    #[test]
    fn the_cuda_libraries_own_tables_keep_host_blocks_but_no_device_memory() {
        // Blocks: 0 device memory, 1 a host block of the driver's, 2 pinned host memory.
        let mut b = blocks();
        b.truncate(3);
        b[0].cuda = true;
        b[0].opaque = true;
        b[2].cuda = true;
        let mut m = BTreeMap::new();
        // The driver's global table (a runtime root) lists every allocation and its own
        // host block, which lists them again.
        m.insert(0x40, 0x1000);
        m.insert(0x48, 0x1100);
        m.insert(0x50, 0x1200);
        m.insert(0x1100, 0x1000);
        m.insert(0x1108, 0x1200);
        use Verdict::*;
        assert_eq!(classify(&b, &[], &[(0x40, 0x18)], &Fake(m.clone())), vec![Definite, Reachable, Definite]);
        // The program holds the device pointer in a global: reachable.
        m.insert(0x10, 0x1000);
        assert_eq!(classify(&b, &[(0x10, 8)], &[(0x40, 0x18)], &Fake(m)), vec![Reachable, Reachable, Definite]);
    }

    #[test]
    fn zero_sized_blocks_and_empty_inputs() {
        let b = vec![Block { start: 0x100, size: 0, opaque: false, cuda: false }, Block { start: 0x200, size: 8, opaque: false, cuda: false }];
        let mut m = BTreeMap::new();
        m.insert(0x8, 0x100);
        assert_eq!(classify(&b, &[(0, 0x10)], &[], &Fake(m)), vec![Verdict::Reachable, Verdict::Definite]);
        assert!(classify(&[], &[(0, 0x10)], &[], &Fake(BTreeMap::new())).is_empty());
        let idx = BlockIndex::new(&b);
        assert_eq!(idx.find(0x100), Some(0));
        assert_eq!(idx.find(0x101), None);
        assert_eq!(idx.find(0x207), Some(1));
        assert_eq!(idx.find(0x208), None);
        assert_eq!(idx.find(u64::MAX), None);
    }
}
