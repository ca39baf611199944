//! The consumer's state: the collector's model and its place in the event order, the
//! pause that holds consumers off while a scan reads the live set, and the bounded
//! waits every stage here uses. The bottom of `agent`: it imports no sibling.
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::collector::state::Collector;
use crate::hotpath::channel::DrainState;
use crate::os::lock::SpinLock;

/// The consumer side: the collector's model and its position in the event order.
pub(super) struct Consumer {
    pub(super) model: Collector,
    pub(super) order: DrainState,
}

pub(super) static STATE: SpinLock<Option<Consumer>> = SpinLock::new(None);
pub(super) static SCAN_AT_EXIT: AtomicBool = AtomicBool::new(false);
/// Set in a forked child that will scan at exit: its collector thread gathers the
/// inherited blocks while the child runs (`prepare_inherited`).
pub(super) static PREPARE_INHERITED: AtomicBool = AtomicBool::new(false);
/// A child that execs does so within a millisecond or two: one still here after this
/// long is a worker, worth the preparation.
pub(super) const PREPARE_AFTER: Duration = Duration::from_millis(5);
/// True from the gather until the sorted list is installed: an exit meanwhile waits for
/// it (at most `PREPARE_WAIT`) rather than gathering and sorting everything again.
pub(super) static PREPARING: AtomicBool = AtomicBool::new(false);
pub(super) const PREPARE_WAIT: Duration = Duration::from_millis(500);

/// Set while a check, a snapshot or the final report scans the live set it took: nobody
/// applies events meanwhile, so that the frees published until the program's threads
/// are stopped are still in the rings for the scan to read (`channel::unapplied_frees`),
/// instead of leaving a freed block in the set with nothing pointing to it (a false
/// leak). Only a forced drain (one whose ticket predecessors never come: the final
/// report's, a forked child's) goes ahead.
pub(super) static SCAN_PAUSE: AtomicBool = AtomicBool::new(false);

/// Holds the consumers off (`SCAN_PAUSE`) until dropped, even by a panic.
pub(super) struct ScanPause;

impl ScanPause {
    /// Called holding the collector, right after the drain that the live set follows.
    pub(super) fn start() -> ScanPause {
        SCAN_PAUSE.store(true, Ordering::SeqCst);
        ScanPause
    }
}

impl Drop for ScanPause {
    fn drop(&mut self) {
        SCAN_PAUSE.store(false, Ordering::SeqCst);
    }
}

pub(super) fn drain_into(c: &mut Consumer, max: usize, force: bool) -> usize {
    if !force && SCAN_PAUSE.load(Ordering::Acquire) {
        return 0;
    }
    let Consumer { model, order } = c;
    let n = order.drain(max, force, &mut *model);
    // Whoever drains here reads the groups next, or lets a report do: their transients
    // go in first (the collector thread's own turns leave them summed).
    model.settle_transients();
    n
}

/// The collector thread's own turn (`DrainState::drain_lagged`): the last events of
/// each ring may wait for their thread to cancel an allocation with its free.
pub(super) fn drain_lagged_into(c: &mut Consumer, max: usize) -> usize {
    if SCAN_PAUSE.load(Ordering::Acquire) {
        return 0;
    }
    let Consumer { model, order } = c;
    order.drain_lagged(max, model)
}

/// Naps `nap` at a time while `busy` holds, for at most `limit`.
pub(super) fn wait_while(busy: impl Fn() -> bool, limit: Duration, nap: Duration) {
    let start = Instant::now();
    while busy() && start.elapsed() < limit {
        std::thread::sleep(nap);
    }
}

pub(super) fn lock_bounded<T>(lock: &'static SpinLock<T>, limit: Duration) -> Option<crate::os::lock::Guard<'static, T>> {
    let start = Instant::now();
    loop {
        if let Some(g) = lock.try_lock() {
            return Some(g);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::yield_now();
    }
}

/// Drains every event published so far. Events still blocked after 200 ms wait for a
/// ticket whose thread stopped mid-hook (killed, or stopped by a debugger): they are
/// applied anyway rather than hanging the exit.
pub(super) fn drain_everything(c: &mut Consumer) {
    let start = Instant::now();
    loop {
        drain_into(c, usize::MAX, false);
        if !c.order.pending() {
            return;
        }
        if start.elapsed() > Duration::from_millis(200) {
            drain_into(c, usize::MAX, true);
            return;
        }
        std::thread::yield_now();
    }
}
