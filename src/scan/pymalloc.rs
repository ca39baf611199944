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

/// Where CPython keeps an int's value (`PyLongObject`), for reading the addresses a
/// program keeps as Python ints (`scan::mark`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IntLayout {
    /// `&PyLong_Type`.
    pub type_addr: u64,
    /// 3.12 and later: the third word is `lv_tag` (sign in bits 0–1, digit count from
    /// bit 3); before, `ob_size` (the digit count, negative for a negative int).
    pub tagged: bool,
}

/// The size class of an int of one or two 30-bit digits (24 bytes of header and
/// `ob_size`/`lv_tag`, then the digits): every address a program can hold fits in two.
pub const INT_BLOCK: u64 = 32;

/// The value of the object whose first four words are `w` when it is a live,
/// non-negative int of one or two digits, as an address is; `None` for anything else.
/// The reference count must be one a live object has: pymalloc also hands out raw
/// buffers (`PyMem_Malloc`), and one that holds a copy of an int's words after some
/// other pointer (seen in a pytest run: `[&…, &PyLong_Type, 2, digits]`) is no int.
pub fn int_value(w: [u64; 4], l: IntLayout) -> Option<u64> {
    if w[1] != l.type_addr || w[0] == 0 || w[0] >= 1 << 32 {
        return None;
    }
    let digits = if l.tagged {
        if w[2] & 3 != 0 {
            // Zero or negative.
            return None;
        }
        w[2] >> 3
    } else {
        w[2]
    };
    let (d0, d1) = (w[3] & 0x3fff_ffff, (w[3] >> 32) & 0x3fff_ffff);
    match digits {
        1 => Some(d0),
        2 => Some(d0 | d1 << 30),
        _ => None,
    }
}

/// Calls `visit(start, len, block_size)` for each run of live blocks in the arena
/// `(start, size)`.
pub fn live_runs(mem: &impl Memory, arena: (u64, u64), mut visit: impl FnMut(u64, u64, u64)) {
    let (start, size) = arena;
    let pool = pool_size(size);
    let end = start.saturating_add(size);
    let mut p = start.next_multiple_of(pool);
    while p + pool <= end {
        pool_runs(mem, p, pool, &mut visit);
        p += pool;
    }
}

fn pool_runs(mem: &impl Memory, p: u64, pool: u64, visit: &mut impl FnMut(u64, u64, u64)) {
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
                visit(s, b - s, bsize);
                run = None;
            }
            _ => {}
        }
    }
    if let Some(s) = run {
        visit(s, first + nblocks as u64 * bsize - s, bsize);
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
        live_runs(&mem, (base, 256 << 10), |s, l, b| runs.push((s, l, b)));
        assert_eq!(runs, vec![(block(0), 32, 32), (block(2), 32, 32), (block(4), 32, 32)]);
    }

    #[test]
    fn ints_of_one_or_two_digits_give_their_value_in_both_layouts() {
        let t = 0x7f00_0000_1000;
        let addr: u64 = 0x55d2_3a4b_9c60;
        let digits = (addr & 0x3fff_ffff) | (addr >> 30) << 32;
        let old = IntLayout { type_addr: t, tagged: false };
        let new = IntLayout { type_addr: t, tagged: true };
        // 3.9–3.11: ob_size; 3.12+: lv_tag = digits << 3 | sign.
        assert_eq!(int_value([1, t, 2, digits], old), Some(addr));
        assert_eq!(int_value([1, t, 2 << 3, digits], new), Some(addr));
        assert_eq!(int_value([1, t, 1, 12345], old), Some(12345));
        assert_eq!(int_value([1, t, 1 << 3, 12345], new), Some(12345));
        // Negative, zero, three digits, another type: not an address.
        assert_eq!(int_value([1, t, (-2i64) as u64, digits], old), None);
        assert_eq!(int_value([1, t, 2 << 3 | 2, digits], new), None);
        assert_eq!(int_value([1, t, 1, 0], new), None);
        assert_eq!(int_value([1, t, 3, digits], old), None);
        assert_eq!(int_value([1, t + 8, 2, digits], old), None);
        // Not a live object's reference count: a raw buffer, or a freed block.
        assert_eq!(int_value([0x7f9d_9544_6f00, t, 2, digits], old), None);
        assert_eq!(int_value([0, t, 2 << 3, digits], new), None);
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
        pool_runs(&mem, base, 16 << 10, &mut |s, l, b| runs.push((s, l, b)));
        assert_eq!(runs, vec![(first, 16, 16), (first + 32, 16, 16)]);
        assert_eq!(pool_size(1 << 20), 16 << 10);
        assert_eq!(pool_size(256 << 10), 4 << 10);
    }
}
