//! The live objects in pymalloc's arenas (`interpose::pymalloc`), as root ranges.
//!
//! An arena is cut into pools (4 KiB in 256 KiB arenas before Python 3.10, 16 KiB in
//! 1 MiB arenas since); each pool in use starts with a header (`struct pool_header`,
//! the same from 3.9 to 3.13) and holds blocks of one size class. The blocks between the
//! header and `nextoffset` have been handed out; the free ones among them are on the
//! pool's `freeblock` list. Only the others are read: a freed object still holds the
//! addresses it held when alive, and would keep a block that leaked since "reachable".
use super::mark::Memory;

/// `sizeof(struct pool_header)` rounded to the 16-byte alignment.
const POOL_OVERHEAD: u64 = 48;
/// pymalloc's alignment and size-class step on 64-bit (3.8+).
const ALIGNMENT: u64 = 16;
const MAX_POOL: u64 = 16 << 10;
const BITMAP_WORDS: usize = (MAX_POOL / ALIGNMENT / 64) as usize;

/// The pool size of an arena of `arena_size` bytes.
pub fn pool_size(arena_size: u64) -> u64 {
    if arena_size >= 1 << 20 {
        16 << 10
    } else {
        4 << 10
    }
}

fn word(mem: &impl Memory, addr: u64) -> Option<u64> {
    let mut v = None;
    mem.words(addr, 8, &mut |w| v = Some(w));
    v
}

/// Calls `visit(start, len)` for each run of live blocks in the arena `(start, size)`.
pub fn live_runs(mem: &impl Memory, arena: (u64, u64), mut visit: impl FnMut(u64, u64)) {
    let (start, size) = arena;
    let pool = pool_size(size);
    let end = start.saturating_add(size);
    let mut p = start.next_multiple_of(pool);
    while p + pool <= end {
        pool_runs(mem, p, pool, &mut visit);
        p += pool;
    }
}

fn pool_runs(mem: &impl Memory, p: u64, pool: u64, visit: &mut impl FnMut(u64, u64)) {
    let mut h = [0u64; 6];
    let mut n = 0;
    mem.words(p, POOL_OVERHEAD, &mut |w| {
        if n < 6 {
            h[n] = w;
            n += 1;
        }
    });
    if n < 6 {
        return;
    }
    let count = h[0] as u32;
    let freeblock = h[1];
    let szidx = h[4] >> 32;
    let nextoffset = h[5] as u32 as u64;
    if count == 0 || szidx >= 64 || nextoffset < POOL_OVERHEAD || nextoffset > pool {
        return;
    }
    let bsize = (szidx + 1) * ALIGNMENT;
    let nblocks = ((nextoffset - POOL_OVERHEAD) / bsize) as usize;
    let first = p + POOL_OVERHEAD;
    let mut free = [0u64; BITMAP_WORDS];
    let mut f = freeblock;
    for _ in 0..nblocks {
        if f < first || f >= first + nblocks as u64 * bsize || !(f - first).is_multiple_of(bsize) {
            break;
        }
        let i = ((f - first) / bsize) as usize;
        if free[i / 64] & 1 << (i % 64) != 0 {
            break;
        }
        free[i / 64] |= 1 << (i % 64);
        match word(mem, f) {
            Some(next) => f = next,
            None => break,
        }
    }
    let mut run: Option<u64> = None;
    for i in 0..nblocks {
        let is_free = free[i / 64] & 1 << (i % 64) != 0;
        let b = first + i as u64 * bsize;
        match (run, is_free) {
            (None, false) => run = Some(b),
            (Some(s), true) => {
                visit(s, b - s);
                run = None;
            }
            _ => {}
        }
    }
    if let Some(s) = run {
        visit(s, first + nblocks as u64 * bsize - s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake address space: one buffer at `base`.
    struct Fake {
        base: u64,
        words: Vec<u64>,
    }

    impl Memory for Fake {
        fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64)) -> bool {
            let mut p = start;
            while p + 8 <= start + len {
                match p.checked_sub(self.base).map(|o| (o / 8) as usize).and_then(|i| self.words.get(i)) {
                    Some(&w) => visit(w),
                    None => return false,
                }
                p += 8;
            }
            true
        }
    }

    #[test]
    fn free_blocks_are_not_read() {
        // One 256 KiB arena, 4 KiB pools; pool 0 holds 32-byte blocks (szidx 1), five
        // handed out, the 2nd and 4th freed; pool 1 is empty (count 0).
        let base = 0x10_0000u64;
        let mut words = vec![0u64; (256 << 10) / 8];
        let first = base + 48;
        let block = |i: u64| first + i * 32;
        words[0] = 3; // count
        words[1] = block(3); // freeblock → 3 → 1 → null
        words[((block(3) - base) / 8) as usize] = block(1);
        words[((block(1) - base) / 8) as usize] = 0;
        words[4] = 1 << 32; // arenaindex 0, szidx 1
        words[5] = 48 + 5 * 32; // nextoffset
        let mem = Fake { base, words };
        let mut runs = Vec::new();
        live_runs(&mem, (base, 256 << 10), |s, l| runs.push((s, l)));
        assert_eq!(runs, vec![(block(0), 32), (block(2), 32), (block(4), 32)]);
    }

    #[test]
    fn a_looping_free_list_ends() {
        let base = 0x20_0000u64;
        let mut words = vec![0u64; (16 << 10) / 8];
        let first = base + 48;
        words[0] = 1;
        words[1] = first + 16;
        words[((first + 16 - base) / 8) as usize] = first + 16; // points to itself
        words[4] = 0; // szidx 0: 16-byte blocks
        words[5] = 48 + 3 * 16;
        let mem = Fake { base, words };
        let mut runs = Vec::new();
        pool_runs(&mem, base, 16 << 10, &mut |s, l| runs.push((s, l)));
        assert_eq!(runs, vec![(first, 16), (first + 32, 16)]);
        assert_eq!(pool_size(1 << 20), 16 << 10);
        assert_eq!(pool_size(256 << 10), 4 << 10);
    }
}
