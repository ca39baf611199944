//! The lock-free event ring between the hooks (many producers) and the collector (one
//! consumer at a time, serialised by the collector lock).
//!
//! A producer takes a ticket with one `fetch_add`; tickets give a single total order.
//! Because a free is published *before* the real `free` runs and an allocation *after*
//! the real `malloc` returns, any reuse of an address by another thread takes a later
//! ticket than the free that released it, so the collector — which consumes strictly
//! in ticket order — can never see an address "allocated twice" or lose a leak.
//!
//! A full ring never drops an event: the producer waits for its slot and, while it
//! waits, calls back into the collector to drain (`help`), counting each wait.
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::event::Event;

pub const RING_BITS: u32 = 17;
pub const RING_SIZE: u64 = 1 << RING_BITS;
const MASK: u64 = RING_SIZE - 1;

/// `seq` is relative to the slot index so that an all-zero ring is a valid empty ring:
/// slot i is free for ticket t when `seq == t - i`, and holds t's event when
/// `seq == t - i + 1`. One cache line per slot: neighbouring tickets usually belong to
/// different threads, which must not write the same line.
#[repr(C)]
struct Slot {
    seq: AtomicU64,
    addr: AtomicU64,
    size: AtomicU64,
    meta: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_SLOT: Slot = Slot {
    seq: AtomicU64::new(0),
    addr: AtomicU64::new(0),
    size: AtomicU64::new(0),
    meta: AtomicU64::new(0),
};

/// Keeps a hot atomic alone on its cache line.
#[repr(C, align(128))]
struct Padded<T>(T);

pub struct Ring {
    tail: Padded<AtomicU64>,
    full_waits: Padded<AtomicU64>,
    /// Set once the final report is written: producers stop waiting for space.
    closed: AtomicBool,
    slots: [Slot; RING_SIZE as usize],
}

impl Ring {
    pub const fn new() -> Ring {
        Ring {
            tail: Padded(AtomicU64::new(0)),
            full_waits: Padded(AtomicU64::new(0)),
            closed: AtomicBool::new(false),
            slots: [EMPTY_SLOT; RING_SIZE as usize],
        }
    }

    /// Publishes one event. `help` is called while the ring is full; it should try to
    /// drain the ring (it must not block indefinitely).
    #[inline]
    pub fn publish(&self, ev: &Event, mut help: impl FnMut()) {
        let ticket = self.tail.0.fetch_add(1, Ordering::Relaxed);
        let slot = &self.slots[(ticket & MASK) as usize];
        let lap = ticket & !MASK;
        if slot.seq.load(Ordering::Acquire) != lap {
            self.full_waits.0.fetch_add(1, Ordering::Relaxed);
            let mut spins = 0u32;
            while slot.seq.load(Ordering::Acquire) != lap {
                if self.closed.load(Ordering::Relaxed) {
                    return;
                }
                help();
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        slot.addr.store(ev.addr, Ordering::Relaxed);
        slot.size.store(ev.size, Ordering::Relaxed);
        slot.meta.store(ev.pack_meta(), Ordering::Relaxed);
        slot.seq.store(lap + 1, Ordering::Release);
    }

    pub fn tail(&self) -> u64 {
        self.tail.0.load(Ordering::Acquire)
    }

    pub fn full_waits(&self) -> u64 {
        self.full_waits.0.load(Ordering::Relaxed)
    }

    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    pub fn reopen(&self) {
        self.closed.store(false, Ordering::SeqCst);
    }

    /// Consumes published events in ticket order starting at `*head`, at most `max`.
    /// Stops at the first slot still being written, except below `skip_below`, where an
    /// unwritten slot belongs to a thread that no longer exists (a forked child) and is
    /// skipped. Returns how many slots were consumed.
    pub fn drain(&self, head: &mut u64, max: usize, skip_below: u64, mut f: impl FnMut(Option<Event>)) -> usize {
        let mut n = 0;
        while n < max {
            let pos = *head;
            let slot = &self.slots[(pos & MASK) as usize];
            let lap = pos & !MASK;
            let seq = slot.seq.load(Ordering::Acquire);
            if seq == lap + 1 {
                let ev = Event::unpack(
                    slot.meta.load(Ordering::Relaxed),
                    slot.addr.load(Ordering::Relaxed),
                    slot.size.load(Ordering::Relaxed),
                );
                f(ev);
            } else if pos < skip_below {
                f(None);
            } else {
                break;
            }
            slot.seq.store(lap + RING_SIZE, Ordering::Release);
            *head = pos + 1;
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hotpath::event::{Api, EventKind};
    use std::sync::Mutex;

    fn ev(addr: u64) -> Event {
        Event { kind: EventKind::Alloc, api: Api::Malloc, tid: 1, stack: 2, addr, size: 8 }
    }

    #[test]
    fn events_come_out_in_order_across_laps() {
        static RING: Ring = Ring::new();
        let ring = &RING;
        let mut head = 0;
        let mut seen = Vec::new();
        for round in 0..3u64 {
            for i in 0..RING_SIZE {
                ring.publish(&ev(round * RING_SIZE + i), || {});
            }
            ring.drain(&mut head, usize::MAX, 0, |e| seen.push(e.unwrap().addr));
        }
        assert_eq!(seen.len() as u64, 3 * RING_SIZE);
        assert!(seen.iter().enumerate().all(|(i, a)| *a == i as u64));
    }

    #[test]
    fn full_ring_is_drained_by_the_producer_and_nothing_is_lost() {
        static RING: Ring = Ring::new();
        let ring = &RING;
        let consumer = Mutex::new((0u64, Vec::new()));
        let threads = 4;
        let per_thread = RING_SIZE + 1000;
        std::thread::scope(|s| {
            for t in 0..threads {
                let consumer = &consumer;
                s.spawn(move || {
                    for i in 0..per_thread {
                        ring.publish(&ev((t << 40) | i), || {
                            if let Ok(mut g) = consumer.try_lock() {
                                let (head, seen) = &mut *g;
                                ring.drain(head, 1024, 0, |e| seen.push(e.unwrap().addr));
                            }
                        });
                    }
                });
            }
        });
        let mut g = consumer.lock().unwrap();
        let (head, seen) = &mut *g;
        ring.drain(head, usize::MAX, 0, |e| seen.push(e.unwrap().addr));
        assert_eq!(seen.len() as u64, threads * per_thread);
        // Each producer's own events stay in its program order.
        for t in 0..threads {
            let mine: Vec<u64> = seen.iter().filter(|a| **a >> 40 == t).map(|a| a & 0xff_ffff_ffff).collect();
            assert!(mine.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(mine.len() as u64, per_thread);
        }
        assert!(ring.full_waits() > 0);
    }

    #[test]
    fn unwritten_slots_below_the_fork_point_are_skipped() {
        static RING: Ring = Ring::new();
        let ring = &RING;
        ring.publish(&ev(1), || {});
        // A ticket taken by a thread that never wrote it (it did not survive fork).
        ring.tail.0.fetch_add(1, Ordering::Relaxed);
        ring.publish(&ev(3), || {});
        let mut head = 0;
        let mut seen = Vec::new();
        ring.drain(&mut head, usize::MAX, 0, |e| seen.push(e.map(|e| e.addr)));
        assert_eq!(seen, vec![Some(1)]);
        ring.drain(&mut head, usize::MAX, ring.tail(), |e| seen.push(e.map(|e| e.addr)));
        assert_eq!(seen, vec![Some(1), None, Some(3)]);
    }
}
