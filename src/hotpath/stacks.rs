//! Stack interning: the hot path turns a captured stack (raw return addresses) into a
//! 32-bit id with a lock-free, insert-only hash table, so an event carries an id and
//! not 64 addresses. Id 0 means "no stack" (capture impossible or table full).
//!
//! Storage is three anonymous `MAP_NORESERVE` mappings made once: the frame arena, the
//! per-id records, and the open-addressing index. Nothing is ever removed, so readers
//! (the collector, the report writer) can hold `&'static [u64]` slices.
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

const MAX_STACKS: usize = 1 << 22;
const INDEX_SLOTS: usize = 1 << 23;
const FRAME_CAPACITY: usize = 1 << 27;
const MAX_PROBES: usize = 64;

struct Record {
    hash: AtomicU64,
    epoch: AtomicU32,
    /// frame offset (40 bits) | length (16 bits) << 40 | ready bit 63
    location: AtomicU64,
}

const READY: u64 = 1 << 63;

struct Tables {
    records: *const Record,
    index: *const AtomicU32,
    frames: *mut u64,
    next_id: AtomicU32,
    next_frame: AtomicU64,
    overflows: AtomicU64,
}

// SAFETY: every shared field is atomic or points into mappings that live forever and
// whose cells are atomics (records, index) or written once before being published.
unsafe impl Sync for Tables {}
unsafe impl Send for Tables {}

static TABLES: AtomicPtr<Tables> = AtomicPtr::new(std::ptr::null_mut());

use super::mapping::map_zeroed as map_anonymous;

fn tables() -> Option<&'static Tables> {
    let t = TABLES.load(Ordering::Acquire);
    if !t.is_null() {
        // SAFETY: once published the tables are never freed.
        return Some(unsafe { &*t });
    }
    init_tables()
}

#[cold]
fn init_tables() -> Option<&'static Tables> {
    let records = map_anonymous(MAX_STACKS * std::mem::size_of::<Record>())?;
    let index = map_anonymous(INDEX_SLOTS * 4)?;
    let frames = map_anonymous(FRAME_CAPACITY * 8)?;
    let header = map_anonymous(std::mem::size_of::<Tables>())? as *mut Tables;
    // SAFETY: `header` is a fresh, writable, suitably aligned (page) mapping.
    unsafe {
        header.write(Tables {
            records: records as *const Record,
            index: index as *const AtomicU32,
            frames: frames as *mut u64,
            // id 0 is reserved for "no stack".
            next_id: AtomicU32::new(1),
            next_frame: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
        });
    }
    match TABLES.compare_exchange(std::ptr::null_mut(), header, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: we just published it.
        Ok(_) => Some(unsafe { &*header }),
        // Lost the race (only possible before the library is initialised): use the
        // winner's tables; the few MiB of untouched reserve we made stay unused.
        // SAFETY: the winner's pointer is published and never freed.
        Err(winner) => Some(unsafe { &*winner }),
    }
}

#[inline]
pub fn hash_frames(epoch: u32, frames: &[u64]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ epoch as u64;
    for &f in frames {
        h = (h.rotate_left(5) ^ f).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    h ^= h >> 29;
    h | 1
}

impl Tables {
    fn record(&self, id: u32) -> &Record {
        // SAFETY: id < MAX_STACKS is checked by callers; the mapping holds MAX_STACKS records.
        unsafe { &*self.records.add(id as usize) }
    }

    fn slot(&self, i: usize) -> &AtomicU32 {
        // SAFETY: i is masked to INDEX_SLOTS by callers.
        unsafe { &*self.index.add(i) }
    }

    fn frames_of(&self, location: u64) -> &'static [u64] {
        let off = (location & ((1 << 40) - 1)) as usize;
        let len = ((location >> 40) & 0xffff) as usize;
        // SAFETY: [off, off+len) was reserved by fetch_add and fully written before the
        // record's READY bit was published with Release.
        unsafe { std::slice::from_raw_parts(self.frames.add(off), len) }
    }
}

/// Returns the id of `frames` (captured in dlclose `epoch`), inserting it if new.
#[inline]
pub fn intern(epoch: u32, frames: &[u64]) -> u32 {
    let Some(t) = tables() else { return 0 };
    let h = hash_frames(epoch, frames);
    let mut i = (h as usize) & (INDEX_SLOTS - 1);
    let mut new_id = 0u32;
    for _ in 0..MAX_PROBES {
        let slot = t.slot(i);
        let cur = slot.load(Ordering::Acquire);
        if cur != 0 {
            let rec = t.record(cur - 1);
            if rec.hash.load(Ordering::Relaxed) == h && rec.epoch.load(Ordering::Relaxed) == epoch {
                let loc = rec.location.load(Ordering::Acquire);
                if t.frames_of(loc) == frames {
                    return cur - 1;
                }
            }
            i = (i + 1) & (INDEX_SLOTS - 1);
            continue;
        }
        if new_id == 0 {
            match make_record(t, h, epoch, frames) {
                Some(id) => new_id = id,
                None => {
                    t.overflows.fetch_add(1, Ordering::Relaxed);
                    return 0;
                }
            }
        }
        match slot.compare_exchange(0, new_id + 1, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return new_id,
            // Someone else filled this slot; look at it on the next iteration.
            Err(_) => continue,
        }
    }
    t.overflows.fetch_add(1, Ordering::Relaxed);
    0
}

fn make_record(t: &Tables, h: u64, epoch: u32, frames: &[u64]) -> Option<u32> {
    let id = t.next_id.fetch_add(1, Ordering::Relaxed);
    if id as usize >= MAX_STACKS {
        return None;
    }
    let off = t.next_frame.fetch_add(frames.len() as u64, Ordering::Relaxed);
    if off as usize + frames.len() > FRAME_CAPACITY {
        // Mark the id as an empty, ready record so readers do not wait for it.
        t.record(id).location.store(READY, Ordering::Release);
        return None;
    }
    // SAFETY: [off, off+len) is ours alone (fetch_add) and inside the mapping.
    unsafe {
        std::ptr::copy_nonoverlapping(frames.as_ptr(), t.frames.add(off as usize), frames.len());
    }
    let rec = t.record(id);
    rec.hash.store(h, Ordering::Relaxed);
    rec.epoch.store(epoch, Ordering::Relaxed);
    rec.location.store(off | ((frames.len() as u64) << 40) | READY, Ordering::Release);
    Some(id)
}

/// Number of ids handed out so far (some may not be ready yet).
pub fn count() -> u32 {
    tables().map(|t| t.next_id.load(Ordering::Acquire).min(MAX_STACKS as u32)).unwrap_or(1)
}

/// The frames of a stack, or `None` while its record is still being written.
pub fn frames(id: u32) -> Option<&'static [u64]> {
    frames_and_epoch(id).map(|(frames, _)| frames)
}

/// The frames of a stack and the dlclose epoch it was captured in, or `None` while its
/// record is still being written.
pub fn frames_and_epoch(id: u32) -> Option<(&'static [u64], u32)> {
    if id == 0 || id as usize >= MAX_STACKS {
        return Some((&[], 0));
    }
    let t = tables()?;
    let rec = t.record(id);
    let loc = rec.location.load(Ordering::Acquire);
    if loc & READY == 0 {
        return None;
    }
    Some((t.frames_of(loc), rec.epoch.load(Ordering::Relaxed)))
}

/// How many stacks could not be interned (table full); their events carry id 0.
pub fn overflows() -> u64 {
    tables().map(|t| t.overflows.load(Ordering::Relaxed)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_frames_same_id_different_epoch_different_id() {
        let a = [1u64, 2, 3, 0xdead_beef];
        let id1 = intern(0, &a);
        let id2 = intern(0, &a);
        assert_ne!(id1, 0);
        assert_eq!(id1, id2);
        assert_eq!(frames(id1).unwrap(), &a);
        let id3 = intern(1, &a);
        assert_ne!(id3, id1);
        let b = [1u64, 2, 4];
        assert_ne!(intern(0, &b), id1);
        assert!(count() > id3);
    }

    #[test]
    fn concurrent_interning_agrees_on_ids() {
        let ids: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| (0..2000u64).map(|i| intern(7, &[i, i * 3, 0x1000 + i])).collect::<Vec<_>>())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for v in &ids[1..] {
            assert_eq!(v, &ids[0]);
        }
        for (i, id) in ids[0].iter().enumerate() {
            let i = i as u64;
            assert_eq!(frames(*id).unwrap(), &[i, i * 3, 0x1000 + i]);
        }
    }
}
