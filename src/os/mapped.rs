//! The program's own anonymous mappings as the `mmap` hooks saw them
//! (`interpose::mmap`): start, length and the stack id they were published with, so
//! that a partial `munmap` or a `mremap` can be published as what it does to each
//! (the part that stays keeps its stack), and the memory accounting can measure what
//! of them is resident. A fixed table behind a lock that is never waited for long:
//! calls that cannot take it in time go untracked rather than block.
use super::lock::SpinLock;

#[derive(Clone, Copy, Default)]
pub struct Range {
    pub start: u64,
    pub len: u64,
    pub stack: u32,
}

const MAX: usize = 4096;

pub struct Ranges {
    n: usize,
    e: [Range; MAX],
}

static TABLE: SpinLock<Ranges> = SpinLock::new(Ranges { n: 0, e: [Range { start: 0, len: 0, stack: 0 }; MAX] });
/// Mappings that found the table full (counted, not tracked).
static OVERFLOWS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn lock() -> Option<super::lock::Guard<'static, Ranges>> {
    for _ in 0..10_000 {
        if let Some(g) = TABLE.try_lock() {
            return Some(g);
        }
        std::hint::spin_loop();
    }
    None
}

/// Whether any mapping is tracked (a `munmap` with none looks no further).
#[inline]
pub fn any() -> bool {
    COUNT.load(std::sync::atomic::Ordering::Relaxed) != 0
}

/// Adds a tracked mapping; false when the table is full or busy.
pub fn add(r: Range) -> bool {
    let Some(mut t) = lock() else { return false };
    if t.n == MAX {
        OVERFLOWS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return false;
    }
    let n = t.n;
    t.e[n] = r;
    t.n += 1;
    COUNT.store(t.n, std::sync::atomic::Ordering::Relaxed);
    true
}

/// Takes `[start, start + len)` out of the tracked mappings: `gone` is called with each
/// tracked mapping it overlaps (before), and `kept` with each part of one that stays
/// mapped (a head or a tail, with the mapping's stack), which the table keeps.
pub fn remove(start: u64, len: u64, mut gone: impl FnMut(Range), mut kept: impl FnMut(Range)) {
    let end = start.saturating_add(len);
    let Some(mut t) = lock() else { return };
    let mut i = 0;
    while i < t.n {
        let r = t.e[i];
        let r_end = r.start + r.len;
        if r.start >= end || r_end <= start {
            i += 1;
            continue;
        }
        gone(r);
        let last = t.n - 1;
        t.e[i] = t.e[last];
        t.n -= 1;
        let mut rest = [None, None];
        if r.start < start {
            rest[0] = Some(Range { start: r.start, len: start - r.start, stack: r.stack });
        }
        if r_end > end {
            rest[1] = Some(Range { start: end, len: r_end - end, stack: r.stack });
        }
        for part in rest.into_iter().flatten() {
            kept(part);
            let n = t.n;
            t.e[n] = part;
            t.n += 1;
        }
        // The parts added at the end are past the overlap: the loop skips them.
    }
    COUNT.store(t.n, std::sync::atomic::Ordering::Relaxed);
}

/// The tracked mapping that starts at `start`, if any.
pub fn find(start: u64) -> Option<Range> {
    let t = lock()?;
    t.e[..t.n].iter().find(|r| r.start == start).copied()
}

/// The resident bytes of the tracked mappings (`mincore`).
pub fn resident() -> u64 {
    if !any() {
        // Nothing to measure: the table's lock and length lie 96 KiB apart (two page
        // faults in a short process's exit report).
        return 0;
    }
    let ranges: Vec<Range> = match lock() {
        Some(t) => t.e[..t.n].to_vec(),
        None => return 0,
    };
    ranges.iter().map(|r| super::own::resident(r.start as usize, r.len as usize)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partial_unmap_keeps_the_head_and_the_tail_with_their_stack() {
        assert!(add(Range { start: 0x10_0000, len: 0x10_000, stack: 7 }));
        let (mut gone, mut kept) = (Vec::new(), Vec::new());
        remove(0x10_4000, 0x4000, |r| gone.push((r.start, r.len)), |r| kept.push((r.start, r.len, r.stack)));
        assert_eq!(gone, [(0x10_0000, 0x10_000)]);
        assert_eq!(kept, [(0x10_0000, 0x4000, 7), (0x10_8000, 0x8000, 7)]);
        assert_eq!(find(0x10_8000).map(|r| r.len), Some(0x8000));
        let mut n = 0;
        remove(0x10_0000, 0x10_000, |_| n += 1, |_| panic!("nothing stays"));
        assert_eq!(n, 2);
        assert!(find(0x10_0000).is_none());
    }
}
