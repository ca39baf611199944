//! The process lifecycle, owned by one object: which phase this process image is in,
//! which process owns the state, the collector thread's state, and the exit that is
//! under way. Every exit path asks it for the final report's turn.
//!
//! ```text
//!            start()                 begin_final() == Mine             final_written()
//!   Off ─────────────────▶ Tracking ─────────────────────▶ Finishing ─────────────────▶ Finished
//!                           │  │  ▲                              ▲
//!        internal error     │  │  │ fork, followed: new owner,   │ a second exit path waits
//!        or fork, not ──────┘  │  │ collector restarted          │ for the first (InProgress)
//!        followed: Finished    └──┘
//! ```
//!
//! The exit paths, each through `begin_final`: the library destructor (return from
//! `main`, `exit`), `exit` from a second thread at once (`exit_called`), `_exit`/`_Exit`,
//! `quick_exit`, SIGTERM (its handler records the signal, the collector writes the report
//! and dies by it), and the exit of a process whose collector failed (the exiting thread
//! writes it). `exec` ends an image without a report: nothing of its memory survives it.
//! The Go runtime's `exit_group` passes through nothing of ours: such a process says so
//! in every periodic report (`no_final_report`), and `leaktrace run` fails
//! `--fail-on-leak` on it.
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// The phase of this process image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Not started (or disabled): hooks pass through.
    Off = 0,
    /// Hooks record; the collector (or the program's threads) drain.
    Tracking = 1,
    /// The final report is written or tracking was given up: hooks pass through.
    Finished = 2,
    /// One exit path is writing the final report; others wait for it.
    Finishing = 3,
}

/// Whose turn the final report is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalTurn {
    /// The caller writes it.
    Mine,
    /// Another exit path is writing it (or has): the caller waits for `in_progress`.
    InProgress,
    /// Not this process's to write (tracking off, or a vfork child sharing our memory).
    NotOurs,
}

/// The collector thread's state.
struct Collector {
    /// Set while a collector thread runs in this process.
    running: AtomicBool,
    /// Asks the collector thread to leave (the process must become single-threaded).
    stop: AtomicBool,
    tid: AtomicU32,
    /// Collector threads created and not yet finished (counted from before
    /// pthread_create, so a thread that has not started running yet is counted too).
    live: AtomicU32,
    /// What the collector waits for: `NOT_DEFERRED`, `UNTIL_THREAD` (the program's own
    /// second thread only) or `ON_DEMAND` (that, or the allocations and signals of
    /// `CollectorStart::OnDemand`).
    deferred: AtomicU8,
    failures: AtomicU32,
}

/// The phase is read on every hook call and written almost never: it shares a line only
/// with the stack depth, away from the ring's hot lines.
#[repr(C, align(128))]
struct ReadMostly {
    phase: AtomicU8,
    /// Set while the collector waits on demand: the allocation hooks then count towards
    /// its start (`agent::collector_thread::on_demand_alloc`).
    demand: AtomicBool,
    depth: AtomicUsize,
}

const NOT_DEFERRED: u8 = 0;
const UNTIL_THREAD: u8 = 1;
const ON_DEMAND: u8 = 2;

pub struct Lifecycle {
    hot: ReadMostly,
    /// The process whose state this is; a vfork child sharing our memory has another pid.
    owner_pid: AtomicU32,
    /// A termination signal to die by once the final report is written (0: none).
    terminating_signal: AtomicI32,
    collector: Collector,
    /// The process (high 32 bits) and thread (its kernel id, low 32 bits) that called
    /// `exit` first: one word, claimed by one compare-and-swap (as two words, a second
    /// thread could take the first's claim in the moment between its two stores, and
    /// both went on to the C library's exit: 4 of 600 loaded runs of `exit_race.c`
    /// ended with no report).
    exit_owner: AtomicU64,
    /// The status `exit` runs with (glibc passes it to `on_exit` handlers, which run
    /// before the destructors); `NO_STATUS` until known.
    exit_status: AtomicI32,
    /// The final report found leaks (after suppressions).
    leaked: AtomicBool,
    /// `LEAKTRACE_EXIT_CODE` (0: off).
    leak_exit_code: AtomicU8,
    /// The final report's scan holds the program's threads (or runs no scan): their
    /// frees no longer matter to it (see `frees_still_wanted`).
    final_threads_held: AtomicBool,
}

const NO_STATUS: i32 = i32::MIN;

pub static LIFECYCLE: Lifecycle = Lifecycle::new();

impl Default for Lifecycle {
    fn default() -> Lifecycle {
        Lifecycle::new()
    }
}

/// A collector that failed is started again this many times; after that the program's
/// threads drain the events and the exit paths still write the final report.
pub const COLLECTOR_RESTARTS: u32 = 2;

impl Lifecycle {
    pub const fn new() -> Lifecycle {
        Lifecycle {
            hot: ReadMostly { phase: AtomicU8::new(Phase::Off as u8), demand: AtomicBool::new(false), depth: AtomicUsize::new(crate::config::DEFAULT_DEPTH) },
            owner_pid: AtomicU32::new(0),
            terminating_signal: AtomicI32::new(0),
            collector: Collector {
                running: AtomicBool::new(false),
                stop: AtomicBool::new(false),
                tid: AtomicU32::new(0),
                live: AtomicU32::new(0),
                deferred: AtomicU8::new(NOT_DEFERRED),
                failures: AtomicU32::new(0),
            },
            exit_owner: AtomicU64::new(0),
            exit_status: AtomicI32::new(NO_STATUS),
            leaked: AtomicBool::new(false),
            leak_exit_code: AtomicU8::new(0),
            final_threads_held: AtomicBool::new(false),
        }
    }

    // ---- phase ------------------------------------------------------------------------

    /// Whether hooks record (the hot path's one check).
    #[inline(always)]
    pub fn tracking(&self) -> bool {
        self.hot.phase.load(Ordering::Relaxed) == Phase::Tracking as u8
    }

    /// Whether hooks have a release to record: while tracking, and while the final
    /// report still takes frees (`frees_still_wanted` says which). Off and finished, a
    /// release hook hands the call straight on (the free path's one check).
    #[inline(always)]
    pub fn releases_recorded(&self) -> bool {
        let phase = self.hot.phase.load(Ordering::Acquire);
        phase == Phase::Tracking as u8 || phase == Phase::Finishing as u8
    }

    pub fn phase(&self) -> Phase {
        match self.hot.phase.load(Ordering::Acquire) {
            1 => Phase::Tracking,
            2 => Phase::Finished,
            3 => Phase::Finishing,
            _ => Phase::Off,
        }
    }

    /// Frames kept per captured stack.
    #[inline(always)]
    pub fn depth(&self) -> usize {
        self.hot.depth.load(Ordering::Relaxed)
    }

    /// Off -> Tracking, for the process `pid`, with stacks of `depth` frames.
    pub fn start(&self, pid: u32, depth: usize) {
        self.hot.depth.store(depth, Ordering::Relaxed);
        self.owner_pid.store(pid, Ordering::SeqCst);
        self.final_threads_held.store(false, Ordering::SeqCst);
        self.hot.phase.store(Phase::Tracking as u8, Ordering::SeqCst);
    }

    /// Tracking ends for good without a final report (an internal error, or a forked
    /// child that is not followed).
    pub fn give_up(&self) {
        self.hot.phase.store(Phase::Finished as u8, Ordering::SeqCst);
    }

    /// The final report's turn for the calling exit path of process `pid`.
    pub fn begin_final(&self, pid: u32) -> FinalTurn {
        if self.owner_pid.load(Ordering::SeqCst) != pid {
            return FinalTurn::NotOurs;
        }
        match self.hot.phase.compare_exchange(Phase::Tracking as u8, Phase::Finishing as u8, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => FinalTurn::Mine,
            Err(p) if p == Phase::Finishing as u8 => FinalTurn::InProgress,
            Err(_) => FinalTurn::NotOurs,
        }
    }

    /// Finishing -> Finished.
    pub fn final_written(&self) {
        self.hot.phase.store(Phase::Finished as u8, Ordering::SeqCst);
    }

    /// Tracking has stopped for the final report, whose scan has not held the program's
    /// threads yet: a block another thread frees now is still in the live set the
    /// report takes, so the free is published (and nothing else is).
    #[inline]
    pub fn frees_still_wanted(&self) -> bool {
        self.phase() == Phase::Finishing && !self.final_threads_held.load(Ordering::Acquire)
    }

    /// The final report's scan holds the program's threads, or there is no scan.
    pub fn final_threads_held(&self) {
        self.final_threads_held.store(true, Ordering::Release);
    }

    /// Whether an exit path is writing the final report now.
    pub fn final_in_progress(&self) -> bool {
        self.phase() == Phase::Finishing
    }

    // ---- exit paths -------------------------------------------------------------------

    /// `exit` was called by thread `me` of process `pid`: whether another thread of
    /// this process called it first (glibc before 2.41 lets that second `exit` end the
    /// process while the first one's destructors write the final report, so the second
    /// writes it first).
    pub fn exit_called(&self, me: u32, pid: u32) -> bool {
        let mine = u64::from(pid) << 32 | u64::from(me);
        loop {
            let owner = self.exit_owner.load(Ordering::Acquire);
            if owner >> 32 == u64::from(pid) {
                return owner != mine;
            }
            // Free, or left by the parent of this forked child.
            if self.exit_owner.compare_exchange(owner, mine, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return false;
            }
        }
    }

    /// From a termination signal's handler (async-signal-safe): whether the collector
    /// will write the final report and then end the process by `sig`. False when the
    /// caller must die at once: not tracking, no collector, or a second signal.
    pub fn final_on_signal(&self, sig: i32) -> bool {
        if self.final_in_progress() {
            // The process is already ending (exit, _exit) and writing its last report:
            // let it finish; it ends right after, by this signal (`agent::finish`).
            // Killing it now would lose the report.
            let _ = self.terminating_signal.compare_exchange(0, sig, Ordering::AcqRel, Ordering::Acquire);
            return true;
        }
        // A collector created and not yet running (started on demand by this very
        // signal) will see the signal at its first turn.
        let collector = self.collector.running.load(Ordering::Acquire) || self.collector.live.load(Ordering::Acquire) > 0;
        if !self.tracking() || !collector || self.owner_pid.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.terminating_signal.compare_exchange(0, sig, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// The termination signal process `pid` must end by once its final report is
    /// written: one came before or during the report. `None` in another process (a
    /// vfork child shares our memory) and before the report is written.
    pub fn ends_by_signal(&self, pid: u32) -> Option<i32> {
        let sig = self.terminating_signal.load(Ordering::Acquire);
        (sig != 0 && self.owner_pid.load(Ordering::SeqCst) == pid && self.phase() == Phase::Finished).then_some(sig)
    }

    /// The termination signal the collector must write the final report for (0: none).
    pub fn terminating_signal(&self) -> i32 {
        self.terminating_signal.load(Ordering::Acquire)
    }

    /// `exit` is running with `status` (from an `on_exit` handler).
    pub fn exit_status_is(&self, status: i32) {
        self.exit_status.store(status, Ordering::SeqCst);
    }

    /// The final report found leaks.
    pub fn leaks_found(&self, leaked: bool) {
        self.leaked.store(leaked, Ordering::SeqCst);
    }

    pub fn set_leak_exit_code(&self, code: Option<u8>) {
        self.leak_exit_code.store(code.unwrap_or(0), Ordering::SeqCst);
    }

    /// `LEAKTRACE_EXIT_CODE`, if set.
    pub fn leak_exit_code(&self) -> Option<u8> {
        Some(self.leak_exit_code.load(Ordering::SeqCst)).filter(|&c| c != 0)
    }

    /// The status process `pid` ends with instead of `status` (the program's, or the one
    /// its `exit` runs with when `None`): the leak exit code when this process wrote a
    /// final report that found leaks and would have exited with 0 (LeakSanitizer's
    /// `exitcode`; the program's own failure always wins).
    pub fn status_after_final(&self, pid: u32, status: Option<i32>) -> Option<i32> {
        if self.owner_pid.load(Ordering::SeqCst) != pid || self.phase() != Phase::Finished {
            return None;
        }
        self.leak_exit_status(self.leak_exit_code(), status)
    }

    /// `code` when the process leaked and `status` (or the recorded exit status) is 0.
    fn leak_exit_status(&self, code: Option<u8>, status: Option<i32>) -> Option<i32> {
        let code = code?;
        let status = status.or_else(|| Some(self.exit_status.load(Ordering::SeqCst)).filter(|&s| s != NO_STATUS))?;
        (status & 0xff == 0 && self.leaked.load(Ordering::SeqCst)).then_some(i32::from(code))
    }

    // ---- fork -------------------------------------------------------------------------

    /// In a forked child: the child owns the state now; the parent's collector thread and
    /// its pending signal do not exist here.
    pub fn fork_child(&self, pid: u32) {
        self.owner_pid.store(pid, Ordering::SeqCst);
        self.collector.running.store(false, Ordering::SeqCst);
        self.collector.live.store(0, Ordering::SeqCst);
        self.collector.stop.store(false, Ordering::SeqCst);
        self.terminating_signal.store(0, Ordering::SeqCst);
    }

    // ---- the collector thread ---------------------------------------------------------

    /// A collector thread is about to be created.
    pub fn collector_spawning(&self) {
        self.collector.live.fetch_add(1, Ordering::SeqCst);
    }

    /// Its creation failed, or it finished (whatever ended it).
    pub fn collector_gone(&self) {
        self.collector.running.store(false, Ordering::SeqCst);
        self.collector.live.fetch_sub(1, Ordering::SeqCst);
    }

    /// It runs, as kernel thread `tid`.
    pub fn collector_running(&self, tid: u32) {
        self.collector.tid.store(tid, Ordering::SeqCst);
        self.collector.running.store(true, Ordering::SeqCst);
    }

    /// The collector's kernel thread id (0 before its first run).
    pub fn collector_tid(&self) -> u32 {
        self.collector.tid.load(Ordering::SeqCst)
    }

    /// Whether the collector loop goes on.
    pub fn collector_continues(&self) -> bool {
        self.tracking() && !self.collector.stop.load(Ordering::Acquire)
    }

    /// Counts a failure; whether the collector may be started again.
    pub fn collector_failed(&self) -> bool {
        self.collector.failures.fetch_add(1, Ordering::SeqCst) < COLLECTOR_RESTARTS
    }

    pub fn collector_failures(&self) -> u32 {
        self.collector.failures.load(Ordering::Relaxed)
    }

    /// The collector waits for the program's own second thread.
    pub fn defer_collector(&self) {
        self.hot.demand.store(false, Ordering::SeqCst);
        self.collector.deferred.store(UNTIL_THREAD, Ordering::SeqCst);
    }

    /// The collector waits until the process needs it (`CollectorStart::OnDemand`).
    pub fn defer_collector_on_demand(&self) {
        self.collector.deferred.store(ON_DEMAND, Ordering::SeqCst);
        self.hot.demand.store(true, Ordering::SeqCst);
    }

    pub fn collector_deferred(&self) -> bool {
        self.collector.deferred.load(Ordering::SeqCst) != NOT_DEFERRED
    }

    /// Whether the collector waits for the program's own second thread only.
    pub fn collector_waits_for_a_thread(&self) -> bool {
        self.collector.deferred.load(Ordering::SeqCst) == UNTIL_THREAD
    }

    /// Whether the collector waits on demand (the allocation hooks' one check).
    #[inline(always)]
    pub fn collector_on_demand(&self) -> bool {
        self.hot.demand.load(Ordering::Relaxed)
    }

    /// The program started a thread: whether a deferred collector starts now (the
    /// caller starts it).
    pub fn take_deferred_collector(&self) -> bool {
        self.collector.deferred.load(Ordering::Relaxed) != NOT_DEFERRED && self.take(|_| true)
    }

    /// The process needs its collector now (an allocation, a signal): whether one that
    /// waits on demand starts (the caller starts it). One that waits for the program's
    /// second thread goes on waiting.
    pub fn take_on_demand_collector(&self) -> bool {
        self.collector.deferred.load(Ordering::Relaxed) == ON_DEMAND && self.take(|d| d == ON_DEMAND)
    }

    fn take(&self, wanted: impl Fn(u8) -> bool) -> bool {
        let mut d = self.collector.deferred.load(Ordering::Acquire);
        loop {
            if d == NOT_DEFERRED || !wanted(d) {
                return false;
            }
            match self.collector.deferred.compare_exchange(d, NOT_DEFERRED, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(now) => d = now,
            }
        }
        self.hot.demand.store(false, Ordering::SeqCst);
        self.tracking()
    }

    /// Asks the collector to leave; returns false when none lives.
    pub fn ask_collector_to_stop(&self) -> bool {
        if self.collector.live.load(Ordering::SeqCst) == 0 {
            return false;
        }
        self.collector.stop.store(true, Ordering::SeqCst);
        true
    }

    /// Whether no collector thread lives (none counted).
    pub fn no_collector_lives(&self) -> bool {
        self.collector.live.load(Ordering::SeqCst) == 0
    }

    /// The collector may run again (after `ask_collector_to_stop`).
    pub fn collector_may_run(&self) {
        self.collector.stop.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Lifecycle {
        Lifecycle::new()
    }

    #[test]
    fn a_leaking_process_that_would_exit_0_exits_with_the_code_and_a_failing_one_keeps_its_status() {
        let l = fresh();
        assert_eq!(l.leak_exit_status(Some(23), Some(0)), None, "no leak");
        l.leaks_found(true);
        assert_eq!(l.leak_exit_status(None, Some(0)), None, "not asked for");
        assert_eq!(l.leak_exit_status(Some(23), Some(0)), Some(23));
        assert_eq!(l.leak_exit_status(Some(23), Some(3)), None, "the program's failure wins");
        assert_eq!(l.leak_exit_status(Some(23), None), None, "status unknown");
        l.exit_status_is(0);
        assert_eq!(l.leak_exit_status(Some(23), None), Some(23));
        l.exit_status_is(256);
        assert_eq!(l.leak_exit_status(Some(23), None), Some(23), "exit(256) is status 0");
    }

    #[test]
    fn the_final_report_is_written_once_by_the_first_exit_path_of_the_owner() {
        let l = fresh();
        assert_eq!(l.begin_final(7), FinalTurn::NotOurs, "not started");
        assert!(!l.releases_recorded(), "off: the hooks hand every call on");
        l.start(7, 16);
        assert!(l.tracking() && l.releases_recorded());
        assert_eq!(l.depth(), 16);
        assert_eq!(l.begin_final(8), FinalTurn::NotOurs, "a vfork child sharing our memory");
        assert_eq!(l.begin_final(7), FinalTurn::Mine);
        assert!(!l.tracking() && l.final_in_progress());
        assert!(l.frees_still_wanted(), "until the final scan holds the threads");
        assert!(l.releases_recorded(), "a free then takes the recording path");
        l.final_threads_held();
        assert!(!l.frees_still_wanted());
        assert_eq!(l.begin_final(7), FinalTurn::InProgress);
        l.final_written();
        assert_eq!(l.phase(), Phase::Finished);
        assert!(!l.releases_recorded(), "finished: the hooks hand every call on");
        assert_eq!(l.begin_final(7), FinalTurn::NotOurs);
    }

    #[test]
    fn a_second_thread_calling_exit_is_told_so_and_a_forked_child_starts_afresh() {
        let l = fresh();
        assert!(!l.exit_called(1, 100));
        assert!(!l.exit_called(1, 100), "the same thread again (exit from an atexit handler)");
        assert!(l.exit_called(2, 100));
        // A child forked while its parent was exiting: the marker is not its own.
        assert!(!l.exit_called(2, 101));
    }

    /// Threads calling `exit` at the same moment: exactly one is first, every time.
    #[test]
    fn of_threads_calling_exit_at_once_exactly_one_is_first() {
        for round in 0..300 {
            let l = fresh();
            let go = std::sync::Barrier::new(4);
            let firsts: usize = std::thread::scope(|s| {
                let runs: Vec<_> = (1..=4u32)
                    .map(|me| {
                        s.spawn({
                            let (l, go) = (&l, &go);
                            move || {
                                go.wait();
                                !l.exit_called(me, 100)
                            }
                        })
                    })
                    .collect();
                runs.into_iter().map(|r| usize::from(r.join().unwrap())).sum()
            });
            assert_eq!(firsts, 1, "round {round}");
        }
    }

    #[test]
    fn sigterm_is_taken_only_while_a_collector_runs_and_only_once() {
        let l = fresh();
        l.start(7, 8);
        assert!(!l.final_on_signal(15), "no collector: die at once");
        l.collector_spawning();
        l.collector_running(42);
        assert!(l.final_on_signal(15));
        assert_eq!(l.terminating_signal(), 15);
        assert!(!l.final_on_signal(15), "a second signal kills at once");
        l.fork_child(9);
        assert_eq!(l.terminating_signal(), 0);
        assert!(l.no_collector_lives());
    }

    #[test]
    fn a_signal_before_or_during_the_final_report_ends_the_process_after_it() {
        let l = fresh();
        l.start(7, 8);
        l.collector_spawning();
        l.collector_running(42);
        assert!(l.final_on_signal(15));
        assert_eq!(l.ends_by_signal(7), None, "not before the report is written");
        assert_eq!(l.begin_final(7), FinalTurn::Mine);
        l.final_written();
        assert_eq!(l.ends_by_signal(7), Some(15));
        assert_eq!(l.ends_by_signal(8), None, "another process sharing our memory");
        // A signal while the exit path writes the report: taken, and ends it after.
        let l = fresh();
        l.start(7, 8);
        assert_eq!(l.begin_final(7), FinalTurn::Mine);
        assert!(l.final_on_signal(2), "the report being written is not cut short");
        l.final_written();
        assert_eq!(l.ends_by_signal(7), Some(2));
        // No signal: the exit's own status.
        let l = fresh();
        l.start(7, 8);
        assert_eq!(l.begin_final(7), FinalTurn::Mine);
        l.final_written();
        assert_eq!(l.ends_by_signal(7), None);
    }

    #[test]
    fn a_failed_collector_is_restarted_a_bounded_number_of_times() {
        let l = fresh();
        assert!((0..COLLECTOR_RESTARTS).all(|_| l.collector_failed()));
        assert!(!l.collector_failed());
    }

    #[test]
    fn a_deferred_collector_starts_once() {
        let l = fresh();
        l.start(7, 8);
        l.defer_collector();
        assert!(l.take_deferred_collector());
        assert!(!l.take_deferred_collector());
    }

    #[test]
    fn an_on_demand_collector_starts_once_by_either_way_and_one_waiting_for_a_thread_only_by_a_thread() {
        let l = fresh();
        l.start(7, 8);
        l.defer_collector_on_demand();
        assert!(l.collector_on_demand() && l.collector_deferred());
        assert!(l.take_on_demand_collector());
        assert!(!l.collector_on_demand() && !l.collector_deferred());
        assert!(!l.take_on_demand_collector() && !l.take_deferred_collector());
        l.defer_collector_on_demand();
        assert!(l.take_deferred_collector());
        assert!(!l.take_on_demand_collector());
        // A raw clone's child, a zygote: only its own second thread starts it.
        l.defer_collector();
        assert!(!l.collector_on_demand());
        assert!(!l.take_on_demand_collector());
        assert!(l.collector_deferred());
        assert!(l.take_deferred_collector());
    }

    #[test]
    fn a_signal_is_taken_by_a_collector_created_and_not_yet_running() {
        let l = fresh();
        l.start(std::process::id(), 8);
        assert!(!l.final_on_signal(15), "no collector: the caller dies at once");
        l.collector_spawning();
        assert!(l.final_on_signal(15));
        assert_eq!(l.terminating_signal(), 15);
    }
}
