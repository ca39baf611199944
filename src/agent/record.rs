//! The hooks' entry (`record_*`): each allocation event is captured (its stack) and
//! published to this thread's ring, on the calling thread, never twice at once, never
//! letting a panic out. A full ring is drained here (`help_drain`).
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::hotpath::channel;
use crate::hotpath::event::{self, Api, EventKind, Space};
use crate::hotpath::thread::{self, ThreadState};
use crate::hotpath::unwind;
use crate::lifecycle::LIFECYCLE;
use crate::os::fds::stderr_line;

use super::consumer::{drain_into, lock_bounded, wait_while, SCAN_PAUSE, STATE};
use super::fork::adopt_if_cloned;

#[inline(always)]
pub fn active() -> bool {
    LIFECYCLE.tracking()
}

/// Whether a release hook has anything to publish now (tracking, or the final report
/// still takes frees): otherwise it hands the call on and does nothing else.
#[inline(always)]
pub fn releases_recorded() -> bool {
    LIFECYCLE.releases_recorded()
}

/// Whether the pointer scan will read the heap (`LEAKTRACE_SCAN`): the hooks then hand
/// out blocks without the words of their memory's earlier owners
/// (`interpose::malloc::fresh`).
#[inline(always)]
pub fn scanning() -> bool {
    super::consumer::SCAN_AT_EXIT.load(Ordering::Relaxed)
}

/// Called by a producer that found its ring full.
fn help_drain() {
    adopt_if_cloned();
    if let Some(mut g) = STATE.try_lock() {
        if let Some(c) = g.as_mut() {
            drain_into(c, 4096, false);
        }
    } else if let Some(mut g) = STATE.parked_by_me() {
        // This thread parked the lock for fork and is allocating inside fork.
        if let Some(c) = g.as_mut() {
            drain_into(c, 4096, false);
        }
        g.keep_parked();
    }
}

#[inline(always)]
fn publish(state: &ThreadState, kind: EventKind, api: Api, stack: u32, addr: u64, size: u64) {
    channel::publish(state, kind, api, stack, addr, size, help_drain);
}

fn disable_after_panic() {
    LIFECYCLE.give_up();
    channel::close();
    stderr_line("leaktrace: internal error; tracking stopped, the program continues unchanged");
}

/// Runs `f` as a recording step of a hook: never twice on one thread at once, never on
/// the library's own threads, never letting a panic out, and leaving `errno` as it was.
#[inline(always)]
fn recording(f: impl FnOnce(&ThreadState)) {
    if !active() {
        return;
    }
    recording_step(f);
}

#[inline(always)]
fn recording_step(f: impl FnOnce(&ThreadState)) {
    let Some(guard) = thread::HookGuard::enter() else { return };
    if catch_unwind(AssertUnwindSafe(|| f(guard.state()))).is_err() {
        disable_after_panic();
    }
}

#[inline]
pub fn record_alloc(addr: usize, size: usize, api: Api) {
    recording(|s| alloc_step(s, addr, size, api));
}

/// Publishes a new block with the caller's stack.
#[inline(always)]
fn alloc_step(s: &ThreadState, addr: usize, size: usize, api: Api) {
    let stack = unwind::capture_stack_id(s, LIFECYCLE.depth());
    publish(s, EventKind::Alloc, api, stack, addr as u64, size as u64);
    if LIFECYCLE.collector_on_demand() {
        super::collector_thread::on_demand_alloc(stack);
    }
    if s.lsan_disabled() {
        // Between __lsan_disable and __lsan_enable: never a leak.
        publish(s, EventKind::Ignore, Api::Malloc, 0, addr as u64, 0);
    }
}

/// Runs `f` as the recording step of a release (a free, an unmapping, a realloc's old
/// block), with whether the thread records nothing of its own here (`Releaser`). Unlike
/// an allocation, a release is published on the library's own threads and inside
/// `thread::untracked` too: the C library frees there what the program's threads
/// allocated — a dead thread's dynamic TLS blocks, when a thread we start takes its
/// cached stack or trims the cache — and a free never seen leaves a freed block in the
/// books: a false leak, or a block replaced when its address comes back (TensorFlow's
/// Keras fit beside two busy loops, 1 run in 2).
///
/// The phase is not looked at again here: the hook decided with one look (tracking, or
/// the final report still taking frees) and the release is published whatever the phase
/// is now. A second look dropped the free of a thread whose first look saw tracking
/// just before the final report began: its block was in the report's live set, nothing
/// said it was freed, and the report called it leaked (1 detach report in about 1,000
/// in an 8-thread allocation storm on a loaded machine).
#[inline(always)]
fn releasing_step(f: impl FnOnce(&ThreadState, Releaser)) {
    let Some((guard, internal)) = thread::HookGuard::enter_release() else { return };
    let who = if internal { Releaser::Library } else { Releaser::Program };
    if catch_unwind(AssertUnwindSafe(|| f(guard.state(), who))).is_err() {
        disable_after_panic();
    }
}

/// Who publishes a release.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Releaser {
    /// A program thread, recording as usual.
    Program,
    /// The library's own thread, or a program thread inside `thread::untracked`: it may
    /// hold the collector, so it never waits for room (`channel::try_publish`).
    Library,
}

/// Releases from the library's threads that found no room without waiting: their blocks
/// stay in the books (a diagnostic; none in any run measured).
static RELEASES_DROPPED: AtomicU64 = AtomicU64::new(0);

pub fn releases_dropped() -> u64 {
    RELEASES_DROPPED.load(Ordering::Relaxed)
}

/// Publishes a release by `who`; one from the library's threads is marked
/// `INTERNAL_FREE` (most are the library's own blocks). `room_for` events must fit from
/// the library's threads: a realloc's release leaves its outcome room. Returns whether
/// it was published.
#[inline(always)]
fn publish_release(s: &ThreadState, who: Releaser, kind: EventKind, api: Api, stack: u32, addr: u64, room_for: u64) -> bool {
    match who {
        Releaser::Program => {
            publish(s, kind, api, stack, addr, 0);
            true
        }
        Releaser::Library => publish_library_release(s, kind, api, stack, addr, room_for),
    }
}

#[cold]
#[inline(never)]
fn publish_library_release(s: &ThreadState, kind: EventKind, api: Api, stack: u32, addr: u64, room_for: u64) -> bool {
    let stack = if stack == 0 { event::INTERNAL_FREE } else { stack };
    let done = channel::try_publish(s, kind, api, stack, addr, 0, room_for);
    if !done {
        RELEASES_DROPPED.fetch_add(1, Ordering::Relaxed);
    }
    done
}

/// A free the hook decided to record while tracking (see `releasing_step`: published
/// even if tracking ended since).
#[inline]
pub fn record_free(addr: usize) {
    releasing_step(|s, who| {
        // Freed soon after its own allocation on this thread: one event, already there.
        if who == Releaser::Program && channel::cancel_alloc(s, addr as u64, Space::Heap) {
            return;
        }
        publish_release(s, who, EventKind::Free, Api::Malloc, 0, addr as u64, 1);
    });
}

/// A free (`Api::Malloc`) or a CUDA release (`Api::releasing(space)`) after tracking
/// stopped, while the final report still wants frees (`Lifecycle::frees_still_wanted`):
/// published, so that the report does not count the block as leaked. Frees the final
/// drain was too late for are in the rings when the scan holds the threads
/// (`channel::unapplied_frees`).
#[cold]
pub fn record_late_free(addr: u64, api: Api) {
    if LIFECYCLE.frees_still_wanted() {
        releasing_step(|s, who| {
            publish_release(s, who, EventKind::Free, api, event::LATE_FREE, addr, 1);
        });
    }
}

/// A realloc is about to run on the block at `addr`, decided while tracking (as
/// `record_free`). Returns who published the release (`None`: nobody), for
/// `record_realloc_outcome`.
#[inline]
pub fn record_realloc_release(addr: usize) -> Option<Releaser> {
    let mut out = None;
    releasing_step(|s, who| {
        if publish_release(s, who, EventKind::ReallocRelease, Api::Realloc, 0, addr as u64, 2) {
            out = Some(who);
        }
    });
    out
}

/// The outcome of a realloc whose old block `old_addr` was released by `who` with
/// `record_realloc_release`. The library's threads record no new block: theirs is
/// whether the old one is gone (freed, or moved) or stays (the call failed, or grew it
/// in place). Published whatever the phase is now, as the release was.
#[inline]
pub fn record_realloc_outcome(who: Releaser, old_addr: usize, new_addr: usize, size: usize, api: Api, freed_without_new_block: bool) {
    if who == Releaser::Library {
        let gone = freed_without_new_block || (new_addr != 0 && new_addr != old_addr);
        let kind = if gone { EventKind::ReallocFreed } else { EventKind::ReallocRestore };
        // Room for it was made with the release.
        releasing_step(|s, who| {
            publish_release(s, who, kind, api, 0, 0, 1);
        });
    } else if new_addr != 0 {
        recording_step(|s| alloc_step(s, new_addr, size, api));
    } else if freed_without_new_block {
        recording_step(|s| publish(s, EventKind::ReallocFreed, api, 0, 0, 0));
    } else {
        recording_step(|s| publish(s, EventKind::ReallocRestore, api, 0, 0, 0));
    }
}

/// A sampled Python object (`interpose::pyalloc`): `weight` is the bytes it stands
/// for. Returns whether it was published (not on the library's own threads, nor
/// inside another hook).
#[inline(never)]
pub fn record_python_sample(addr: u64, weight: u64) -> bool {
    let mut done = false;
    recording(|s| {
        let stack = unwind::capture_stack_id(s, LIFECYCLE.depth());
        publish(s, EventKind::Alloc, Api::PyObject, stack, addr, weight);
        if LIFECYCLE.collector_on_demand() {
            super::collector_thread::on_demand_alloc(stack);
        }
        done = true;
    });
    done
}

/// A sampled Python object is about to be freed.
#[inline(never)]
pub fn record_python_free(addr: u64) {
    recording_step(|s| {
        if !channel::cancel_alloc(s, addr, Space::Python) {
            publish(s, EventKind::Free, Api::PyObject, 0, addr, 0);
        }
    });
}

/// A mapping of the program's own (`interpose::mmap`), published with `stack` or, when
/// `None`, the caller's stack. Returns the stack id it was published with, `None` when
/// it was not (the library's own threads, inside another hook).
pub fn record_mapping(addr: u64, len: u64, api: Api, stack: Option<u32>) -> Option<u32> {
    let mut out = None;
    recording(|s| {
        let stack = stack.unwrap_or_else(|| unwind::capture_stack_id(s, LIFECYCLE.depth()));
        publish(s, EventKind::Alloc, api, stack, addr, len);
        if LIFECYCLE.collector_on_demand() {
            super::collector_thread::on_demand_alloc(stack);
        }
        out = Some(stack);
    });
    out
}

/// A tracked mapping is about to be unmapped (or replaced, or moved).
pub fn record_unmapping(addr: u64) {
    releasing_step(|s, who| {
        publish_release(s, who, EventKind::Free, Api::Mmap, 0, addr, 1);
    });
}

/// A CUDA allocation that succeeded. `device` is the ordinal it belongs to, if known.
#[inline]
pub fn record_cuda_alloc(addr: u64, size: u64, api: Api, device: Option<u8>) {
    recording(|s| {
        let stack = unwind::capture_stack_id(s, LIFECYCLE.depth());
        publish(s, EventKind::Alloc, api, stack, addr, event::pack_size(size, device));
        if LIFECYCLE.collector_on_demand() {
            super::collector_thread::on_demand_alloc(stack);
        }
    });
}

/// A CUDA release about to run on the block `addr` in `space` (published before the
/// call, like a free, so that the address cannot be handed out again first), decided
/// while tracking: published whatever the phase is now (as `record_free`).
#[inline]
pub fn record_cuda_release(addr: u64, space: Space) {
    recording_step(|s| publish(s, EventKind::ReallocRelease, Api::releasing(space), 0, addr, 0));
}

/// How the release published with `record_cuda_release` ended.
#[inline]
pub fn record_cuda_release_outcome(space: Space, freed: bool) {
    let kind = if freed { EventKind::ReallocFreed } else { EventKind::ReallocRestore };
    recording_step(|s| publish(s, kind, Api::releasing(space), 0, 0, 0));
}

/// A context destroy or device reset that succeeded: every context-bound block of
/// `device` is gone. Applied here, in the caller's thread, after everything published
/// so far (this thread's allocations among them), so that no block allocated before
/// the reset survives it in the books.
pub fn record_device_reset(device: u8) {
    recording(|_| {
        // Not with a raw clone's child's inherited state (see `checkpoint`).
        adopt_if_cloned();
        // A check's scan holds the events back: the reset comes after all of them.
        wait_while(|| SCAN_PAUSE.load(Ordering::Acquire), Duration::from_secs(5), Duration::from_micros(200));
        let Some(mut g) = lock_bounded(&STATE, Duration::from_secs(5)) else { return };
        if let Some(c) = g.as_mut() {
            let backlog = c.order.backlog();
            drain_into(c, backlog, false);
            c.model.device_reset(device);
        }
    });
}

/// A checkpoint region starts (`leaktrace_mark`): blocks this thread allocates from
/// now on belong to it. Ordered with the calling thread's own events.
pub fn start_region() -> bool {
    if !active() {
        return false;
    }
    let mut done = false;
    recording(|s| {
        publish(s, EventKind::Mark, Api::Malloc, 0, 0, 0);
        done = true;
    });
    done
}

/// `__lsan_disable` (`true`) and `__lsan_enable`: while a thread's count is above
/// zero, the blocks it allocates are never reported. Nests, as LeakSanitizer's does;
/// an enable without a disable is ignored (LeakSanitizer calls it an error).
pub fn lsan_disable(on: bool) {
    thread::with(|s| s.lsan_disable(on));
}

/// The live block at `addr` is never reported (`__lsan_ignore_object`).
pub fn ignore_block(addr: u64) {
    recording(|s| publish(s, EventKind::Ignore, Api::Malloc, 0, addr, 0));
}

/// CUDA copies of a hooked function beyond the wrappers we have (`interpose::cuda`):
/// their allocations are not seen; the report says how many.
static UNTRACKED_COPIES: AtomicU64 = AtomicU64::new(0);

pub fn note_untracked_copy() {
    UNTRACKED_COPIES.fetch_add(1, Ordering::Relaxed);
}

pub fn untracked_copies() -> u64 {
    UNTRACKED_COPIES.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release hook looks at the phase once: a thread whose hook saw tracking just
    /// before the final report began still publishes its release, although tracking
    /// has ended by the time it does. (Unit tests never start tracking: the phase reads
    /// as it does once tracking has ended.) A second look here dropped the free, and
    /// the final report called a block freed before its scan leaked: 1 detach report in
    /// about 1,000 of `a_hundred_attach_and_detach_cycles_in_an_allocation_storm` on CI.
    #[test]
    fn a_release_the_hook_decided_to_record_is_published_whatever_the_phase_is_now() {
        let (_turn, mut state) = channel::tests::turn_with_rings_drained();
        assert!(!active() && !releases_recorded());
        let (freed, moved, cuda) = (0x5100_0000u64 << 4, 0x5200_0000u64 << 4, 0x5300_0000u64 << 4);
        let tid = std::thread::spawn(move || {
            record_free(freed as usize);
            let who = record_realloc_release(moved as usize).expect("published");
            record_realloc_outcome(who, moved as usize, 0, 0, Api::Realloc, true);
            record_cuda_release(cuda, Space::Cuda);
            record_cuda_release_outcome(Space::Cuda, true);
            crate::hotpath::thread::tid()
        })
        .join()
        .unwrap();
        let mut released = Vec::new();
        channel::unapplied_frees(|a| released.push(a));
        // An outcome that the block is gone carries no address of its own.
        released.retain(|&a| a != 0);
        assert_eq!(released, vec![freed, moved, cuda]);
        let mut kinds = Vec::new();
        state.as_mut().unwrap().drain(usize::MAX, false, |e: crate::hotpath::event::Event| {
            if e.tid == tid {
                kinds.push(e.kind)
            }
        });
        assert_eq!(kinds, vec![EventKind::Free, EventKind::ReallocRelease, EventKind::ReallocFreed, EventKind::ReallocRelease, EventKind::ReallocFreed]);
    }
}
