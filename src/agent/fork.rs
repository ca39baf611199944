//! fork, and children made by a raw clone that ran no fork handler of ours: the child
//! takes the parent's state over, drains what the parent's threads published, and starts
//! its own collector (or stays off when fork is not followed).
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;

use crate::hotpath::{channel, thread};
use crate::lifecycle::LIFECYCLE;
use crate::report::process::ProcessInfo;
use crate::report::symbolize::Symbolizer;

use super::collector_thread::spawn_collector;
use super::consumer::{drain_into, PREPARE_INHERITED, PREPARING, SCAN_AT_EXIT, SCAN_PAUSE, STATE};
use super::reports::{ReportSide, REPORT};

/// A child made by `fork` or a raw `clone` that ran none of our `atfork` handlers
/// (`os::image`): it takes our state over as `fork_child` does, before it takes any lock
/// of ours (one may be held by a thread that does not exist here). Called where a
/// program thread is about to take one: a full ring, its own `fork`, its exit.
pub(super) fn adopt_if_cloned() {
    if crate::os::image::is_unadopted_child() && LIFECYCLE.phase() == crate::lifecycle::Phase::Tracking {
        // Marked first: a second thread of the child does not adopt again.
        crate::os::image::mark_own_image();
        // A raw clone's child may end by returning from its clone function: a thread's
        // exit, not the process's. A collector thread of ours would keep that process
        // alive, a zombie its parent waits for forever (firejail's sandbox). It gets one
        // only when it starts a thread of its own; until then its producers drain.
        LIFECYCLE.defer_collector();
        fork_child();
    }
}

pub fn fork_prepare() {
    adopt_if_cloned();
    crate::os::loader::fork_hold_loader_walks();
    STATE.lock_raw();
    // Last: the collector allocates from it while holding the state.
    crate::os::own_heap::fork_prepare();
}

pub fn fork_parent() {
    crate::os::own_heap::fork_parent();
    STATE.unlock_raw();
    crate::os::loader::fork_release_loader_walks();
}

pub fn fork_child() {
    // Parked by this thread in `fork_prepare`, or held by a thread this child does not
    // have (a raw clone ran no handler): then abandoned.
    crate::os::own_heap::after_fork_child();
    crate::os::loader::fork_release_loader_walks();
    super::reports::FORKED.store(true, Ordering::Relaxed);
    // A holder search of the parent's has no thread here.
    super::reports::HOLDER_SEARCH.store(false, Ordering::SeqCst);
    super::reports::STOP_SEARCHES.store(false, Ordering::SeqCst);
    super::reports::forget_search_cost_after_fork();
    super::reports::forget_joining_after_fork();
    // Nor any other thread of ours.
    crate::os::threads::forget_after_fork();
    // Before the child can enter a sandbox: the measure then never opens a file.
    crate::os::procfs::open(true);
    // The parent's collector thread does not exist here; ours starts below.
    LIFECYCLE.fork_child(std::process::id());
    crate::os::image::mark_own_image();
    // Before the reset clears it: a `fork` from a signal handler that interrupted one of
    // this thread's hooks returns into that hook, which may be using the unwinder's tree.
    let in_hook = thread::in_hook();
    // The forking thread keeps its stack (and the bounds it noted) in the child.
    thread::reset_after_fork();
    thread::untracked(|| {
        let _ = catch_unwind(AssertUnwindSafe(fork_child_inner));
    });
    // Whatever happened above, the child must never inherit a held lock.
    STATE.unlock_raw();
    if LIFECYCLE.tracking() {
        let follow = REPORT.lock().as_ref().map(|r| r.config.follow_fork).unwrap_or(false);
        if follow {
            // A parent that was preparing its own list forked: not this process's.
            PREPARING.store(false, Ordering::SeqCst);
            PREPARE_INHERITED.store(SCAN_AT_EXIT.load(Ordering::Relaxed), Ordering::Release);
            if !in_hook {
                thread::untracked(crate::hotpath::unwind::give_back_caches);
            }
            // A child of a process whose collector still waits for a thread waits too;
            // one whose collector starts on demand starts its own wait (a child that
            // `exec`s soon, as a shell's or `make`'s do, never starts one).
            if !LIFECYCLE.collector_waits_for_a_thread() {
                if super::collector_thread::starts_on_demand() {
                    super::collector_thread::defer_on_demand();
                } else if !LIFECYCLE.collector_deferred() {
                    spawn_collector();
                }
            }
        } else {
            LIFECYCLE.give_up();
            channel::close();
        }
    }
}

fn fork_child_inner() {
    // A check in another thread of the parent is not running here.
    SCAN_PAUSE.store(false, Ordering::SeqCst);
    // Parked by this thread in `fork_prepare`; in a raw clone's child, which ran no fork
    // handler, free or held by a thread of the parent that does not exist here (its
    // collector): taken over. Either way the parent's blocks become the child's
    // inherited ones: a raw clone's child had counted them as its own, and its exit
    // report and its leak checks named its parent's leaks as its.
    let (mut g, parked) = match STATE.parked_by_me() {
        Some(g) => (g, true),
        None => (STATE.take_over().0, false),
    };
    if let Some(c) = g.as_mut() {
        // The parent's events in causal order as far as they go, then the rest:
        // tickets taken by threads that do not exist here will never arrive.
        drain_into(c, usize::MAX, false);
        c.order.after_fork_child();
        drain_into(c, usize::MAX, true);
        c.model.fork_boundary();
    }
    if parked {
        g.keep_parked();
    }
    // If a thread that does not exist here held the report side, its contents may be
    // half-updated: take the lock over and start the symbolizer afresh, never running
    // destructors on what it was mutating.
    let (mut r, was_free) = REPORT.take_over();
    if let Some(old) = r.take() {
        let process = if was_free { ProcessInfo::forked(&old.process) } else { ProcessInfo::current(Some(old.process.pid)) };
        let (symbolizer, config, output_dir, host_tracking, suppressions) = if was_free {
            (old.symbolizer, old.config, old.output_dir, old.host_tracking, old.suppressions)
        } else {
            let kept = (Symbolizer::new(process.exe.clone()), old.config.clone(), old.output_dir.clone(), old.host_tracking.clone(), old.suppressions.clone());
            std::mem::forget(old);
            kept
        };
        *r = Some(ReportSide::new(config, process, output_dir, symbolizer, host_tracking, suppressions));
    }
}
