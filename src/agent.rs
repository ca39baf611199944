//! The in-process agent: glue between the hooks (interpose), the hot path (hotpath),
//! the collector and the report writer. Everything here is safe Rust; the hooks call
//! `record_*`, the lifecycle hooks call `start`, `finish`, the fork and dlclose steps.
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::collector::state::Collector;
use crate::config::Config;
use crate::hotpath::channel::{self, DrainState};
use crate::hotpath::event::{self, Api, EventKind, Kind, Space};
use crate::hotpath::thread::ThreadState;
use crate::hotpath::{stacks, thread, unwind};
use crate::os::lock::SpinLock;
use crate::report::build::{self, Reason, RunFacts, Tally};
use crate::report::checks;
use crate::report::process::{self, ProcessInfo};
use crate::report::symbolize::Symbolizer;
use crate::report::timeline::Timeline;
use crate::report::writer;

use crate::lifecycle::{FinalTurn, LIFECYCLE};

/// The consumer side: the collector's model and its position in the event order.
struct Consumer {
    model: Collector,
    order: DrainState,
}

static STATE: SpinLock<Option<Consumer>> = SpinLock::new(None);
static SNAPSHOT_REQUESTED: AtomicBool = AtomicBool::new(false);
static SCAN_AT_EXIT: AtomicBool = AtomicBool::new(false);
/// Set in a forked child that will scan at exit: its collector thread gathers the
/// inherited blocks while the child runs (`prepare_inherited`).
static PREPARE_INHERITED: AtomicBool = AtomicBool::new(false);
/// A child that execs does so within a millisecond or two: one still here after this
/// long is a worker, worth the preparation.
const PREPARE_AFTER: Duration = Duration::from_millis(5);
/// True from the gather until the sorted list is installed: an exit meanwhile waits for
/// it (at most `PREPARE_WAIT`) rather than gathering and sorting everything again.
static PREPARING: AtomicBool = AtomicBool::new(false);
const PREPARE_WAIT: Duration = Duration::from_millis(500);

/// Set while a check, a snapshot or the final report scans the live set it took: nobody
/// applies events meanwhile, so that the frees published until the program's threads
/// are stopped are still in the rings for the scan to read (`channel::unapplied_frees`),
/// instead of leaving a freed block in the set with nothing pointing to it (a false
/// leak). Only a forced drain (one whose ticket predecessors never come: the final
/// report's, a forked child's) goes ahead.
static SCAN_PAUSE: AtomicBool = AtomicBool::new(false);

/// Holds the consumers off (`SCAN_PAUSE`) until dropped, even by a panic.
struct ScanPause;

impl ScanPause {
    /// Called holding the collector, right after the drain that the live set follows.
    fn start() -> ScanPause {
        SCAN_PAUSE.store(true, Ordering::SeqCst);
        ScanPause
    }
}

impl Drop for ScanPause {
    fn drop(&mut self) {
        SCAN_PAUSE.store(false, Ordering::SeqCst);
    }
}

/// Everything the report writer needs; one lock so that reports are written one at a time.
struct ReportSide {
    config: Config,
    process: ProcessInfo,
    output_dir: PathBuf,
    symbolizer: Symbolizer,
    final_written: bool,
    write_failed_once: bool,
    host_tracking: String,
    timeline: Timeline,
    suppressions: leaktrace_common::Suppressions,
    /// The signal ending the process, for the final report.
    exit_signal: Option<i32>,
    /// Why this process can never be given a final report, once the collector found out.
    no_final_report: Option<&'static str>,
    /// The checks the program asked for (`checkpoint`), and how many more were not kept.
    checks: Vec<checks::Check>,
    checks_dropped: u64,
}

impl ReportSide {
    fn new(
        config: Config,
        process: ProcessInfo,
        output_dir: PathBuf,
        symbolizer: Symbolizer,
        host_tracking: String,
        suppressions: leaktrace_common::Suppressions,
    ) -> ReportSide {
        ReportSide {
            config,
            process,
            output_dir,
            symbolizer,
            final_written: false,
            write_failed_once: false,
            host_tracking,
            timeline: Timeline::default(),
            suppressions,
            exit_signal: None,
            no_final_report: None,
            checks: Vec::new(),
            checks_dropped: 0,
        }
    }
}

static REPORT: SpinLock<Option<ReportSide>> = SpinLock::new(None);
/// The groups of the last report's snapshot, kept for the next one (see
/// `Collector::snapshot_unsorted_into`); empty while a report holds them.
static SNAPSHOT_BUFFER: SpinLock<Vec<crate::collector::state::GroupSnapshot>> = SpinLock::new(Vec::new());
/// The same for the changed groups of a timeline point (`record_point`).
static CHANGES_BUFFER: SpinLock<Vec<crate::collector::state::Change>> = SpinLock::new(Vec::new());

/// One line on the program's standard error, if fd 2 is still that (`os::fds`).
pub fn stderr_line(line: &str) {
    let mut s = String::with_capacity(line.len() + 1);
    s.push_str(line);
    s.push('\n');
    crate::os::fds::write_stderr(s.as_bytes());
}

#[inline(always)]
pub fn active() -> bool {
    LIFECYCLE.tracking()
}

fn drain_into(c: &mut Consumer, max: usize, force: bool) -> usize {
    if !force && SCAN_PAUSE.load(Ordering::Acquire) {
        return 0;
    }
    let Consumer { model, order } = c;
    order.drain(max, force, model)
}

/// A child made by `fork` or a raw `clone` that ran none of our `atfork` handlers
/// (`os::image`): it takes our state over as `fork_child` does, before it takes any lock
/// of ours (one may be held by a thread that does not exist here). Called where a
/// program thread is about to take one: a full ring, its own `fork`, its exit.
fn adopt_if_cloned() {
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
    recording(|s| {
        let stack = unwind::capture_stack_id(s, LIFECYCLE.depth());
        publish(s, EventKind::Alloc, api, stack, addr as u64, size as u64);
        if s.lsan_disabled() {
            // Between __lsan_disable and __lsan_enable: never a leak.
            publish(s, EventKind::Ignore, Api::Malloc, 0, addr as u64, 0);
        }
    });
}

#[inline]
pub fn record_free(addr: usize) {
    recording(|s| publish(s, EventKind::Free, Api::Malloc, 0, addr as u64, 0));
}

/// A free (`Api::Malloc`) or a CUDA release (`Api::releasing(space)`) after tracking
/// stopped, while the final report still wants frees (`Lifecycle::frees_still_wanted`):
/// published, so that the report does not count the block as leaked. Frees the final
/// drain was too late for are in the rings when the scan holds the threads
/// (`channel::unapplied_frees`).
#[cold]
pub fn record_late_free(addr: u64, api: Api) {
    if LIFECYCLE.frees_still_wanted() {
        recording_step(|s| publish(s, EventKind::Free, api, event::LATE_FREE, addr, 0));
    }
}

#[inline]
pub fn record_realloc_release(addr: usize) {
    recording(|s| publish(s, EventKind::ReallocRelease, Api::Realloc, 0, addr as u64, 0));
}

/// The outcome of a realloc whose old block was released with `record_realloc_release`.
#[inline]
pub fn record_realloc_outcome(new_addr: usize, size: usize, api: Api, freed_without_new_block: bool) {
    if new_addr != 0 {
        record_alloc(new_addr, size, api);
    } else if freed_without_new_block {
        recording(|s| publish(s, EventKind::ReallocFreed, api, 0, 0, 0));
    } else {
        recording(|s| publish(s, EventKind::ReallocRestore, api, 0, 0, 0));
    }
}

/// A CUDA allocation that succeeded. `device` is the ordinal it belongs to, if known.
#[inline]
pub fn record_cuda_alloc(addr: u64, size: u64, api: Api, device: Option<u8>) {
    recording(|s| {
        let stack = unwind::capture_stack_id(s, LIFECYCLE.depth());
        publish(s, EventKind::Alloc, api, stack, addr, event::pack_size(size, device));
    });
}

/// A CUDA release about to run on the block `addr` in `space` (published before the
/// call, like a free, so that the address cannot be handed out again first).
#[inline]
pub fn record_cuda_release(addr: u64, space: Space) {
    recording(|s| publish(s, EventKind::ReallocRelease, Api::releasing(space), 0, addr, 0));
}

/// How the release published with `record_cuda_release` ended.
#[inline]
pub fn record_cuda_release_outcome(space: Space, freed: bool) {
    let kind = if freed { EventKind::ReallocFreed } else { EventKind::ReallocRestore };
    recording(|s| publish(s, kind, Api::releasing(space), 0, 0, 0));
}

/// A context destroy or device reset that succeeded: every context-bound block of
/// `device` is gone. Applied here, in the caller's thread, after everything published
/// so far (this thread's allocations among them), so that no block allocated before
/// the reset survives it in the books.
pub fn record_device_reset(device: u8) {
    recording(|_| {
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

// ---- start -------------------------------------------------------------------------

/// Initialises everything from the library constructor. Returns false when tracking
/// stays off (disabled by configuration or unsupported platform).
pub fn start(config: Config, host_tracking: String) -> bool {
    thread::untracked(|| {
        if config.disabled {
            return false;
        }
        if !unwind::init() {
            stderr_line("leaktrace: this C library has no _dl_find_object (glibc >= 2.35 needed); tracking is off");
            return false;
        }
        let (output_dir, warning) = writer::choose_output_dir(config.output_dir.clone());
        if let Some(w) = warning {
            stderr_line(&w);
        }
        let depth = config.stack_depth;
        let process = ProcessInfo::current(None);
        let symbolizer = Symbolizer::new(process.exe.clone());
        let suppressions = match &config.suppressions {
            Some(path) => leaktrace_common::Suppressions::load(path).unwrap_or_else(|e| {
                stderr_line(&format!("leaktrace: {e}; the exit summary is filtered by the built-in suppressions only"));
                Default::default()
            }),
            None => leaktrace_common::Suppressions::default(),
        }
        .with_built_in(config.default_suppressions);
        channel::init();
        // pymalloc's arenas are known from before the interpreter maps its first one.
        if config.scan {
            crate::interpose::pymalloc::install();
        }
        match crate::hotpath::python::init(config.python_frames) {
            crate::hotpath::python::Found::Off(line) if !line.is_empty() => stderr_line(&line),
            _ => {}
        }
        if config.scan {
            SCAN_AT_EXIT.store(true, Ordering::Relaxed);
            crate::scan::roots::record_main_tls();
            crate::scan::roots::install();
        }
        *STATE.lock() = Some(Consumer { model: Collector::new(), order: DrainState::default() });
        let lazy = config.collector.resolve(&process.argv) == crate::config::CollectorStart::Lazy;
        let mut side = ReportSide::new(config, process, output_dir, symbolizer, host_tracking, suppressions);
        // A cgo program may be gone before the collector's first turn: its first report
        // (saying that no final one will come) is written here, before main.
        let cgo = process::is_cgo_program();
        if cgo {
            side.no_final_report = Some(process::GO_EXIT);
        }
        LIFECYCLE.set_leak_exit_code(side.config.exit_code);
        *REPORT.lock() = Some(side);
        crate::os::image::mark_own_image();
        LIFECYCLE.start(std::process::id(), depth);
        if cgo {
            write_report(Reason::Periodic);
        }
        if lazy {
            LIFECYCLE.defer_collector();
        } else {
            spawn_collector();
        }
        true
    })
}

/// The program started a thread: a deferred collector (`CollectorStart::Lazy`) starts now.
pub fn program_started_thread() {
    if LIFECYCLE.take_deferred_collector() {
        spawn_collector();
    }
}

fn spawn_collector() {
    LIFECYCLE.collector_spawning();
    // Untracked: pthread_create allocates the new thread's TLS vector on the calling
    // thread (a forked child's starts here, in the fork handler), and that block is ours.
    if let Err(rc) = thread::untracked(|| crate::interpose::lifecycle::spawn_internal_thread(collector_thread)) {
        LIFECYCLE.collector_gone();
        stderr_line(&format!("leaktrace: cannot start the collector thread (error {rc}); events are drained by the program's threads instead"));
    }
}

/// The collector thread's body: the loop, and whatever ends it — a return, or a panic —
/// leaves the "collector running" state false, so that SIGTERM never waits for a thread
/// that is gone (its handler then ends the process as before).
fn collector_thread() {
    struct Running;
    impl Drop for Running {
        fn drop(&mut self) {
            LIFECYCLE.collector_gone();
        }
    }
    let running = Running;
    let failed = catch_unwind(collector_main).is_err();
    drop(running);
    if failed && active() {
        if LIFECYCLE.collector_failed() {
            stderr_line("leaktrace: internal error in the collector thread; starting it again");
            spawn_collector();
        } else {
            stderr_line(
                "leaktrace: internal error in the collector thread again; the program's threads drain the events, the final report is still written at exit",
            );
        }
    }
}

fn collector_main() {
    LIFECYCLE.collector_running(thread::tid());
    // For the tests of the failure path only: the first collector fails at once.
    if LIFECYCLE.collector_failures() == 0 && std::env::var_os("LEAKTRACE_TEST_COLLECTOR_PANIC").is_some() {
        panic!("collector failure requested by LEAKTRACE_TEST_COLLECTOR_PANIC");
    }
    let (mut interval, interval_set) = REPORT.lock().as_ref().map(|r| (r.config.interval_ms, r.config.interval_set)).unwrap_or((0, true));
    // A process that no exit hook will see ending (Go) is reported at once and then at
    // least every second: the last periodic report is all that will be left of it.
    let (exe, known) = REPORT.lock().as_ref().map(|r| (r.process.exe.clone(), r.no_final_report.is_some())).unwrap_or_default();
    let found = if known { None } else { process::final_report_unreachable(&exe) };
    if let Some(why) = found {
        if let Some(r) = REPORT.lock().as_mut() {
            r.no_final_report = Some(why);
        }
        write_report(Reason::Periodic);
    }
    if (known || found.is_some()) && interval > 0 {
        interval = interval.min(FINAL_LESS_INTERVAL_MS);
    }
    let born = Instant::now();
    // The next periodic report is due at this instant (None: periodic reports are off).
    // The period depends on the time run so far (`config::report_period`), so it is
    // worked out once per report, and each turn reads the clock once, as before.
    let next_due = |now: Instant| {
        let period = crate::config::report_period(interval, interval_set, now.duration_since(born).as_millis() as u64);
        (period > 0).then(|| now + Duration::from_millis(period))
    };
    let mut report_due = next_due(born);
    // Timeline points between reports (`config::point_period`): growth needs points, a
    // point needs no report written.
    let next_point = |now: Instant| {
        let period = crate::config::point_period(interval, interval_set, now.duration_since(born).as_millis() as u64);
        (period > 0).then(|| now + Duration::from_millis(period))
    };
    let mut point_due = next_point(born);
    let mut idle_sleep_us = 200u64;
    while LIFECYCLE.collector_continues() {
        let sig = LIFECYCLE.terminating_signal();
        if sig != 0 {
            finish_as(sig);
            // Another thread may be writing the final report (exit, _exit raced the
            // signal): let it finish; the process usually ends on its own meanwhile.
            wait_while(|| LIFECYCLE.final_in_progress(), Duration::from_secs(60), Duration::from_millis(1));
            crate::os::signals::die_by_signal(sig);
        }
        let drained = {
            let mut g = STATE.lock();
            g.as_mut().map(|c| drain_into(c, 1 << 16, false)).unwrap_or(0)
        };
        stacks::promote_tables_if_large();
        // The flag first: reading the clock on every turn was ~3% of the collector's
        // samples under two allocating threads.
        if PREPARE_INHERITED.load(Ordering::Relaxed) && born.elapsed() >= PREPARE_AFTER && PREPARE_INHERITED.swap(false, Ordering::AcqRel) {
            prepare_inherited();
        }
        // A load first: the flag shares a cache line with statics the unwinder reads on
        // every capture, and a locked write on every turn of this loop would take that
        // line from every allocating core.
        if SNAPSHOT_REQUESTED.load(Ordering::Relaxed) && SNAPSHOT_REQUESTED.swap(false, Ordering::AcqRel) {
            write_report(Reason::Signal);
        }
        if report_due.is_some_and(|due| Instant::now() >= due) {
            write_report(Reason::Periodic);
            let now = Instant::now();
            (report_due, point_due) = (next_due(now), next_point(now));
        } else if point_due.is_some_and(|due| Instant::now() >= due) {
            record_point();
            point_due = next_point(Instant::now());
        }
        if drained == 0 {
            channel::park_consumer(Duration::from_micros(idle_sleep_us));
            idle_sleep_us = (idle_sleep_us * 2).min(2000);
        } else {
            idle_sleep_us = 200;
        }
    }
}

/// The longest periodic interval of a process that gets no final report.
const FINAL_LESS_INTERVAL_MS: u64 = 1000;

/// Naps `nap` at a time while `busy` holds, for at most `limit`.
fn wait_while(busy: impl Fn() -> bool, limit: Duration, nap: Duration) {
    let start = Instant::now();
    while busy() && start.elapsed() < limit {
        std::thread::sleep(nap);
    }
}

/// In a forked child, gathers the blocks it inherited and sorts them, the sort without
/// holding the collector, so that the exit report's scan starts from a ready list (a
/// DataLoader worker's exit, which its parent waits for, took 40–75 ms longer without).
fn prepare_inherited() {
    struct Preparing;
    impl Drop for Preparing {
        fn drop(&mut self) {
            PREPARING.store(false, Ordering::SeqCst);
        }
    }
    PREPARING.store(true, Ordering::SeqCst);
    let _clear = Preparing;
    let gathered = STATE.lock().as_mut().and_then(|c| c.model.gather_inherited());
    if let Some((mut list, generation)) = gathered {
        list.sort_unstable_by_key(|b| b.0);
        if let Some(c) = STATE.lock().as_mut() {
            c.model.install_inherited(list, generation);
        }
    }
}

/// Called from a termination signal handler (async-signal-safe). Returns false when the
/// caller must die at once: tracking is off, no collector runs, or this is the second
/// signal.
pub fn request_final_on_signal(sig: i32) -> bool {
    LIFECYCLE.final_on_signal(sig)
}

/// Makes the process single-threaded again for a moment (`unshare(CLONE_NEWUSER)` and
/// friends refuse multi-threaded callers): the collector thread leaves and is waited
/// for. Returns whether it has to be started again with `resume_collector`.
pub fn pause_collector() -> bool {
    if !LIFECYCLE.ask_collector_to_stop() {
        return false;
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) {
        // Finished its loop (a thread not yet started leaves at once), and gone from the
        // kernel's thread list.
        if LIFECYCLE.no_collector_lives() && crate::os::threads::thread_is_gone(LIFECYCLE.collector_tid()) {
            break;
        }
        std::thread::yield_now();
    }
    true
}

pub fn resume_collector() {
    LIFECYCLE.collector_may_run();
    if active() {
        spawn_collector();
    }
}

/// Called from the snapshot signal handler: only sets a flag.
pub fn request_snapshot() {
    SNAPSHOT_REQUESTED.store(true, Ordering::Release);
}

// ---- reports -----------------------------------------------------------------------

fn lock_bounded<T>(lock: &'static SpinLock<T>, limit: Duration) -> Option<crate::os::lock::Guard<'static, T>> {
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
fn drain_everything(c: &mut Consumer) {
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

/// One timeline point without a report, for growth detection: the groups whose live
/// bytes moved since the last point or report (`Collector::take_changes`) move the
/// timeline's sums. In a training loop that is a few thousand groups, not the 600k that
/// a report copies after `import torch`.
fn record_point() {
    let (totals, changes) = {
        let Some(mut state) = lock_bounded(&STATE, Duration::from_secs(5)) else { return };
        let Some(c) = state.as_mut() else { return };
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
        let mut changes = CHANGES_BUFFER.try_lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default();
        c.model.take_changes(&mut changes);
        (c.model.totals(), changes)
    };
    // The timeline must see these changes, or its sums drift until the next report
    // starts them afresh: wait as long as a report would.
    if let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) {
        if let Some(r) = report.as_mut().filter(|r| !r.final_written) {
            r.timeline.record_changes(process::unix_ms(), &totals, &changes);
        }
    }
    if let Some(mut b) = CHANGES_BUFFER.try_lock() {
        *b = changes;
    }
}

fn write_report(reason: Reason) {
    let final_report = reason == Reason::Exit;
    if final_report {
        // Before taking the collector: the preparation needs it to install its list.
        wait_while(|| PREPARING.load(Ordering::SeqCst), PREPARE_WAIT, Duration::from_micros(200));
    }
    let Some(mut state) = lock_bounded(&STATE, Duration::from_secs(5)) else {
        stderr_line("leaktrace: collector busy for 5 s; report skipped");
        return;
    };
    let Some(c) = state.as_mut() else { return };
    if final_report {
        // Tracking has stopped: the events in flight remain, and the frees of threads
        // that run on (`Lifecycle::frees_still_wanted`).
        drain_everything(c);
    } else {
        // The program keeps allocating: take what is there now, never chase it (and
        // never force the order while producers are live).
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
    }
    c.model.advance_trends();
    // The last report's buffer, if no other report holds it.
    let buffer = SNAPSHOT_BUFFER.try_lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default();
    let mut snapshot = c.model.snapshot_unsorted_into(buffer);
    // The timeline's sums start afresh from this snapshot: the changes until now are in it.
    c.model.settle_changes();
    if final_report {
        // Tracking has stopped: nobody waits for the collector.
        snapshot.sort();
    }
    // The scan runs for the final report and for snapshots asked with the signal.
    let scan_now = (final_report || reason == Reason::Signal) && SCAN_AT_EXIT.load(Ordering::Relaxed);
    // The final report's names are found on another core while this one gathers the
    // blocks and scans: the largest groups are the ones reported, unless the scan finds
    // smaller ones leaked (named afterwards).
    let presymbolizer = (final_report && scan_now).then(|| Presymbolizer::start(&snapshot)).flatten();
    let live = scan_now.then(|| if final_report { c.model.take_live_blocks() } else { c.model.live_blocks() });
    // The frees published from now until the stop (the program runs on; at exit, its
    // other threads do, and their frees are still published) are read from the rings.
    let pause = scan_now.then(ScanPause::start);
    drop(state);
    // The scan stops the other threads: it runs holding none of our locks.
    let scan = live.map(|live| reachability_scan(&live, presymbolizer.as_ref().map_or(0, Presymbolizer::tid)));
    if final_report {
        LIFECYCLE.final_threads_held();
    }
    drop(pause);
    drop(presymbolizer);
    let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) else {
        stderr_line("leaktrace: report writer busy for 30 s; report skipped");
        return;
    };
    let Some(r) = report.as_mut() else { return };
    if r.final_written {
        return;
    }
    if !final_report {
        if scan_now {
            // `select_groups` re-sorts by what the scan found: ties keep this order.
            snapshot.sort();
        } else {
            // What a periodic report reads of the order: each class's listed groups and
            // the timeline's largest.
            snapshot.sort_top(r.config.report_groups.max(crate::report::timeline::JOIN_TOP));
        }
    }
    let now = process::unix_ms();
    r.timeline.record(now, &snapshot);
    // Groups the scan cannot classify (registrations, VMM handles and ranges) keep no
    // breakdown: they count as outstanding.
    let reach = scan.as_ref().map(|s| |g: &crate::collector::state::GroupSnapshot| s.by_group.get(&(g.stack, g.api.name(), g.device)).copied());
    let (selected, omitted) = build::select_groups(&snapshot.groups, reach, r.config.report_groups);
    let mut groups = build::resolve_groups(&selected, &mut r.symbolizer);
    if let Some(s) = &scan {
        for g in groups.iter_mut() {
            if let Some(from) = s.indirect_from.get(&(g.stack_id, g.api.as_ref(), g.device.and_then(|d| u8::try_from(d).ok()))) {
                g.indirect_from = from.iter().map(|(&stack_id, &(bytes, blocks))| build::IndirectFrom { stack_id, bytes, blocks }).collect();
            }
        }
    }
    let timeline = build::timeline_out(&r.timeline, &groups, &mut r.symbolizer);
    let facts = RunFacts {
        stack_depth: r.config.stack_depth,
        interval_ms: r.config.interval_ms,
        buffer_full_waits: channel::full_waits(),
        rings_grown: channel::rings_grown(),
        stacks_interned: stacks::count().saturating_sub(1) as u64 + stacks::children(),
        stack_table_overflows: stacks::overflows(),
        host_tracking: r.host_tracking.clone(),
        exit_signal: r.exit_signal,
        no_final_report: r.no_final_report,
        cuda_untracked_copies: crate::interpose::cuda::untracked_copies(),
    };
    let scan_out = scan.as_ref().map(|s| (&s.out, s.totals));
    let emit = |path: &std::path::Path, process: &ProcessInfo| {
        let parts = build::ReportParts {
            process,
            reason,
            written_unix_ms: now,
            totals: &snapshot.totals,
            groups: &groups,
            facts: &facts,
            timeline: &timeline,
            scan: scan_out,
            omitted,
            checks: &r.checks,
            checks_dropped: r.checks_dropped,
        };
        writer::write_atomic_with(path, |w| build::write_report_json(w, &parts))
    };
    let mut path = r.process.report_path(&r.output_dir);
    let mut result = emit(&path, &r.process);
    if let Err(e) = &result {
        let fallback = PathBuf::from("/tmp");
        if !r.write_failed_once {
            stderr_line(&format!("leaktrace: cannot write report {} ({e}); trying {}", path.display(), fallback.display()));
        }
        r.write_failed_once = true;
        if r.output_dir != fallback {
            r.output_dir = fallback;
            path = r.process.report_path(&r.output_dir);
            result = emit(&path, &r.process);
            if let Err(e) = &result {
                stderr_line(&format!("leaktrace: cannot write report {} either ({e})", path.display()));
            }
        }
    }
    if final_report {
        r.final_written = true;
        let (visible, suppressed, used) = build::apply_suppressions(&groups, &r.suppressions);
        let visible: Vec<&build::Group> = visible.iter().map(|g| &**g).collect();
        let leaked = build::leaked_total(&visible, omitted).1 > 0;
        LIFECYCLE.leaks_found(leaked);
        let checks_text = checks::summary_lines(&r.checks, r.checks_dropped);
        let print = match r.config.summary {
            crate::config::Summary::Never => false,
            // LeakSanitizer prints its "Suppressions used" table whenever one matched.
            crate::config::Summary::Leaks => leaked || !checks_text.is_empty() || !used.is_empty(),
            crate::config::Summary::Always => true,
        };
        if print {
            let shown = result.is_ok().then(|| path.display().to_string());
            let mut text = build::summary_text(r.process.pid, &visible, suppressed, &used, r.config.summary_top, shown.as_deref(), omitted);
            text.push_str(&checks_text);
            crate::os::fds::write_stderr(text.as_bytes());
        }
    }
    // Kept for the next report (plain data: the next one's `clear` costs nothing).
    drop(selected);
    if let Some(mut b) = SNAPSHOT_BUFFER.try_lock() {
        *b = std::mem::take(&mut snapshot.groups);
    }
}

/// A thread that names the frames of the largest groups into the report's symbolizer
/// while the final report gathers and scans (`write_report`). Dropping it waits for it.
/// A raw thread of ours (`os::threads`): it runs at exit, when a program may have used
/// every pthread key that `std::thread` would need.
struct Presymbolizer {
    shared: Arc<PresymbolizerShared>,
}

struct PresymbolizerShared {
    ids: Vec<u32>,
    tid: AtomicU32,
    done: AtomicBool,
}

extern "C" fn presymbolizer_main(arg: *mut std::ffi::c_void) -> *mut std::ffi::c_void {
    thread::mark_internal();
    // SAFETY: arg is the reference `Presymbolizer::start` leaked for this thread.
    let shared = unsafe { Arc::from_raw(arg as *const PresymbolizerShared) };
    shared.tid.store(thread::tid(), Ordering::SeqCst);
    let _ = catch_unwind(AssertUnwindSafe(|| {
        if let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(30)) {
            if let Some(r) = r.as_mut() {
                build::presymbolize(&shared.ids, &mut r.symbolizer);
            }
        }
    }));
    shared.done.store(true, Ordering::SeqCst);
    std::ptr::null_mut()
}

impl Presymbolizer {
    /// `None` when no thread can be started (the report then names everything itself).
    fn start(snapshot: &crate::collector::state::Snapshot) -> Option<Presymbolizer> {
        let limit = lock_bounded(&REPORT, Duration::from_secs(1))?.as_ref()?.config.report_groups;
        let ids: Vec<u32> = snapshot.groups.iter().take(limit).map(|g| g.stack).collect();
        let shared = Arc::new(PresymbolizerShared { ids, tid: AtomicU32::new(0), done: AtomicBool::new(false) });
        let arg = Arc::into_raw(shared.clone()) as *mut std::ffi::c_void;
        // SAFETY: the thread takes over the reference `arg` is (or it is dropped below).
        if unsafe { crate::os::threads::spawn_raw(presymbolizer_main, arg) }.is_err() {
            // SAFETY: the thread did not start: the reference is still ours to drop.
            drop(unsafe { Arc::from_raw(arg as *const PresymbolizerShared) });
            return None;
        }
        Some(Presymbolizer { shared })
    }

    /// The thread's kernel id (0 if it has not started yet): the scan must not stop it.
    fn tid(&self) -> u32 {
        let start = Instant::now();
        loop {
            let t = self.shared.tid.load(Ordering::SeqCst);
            if t != 0 || self.shared.done.load(Ordering::SeqCst) || start.elapsed() > Duration::from_millis(100) {
                return t;
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for Presymbolizer {
    fn drop(&mut self) {
        // Its own lock wait is bounded by 30 s; the naming after it by the work.
        wait_while(|| !self.shared.done.load(Ordering::SeqCst), Duration::from_secs(120), Duration::from_micros(200));
    }
}

/// The final report when the process is being ended by `sig`.
fn finish_as(sig: i32) {
    if let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(2)) {
        if let Some(r) = r.as_mut() {
            r.exit_signal = Some(sig);
        }
    }
    finish();
}

/// A group's key in the scan's results: stack, API name, device.
type GroupKey = (u32, &'static str, Option<u8>);

struct ScanResult {
    out: crate::scan::ScanInfo,
    by_group: std::collections::HashMap<GroupKey, build::Reachability>,
    totals: build::KindReachability,
    /// Per group, its indirect bytes and blocks by the stack of the definite leak each
    /// block hangs from.
    indirect_from: std::collections::HashMap<GroupKey, std::collections::BTreeMap<u32, (u64, u64)>>,
}

/// Classifies the outstanding blocks of this process image (inherited ones help keep
/// others reachable but are not counted). Device and managed memory is a target only:
/// its contents are not host memory to read (managed pages would migrate); page-locked
/// host memory is read like the heap.
/// The pointer scan's verdict on each of `input.blocks` (in order), the index of the
/// leaked block each indirect one hangs from, and what the scan measured.
fn classify_live(input: &crate::collector::state::ScanInput, names_thread: u32) -> (Vec<crate::scan::mark::Verdict>, Vec<u32>, crate::scan::ScanInfo) {
    let live = &input.blocks;
    let blocks: Vec<crate::scan::mark::Block> = live
        .iter()
        .map(|b| crate::scan::mark::Block {
            start: b.addr,
            size: b.size,
            opaque: matches!(b.api.kind(), Kind::Device | Kind::Managed),
            cuda: b.api.kind() != Kind::Host,
            not_a_reference: if b.api.kind() == Kind::Host { crate::scan::mark::glibc_next_chunk_header(b.addr, b.size) } else { 0 },
        })
        .collect();
    // The collector, running or on its way out (the final report stops its loop: a
    // thread that is exiting never answers the stop signal).
    let collector = LIFECYCLE.collector_tid();
    let own: Vec<u32> = [collector, names_thread].into_iter().filter(|&t| t != 0).collect();
    // Ignored blocks are roots (what they point to is not leaked either), and so are
    // the regions the program registered (LeakSanitizer's interface).
    let mut extra_roots = crate::scan::roots::root_regions();
    // The start arguments of threads created and not yet running (a copy, read as a
    // root while the scan runs).
    let pending = crate::interpose::threads::pending_args();
    extra_roots.push((pending.as_ptr() as u64, (pending.len() * 8) as u64));
    extra_roots.extend(live.iter().filter(|b| b.ignored).map(|b| (b.addr, b.size)));
    let (mut verdicts, owners, info) = crate::scan::scan(&blocks, &input.inherited, &own, &extra_roots);
    for (b, v) in live.iter().zip(verdicts.iter_mut()) {
        if b.ignored {
            *v = crate::scan::mark::Verdict::Reachable;
        }
    }
    if let Some((lo, hi)) = crate::scan::roots::loader_range() {
        // Only leaked blocks can change (most are reachable): each lookup reads the
        // stack table, a cache miss or two, 120k of them after `import torch`.
        for (b, v) in live.iter().zip(verdicts.iter_mut()).filter(|(_, v)| **v != crate::scan::mark::Verdict::Reachable) {
            let innermost = stacks::innermost(b.stack);
            if innermost.is_some_and(|ip| ip >= lo && ip < hi) {
                *v = crate::scan::mark::Verdict::Reachable;
            }
        }
    }
    (verdicts, owners, info)
}

fn reachability_scan(input: &crate::collector::state::ScanInput, names_thread: u32) -> ScanResult {
    let live = &input.blocks;
    let (verdicts, owners, info) = classify_live(input, names_thread);
    let mut by_group: std::collections::HashMap<GroupKey, build::Reachability> = Default::default();
    let mut indirect_from: std::collections::HashMap<GroupKey, std::collections::BTreeMap<u32, (u64, u64)>> = Default::default();
    let mut totals = build::KindReachability::default();
    for ((b, v), owner) in live.iter().zip(verdicts).zip(owners) {
        let key = (b.stack, b.api.name(), b.device);
        by_group.entry(key).or_default().add(v, b.size);
        totals[b.api.kind().index()].add(v, b.size);
        if v == crate::scan::mark::Verdict::Indirect {
            if let Some(o) = live.get(owner as usize) {
                let e = indirect_from.entry(key).or_default().entry(o.stack).or_default();
                e.0 += b.size;
                e.1 += 1;
            }
        }
    }
    ScanResult { out: info, by_group, totals, indirect_from }
}

/// A leak check the program asked for (the C API): drains what was published so far,
/// runs the pointer scan over every outstanding block, and classifies those of `scope`
/// (allocated since the last `leaktrace_mark`, or all); suppressions apply. The check is
/// kept under `label` for every later report. `None` when nothing is tracked here or
/// the scan is off (`LEAKTRACE_SCAN=0`).
///
/// Runs on the calling thread, which is not stopped: its stack from here up is a root,
/// as the program's own frames are (LeakSanitizer's `__lsan_do_recoverable_leak_check`
/// does the same).
pub fn checkpoint(label: &str, scope: checks::Scope) -> Option<checks::Check> {
    if !active() || !SCAN_AT_EXIT.load(Ordering::Relaxed) || LIFECYCLE.final_in_progress() {
        return None;
    }
    thread::untracked(|| catch_unwind(AssertUnwindSafe(|| checkpoint_inner(label, scope))).ok().flatten())
}

fn checkpoint_inner(label: &str, scope: checks::Scope) -> Option<checks::Check> {
    let (input, mark, pause) = {
        let mut state = lock_bounded(&STATE, Duration::from_secs(5))?;
        let c = state.as_mut()?;
        // Every event published before this call (ours in order, other threads' up to
        // their tickets) is applied before the blocks are taken.
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
        (c.model.live_blocks(), c.model.mark(), ScanPause::start())
    };
    let (verdicts, _, _) = classify_live(&input, 0);
    drop(pause);
    let mut by_group: std::collections::HashMap<(u32, Api, Option<u8>), build::Reachability> = Default::default();
    for (b, v) in input.blocks.iter().zip(verdicts) {
        if scope == checks::Scope::Region && b.mark != mark {
            continue;
        }
        by_group.entry((b.stack, b.api, b.device)).or_default().add(v, b.size);
    }
    let mut keys: Vec<_> = by_group.into_iter().collect();
    // Leaked groups first, largest first: those are the ones named.
    keys.sort_by_key(|(_, r)| std::cmp::Reverse((r.leaked().bytes, r.leaked().blocks)));
    let named = keys.iter().take_while(|(_, r)| r.leaked().blocks > 0).count().min(CHECK_NAMED_GROUPS);
    let mut report = lock_bounded(&REPORT, Duration::from_secs(30))?;
    let r = report.as_mut()?;
    let ids: Vec<u32> = keys[..named].iter().map(|((stack, _, _), _)| *stack).collect();
    let mut stacks = build::resolve_stacks(&ids, &mut r.symbolizer).into_iter();
    let groups: Vec<build::Group> = keys
        .iter()
        .enumerate()
        .map(|(i, ((stack, api, device), reach))| build::Group {
            kind: api.kind().name().into(),
            api: api.name().into(),
            device: device.map(u32::from),
            cached_by: None,
            bytes: reach.outstanding().bytes,
            blocks: reach.outstanding().blocks,
            peak_bytes: 0,
            total_allocs: 0,
            total_bytes: 0,
            stack_id: *stack,
            reachability: Some(*reach),
            indirect_from: Vec::new(),
            stack: if i < named { stacks.next().unwrap_or_default() } else { Vec::new() },
        })
        .collect();
    let (shown, _, _) = build::apply_suppressions(&groups, &r.suppressions);
    let check = checks::make(label, process::unix_ms(), scope, &groups, &shown);
    if r.checks.len() < checks::KEPT_CHECKS {
        r.checks.push(check.clone());
    } else {
        r.checks_dropped += 1;
    }
    Some(check)
}

/// Leaked groups of a check whose stacks are named (and matched by suppressions).
const CHECK_NAMED_GROUPS: usize = 256;

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

/// The final report: exactly once per process image, after the last event is drained.
/// A second caller (the process is ending through two paths at once: `exit` and a
/// signal, or two threads) waits for the first to finish writing, so that no exit path
/// ends the process in the middle of the report.
pub fn finish() {
    adopt_if_cloned();
    match LIFECYCLE.begin_final(std::process::id()) {
        FinalTurn::Mine => {}
        FinalTurn::InProgress => {
            wait_while(|| LIFECYCLE.final_in_progress(), Duration::from_secs(60), Duration::from_millis(1));
            return;
        }
        // Tracking off, or a vfork child (posix_spawn) sharing our memory: never
        // finalise the parent's state.
        FinalTurn::NotOurs => return,
    }
    thread::untracked(|| {
        if catch_unwind(|| write_report(Reason::Exit)).is_err() {
            stderr_line("leaktrace: internal error while writing the final report");
        }
    });
    channel::close();
    LIFECYCLE.final_written();
}

// ---- dlclose -----------------------------------------------------------------------

/// Before the program changes its root: `/proc` and the report directory stay reachable.
pub fn before_chroot() {
    if !active() {
        return;
    }
    thread::untracked(|| {
        let _ = catch_unwind(|| {
            let dir = lock_bounded(&REPORT, Duration::from_secs(5)).and_then(|r| r.as_ref().map(|r| r.output_dir.clone()));
            if let Some(dir) = dir {
                crate::os::anchor::hold_before_chroot(&dir);
            }
        });
    });
}

/// Before a module may be unmapped: keep the module list of the epoch that ends.
pub fn before_dlclose() {
    if !active() {
        return;
    }
    thread::untracked(|| {
        let _ = catch_unwind(|| {
            if let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(30)) {
                if let Some(r) = r.as_mut() {
                    r.symbolizer.pin_modules();
                }
            }
        });
    });
}

pub fn after_dlclose() {
    unwind::bump_epoch();
}

// ---- fork --------------------------------------------------------------------------

pub fn fork_prepare() {
    adopt_if_cloned();
    crate::os::loader::fork_hold_loader_walks();
    STATE.lock_raw();
}

pub fn fork_parent() {
    STATE.unlock_raw();
    crate::os::loader::fork_release_loader_walks();
}

pub fn fork_child() {
    crate::os::loader::fork_release_loader_walks();
    // The parent's collector thread does not exist here; ours starts below.
    LIFECYCLE.fork_child(std::process::id());
    crate::os::image::mark_own_image();
    // The forking thread keeps its stack (and the bounds it noted) in the child.
    thread::reset_after_fork();
    thread::untracked(|| {
        let _ = catch_unwind(AssertUnwindSafe(fork_child_inner));
    });
    // Whatever happened above, the child must never inherit a held lock.
    STATE.unlock_raw();
    if active() {
        let follow = REPORT.lock().as_ref().map(|r| r.config.follow_fork).unwrap_or(false);
        if follow {
            // A parent that was preparing its own list forked: not this process's.
            PREPARING.store(false, Ordering::SeqCst);
            PREPARE_INHERITED.store(SCAN_AT_EXIT.load(Ordering::Relaxed), Ordering::Release);
            // A child of a process whose collector still waits waits too.
            if !LIFECYCLE.collector_deferred() {
                spawn_collector();
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
    if let Some(mut g) = STATE.parked_by_me() {
        if let Some(c) = g.as_mut() {
            // The parent's events in causal order as far as they go, then the rest:
            // tickets taken by threads that do not exist here will never arrive.
            drain_into(c, usize::MAX, false);
            c.order.after_fork_child();
            drain_into(c, usize::MAX, true);
            c.model.fork_boundary();
        }
        g.keep_parked();
    }
    // If a thread that does not exist here held the report side, its contents may be
    // half-updated: take the lock over and start the symbolizer afresh, never running
    // destructors on what it was mutating.
    let was_free = REPORT.try_lock().map(drop).is_some();
    if !was_free {
        REPORT.unlock_raw();
    }
    let mut r = REPORT.lock();
    if let Some(old) = r.take() {
        let process = ProcessInfo::current(Some(old.process.pid));
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
