//! The event path from the hooks (every thread) to the collector (one consumer at a
//! time, serialised by the collector lock): one single-producer ring per thread, so a
//! hook never writes a cache line that another producer writes.
//!
//! **Order without a global lock or counter.** Per-thread rings alone would lose the
//! order between threads, and that order matters for events on the same address: thread
//! A frees X and thread B's malloc then returns X, or B allocates X and hands it to A,
//! who frees it. Applied in the wrong order, the collector would drop a live block (a
//! missed leak) or keep a freed one (a false leak). So every event on an address takes a
//! ticket from one of 256 per-address-bucket counters — a `fetch_add` taken *before* the
//! real free runs and *after* the real malloc returned — and the collector applies each
//! bucket's events in ticket order. Whatever the program (or the allocator) does to pass
//! an address from one thread to another happens between those two points, so tickets
//! follow the real order of events on every address. All ticket operations are SeqCst,
//! so the waits they impose form no cycle. The 256 buckets sit on separate cache lines,
//! and a bucket is a block's MiB region (`bucket_of`): threads that allocate from arenas
//! of their own take tickets on lines no other thread touches.
//!
//! **Nothing dropped.** A full ring makes its producer wait and, while it waits, drain
//! the rings itself through `help` (each wait is counted).
//!
//! **Rings grow for the threads that need it.** Every thread starts with a small ring.
//! One that fills it moves to a ring four times larger instead of waiting: the old ring
//! becomes the new one's *predecessor*, which the consumer empties before it takes
//! anything from the new one, so the thread's events keep their order (a realloc's
//! release and outcome may straddle the move). Only the consumer lets go of a
//! predecessor, once it is empty and after unlinking it, so a ring is never reused while
//! a successor still waits on it.
//!
//! **An allocation freed soon by its own thread costs the consumer one event.** A
//! thread that frees a block whose allocation event still waits in its own ring, in
//! the last `LAG` events, turns that event into a `Transient` one (one compare-and-swap
//! on its meta word) and publishes no free: the consumer counts both at once and never
//! touches its live-block table. Two conditions keep it exact. The consumer never
//! takes the last `LAG` events of a ring with a plain read: in a turn of its own it
//! leaves them for later (`drain_lagged`: until they are `LAG` events old or have
//! waited a snapshot period), and where it must take them (a report, a full ring, a
//! fork) it claims each allocation's meta word with a swap, so exactly one of the two
//! sides wins. And no other thread may have released an address of the block's bucket
//! since the allocation: the block might have been freed there, handed out again and
//! passed back, and this free would then be another allocation's. Each bucket's counter
//! also counts releases (its top bits), each ring counts its own, and an allocation
//! slot keeps how many releases were others' when it was published.
//!
//! **A stalled consumer does not stall the program.** Growing the collector's live-block
//! table takes tens of milliseconds at a few million blocks (the kernel zeroes the new
//! arrays), longer than a large ring lasts at full speed. While the consumer says it is
//! stalled (`ConsumerStall`), a thread that fills its large ring moves on once more, to
//! a huge one, instead of waiting. Only then: a program that allocates faster than the
//! consumer keeps up waits on its large ring, which stays in the consumer's cache.
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::event::{Api, Event, EventKind};
use super::thread::{self, ThreadState};

pub const BUCKETS: usize = 256;
/// A ticket counter's low bits are the bucket's order; its top bits count the releases
/// among its events (`EventKind::releases`), wrapping.
const ORDER_BITS: u32 = 40;
const ORDER_MASK: u64 = (1 << ORDER_BITS) - 1;
const ONE_RELEASE: u64 = 1 << ORDER_BITS;
const RELEASE_MASK: u32 = (1 << 24) - 1;
/// The last events of a small ring, where an allocation may still be cancelled by its
/// own thread's free (`cancel_alloc`).
pub const LAG: u64 = 2048;
/// The same for a large ring taken by a thread whose blocks live longer
/// (`ThreadRing::long_lag`). `bench/malloc_bench.c` frees a block chosen at random
/// among its last 1,000: a block lives 1,000 allocations on average, and a third of
/// them outlived 2,048 events.
const LARGE_LAG: u64 = 8192;
/// Frees too late to cancel, among a thread's last `LATE_WINDOW` events, after which
/// it moves to a large ring with the longer lag (`ProducerLine::late`): a thread that
/// frees many blocks a few thousand events after allocating them. A thread that
/// allocates little, or whose blocks live only briefly (a shell's), never gets there,
/// and keeps the short lag, whose events and table of recent allocations stay in the
/// cache (the bash loop took 9% more CPU time with every large ring's lag long).
const LATE_TO_GROW: u32 = 1024;
/// Events over which late frees are counted: past this many, the count starts again.
const LATE_WINDOW: u64 = 1 << 16;
/// Places in a ring's table of recent allocations (`cancel_alloc`, by address,
/// direct-mapped) for each event of its lag. A place survives `n` later allocations
/// with a probability of about `e^(-n / places)`: a block freed `LARGE_LAG`
/// allocations later is still found in 61% of cases at twice as many places, in 14%
/// at half as many.
const RECENT_PER_LAG: usize = 2;
/// The places of a ring with the short lag (4,096).
const RECENT: usize = RECENT_PER_LAG * LAG as usize;
/// The places of a ring with the long lag (16,384): large and huge rings have room for
/// this many.
const LARGE_RECENT: usize = RECENT_PER_LAG * LARGE_LAG as usize;
/// How long the consumer's own turns leave the last `LAG` events of a quiet ring alone:
/// an event is taken once it is `LAG` events old or was published before the snapshot
/// before last (1–2 periods ago).
const SNAPSHOT_EVERY_NS: u64 = 1_000_000;
/// Every thread's first ring (256 KiB).
const SMALL_SLOTS: u64 = 8192;
const _: () =
    assert!(LAG * 4 <= SMALL_SLOTS && LARGE_LAG * 4 <= LARGE_SLOTS && LARGE_LAG <= SMALL_SLOTS && RECENT.is_power_of_two() && LARGE_RECENT.is_power_of_two());
/// The ring of a thread that filled its small one (1 MiB). A Python program allocating
/// flat out filled a small ring about 5,000 times a run while the consumer caught up;
/// at this size, twice. Twice as large gained nothing more there and cost a program
/// that allocates faster than the consumer can follow 5–10% (its rings fall out of the
/// consumer's cache).
const LARGE_SLOTS: u64 = 32768;
/// The ring of a thread that filled its large one while the consumer was stalled (8 MiB).
const HUGE_SLOTS: u64 = 1 << 18;
/// A thread on a huge ring moves back to a large one at its next check once the
/// consumer is no longer stalled and has caught up to within this many events; the huge
/// ring's slots go back to the system once it is drained. It stayed the thread's for
/// good before: 8 MiB resident in a PyTorch job's main thread after `import torch`
/// (its tables grew), and in each DataLoader worker forked from it, copied as written.
const SHRINK_BELOW: u64 = LARGE_SLOTS / 2;
/// A producer that finds its ring this full wakes a sleeping consumer: at 10+ M events
/// a second a small ring fills in under a millisecond, about the consumer's idle sleep.
/// The same for both sizes: a large ring is there to absorb the consumer's wake-up.
/// Past the `LAG` events its own turns leave, half a small ring to take (a larger ring:
/// past its own lag, `ThreadRing::wake_at`).
const WAKE_AT: u64 = SMALL_SLOTS / 2 + LAG;
/// A producer takes the line this many slots ahead of its write position for writing
/// (`prefetch_line_for_write`): 8 lines, a few events' time to arrive.
const PREFETCH_AHEAD: u64 = 16;
/// A producer whose ring stays past `WAKE_AT` looks at the consumer again this often.
const RECHECK_EVERY: u64 = 512;

#[repr(C, align(128))]
struct Padded<T>(T);

#[allow(clippy::declare_interior_mutable_const)]
const ZERO_TICKETS: Padded<AtomicU64> = Padded(AtomicU64::new(0));
static TICKETS: [Padded<AtomicU64>; BUCKETS] = [ZERO_TICKETS; BUCKETS];
static FULL_WAITS: AtomicU64 = AtomicU64::new(0);
static RINGS_GROWN: AtomicU64 = AtomicU64::new(0);
static RINGS_SHRUNK: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicBool = AtomicBool::new(false);
/// How many long steps that take no events the consumer is in (see `ConsumerStall`).
static CONSUMER_STALLS: AtomicU32 = AtomicU32::new(0);
/// 1 while the consumer sleeps in `park_consumer` (a futex word).
static CONSUMER_PARKED: AtomicU32 = AtomicU32::new(0);
static RINGS: AtomicPtr<ThreadRing> = AtomicPtr::new(std::ptr::null_mut());
static RETIRE_KEY: AtomicUsize = AtomicUsize::new(usize::MAX);

/// A bucket's addresses: one MiB-aligned region, spread over `REGION_SPREAD` buckets.
const REGION_SHIFT: u32 = 20;
const REGION_SPREAD: usize = 4;

/// The ticket bucket of `addr`: any function of the address keeps the order of events
/// on one address; this one keeps each thread's tickets on lines no other thread takes.
/// glibc gives each thread that allocates concurrently an arena of its own (a 64 MiB
/// heap of its own for all but the main thread), so a thread's blocks lie in a few MiB
/// regions that no other thread's do. A bucket per region (hashed, then spread over 4
/// neighbouring buckets by the address's low bits, so that threads which do share an
/// arena share 4 lines, not 1) leaves each thread's counters in its own core's cache;
/// a bucket per 16-byte granule made every thread's tickets land on all 256 lines and
/// pass each line back and forth between the cores. `bench/malloc_bench.c` with two
/// threads: 0.66 -> 0.51 s CPU, with `MALLOC_ARENA_MAX=1` (one shared arena) 0.99 ->
/// 0.87 s; one thread within -4% to +6% in three A/B runs (the same instructions).
#[inline(always)]
pub fn bucket_of(addr: u64) -> usize {
    let region = ((addr >> REGION_SHIFT).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as usize;
    (region ^ ((addr >> 4) as usize & (REGION_SPREAD - 1))) & (BUCKETS - 1)
}

struct Slot {
    addr: AtomicU64,
    size: AtomicU64,
    meta: AtomicU64,
    order: AtomicU64,
}

/// The line only the ring's producer writes.
struct ProducerLine {
    /// The write position.
    tail: AtomicU64,
    /// The write position at which the producer next looks at the consumer's position
    /// (`make_room`), so that the consumer's line is not pulled over on every event.
    check_at: AtomicU64,
    /// Frees that found their allocation in this ring past its short lag, too late to
    /// cancel it (`cancel_alloc`), since the write position `late_since`: at
    /// `LATE_TO_GROW` within `LATE_WINDOW` events the thread moves to a large ring with
    /// the long lag.
    late: AtomicU32,
    late_since: AtomicU64,
}

struct ThreadRing {
    /// Identity of the owning thread (`thread::identity`), 0 while free to claim.
    owner: AtomicUsize,
    tid: AtomicU32,
    /// The owner ran its thread-exit destructor (or did not survive fork): recycle the
    /// ring once it is drained and the thread is gone.
    retired: AtomicBool,
    /// The owner moved to a larger ring: only the successor's drain recycles this one.
    superseded: AtomicBool,
    /// The ring the owner published into before this one (null: none). Its events come
    /// first; the consumer unlinks it once it is empty.
    predecessor: AtomicPtr<ThreadRing>,
    next: *mut ThreadRing,
    /// `SMALL_SLOTS` or `LARGE_SLOTS`; fixed when the ring is made.
    capacity: u64,
    /// `LARGE_LAG` rather than `LAG` (`ThreadRing::lag`): set by the thread that takes
    /// the ring before it publishes anything there (a large or huge ring only).
    long_lag: AtomicBool,
    /// `capacity` slots, in the same mapping, just after this header.
    slots: *const Slot,
    producer: Padded<ProducerLine>,
    head: Padded<AtomicU64>,
    /// The consumer's marks for its own turns (`drain_lagged`).
    lag: Padded<LagMarks>,
    /// The producer's memory of its recent allocations (`cancel_alloc`).
    recent: Recent,
    /// By address (`ThreadRing::recent_at`): the position + 1 (low 32 bits) of the last
    /// cancellable allocation published here; 0: none, or the address was released.
    /// `recent_slots(capacity)` of them, in the ring's mapping after its slots; those of
    /// `ThreadRing::recent_in_use` in use.
    recent_at: *const AtomicU32,
}

/// Written by the consumer only.
struct LagMarks {
    /// Events before this position are taken even within the last `LAG`.
    release_to: AtomicU64,
    /// The tail at the last snapshot: `release_to` at the next one.
    snapshot: AtomicU64,
}

/// Written by the ring's producer only (atomics for `Sync`; relaxed, plain moves).
struct Recent {
    /// Per ticket bucket, the releases this ring's producer took tickets for (wrapping).
    own_releases: [AtomicU32; BUCKETS],
}

/// The room for recent allocations in a ring of `capacity` slots.
const fn recent_slots(capacity: u64) -> usize {
    if capacity == SMALL_SLOTS {
        RECENT
    } else {
        LARGE_RECENT
    }
}

impl ThreadRing {
    /// The last events of this ring where its producer may cancel an allocation, and
    /// which the consumer's own turns leave (`LAG`, `LARGE_LAG`).
    #[inline(always)]
    fn lag(&self) -> u64 {
        if self.long_lag.load(Ordering::Relaxed) {
            LARGE_LAG
        } else {
            LAG
        }
    }

    /// The entries of the table of recent allocations in use (`RECENT`, `LARGE_RECENT`).
    #[inline(always)]
    fn recent_in_use(&self) -> usize {
        RECENT_PER_LAG * self.lag() as usize
    }

    /// How full the ring is when its producer wakes the consumer: past the events the
    /// consumer's own turns leave, half a small ring to take.
    #[inline(always)]
    fn wake_at(&self) -> u64 {
        WAKE_AT - LAG + self.lag()
    }

    /// The entry of the table of recent allocations for `addr`.
    #[inline(always)]
    fn recent_at(&self, addr: u64) -> &AtomicU32 {
        let bits = self.recent_in_use().trailing_zeros();
        let i = ((addr >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - bits)) as usize;
        // SAFETY: `recent_at` holds `recent_slots(capacity)` entries that live as long
        // as the ring (forever), at least `recent_in_use` (a power of two, `2^bits`;
        // only a large or huge ring has the long lag); the index is the product's top
        // `bits` bits.
        unsafe { &*self.recent_at.add(i) }
    }

    /// The whole table of recent allocations.
    fn recent_table(&self) -> &[AtomicU32] {
        // SAFETY: as in `recent_at`.
        unsafe { std::slice::from_raw_parts(self.recent_at, recent_slots(self.capacity)) }
    }

    #[inline(always)]
    fn slot(&self, position: u64) -> &Slot {
        // SAFETY: `slots` holds `capacity` (a power of two) slots that live as long as
        // the ring (forever); the index is masked into range.
        unsafe { &*self.slots.add((position & (self.capacity - 1)) as usize) }
    }
}

/// Creates the thread-exit key; called once from the library constructor.
pub fn init() {
    super::mapping::detect_prefetch_for_write();
    if RETIRE_KEY.load(Ordering::Acquire) != 0 {
        // A second recording of the same process (attached again after a detach).
        return;
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: valid out pointer; the destructor never unwinds.
    if unsafe { libc::pthread_key_create(&mut key, Some(retire_ring)) } == 0 {
        RETIRE_KEY.store(key as usize, Ordering::Release);
    }
}

extern "C" fn retire_ring(p: *mut std::ffi::c_void) {
    if !p.is_null() {
        // SAFETY: p is this thread's ring, which lives forever (rings are recycled,
        // never unmapped). The thread may still publish into it until it is gone.
        unsafe { (*(p as *const ThreadRing)).retired.store(true, Ordering::Release) };
    }
}

fn rings() -> impl Iterator<Item = &'static ThreadRing> {
    let mut p = RINGS.load(Ordering::Acquire);
    std::iter::from_fn(move || {
        if p.is_null() {
            return None;
        }
        // SAFETY: rings are published fully initialised and never freed.
        let r = unsafe { &*p };
        p = r.next;
        Some(r)
    })
}

/// The slots of every ring there is now: no more events than this wait in them (rings
/// are never freed, only reused).
pub fn slots_in_rings() -> usize {
    rings().map(|r| r.capacity as usize).sum()
}

/// Calls `each` with the address of every event published and not yet applied that
/// takes a block out of the live set: a free, a realloc's release, a CUDA free; returns
/// how many there were (nothing is allocated here: a caller whose room was too short
/// maps room for all and asks again). A pointer scan that took the live set before it
/// stopped the program's threads reads these (the consumers held off meanwhile): a
/// block freed in between is no leak, whatever still points to it.
pub fn unapplied_frees(mut each: impl FnMut(u64)) -> usize {
    let mut n = 0;
    for ring in rings() {
        let tail = ring.producer.0.tail.load(Ordering::Acquire);
        let head = ring.head.0.load(Ordering::Acquire);
        for position in head..tail {
            let slot = ring.slot(position);
            let addr = slot.addr.load(Ordering::Relaxed);
            if let Some(ev) = Event::unpack(slot.meta.load(Ordering::Relaxed), addr, slot.size.load(Ordering::Relaxed)) {
                if matches!(ev.kind, EventKind::Free | EventKind::ReallocRelease | EventKind::ReallocFreed) {
                    each(addr);
                    n += 1;
                }
            }
        }
    }
    n
}

/// A free ring of `capacity` slots, or a new one, owned by the calling thread from now,
/// with the long lag or not (`long_lag`: a large or huge ring only).
fn take_ring(capacity: u64, long_lag: bool) -> Option<&'static ThreadRing> {
    debug_assert!(!long_lag || recent_slots(capacity) >= LARGE_RECENT);
    let me = crate::os::threads::identity();
    let free = rings().find(|r| r.capacity == capacity && r.owner.compare_exchange(0, me, Ordering::AcqRel, Ordering::Relaxed).is_ok());
    let ring = match free {
        Some(r) => {
            // A reused ring's memory is its last owner's: this thread released nothing
            // yet. (A new ring's is zero already, and its pages untouched.)
            for c in r.recent.own_releases.iter().chain(r.recent_table()) {
                c.store(0, Ordering::Relaxed);
            }
            r
        }
        None => {
            let header = std::mem::size_of::<ThreadRing>().next_multiple_of(std::mem::align_of::<Slot>());
            // All-zero bytes are a valid empty ring but for its two fixed fields.
            let slots = capacity as usize * std::mem::size_of::<Slot>();
            let table = recent_slots(capacity) * std::mem::size_of::<AtomicU32>();
            let m = super::mapping::map_zeroed(header + slots + table, super::mapping::Part::Rings)?;
            let r = m as *mut ThreadRing;
            // SAFETY: fresh mapping, not yet shared; the slots start `header` bytes in,
            // aligned for `Slot` (the mapping is page-aligned), the table of recent
            // allocations after them (aligned: a slot's size is a multiple of 4).
            unsafe {
                (*r).owner.store(me, Ordering::Relaxed);
                (*r).capacity = capacity;
                (*r).slots = m.add(header) as *const Slot;
                (*r).recent_at = m.add(header + slots) as *const AtomicU32;
            }
            let mut head = RINGS.load(Ordering::Acquire);
            loop {
                // SAFETY: not yet shared; `next` is immutable once published.
                unsafe { (*r).next = head };
                match RINGS.compare_exchange(head, r, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(h) => head = h,
                }
            }
            // SAFETY: published above, never freed.
            unsafe { &*r }
        }
    };
    ring.tid.store(thread::tid(), Ordering::Release);
    ring.retired.store(false, Ordering::Release);
    ring.superseded.store(false, Ordering::Release);
    // The first event looks at the consumer's position (a reused ring's check position
    // is its last owner's).
    ring.producer.0.check_at.store(0, Ordering::Relaxed);
    ring.producer.0.late.store(0, Ordering::Relaxed);
    ring.producer.0.late_since.store(0, Ordering::Relaxed);
    // Before the ring's first event, which the consumer's loads of the tail acquire.
    ring.long_lag.store(long_lag, Ordering::Relaxed);
    Some(ring)
}

#[cold]
fn claim_ring(state: &ThreadState) -> Option<&'static ThreadRing> {
    let ring = take_ring(SMALL_SLOTS, false)?;
    adopt(state, ring);
    Some(ring)
}

/// Makes `ring` the calling thread's: where its events go, and what its exit retires.
fn adopt(state: &ThreadState, ring: &'static ThreadRing) {
    state.ring.set(ring as *const ThreadRing as usize);
    let key = RETIRE_KEY.load(Ordering::Acquire);
    if key != usize::MAX {
        // SAFETY: valid key; setspecific only allocates for keys past the first 32, and
        // then through calloc, which the hook guard forwards.
        unsafe { libc::pthread_setspecific(key as libc::pthread_key_t, ring as *const ThreadRing as *const _) };
    }
}

/// Marks the consumer as stalled while it lives: held around a long step (growing a
/// table) during which the consumer takes no events.
pub struct ConsumerStall(());

impl ConsumerStall {
    pub fn begin() -> ConsumerStall {
        CONSUMER_STALLS.fetch_add(1, Ordering::Relaxed);
        #[cfg(test)]
        STALLS_BEGUN_HERE.with(|c| c.set(c.get() + 1));
        ConsumerStall(())
    }
}

#[cfg(test)]
thread_local! {
    /// Stalls this thread began (for tests of who begins one).
    static STALLS_BEGUN_HERE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Stalls the calling thread began so far.
#[cfg(test)]
pub fn stalls_begun_here() -> u64 {
    STALLS_BEGUN_HERE.with(|c| c.get())
}

impl Drop for ConsumerStall {
    fn drop(&mut self) {
        CONSUMER_STALLS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The ring size a thread whose full ring holds `capacity` slots moves to, if any.
fn next_capacity(capacity: u64) -> Option<u64> {
    if capacity < LARGE_SLOTS {
        Some(LARGE_SLOTS)
    } else if capacity < HUGE_SLOTS && CONSUMER_STALLS.load(Ordering::Relaxed) != 0 {
        Some(HUGE_SLOTS)
    } else {
        None
    }
}

/// Moves the calling thread from its full ring `old` to one of `capacity` slots.
/// Returns `None` (the caller waits instead) when no memory can be had.
#[cold]
fn grow(state: &ThreadState, old: &'static ThreadRing, capacity: u64, long_lag: bool) -> Option<&'static ThreadRing> {
    let ring = move_to(state, old, capacity, long_lag)?;
    RINGS_GROWN.fetch_add(1, Ordering::Relaxed);
    Some(ring)
}

/// Moves the calling thread from `old` to a ring of `capacity` slots (with the long lag
/// or not), with `old` as its predecessor (emptied by the consumer first, so the
/// thread's events keep their order).
fn move_to(state: &ThreadState, old: &'static ThreadRing, capacity: u64, long_lag: bool) -> Option<&'static ThreadRing> {
    let ring = take_ring(capacity, long_lag)?;
    old.superseded.store(true, Ordering::Release);
    // Release: the consumer that sees the link sees every event published into `old`.
    ring.predecessor.store(old as *const ThreadRing as *mut ThreadRing, Ordering::Release);
    adopt(state, ring);
    Some(ring)
}

/// Whether a thread on `ring` (write position `t`, consumer at `h`) should move back to
/// a large ring: a huge one, the stall that sent it there over, its events taken.
#[inline]
fn should_shrink(ring: &ThreadRing, t: u64, h: u64) -> bool {
    ring.capacity == HUGE_SLOTS && CONSUMER_STALLS.load(Ordering::Relaxed) == 0 && t.wrapping_sub(h) < SHRINK_BELOW
}

/// The consumer lets go of `ring` (drained, unlinked, its producer gone or moved on):
/// a huge ring's slots go back to the system first (a large or small one is reused
/// soon enough to keep its pages), then any thread may take the ring again. Not under a
/// seccomp filter, which may answer `madvise` with SIGSYS (rare: after a stall).
fn let_go(ring: &ThreadRing) {
    if ring.capacity == HUGE_SLOTS && crate::os::procfs::unfiltered_now() {
        give_back_slots(ring);
    }
    ring.owner.store(0, Ordering::Release);
}

/// The whole pages of `ring`'s slots go back to the system (they read as zeros, the
/// empty slot, when next written); the header stays.
fn give_back_slots(r: &ThreadRing) {
    let start = r.slots as usize;
    // SAFETY: the ring's slots, in its own private anonymous mapping; a zero slot is an
    // empty one.
    unsafe { super::mapping::give_back_pages(start, start + r.capacity as usize * std::mem::size_of::<Slot>()) };
}

#[inline(always)]
fn my_ring(state: &ThreadState) -> Option<&'static ThreadRing> {
    let p = state.ring.get();
    if p != 0 {
        // SAFETY: set by claim_ring for this thread; rings are never freed.
        return Some(unsafe { &*(p as *const ThreadRing) });
    }
    claim_ring(state)
}

/// Publishes one event from the calling thread, whose state `state` is. `help` is
/// called while the ring is full; it should drain (it must not block indefinitely).
#[inline(always)]
pub fn publish(state: &ThreadState, kind: EventKind, api: Api, stack: u32, addr: u64, size: u64, help: impl FnMut()) {
    let Some(ring) = my_ring(state) else { return };
    let t = ring.producer.0.tail.load(Ordering::Relaxed);
    if t < ring.producer.0.check_at.load(Ordering::Relaxed) {
        write_event(ring, t, kind, api, stack, addr, size);
    } else {
        publish_at_check(state, ring, t, kind, api, stack, addr, size, help);
    }
}

/// `publish` past the check position: makes room (`make_room`) first.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn publish_at_check(state: &ThreadState, ring: &'static ThreadRing, t: u64, kind: EventKind, api: Api, stack: u32, addr: u64, size: u64, help: impl FnMut()) {
    let (ring, t) = match make_room(state, ring, t, 0, Some(help)) {
        Room::Ready => (ring, t),
        Room::Moved(larger) => (larger, larger.producer.0.tail.load(Ordering::Relaxed)),
        Room::Closed | Room::Full => return,
    };
    write_event(ring, t, kind, api, stack, addr, size);
}

/// Publishes one event like `publish`, from a thread that must never wait for room (one
/// that may hold the collector, whose drain alone would make it): only if the ring has
/// room for `room_for` events from here (a realloc's release leaves its outcome room).
/// Returns whether it was published.
#[inline]
pub fn try_publish(state: &ThreadState, kind: EventKind, api: Api, stack: u32, addr: u64, size: u64, room_for: u64) -> bool {
    let Some(mut ring) = my_ring(state) else { return false };
    let mut t = ring.producer.0.tail.load(Ordering::Relaxed);
    let ahead = room_for.max(1) - 1;
    if t + ahead >= ring.producer.0.check_at.load(Ordering::Relaxed) {
        match make_room(state, ring, t, ahead, None::<fn()>) {
            Room::Ready => {}
            Room::Moved(larger) => {
                ring = larger;
                t = ring.producer.0.tail.load(Ordering::Relaxed);
            }
            Room::Closed | Room::Full => return false,
        }
    }
    write_event(ring, t, kind, api, stack, addr, size);
    true
}

/// Writes an event into the free slot `t` of the calling thread's `ring` and publishes it.
#[inline(always)]
fn write_event(ring: &ThreadRing, t: u64, kind: EventKind, api: Api, stack: u32, addr: u64, size: u64) {
    super::mapping::prefetch_line_for_write(ring.slot(t + PREFETCH_AHEAD));
    // The ticket is taken only once there is room: a producer waiting for space never
    // holds a ticket that others must wait for.
    let order = if kind.orders_by_address() { take_ticket(ring, t, kind, api, addr) } else { 0 };
    let slot = ring.slot(t);
    let ev = Event { kind, api, tid: 0, stack, addr, size };
    slot.addr.store(addr, Ordering::Relaxed);
    slot.size.store(size, Ordering::Relaxed);
    slot.meta.store(ev.pack_meta(), Ordering::Relaxed);
    slot.order.store(order, Ordering::Relaxed);
    ring.producer.0.tail.store(t + 1, Ordering::Release);
}

/// Takes the ticket of an event on `addr` about to be written at position `t`, and
/// keeps `cancel_alloc`'s books: a release is counted (in the bucket and in the ring)
/// and forgets any recent allocation remembered for its address; a cancellable
/// allocation is remembered, its slot's order word carrying in its top bits how many
/// of the bucket's releases were other rings' so far.
#[inline(always)]
fn take_ticket(ring: &ThreadRing, t: u64, kind: EventKind, api: Api, addr: u64) -> u64 {
    let b = bucket_of(addr);
    let releases = kind.releases();
    let v = TICKETS[b].0.fetch_add(if releases { 1 + ONE_RELEASE } else { 1 }, Ordering::SeqCst);
    let at = ring.recent_at(addr);
    let own = &ring.recent.own_releases[b];
    if releases {
        own.store(own.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        at.store(0, Ordering::Relaxed);
        v & ORDER_MASK
    } else if kind == EventKind::Alloc && api.cancellable() {
        at.store((t as u32).wrapping_add(1), Ordering::Relaxed);
        (v & ORDER_MASK) | (others_releases(v, own) as u64) << ORDER_BITS
    } else {
        v & ORDER_MASK
    }
}

/// The releases in a bucket whose counter reads `v` that other rings than the one
/// counting `own` took tickets for (wrapping, 24 bits).
#[inline(always)]
fn others_releases(v: u64, own: &AtomicU32) -> u32 {
    ((v >> ORDER_BITS) as u32).wrapping_sub(own.load(Ordering::Relaxed)) & RELEASE_MASK
}

/// The calling thread is about to free `addr` in `space`. If the block's allocation
/// event is still in this thread's ring within the last `LAG` events, not taken by the
/// consumer, and no other thread released an address of its bucket since, the event
/// becomes `Transient` and this returns true: the free is not to be published (nor its
/// ticket taken). See the module's notes for why that is exact.
#[inline(always)]
pub fn cancel_alloc(state: &ThreadState, addr: u64, space: super::event::Space) -> bool {
    let p = state.ring.get();
    if p == 0 {
        return false;
    }
    // SAFETY: this thread's ring (set by claim_ring/grow); rings are never freed.
    let ring = unsafe { &*(p as *const ThreadRing) };
    let at = ring.recent_at(addr);
    let stored = at.load(Ordering::Relaxed);
    if stored == 0 {
        return false;
    }
    let t = ring.producer.0.tail.load(Ordering::Relaxed);
    let back = (t as u32).wrapping_sub(stored - 1) as u64;
    if back == 0 {
        return false;
    }
    if back > ring.lag() {
        if back <= LARGE_LAG && !ring.long_lag.load(Ordering::Relaxed) && ring.slot(t - back).addr.load(Ordering::Relaxed) == addr {
            note_late(ring, t);
        }
        return false;
    }
    let slot = ring.slot(t - back);
    if slot.addr.load(Ordering::Relaxed) != addr {
        return false;
    }
    let meta = slot.meta.load(Ordering::Relaxed);
    match Event::unpack(meta, addr, 0) {
        Some(ev) if ev.kind == EventKind::Alloc && ev.api.cancellable() && ev.api.space() == space => {}
        _ => return false,
    }
    let order = slot.order.load(Ordering::Relaxed);
    let b = bucket_of(addr);
    let now = TICKETS[b].0.load(Ordering::SeqCst);
    let others_then = (order >> ORDER_BITS) as u32;
    // The order distance bounds the releases since (fewer than the counter's wrap).
    if others_releases(now, &ring.recent.own_releases[b]) != others_then || (now & ORDER_MASK).wrapping_sub(order & ORDER_MASK) >= 1 << 24 {
        return false;
    }
    if slot.meta.compare_exchange(meta, meta | super::event::TRANSIENT_BIT, Ordering::AcqRel, Ordering::Relaxed).is_err() {
        // The consumer claimed it first.
        return false;
    }
    at.store(0, Ordering::Relaxed);
    true
}

/// A free found its allocation too late to cancel it on a ring with the short lag; at
/// `LATE_TO_GROW` of them, the thread's next event moves it to a large ring with the
/// long lag (`make_room`, reached at once).
#[cold]
fn note_late(ring: &ThreadRing, t: u64) {
    let p = &ring.producer.0;
    let mut late = p.late.load(Ordering::Relaxed) + 1;
    if t.wrapping_sub(p.late_since.load(Ordering::Relaxed)) > LATE_WINDOW {
        p.late_since.store(t, Ordering::Relaxed);
        late = 1;
    }
    p.late.store(late, Ordering::Relaxed);
    if late >= LATE_TO_GROW {
        p.check_at.store(0, Ordering::Relaxed);
    }
}

enum Room {
    /// There is room at the current write position.
    Ready,
    /// The ring was full and the thread moved to this larger, emptier one.
    Moved(&'static ThreadRing),
    /// The channel closed while waiting: the event is dropped with tracking.
    Closed,
    /// The ring is full and the caller may not wait (`try_publish`).
    Full,
}

/// The producer reached its check position: looks at the consumer's position, wakes
/// the consumer if the ring is half full and it sleeps, moves to a larger ring or waits
/// (with `help`; without, it returns `Full`) while the slots `t..=t + ahead` are not all
/// free, and sets the next check position.
///
/// The check position is never past `head + capacity` for a head seen here, and the
/// head only grows, so a slot is never written before the consumer is done with it.
#[cold]
#[inline(never)]
fn make_room(state: &ThreadState, ring: &'static ThreadRing, t: u64, ahead: u64, mut help: Option<impl FnMut()>) -> Room {
    let mut h = ring.head.0.load(Ordering::Acquire);
    if should_shrink(ring, t + ahead, h) {
        if let Some(large) = move_to(state, ring, LARGE_SLOTS, ring.long_lag.load(Ordering::Relaxed)) {
            RINGS_SHRUNK.fetch_add(1, Ordering::Relaxed);
            return match make_room(state, large, large.producer.0.tail.load(Ordering::Relaxed), ahead, help) {
                Room::Ready => Room::Moved(large),
                other => other,
            };
        }
    }
    if ring.producer.0.late.load(Ordering::Relaxed) >= LATE_TO_GROW && !ring.long_lag.load(Ordering::Relaxed) {
        // Asked once: where no large ring can be had, the thread stays.
        ring.producer.0.late.store(0, Ordering::Relaxed);
        if let Some(larger) = grow(state, ring, LARGE_SLOTS.max(ring.capacity), true) {
            return match make_room(state, larger, larger.producer.0.tail.load(Ordering::Relaxed), ahead, help) {
                Room::Ready => Room::Moved(larger),
                other => other,
            };
        }
    }
    if (t + ahead).wrapping_sub(h) >= ring.capacity {
        if let Some(capacity) = next_capacity(ring.capacity) {
            if let Some(larger) = grow(state, ring, capacity, ring.long_lag.load(Ordering::Relaxed)) {
                wake_consumer();
                return match make_room(state, larger, larger.producer.0.tail.load(Ordering::Relaxed), ahead, help) {
                    Room::Ready => Room::Moved(larger),
                    other => other,
                };
            }
        }
        let Some(help) = help.as_mut() else {
            wake_consumer();
            return Room::Full;
        };
        FULL_WAITS.fetch_add(1, Ordering::Relaxed);
        let mut spins = 0u32;
        loop {
            wake_consumer();
            help();
            h = ring.head.0.load(Ordering::Acquire);
            if (t + ahead).wrapping_sub(h) < ring.capacity {
                break;
            }
            if CLOSED.load(Ordering::Relaxed) {
                return Room::Closed;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
    let wake_at = ring.wake_at();
    let next = if t.wrapping_sub(h) >= wake_at {
        // Behind: wake it if it sleeps, and look again soon.
        wake_consumer();
        (h + ring.capacity).min(t + RECHECK_EVERY)
    } else {
        h + wake_at
    };
    ring.producer.0.check_at.store(next, Ordering::Relaxed);
    Room::Ready
}

/// Whether any ring holds events the consumer has not taken yet.
fn any_pending() -> bool {
    rings().any(|r| r.head.0.load(Ordering::Acquire) < r.producer.0.tail.load(Ordering::Acquire))
}

/// Whether any ring holds events that a turn of the consumer (`drain_lagged`) would
/// take now, ticket order aside.
fn any_ready() -> bool {
    rings().any(|r| {
        let tail = r.producer.0.tail.load(Ordering::Acquire);
        r.head.0.load(Ordering::Acquire) < lagged_end(r, tail)
    })
}

/// Where a turn of the consumer's own (`drain_lagged`) stops in `ring`, whose tail is
/// `tail`: before its last `LAG` events, unless they were published before the
/// snapshot before last, or their producer moved on to another ring.
fn lagged_end(ring: &ThreadRing, tail: u64) -> u64 {
    if ring.superseded.load(Ordering::Acquire) {
        return tail;
    }
    tail.saturating_sub(ring.lag()).max(ring.lag.0.release_to.load(Ordering::Relaxed)).min(tail)
}

/// Wakes the consumer if it sleeps in `park_consumer`.
#[inline(always)]
pub fn wake_consumer() {
    // No fence: a producer that misses the consumer parking (its load of the flag passed
    // the consumer's store) looks again `RECHECK_EVERY` events later, and the sleep is
    // bounded anyway.
    if CONSUMER_PARKED.load(Ordering::Relaxed) != 0 && CONSUMER_PARKED.swap(0, Ordering::AcqRel) != 0 {
        // SAFETY: FUTEX_WAKE on a static word; no memory is handed to the kernel.
        unsafe { libc::syscall(libc::SYS_futex, CONSUMER_PARKED.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, 1) };
    }
}

/// How the consumer's idle sleep ended (`park_consumer`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Parked {
    /// It did not sleep: events its turn would take were waiting.
    Ready,
    /// A producer whose ring filled half woke it.
    Woken,
    /// It slept the whole time.
    TimedOut,
}

/// The consumer thread's idle sleep: returns after `timeout`, or as soon as a producer
/// finds its ring half full, or at once when events its turn would take are waiting.
pub fn park_consumer(timeout: std::time::Duration) -> Parked {
    CONSUMER_PARKED.store(1, Ordering::SeqCst);
    if any_ready() {
        CONSUMER_PARKED.store(0, Ordering::SeqCst);
        return Parked::Ready;
    }
    let ts = libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: FUTEX_WAIT on a static word with a relative timeout that outlives the call;
    // it returns at once if the word is no longer 1 (a producer woke us first).
    unsafe { libc::syscall(libc::SYS_futex, CONSUMER_PARKED.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, 1, &ts as *const libc::timespec) };
    // A producer that wakes the consumer sets the word to 0 first (`wake_consumer`).
    if CONSUMER_PARKED.swap(0, Ordering::SeqCst) == 0 {
        Parked::Woken
    } else {
        Parked::TimedOut
    }
}

pub fn full_waits() -> u64 {
    FULL_WAITS.load(Ordering::Relaxed)
}

/// How many times a thread moved to a larger ring (at most twice per thread: to a
/// large ring, then, while the consumer was stalled, to a huge one).
pub fn rings_grown() -> u64 {
    RINGS_GROWN.load(Ordering::Relaxed)
}

/// How many times a thread moved from a huge ring back to a large one.
pub fn rings_shrunk() -> u64 {
    RINGS_SHRUNK.load(Ordering::Relaxed)
}

pub fn close() {
    CLOSED.store(true, Ordering::SeqCst);
}

/// A second recording of the same process starts (attached again after a detach):
/// the channel opens, whatever a straggler left in a ring since the last drain is
/// dropped, and the drain starts at the tickets taken so far.
pub fn reopen() -> DrainState {
    for r in rings() {
        r.head.0.store(r.producer.0.tail.load(Ordering::Acquire), Ordering::Release);
    }
    let mut d = DrainState::default();
    for (b, t) in TICKETS.iter().enumerate() {
        d.next[b] = t.0.load(Ordering::SeqCst) & ORDER_MASK;
    }
    CLOSED.store(false, Ordering::SeqCst);
    d
}

/// After a recording ended with the process running on (`agent::detach`): the rings'
/// slots go back to the system. Their headers stay, and so do the mappings: a thread
/// still inside a hook that writes a slot gets a fresh zero page, in bounds. Not under
/// a seccomp filter, which may answer `madvise` with SIGSYS (as `let_go`).
pub fn release_slots() {
    if !crate::os::procfs::unfiltered_now() {
        return;
    }
    for r in rings() {
        give_back_slots(r);
    }
}

/// Where drained events go. A plain closure is one; a sink that keeps events in a big
/// table can also say what to load ahead (`prefetch`), and the drain calls it a few
/// events before applying each one so that cache misses overlap.
pub trait Sink {
    fn apply(&mut self, ev: Event);
    /// Called with the address of an event that will be applied soon.
    #[inline(always)]
    fn prefetch(&self, _addr: u64) {}
}

impl<F: FnMut(Event)> Sink for F {
    #[inline(always)]
    fn apply(&mut self, ev: Event) {
        self(ev)
    }
}

/// How many events ahead of the one applied the drain prefetches.
const LOOKAHEAD: u64 = 8;

/// Prefetches the sink's line for the event in `slot`, unless its thread cancelled it
/// already (a transient touches no block table; in a loop that allocates and frees at
/// once nearly every event is one by the time the consumer looks ahead to it).
#[inline(always)]
fn prefetch_for(slot: &Slot, f: &impl Sink) {
    if slot.meta.load(Ordering::Relaxed) & super::event::TRANSIENT_BIT == 0 {
        f.prefetch(slot.addr.load(Ordering::Relaxed));
    }
}

/// The consumer's position in the ticket order: per bucket, the next ticket to apply.
pub struct DrainState {
    next: [u64; BUCKETS],
    /// When the rings' tails were last noted for `drain_lagged` (CLOCK_MONOTONIC, ns).
    snapshot_ns: u64,
}

impl Default for DrainState {
    fn default() -> Self {
        DrainState { next: [0; BUCKETS], snapshot_ns: 0 }
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out pointer; CLOCK_MONOTONIC always exists (a vDSO call).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// How far a drain takes each ring.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Everything published.
    All,
    /// The consumer's own turn: not the last `LAG` events, unless published before the
    /// snapshot before last (`drain_lagged`).
    Lagged,
}

impl DrainState {
    /// Applies ready events from every ring, up to `max`. With `force`, an event whose
    /// ticket predecessors never arrive (their threads died in fork, or are stuck) is
    /// applied anyway. Returns how many events were applied.
    pub fn drain(&mut self, max: usize, force: bool, f: impl Sink) -> usize {
        self.drain_to(max, force, Reach::All, f)
    }

    /// The collector's own turn: like `drain`, but the last `LAG` events of each ring
    /// are left where their thread may still cancel an allocation with its free
    /// (`cancel_alloc`), unless they were published before the snapshot before last
    /// (snapshots are `SNAPSHOT_EVERY_NS` apart): an event waits at most two periods
    /// and a turn, and a quiet thread's events are not held back for long. What is left
    /// is in `backlog`; every other drain takes it.
    pub fn drain_lagged(&mut self, max: usize, f: impl Sink) -> usize {
        let now = monotonic_ns();
        if now.wrapping_sub(self.snapshot_ns) >= SNAPSHOT_EVERY_NS {
            self.snapshot_ns = now;
            for ring in rings() {
                let tail = ring.producer.0.tail.load(Ordering::Acquire);
                let previous = ring.lag.0.snapshot.swap(tail, Ordering::Relaxed);
                ring.lag.0.release_to.store(previous, Ordering::Relaxed);
            }
        }
        self.drain_to(max, false, Reach::Lagged, f)
    }

    fn drain_to(&mut self, max: usize, force: bool, reach: Reach, mut f: impl Sink) -> usize {
        let mut total = 0;
        loop {
            let mut progress = 0;
            for ring in rings() {
                progress += self.drain_ring(ring, max - total - progress, force, reach, &mut f);
                if total + progress >= max {
                    return total + progress;
                }
                if ring.retired.load(Ordering::Acquire)
                    && !ring.superseded.load(Ordering::Acquire)
                    && ring.predecessor.load(Ordering::Acquire).is_null()
                    && ring.head.0.load(Ordering::Acquire) == ring.producer.0.tail.load(Ordering::Acquire)
                    && ring.owner.load(Ordering::Acquire) != 0
                    && crate::os::threads::thread_is_gone(ring.tid.load(Ordering::Acquire))
                {
                    ring.retired.store(false, Ordering::Release);
                    let_go(ring);
                }
            }
            total += progress;
            if progress == 0 {
                return total;
            }
        }
    }

    fn drain_ring(&mut self, ring: &ThreadRing, max: usize, force: bool, reach: Reach, f: &mut impl Sink) -> usize {
        let predecessor = ring.predecessor.load(Ordering::Acquire);
        if !predecessor.is_null() {
            // SAFETY: rings are never freed.
            let p = unsafe { &*predecessor };
            // The predecessor's tail is final: its owner published nothing there after
            // the link (Release) that this load acquired.
            if p.head.0.load(Ordering::Acquire) != p.producer.0.tail.load(Ordering::Acquire) {
                // Its events come first; the walk over all rings drains it.
                return 0;
            }
            // Unlinked before it can be reused, so no ring ever waits on another
            // thread's events.
            ring.predecessor.store(std::ptr::null_mut(), Ordering::Release);
            p.superseded.store(false, Ordering::Release);
            p.retired.store(false, Ordering::Release);
            let_go(p);
        }
        let tail = ring.producer.0.tail.load(Ordering::Acquire);
        // Its producer cancels allocations from here on (`cancel_alloc`): a slot here
        // is claimed, not read.
        let contested = tail.saturating_sub(ring.lag());
        let end = match reach {
            Reach::Lagged => lagged_end(ring, tail),
            Reach::All => tail,
        };
        let mut head = ring.head.0.load(Ordering::Relaxed);
        let start = head;
        let tid = ring.tid.load(Ordering::Acquire);
        for ahead in head..end.min(head + LOOKAHEAD) {
            prefetch_for(ring.slot(ahead), f);
        }
        while head < end && ((head - start) as usize) < max {
            if head + LOOKAHEAD < end {
                prefetch_for(ring.slot(head + LOOKAHEAD), f);
            }
            let slot = ring.slot(head);
            let addr = slot.addr.load(Ordering::Relaxed);
            let order = slot.order.load(Ordering::Relaxed) & ORDER_MASK;
            let mut meta = slot.meta.load(Ordering::Relaxed);
            let Some(mut ev) = Event::unpack(meta, addr, slot.size.load(Ordering::Relaxed)) else {
                head += 1;
                continue;
            };
            let b = bucket_of(addr);
            // Restore/freed outcomes of a realloc concern a block the thread still owns;
            // its own ring already orders them.
            let ordered = ev.kind.orders_by_address();
            if ordered && order > self.next[b] && !force {
                break;
            }
            if head >= contested && ev.kind == EventKind::Alloc && ev.api.cancellable() {
                // Taken from here on, whoever wins: an allocation, or one its thread
                // cancelled first.
                meta = slot.meta.swap(0, Ordering::AcqRel);
                match Event::unpack(meta, addr, ev.size) {
                    Some(e) => ev = e,
                    None => {
                        head += 1;
                        continue;
                    }
                }
            }
            ev.tid = tid;
            if ordered {
                self.next[b] = self.next[b].max(order + 1);
            }
            f.apply(ev);
            head += 1;
            if head.is_multiple_of(256) {
                ring.head.0.store(head, Ordering::Release);
            }
        }
        ring.head.0.store(head, Ordering::Release);
        (head - start) as usize
    }

    /// Events waiting in all rings right now.
    pub fn backlog(&self) -> usize {
        rings().map(|r| r.producer.0.tail.load(Ordering::Acquire).saturating_sub(r.head.0.load(Ordering::Acquire)) as usize).sum()
    }

    /// Whether any ring still holds events.
    pub fn pending(&self) -> bool {
        any_pending()
    }

    /// In a forked child: only the calling thread exists. Every other ring's owner is
    /// gone and every ticket taken before the fork is as far as it will ever get.
    pub fn after_fork_child(&mut self) {
        let me = crate::os::threads::identity();
        for ring in rings() {
            if ring.owner.load(Ordering::Acquire) != me {
                ring.tid.store(0, Ordering::Release);
                if ring.owner.load(Ordering::Acquire) != 0 {
                    ring.retired.store(true, Ordering::Release);
                }
            } else {
                ring.tid.store(thread::tid(), Ordering::Release);
            }
        }
        for (b, t) in TICKETS.iter().enumerate() {
            self.next[b] = self.next[b].max(t.0.load(Ordering::SeqCst) & ORDER_MASK);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn a_regions_addresses_take_a_few_buckets_and_regions_spread_over_all() {
        // A MiB region's blocks take 4 buckets, whatever their sizes.
        let region = 0x7f12_3450_0000u64;
        for step in [16u64, 48, 4096 + 16] {
            let in_region: std::collections::BTreeSet<usize> = (0..(1u64 << REGION_SHIFT) / step).map(|i| bucket_of(region + i * step)).collect();
            assert_eq!(in_region.len(), REGION_SPREAD, "blocks every {step} bytes");
        }
        // Many regions cover every bucket.
        let all: std::collections::BTreeSet<usize> = (0..4096u64).map(|r| bucket_of(0x5500_0000_0000 + (r << REGION_SHIFT))).collect();
        assert_eq!(all.len(), BUCKETS);
    }

    fn publish_here(kind: EventKind, api: Api, stack: u32, addr: u64, size: u64, help: impl FnMut()) {
        thread::with(|s| publish(s, kind, api, stack, addr, size, help));
    }

    /// The rings and tickets are process-wide: the tests take turns, and share the one
    /// consumer position (a second one would wait for tickets the first applied).
    static SERIAL: Mutex<()> = Mutex::new(());
    static STATE: Mutex<Option<DrainState>> = Mutex::new(None);

    #[test]
    fn cross_thread_reuse_is_applied_in_causal_order_and_nothing_is_lost() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        init();
        STATE.lock().unwrap().get_or_insert_with(DrainState::default);
        let applied = Mutex::new(Vec::<Event>::new());
        let drain_some = |force: bool| {
            if let Ok(mut g) = STATE.try_lock() {
                let st = g.as_mut().unwrap();
                let mut out = Vec::new();
                st.drain(1024, force, |e| out.push(e));
                applied.lock().unwrap().extend(out);
            }
        };
        // Threads hand addresses to each other: thread i "frees" address a (ticket) and
        // the next thread then "allocates" the same a, like an allocator reusing it.
        const THREADS: u64 = 4;
        // Enough for every thread to outgrow its small ring and then fill its large one (no
        // one drains until a ring is full).
        const ROUNDS: u64 = LARGE_SLOTS;
        let mailbox: Vec<Mutex<Vec<u64>>> = (0..THREADS).map(|_| Mutex::new(Vec::new())).collect();
        let handoff: Vec<Mutex<Vec<u64>>> = (0..THREADS).map(|_| Mutex::new(Vec::new())).collect();
        let published = AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let mailbox = &mailbox;
                let drain_some = &drain_some;
                let published = &published;
                let handoff = &handoff;
                s.spawn(move || {
                    for i in 0..ROUNDS {
                        let addr = ((t << 32) | i) << 4;
                        publish_here(EventKind::Alloc, Api::Malloc, 1, addr, 8, || drain_some(false));
                        publish_here(EventKind::Free, Api::Malloc, 0, addr, 0, || drain_some(false));
                        mailbox[((t + 1) % THREADS) as usize].lock().unwrap().push(addr);
                        let got: Vec<u64> = std::mem::take(&mut *mailbox[t as usize].lock().unwrap());
                        for a in got {
                            // Reuse of an address another thread freed...
                            publish_here(EventKind::Alloc, Api::Malloc, 2, a, 16, || drain_some(false));
                            // ...and a block allocated here, freed by the next thread.
                            handoff[((t + 1) % THREADS) as usize].lock().unwrap().push(a);
                            published.fetch_add(1, Ordering::Relaxed);
                        }
                        let to_free: Vec<u64> = std::mem::take(&mut *handoff[t as usize].lock().unwrap());
                        for a in to_free {
                            publish_here(EventKind::Free, Api::Malloc, 0, a, 0, || drain_some(false));
                            published.fetch_add(1, Ordering::Relaxed);
                        }
                        published.fetch_add(2, Ordering::Relaxed);
                    }
                });
            }
        });
        // Every producer is done: what is left drains without waiting on anyone.
        while STATE.lock().unwrap().as_ref().unwrap().pending() {
            drain_some(false);
        }
        let applied = applied.into_inner().unwrap();
        // Replaying in the applied order never sees an address allocated twice or freed
        // while not allocated.
        let mut live = std::collections::HashSet::new();
        let mut allocs = 0u64;
        for e in &applied {
            match e.kind {
                EventKind::Alloc => {
                    assert!(live.insert(e.addr), "{:#x} allocated twice", e.addr);
                    allocs += 1;
                }
                EventKind::Free => assert!(live.remove(&e.addr), "{:#x} freed while not live", e.addr),
                _ => unreachable!(),
            }
        }
        // Blocks still in a handoff box when their receiver finished stay live.
        let unfreed: usize = handoff.iter().map(|h| h.lock().unwrap().len()).sum();
        assert_eq!(live.len(), unfreed);
        assert_eq!(applied.len() as u64, published.load(Ordering::Relaxed), "every event applied once");
        assert!(allocs >= THREADS * ROUNDS);
        assert!(!STATE.lock().unwrap().as_ref().unwrap().pending());
        assert!(rings_grown() > 0, "the threads outgrew their small rings");
        assert!(full_waits() > 0, "the large rings were small enough to fill");
    }

    /// Takes the tests' turn and the shared consumer position, every ring drained (also
    /// for other modules' tests that publish into the rings).
    pub(crate) fn turn_with_rings_drained() -> (std::sync::MutexGuard<'static, ()>, std::sync::MutexGuard<'static, Option<DrainState>>) {
        let turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        init();
        let mut state = STATE.lock().unwrap();
        state.get_or_insert_with(DrainState::default).drain(usize::MAX, false, |_e| {});
        (turn, state)
    }

    #[test]
    fn a_thread_that_fills_its_ring_moves_to_a_larger_one_and_its_events_keep_their_order() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        // A fresh thread starts on a small ring. Nothing drains while it publishes more
        // than the small ring holds: it must move on instead of waiting (a waiting
        // producer would call `help`, which fails the test). A realloc's release and its
        // outcome straddle the move.
        const N: u64 = SMALL_SLOTS * 3;
        const STRADDLE: u64 = SMALL_SLOTS;
        let kind_of = |i: u64| match i {
            i if i == STRADDLE - 1 => EventKind::ReallocRelease,
            i if i == STRADDLE => EventKind::ReallocFreed,
            _ => EventKind::Alloc,
        };
        let grown_before = rings_grown();
        let (small, large, tid) = std::thread::spawn(move || {
            let small = thread::with(|s| {
                publish(s, EventKind::Alloc, Api::Malloc, 1, 0x5000_0000 << 4, 8, || panic!("waited"));
                s.ring.get()
            });
            for i in 1..N {
                let addr = (0x5000_0000 + i) << 4;
                publish_here(kind_of(i), Api::Realloc, 1, addr, 8, || panic!("waited at event {i}"));
            }
            (small, thread::with(|s| s.ring.get()), thread::tid())
        })
        .join()
        .unwrap();
        assert_ne!(small, large, "the thread moved to another ring");
        assert_eq!(rings_grown(), grown_before + 1, "it moved once");
        // SAFETY: rings are never freed.
        let (small, large) = unsafe { (&*(small as *const ThreadRing), &*(large as *const ThreadRing)) };
        assert_eq!((small.capacity, large.capacity), (SMALL_SLOTS, LARGE_SLOTS));
        assert_eq!(large.lag(), LAG, "a ring taken for room keeps the short lag");
        assert_eq!(large.predecessor.load(Ordering::Acquire) as usize, small as *const ThreadRing as usize);
        // The large ring's events wait while the small one holds any.
        let mut order = Vec::new();
        let mut drained_now = |max: usize, order: &mut Vec<Event>| {
            drained.drain(max, false, |e: Event| {
                if e.tid == tid {
                    order.push(e)
                }
            })
        };
        while drained_now(1000, &mut order) > 0 {}
        assert_eq!(order.len() as u64, N, "every event applied once");
        for (i, e) in order.iter().enumerate() {
            let i = i as u64;
            assert_eq!(e.kind, kind_of(i), "event {i}");
            if e.kind.orders_by_address() {
                assert_eq!(e.addr, (0x5000_0000 + i) << 4, "event {i} in publish order");
            }
        }
        // The small ring is unlinked and free for another thread; the large one is
        // recycled like any ring of an exited thread.
        assert!(large.predecessor.load(Ordering::Acquire).is_null());
        assert_eq!(small.owner.load(Ordering::Acquire), 0);
        assert!(!small.superseded.load(Ordering::Acquire));
        assert!(!drained.pending());
    }

    /// The frees waiting in the rings are all handed over, in order, and counted; an
    /// allocation is not one of them.
    #[test]
    fn unapplied_frees_hands_over_and_counts_them_all() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        std::thread::spawn(|| {
            thread::with(|s| try_publish(s, EventKind::Alloc, Api::Malloc, 1, 0x5000_0000 << 4, 8, 1));
            for i in 0..10u64 {
                assert!(thread::with(|s| try_publish(s, EventKind::Free, Api::Malloc, 0, (0x5000_0001 + i) << 4, 0, 1)));
            }
        })
        .join()
        .unwrap();
        let mut all = Vec::new();
        assert_eq!(unapplied_frees(|a| all.push(a)), 10);
        let expected: Vec<u64> = (0..10u64).map(|i| (0x5000_0001 + i) << 4).collect();
        assert_eq!(all, expected);
        drained.drain(usize::MAX, false, |_e| {});
        assert_eq!(unapplied_frees(|_| {}), 0, "applied: none left");
    }

    #[test]
    fn a_thread_that_may_not_wait_publishes_while_there_is_room_and_never_waits_when_there_is_none() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        // The library's own threads (which may hold the collector) publish their
        // releases with `try_publish`: into a small ring, then a large one, and once
        // that is full too (nobody drains), nothing more, at once. A realloc's release
        // asks room for its outcome as well.
        let (published, refused, pair_refused, tid) = std::thread::spawn(|| {
            let mut published = 0u64;
            let mut refused = 0u64;
            for i in 0..SMALL_SLOTS + LARGE_SLOTS + 100 {
                if thread::with(|s| try_publish(s, EventKind::Free, Api::Malloc, 0, (0x6000_0000 + i) << 4, 0, 1)) {
                    published += 1;
                } else {
                    refused += 1;
                }
            }
            let pair_refused = !thread::with(|s| try_publish(s, EventKind::ReallocRelease, Api::Realloc, 0, 0x7000_0000 << 4, 0, 2));
            (published, refused, pair_refused, thread::tid())
        })
        .join()
        .unwrap();
        assert_eq!(published, SMALL_SLOTS + LARGE_SLOTS, "both rings filled");
        assert_eq!(refused, 100, "then refused, without waiting");
        assert!(pair_refused);
        let mut applied = Vec::new();
        while drained.drain(4096, false, |e: Event| {
            if e.tid == tid {
                applied.push(e.addr)
            }
        }) > 0
        {}
        let expected: Vec<u64> = (0..published).map(|i| (0x6000_0000 + i) << 4).collect();
        assert_eq!(applied, expected, "every published event applied once, in order");
    }

    #[test]
    fn while_the_consumer_is_stalled_a_thread_moves_on_to_a_huge_ring_and_keeps_its_order() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        // More than a small and a large ring hold, published while nothing drains: the
        // thread moves twice instead of waiting.
        const N: u64 = SMALL_SLOTS + LARGE_SLOTS + 1000;
        let grown_before = rings_grown();
        let (rings, tid) = {
            let _stall = ConsumerStall::begin();
            std::thread::spawn(move || {
                let mut rings = vec![thread::with(|s| {
                    publish(s, EventKind::Alloc, Api::Malloc, 1, 0x6000_0000 << 4, 8, || panic!("waited"));
                    s.ring.get()
                })];
                for i in 1..N {
                    publish_here(EventKind::Alloc, Api::Malloc, 1, (0x6000_0000 + i) << 4, 8, || panic!("waited at event {i}"));
                    let now = thread::with(|s| s.ring.get());
                    if rings.last() != Some(&now) {
                        rings.push(now);
                    }
                }
                (rings, thread::tid())
            })
            .join()
            .unwrap()
        };
        // SAFETY: rings are never freed.
        let capacities: Vec<u64> = rings.iter().map(|&r| unsafe { &*(r as *const ThreadRing) }.capacity).collect();
        assert_eq!(capacities, [SMALL_SLOTS, LARGE_SLOTS, HUGE_SLOTS]);
        assert_eq!(rings_grown(), grown_before + 2);
        let mut addrs = Vec::new();
        while drained.drain(4096, false, |e: Event| {
            if e.tid == tid {
                addrs.push(e.addr)
            }
        }) > 0
        {}
        let want: Vec<u64> = (0..N).map(|i| (0x6000_0000 + i) << 4).collect();
        assert!(addrs == want, "every event once, in publish order");
        assert!(!drained.pending());
    }

    #[test]
    fn once_the_stall_is_over_a_thread_moves_back_from_its_huge_ring_which_gives_its_pages_back() {
        use std::sync::mpsc;
        // Giving pages back asks whether a seccomp filter is in place (/proc/self/status).
        crate::os::procfs::open(false);
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        const N: u64 = SMALL_SLOTS + LARGE_SLOTS + 1000;
        const M: u64 = 3 * WAKE_AT;
        let shrunk_before = rings_shrunk();
        let (to_producer, go) = mpsc::channel::<()>();
        let (to_test, published) = mpsc::channel::<()>();
        let stall = ConsumerStall::begin();
        let producer = std::thread::spawn(move || {
            let ring_now = || thread::with(|s| s.ring.get());
            for i in 0..N {
                publish_here(EventKind::Alloc, Api::Malloc, 1, (0x6100_0000 + i) << 4, 8, || panic!("waited at event {i}"));
            }
            let huge = ring_now();
            to_test.send(()).unwrap();
            go.recv().unwrap();
            // The consumer caught up and is not stalled: at its next check the thread
            // moves back to a large ring.
            for i in N..N + M {
                publish_here(EventKind::Alloc, Api::Malloc, 1, (0x6100_0000 + i) << 4, 8, || {});
            }
            (huge, ring_now(), thread::tid())
        });
        published.recv().unwrap();
        drop(stall);
        let mut addrs = Vec::new();
        let take = |drained: &mut DrainState, addrs: &mut Vec<u64>| {
            while drained.drain(4096, false, |e: Event| {
                if (0x6100_0000..0x6100_0000 + N + M).contains(&(e.addr >> 4)) {
                    addrs.push(e.addr)
                }
            }) > 0
            {}
        };
        // Everything but the last `LAG` events (the consumer's own turns leave those).
        take(drained, &mut addrs);
        to_producer.send(()).unwrap();
        let (huge, now, _tid) = producer.join().unwrap();
        take(drained, &mut addrs);
        // SAFETY: rings are never freed.
        let (huge, now) = unsafe { (&*(huge as *const ThreadRing), &*(now as *const ThreadRing)) };
        assert_eq!(huge.capacity, HUGE_SLOTS);
        assert_eq!(now.capacity, LARGE_SLOTS, "moved back to a large ring");
        assert_eq!(rings_shrunk(), shrunk_before + 1);
        let want: Vec<u64> = (0..N + M).map(|i| (0x6100_0000 + i) << 4).collect();
        assert!(addrs == want, "every event once, in publish order ({} of {})", addrs.len(), want.len());
        // Drained and unlinked: let go, its slots given back.
        assert_eq!(huge.owner.load(Ordering::Acquire), 0, "the huge ring is free again");
        let slots_bytes = HUGE_SLOTS as usize * std::mem::size_of::<Slot>();
        let resident = crate::os::own::resident(huge.slots as usize, slots_bytes);
        assert!(resident <= 2 * super::super::mapping::PAGE as u64, "{resident} bytes of its slots still resident");
    }

    #[test]
    fn a_half_full_ring_wakes_the_sleeping_consumer_and_a_waiting_event_keeps_it_awake() {
        use std::time::{Duration, Instant};
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        assert!(!drained.pending());
        let sleeper = std::thread::spawn(|| {
            let start = Instant::now();
            park_consumer(Duration::from_secs(30));
            start.elapsed()
        });
        let start = Instant::now();
        while CONSUMER_PARKED.load(Ordering::SeqCst) == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "the consumer never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
        // At most two check positions away from `WAKE_AT`, whatever this thread's ring
        // held before: the wake comes before the ring is full.
        let published = WAKE_AT + (SMALL_SLOTS - WAKE_AT) / 2;
        for i in 0..published {
            publish_here(EventKind::Alloc, Api::Malloc, 1, (0x7000_0000 + i) << 4, 8, || panic!("the ring filled up"));
        }
        let slept = sleeper.join().unwrap();
        assert!(slept < Duration::from_secs(10), "woken after {slept:?}");
        // Events wait: parking returns at once.
        let start = Instant::now();
        park_consumer(Duration::from_secs(30));
        assert!(start.elapsed() < Duration::from_secs(10));
        let mut n = 0u64;
        drained.drain(usize::MAX, false, |_e| n += 1);
        assert_eq!(n, published);
    }

    /// `n` allocations on the calling thread from address `base << 4` on, none of them
    /// remembered where the blocks `keep` are (`ThreadRing::recent_at`): a later
    /// allocation there makes a free forget its own. None may wait for room.
    fn publish_avoiding(base: u64, n: u64, keep: &[u64]) {
        // SAFETY: rings are never freed (null before the thread's first event).
        let ring = || unsafe { (thread::with(|s| s.ring.get()) as *const ThreadRing).as_ref() };
        let collides = |addr: u64| ring().is_some_and(|r| keep.iter().any(|&b| std::ptr::eq(r.recent_at(addr), r.recent_at(b))));
        let mut addr = base << 4;
        for _ in 0..n {
            while collides(addr) {
                addr += 16;
            }
            publish_here(EventKind::Alloc, Api::Malloc, 1, addr, 8, || panic!("waited"));
            addr += 16;
        }
    }

    fn cancel_here(addr: u64) -> bool {
        thread::with(|s| cancel_alloc(s, addr, super::super::event::Space::Heap))
    }

    #[test]
    fn a_block_freed_by_its_own_thread_soon_is_one_transient_event_and_a_foreign_release_stops_that() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        let take = |d: &mut DrainState| {
            let mut out = Vec::new();
            d.drain(usize::MAX, false, |e: Event| out.push((e.kind, e.addr, e.size)));
            out
        };
        // Allocated and freed here: one event, the allocation's size with it.
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0010, 48, || {});
        assert!(cancel_here(0x5000_0010));
        assert!(!cancel_here(0x5000_0010), "cancelled once");
        assert_eq!(take(drained), vec![(EventKind::Transient, 0x5000_0010, 48)]);
        // Taken by the consumer first: the free is published.
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0020, 16, || {});
        assert_eq!(take(drained), vec![(EventKind::Alloc, 0x5000_0020, 16)]);
        assert!(!cancel_here(0x5000_0020));
        // A realloc family block, and a block this thread released since: not cancelled.
        publish_here(EventKind::Alloc, Api::Realloc, 5, 0x5000_0030, 16, || {});
        assert!(!cancel_here(0x5000_0030));
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0040, 16, || {});
        publish_here(EventKind::Free, Api::Malloc, 0, 0x5000_0040, 0, || {});
        assert!(!cancel_here(0x5000_0040));
        // Another thread frees the block, gets the same address back and hands it here:
        // this free is of that thread's block, not of the allocation still in this ring.
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0050, 16, || {});
        std::thread::spawn(|| {
            publish_here(EventKind::Free, Api::Malloc, 0, 0x5000_0050, 0, || {});
            publish_here(EventKind::Alloc, Api::Malloc, 6, 0x5000_0050, 16, || {});
        })
        .join()
        .unwrap();
        assert!(!cancel_here(0x5000_0050));
        publish_here(EventKind::Free, Api::Malloc, 0, 0x5000_0050, 0, || {});
        // Another thread's allocation in the meantime changes nothing.
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0060, 16, || {});
        std::thread::spawn(|| publish_here(EventKind::Alloc, Api::Malloc, 6, 0x5000_0060 + (BUCKETS as u64) * 16, 16, || {})).join().unwrap();
        assert!(cancel_here(0x5000_0060));
        // Past the last `LAG` events of the ring: published, whatever the consumer did.
        publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5000_0070, 16, || {});
        for i in 0..LAG {
            publish_here(EventKind::Alloc, Api::Malloc, 5, (0x6100_0000 + i) << 4, 8, || {});
        }
        assert!(!cancel_here(0x5000_0070));
        let events = take(drained);
        let mut live = std::collections::HashMap::new();
        for (kind, addr, _) in &events {
            match kind {
                EventKind::Alloc => assert!(live.insert(*addr, ()).is_none(), "{addr:#x} allocated twice"),
                EventKind::Free => assert!(live.remove(addr).is_some(), "{addr:#x} freed while not live"),
                EventKind::Transient => assert!(!live.contains_key(addr)),
                _ => {}
            }
        }
        assert_eq!(events.iter().filter(|e| e.0 == EventKind::Transient).count(), 1);
        assert!(live.contains_key(&0x5000_0070) && live.contains_key(&0x5000_0030));
        assert!(!live.contains_key(&0x5000_0050) && !live.contains_key(&0x5000_0040));
    }

    #[test]
    fn the_consumers_own_turn_leaves_the_last_events_to_their_thread_for_a_while_only() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        let period = std::time::Duration::from_nanos(SNAPSHOT_EVERY_NS);
        // Snapshots of the drained rings.
        drained.drain_lagged(usize::MAX, |_e: Event| {});
        std::thread::sleep(period);
        drained.drain_lagged(usize::MAX, |_e: Event| {});
        for i in 0..LAG + 100 {
            publish_here(EventKind::Alloc, Api::Malloc, 1, (0x6200_0000 + i) << 4, 8, || {});
        }
        let mut n = 0;
        drained.drain_lagged(usize::MAX, |_e: Event| n += 1);
        assert_eq!(n, 100, "the last LAG events wait");
        assert!(cancel_here((0x6200_0000 + LAG + 99) << 4), "and may still be cancelled");
        // Two snapshot periods later, they are taken.
        for _ in 0..2 {
            std::thread::sleep(period);
            drained.drain_lagged(usize::MAX, |_e: Event| n += 1);
        }
        assert_eq!(n, LAG + 100);
        assert!(!drained.pending());
    }

    #[test]
    fn a_thread_on_a_large_ring_may_cancel_further_back_and_the_consumers_own_turn_leaves_it_that_much() {
        use std::sync::mpsc;
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        let (to_test, published) = mpsc::channel::<()>();
        let (to_thread, go) = mpsc::channel::<()>();
        let filler = |base: u64, n: u64| publish_avoiding(base, n, &[0x5100_0010, 0x5100_0020]);
        let thread = std::thread::spawn(move || {
            // SAFETY: rings are never freed.
            let ring = || unsafe { &*(thread::with(|s| s.ring.get()) as *const ThreadRing) };
            filler(0x6300_0000, 1);
            let small = ring();
            assert_eq!((small.capacity, small.lag()), (SMALL_SLOTS, LAG));
            // Frees too late to cancel (`cancel_alloc` notes them): the next event
            // moves the thread to a large ring with the long lag.
            for _ in 0..LATE_TO_GROW - 1 {
                note_late(small, 0);
            }
            filler(0x6300_1000, 1);
            assert!(std::ptr::eq(ring(), small), "not yet");
            note_late(small, 0);
            filler(0x6300_2000, 1);
            assert_eq!((ring().capacity, ring().lag()), (LARGE_SLOTS, LARGE_LAG));
            publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5100_0010, 16, || {});
            filler(0x6400_0000, 2 * LAG);
            to_test.send(()).unwrap();
            go.recv().unwrap();
            // 2 * LAG + 1 events back: past a small ring's lag, within a large one's.
            assert!(cancel_here(0x5100_0010), "cancelled from a large ring's lag");
            publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5100_0020, 16, || {});
            filler(0x6500_0000, LARGE_LAG);
            assert!(!cancel_here(0x5100_0020), "past the large ring's lag");
        });
        published.recv().unwrap();
        // The consumer's own turn takes the small ring (its thread moved on) and leaves
        // the large ring's last `LARGE_LAG` events: all 2 * LAG + 2 of them here.
        let mut n = 0u64;
        drained.drain_lagged(usize::MAX, |e: Event| {
            assert!((0x6300_0000..0x6300_2000).contains(&(e.addr >> 4)), "{:#x} taken", e.addr);
            n += 1;
        });
        assert_eq!(n, 2);
        to_thread.send(()).unwrap();
        thread.join().unwrap();
        let mut kinds = std::collections::HashMap::new();
        drained.drain(usize::MAX, false, |e: Event| {
            kinds.insert(e.addr, e.kind);
        });
        assert_eq!(kinds.get(&0x5100_0010), Some(&EventKind::Transient));
        assert_eq!(kinds.get(&0x5100_0020), Some(&EventKind::Alloc));
        assert_eq!(kinds.len() as u64, 1 + 2 + 2 * LAG + LARGE_LAG);
    }

    #[test]
    fn late_frees_count_within_a_window_of_events_only() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        std::thread::spawn(|| {
            publish_here(EventKind::Alloc, Api::Malloc, 1, 0x6700_0000 << 4, 8, || {});
            // SAFETY: rings are never freed.
            let ring = unsafe { &*(thread::with(|s| s.ring.get()) as *const ThreadRing) };
            let late = || ring.producer.0.late.load(Ordering::Relaxed);
            let start = 3 * LATE_WINDOW;
            for k in 0..LATE_TO_GROW as u64 - 1 {
                note_late(ring, start + k);
            }
            assert_eq!(late(), LATE_TO_GROW - 1);
            note_late(ring, start + LATE_WINDOW + 1);
            assert_eq!(late(), 1, "a window later, counted afresh");
            publish_here(EventKind::Alloc, Api::Malloc, 1, (0x6700_0000 + 1) << 4, 8, || {});
            assert!(std::ptr::eq(thread::with(|s| s.ring.get()) as *const ThreadRing, ring), "stays");
        })
        .join()
        .unwrap();
        drained.drain(usize::MAX, false, |_e: Event| {});
    }

    #[test]
    fn a_free_past_the_short_lag_counts_as_late_and_one_within_it_is_cancelled() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        std::thread::spawn(|| {
            // SAFETY: rings are never freed.
            let ring = || unsafe { &*(thread::with(|s| s.ring.get()) as *const ThreadRing) };
            let late = || ring().producer.0.late.load(Ordering::Relaxed);
            publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5200_0010, 16, || {});
            publish_avoiding(0x6600_0000, LAG + 10, &[0x5200_0010]);
            assert_eq!(late(), 0);
            assert!(!cancel_here(0x5200_0010), "past the short lag");
            assert_eq!(late(), 1, "noted as late");
            publish_here(EventKind::Alloc, Api::Malloc, 5, 0x5200_0020, 16, || {});
            assert!(cancel_here(0x5200_0020));
            assert!(!cancel_here(0x5200_0030), "never allocated");
            assert_eq!(late(), 1);
        })
        .join()
        .unwrap();
        drained.drain(usize::MAX, false, |_e: Event| {});
    }

    #[test]
    fn a_consumer_taking_every_event_and_a_thread_cancelling_its_allocations_never_both_win() {
        let (_turn, mut state) = turn_with_rings_drained();
        let drained = state.as_mut().unwrap();
        let done = AtomicBool::new(false);
        const BLOCKS: u64 = 200_000;
        let applied = std::thread::scope(|s| {
            let producer = s.spawn(|| {
                let mut cancelled = 0u64;
                let addr = |i: u64| (0x4000_0000 + i) << 4;
                // Each block is freed 16 allocations later, while the consumer takes
                // what it can; every 1,024th waits until the consumer took it.
                const BEHIND: u64 = 16;
                for i in 0..BLOCKS + BEHIND {
                    if i < BLOCKS {
                        publish_here(EventKind::Alloc, Api::Malloc, 7, addr(i), 8, || {});
                        if i % 1024 == 0 {
                            let taken_at = thread::with(|s| my_ring(s).unwrap().producer.0.tail.load(Ordering::Relaxed));
                            while thread::with(|s| my_ring(s).unwrap().head.0.load(Ordering::Acquire)) < taken_at {
                                std::thread::yield_now();
                            }
                        }
                    }
                    let Some(j) = i.checked_sub(BEHIND) else { continue };
                    if cancel_here(addr(j)) {
                        cancelled += 1;
                    } else {
                        publish_here(EventKind::Free, Api::Malloc, 0, addr(j), 0, || {});
                    }
                }
                done.store(true, Ordering::SeqCst);
                cancelled
            });
            let mut applied = Vec::new();
            // A full drain, as a report's: it claims what it takes from the last events.
            while !done.load(Ordering::SeqCst) {
                drained.drain(usize::MAX, false, |e: Event| applied.push((e.kind, e.addr)));
            }
            drained.drain(usize::MAX, false, |e: Event| applied.push((e.kind, e.addr)));
            let cancelled = producer.join().unwrap();
            // The consumer took at least every 1,024th block first: those frees were
            // published. The others went either way.
            assert!(cancelled < BLOCKS, "{cancelled} of {BLOCKS} cancelled");
            applied
        });
        let mut live = std::collections::HashSet::new();
        let mut per_block = 0u64;
        for (kind, addr) in applied {
            match kind {
                EventKind::Alloc => assert!(live.insert(addr)),
                EventKind::Free => {
                    assert!(live.remove(&addr), "{addr:#x} freed while not live");
                    per_block += 1;
                }
                EventKind::Transient => {
                    assert!(!live.contains(&addr));
                    per_block += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(live.is_empty(), "{} blocks left live", live.len());
        assert_eq!(per_block, BLOCKS, "every block ended exactly once");
    }
}
