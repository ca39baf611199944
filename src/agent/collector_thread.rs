//! The collector thread: drains the rings into the collector's model, writes the
//! periodic reports and timeline points, and the final report when a termination signal
//! asks for it. Also steps aside for calls that need a single-threaded process.
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::hotpath::{channel, stacks, thread};
use crate::lifecycle::LIFECYCLE;
use crate::os::fds::stderr_line;
use crate::report::build::Reason;
use crate::report::process;

use super::consumer::{drain_lagged_into, wait_while, PREPARE_AFTER, PREPARE_INHERITED, PREPARING, STATE};
use super::reports::{finish_as, record_point, write_report, REPORT};

static SNAPSHOT_REQUESTED: AtomicBool = AtomicBool::new(false);

/// The program is about to start a thread: a raw clone's child not yet taken over is
/// now (`fork::adopt_if_cloned`), while it has one thread; its collector then waits for
/// that thread (`program_started_thread`).
pub fn program_starts_thread() {
    super::fork::adopt_if_cloned();
}

/// The program started a thread: a deferred collector (`CollectorStart::Lazy`,
/// `OnDemand`) starts now.
pub fn program_started_thread() {
    if LIFECYCLE.take_deferred_collector() {
        spawn_collector();
    }
}

/// A collector waiting on demand starts with the process's 4,096th allocation...
pub const ON_DEMAND_ALLOCATIONS: u32 = 4096;
/// ...or its first allocation once it has run this long: a program that lives on gets
/// its periodic reports and timeline points (the first is due 250 ms in) as before.
pub const ON_DEMAND_AFTER_NS: u64 = 50_000_000;
static ON_DEMAND_SINCE_NS: AtomicU64 = AtomicU64::new(0);
static ON_DEMAND_ALLOCS: AtomicU32 = AtomicU32::new(0);
/// For the tests of a signal's start only (`LEAKTRACE_TEST_ON_DEMAND_SIGNAL_ONLY=1`):
/// no allocation starts the collector.
static SIGNAL_ONLY: AtomicBool = AtomicBool::new(false);
/// `ON_DEMAND_AFTER_NS`, or for the tests that must see a process wait on a busy
/// machine, where a program may be held off the processor past 50 ms anywhere,
/// `LEAKTRACE_TEST_ON_DEMAND_AFTER_MS`.
static AFTER_NS: AtomicU64 = AtomicU64::new(ON_DEMAND_AFTER_NS);

/// Set once the process's collector starts on demand (`CollectorStart::OnDemand`): a
/// forked child's does too.
static ON_DEMAND_MODE: AtomicBool = AtomicBool::new(false);

pub(super) fn starts_on_demand() -> bool {
    ON_DEMAND_MODE.load(Ordering::Relaxed)
}

/// The collector waits until the process needs it (`CollectorStart::OnDemand`). From the
/// constructor (the environment is read before the program's threads exist), or in a
/// forked child, whose wait starts anew: a child that `exec`s soon (a shell's, `make`'s)
/// never starts one.
pub(super) fn defer_on_demand() {
    ON_DEMAND_SINCE_NS.store(coarse_now_ns(), Ordering::Relaxed);
    ON_DEMAND_ALLOCS.store(0, Ordering::Relaxed);
    if !ON_DEMAND_MODE.swap(true, Ordering::Relaxed) {
        SIGNAL_ONLY.store(std::env::var_os("LEAKTRACE_TEST_ON_DEMAND_SIGNAL_ONLY").is_some_and(|v| v == "1"), Ordering::Relaxed);
        if let Some(ms) = std::env::var("LEAKTRACE_TEST_ON_DEMAND_AFTER_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
            AFTER_NS.store(ms.saturating_mul(1_000_000), Ordering::Relaxed);
        }
    }
    crate::os::loader::note_dynamic_loader_text();
    LIFECYCLE.defer_collector_on_demand();
}

/// The coarse clock (the kernel's tick, read from the vDSO in a few nanoseconds): 50 ms
/// needs no finer one.
fn coarse_now_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC_COARSE exists since Linux 2.6.32.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Whether the allocation counted now (the `n`th while waiting, `elapsed_ns` after the
/// wait began, `after_ns` the wait's limit) starts the collector.
fn on_demand_due(n: u32, elapsed_ns: u64, after_ns: u64) -> bool {
    n >= ON_DEMAND_ALLOCATIONS || elapsed_ns >= after_ns
}

/// An allocation recorded while the collector waits on demand (its stack `stack`): it
/// starts the collector once due — here, on the allocating thread, after the real
/// allocator returned (no lock of malloc's is held), but never for an allocation the
/// dynamic loader itself made: it may be halfway through its TLS bookkeeping, which
/// `pthread_create` reads (a later allocation starts it instead).
#[cold]
#[inline(never)]
pub fn on_demand_alloc(stack: u32) {
    let n = ON_DEMAND_ALLOCS.fetch_add(1, Ordering::Relaxed).saturating_add(1);
    let elapsed = coarse_now_ns().saturating_sub(ON_DEMAND_SINCE_NS.load(Ordering::Relaxed));
    if SIGNAL_ONLY.load(Ordering::Relaxed) || !on_demand_due(n, elapsed, AFTER_NS.load(Ordering::Relaxed)) {
        return;
    }
    if stacks::innermost(stack).is_some_and(|ip| crate::os::loader::in_dynamic_loader(ip as usize)) {
        return;
    }
    // A child of a raw clone that inherited the wait (its parent's collector had not
    // started) is taken over first, and then waits for a thread of its own: it may end
    // by returning from its clone function, which our collector thread would outlive,
    // leaving a zombie its parent waits for forever (firejail's sandbox on a busy
    // machine, whose first allocation came past the wait's 50 ms).
    super::fork::adopt_if_cloned();
    if LIFECYCLE.take_on_demand_collector() {
        spawn_collector();
    }
}

/// From a termination or snapshot signal's handler: a collector waiting on demand
/// starts now, to write the report the signal asks for (a single-threaded program has
/// no other thread that could). Async-signal-safe as far as the process has one thread
/// (which it has while its collector waits on demand: its own second thread starts the
/// collector): `pthread_create` takes no lock then that the interrupted code may hold,
/// and its one allocation is served by the caller from the library's static arena
/// (`interpose::real::with_calloc_from_arena`), not by malloc. Returns whether one
/// started.
pub fn start_on_demand_from_signal() -> bool {
    // Not in a raw clone's child not yet taken over (which a handler cannot do): see
    // `on_demand_alloc`.
    !crate::os::image::is_unadopted_child() && LIFECYCLE.take_on_demand_collector() && spawn_collector_quietly().is_ok()
}

pub(super) fn spawn_collector() {
    if let Err(rc) = spawn_collector_quietly() {
        stderr_line(&format!("leaktrace: cannot start the collector thread (error {rc}); events are drained by the program's threads instead"));
    }
}

/// `spawn_collector` without the line on failure (a signal handler's: formatting it
/// would allocate).
fn spawn_collector_quietly() -> Result<(), i32> {
    LIFECYCLE.collector_spawning();
    // Untracked: pthread_create allocates the new thread's TLS vector on the calling
    // thread (a forked child's starts here, in the fork handler), and that block is ours.
    let r = thread::untracked(|| thread::spawn_internal(collector_thread));
    if r.is_err() {
        LIFECYCLE.collector_gone();
    }
    r
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
    if failed && LIFECYCLE.tracking() {
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
    let final_less = known || found.is_some();
    if final_less && interval > 0 {
        interval = interval.min(FINAL_LESS_INTERVAL_MS);
    }
    // By default a report's cost bounds how often they come (`REPORT_COST_SHARE`); a
    // set period is kept as it is, and so is the period of a process whose last
    // periodic report is all that will be left of it.
    let bound_by_cost = !interval_set && !final_less;
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
    let mut sleep_us = SLEEP_MIN_US;
    // How the last sleep ended (None: the last turn did not sleep).
    let mut parked = None;
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
            g.as_mut()
                .map(|c| {
                    let drained = drain_lagged_into(c, TURN_MAX);
                    // The interpreter's teardown and the libraries' destructors after it
                    // free most of the blocks, while the process's peak is still ahead
                    // (the destructors page their code in): the live table follows.
                    if super::reports::INTERPRETER_FINALIZING.load(Ordering::Relaxed) {
                        c.model.compact_going();
                    }
                    drained
                })
                .unwrap_or(0)
        };
        sleep_us = next_sleep_us(sleep_us, parked, drained);
        stacks::promote_tables_if_large();
        let turn = EACH_TURN.load(Ordering::Relaxed);
        if turn != 0 {
            // SAFETY: set by `each_turn` from a `fn()`.
            unsafe { std::mem::transmute::<usize, fn()>(turn)() };
        }
        // Between points too, when the unwinder read much of the tables: a program's
        // teardown (destructors, finalizers) reads them anew in a fraction of a second.
        if crate::hotpath::unwind::cfi_reads().wrapping_sub(UNWIND_TABLES_RELEASED_AT.load(Ordering::Relaxed)) >= RELEASE_AFTER_READS {
            release_unwind_tables();
        }
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
            let began = Instant::now();
            write_report(Reason::Periodic);
            let spent = began.elapsed();
            // With the period set, points come with reports only: the callback that finds
            // the holders before the teardown is asked for here too.
            super::python_exit::arm();
            super::reports::held_while_growing();
            release_unwind_tables();
            let now = Instant::now();
            (report_due, point_due) = (next_due(now).map(|due| cost_bounded(due, now, spent, bound_by_cost)), next_point(now));
        } else if point_due.is_some_and(|due| Instant::now() >= due) {
            record_point();
            super::python_exit::arm();
            super::reports::held_while_growing();
            release_unwind_tables();
            point_due = next_point(Instant::now());
        }
        // A turn that took less than it may took everything it could: what is left
        // waits for its thread (the last events of its ring) or for another ring's
        // turn in the ticket order. A producer whose ring fills wakes the sleep.
        parked = (drained < TURN_MAX).then(|| channel::park_consumer(Duration::from_micros(sleep_us)));
    }
}

/// The consumer's sleep between turns, in microseconds: at least this long...
const SLEEP_MIN_US: u64 = 200;
/// ...and at most this long (a producer whose ring fills half wakes it sooner).
const SLEEP_MAX_US: u64 = 2000;
/// The events a turn should find: the sleep follows the rate at which they come.
const TURN_TARGET: u64 = 2048;

/// The next sleep, after a turn that took `drained` events, the last sleep (`slept_us`)
/// having ended as `parked`. After a whole sleep: long enough for about `TURN_TARGET`
/// events at the rate they came, within `SLEEP_MIN_US..=SLEEP_MAX_US` (twice as long,
/// up to the most, after a turn that found none). A producer had to wake it: the
/// shortest, as the rings fill faster than it sleeps (a futex wake is a system call in
/// the program's thread). No sleep (events were waiting, or the last turn took all it
/// may): unchanged, as that turn says nothing of the rate.
///
/// A turn costs its wake-up (the thread scheduled again, its caches refilled) whatever
/// it finds: a PyTorch training step (~1.5 M events a second) woke the collector ~2,700
/// times a second at a fixed 200 µs, for ~300 events a turn.
fn next_sleep_us(slept_us: u64, parked: Option<channel::Parked>, drained: usize) -> u64 {
    match parked {
        Some(channel::Parked::TimedOut) if drained == 0 => (slept_us * 2).min(SLEEP_MAX_US),
        Some(channel::Parked::TimedOut) => (slept_us.saturating_mul(TURN_TARGET) / drained as u64).clamp(SLEEP_MIN_US, SLEEP_MAX_US),
        Some(channel::Parked::Woken) => SLEEP_MIN_US,
        Some(channel::Parked::Ready) | None => slept_us,
    }
}

/// With the default cadence, the wait after a periodic report is at least this many
/// times what the report took (its snapshot, sort, names and write): the reports then
/// take at most ~3% of a core. Timeline points keep their own cadence (growth is
/// judged from points, not reports). Each report of the PyTorch job's main process
/// took 100-150 ms: 7 reports in 9 s became ~3.
const REPORT_COST_SHARE: u32 = 30;

/// When the next periodic report is due: at `due`, or, `bounded`, no sooner than
/// `REPORT_COST_SHARE` times the last report's cost (`spent`) after `now`.
fn cost_bounded(due: Instant, now: Instant, spent: Duration, bounded: bool) -> Instant {
    if bounded {
        due.max(now + spent * REPORT_COST_SHARE)
    } else {
        due
    }
}

/// The most events one turn of the collector thread applies.
const TURN_MAX: usize = 1 << 16;

/// A function the collector calls on each turn (0: none).
static EACH_TURN: AtomicUsize = AtomicUsize::new(0);

/// Has the collector call `f` on each of its turns (a library loaded late routes the
/// modules loaded since the last turn).
pub fn each_turn(f: fn()) {
    EACH_TURN.store(f as usize, Ordering::Relaxed);
}

/// The collector calls nothing more on its turns.
pub fn no_turn() {
    EACH_TURN.store(0, Ordering::Relaxed);
}

/// Reads of the unwind tables after which the collector gives their pages back without
/// waiting for the next timeline point.
const RELEASE_AFTER_READS: u64 = 4096;

/// The unwinder's reads of the modules' unwind tables when their pages were last given
/// back.
static UNWIND_TABLES_RELEASED_AT: AtomicU64 = AtomicU64::new(0);

/// Gives back the pages of the program's unwind tables (`os::unwind_tables`) if the
/// unwinder read them since the last time (~45 MB of RSS after `import torch`, file pages
/// the program itself does not touch), and those of the spilled stack frames that
/// lookups mapped again. After timeline points and reports, and before the final report.
pub(super) fn release_unwind_tables() {
    let reads = crate::hotpath::unwind::cfi_reads();
    if UNWIND_TABLES_RELEASED_AT.swap(reads, Ordering::Relaxed) != reads {
        crate::os::unwind_tables::release_all();
    }
    stacks::release_spilled();
}

/// The longest periodic interval of a process that gets no final report.
const FINAL_LESS_INTERVAL_MS: u64 = 1000;

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
        list.sort();
        if let Some(c) = STATE.lock().as_mut() {
            c.model.install_inherited(list, generation);
        }
    }
}

/// Makes the process single-threaded again for a moment (`unshare(CLONE_NEWUSER)` and
/// friends refuse multi-threaded callers): the collector thread leaves and is waited
/// for. Returns whether it has to be started again with `resume_collector`.
pub fn pause_collector() -> bool {
    // A raw clone's child not yet taken over has no collector, though the parent's
    // state says one lives: it would wait 2 s for none to leave, then start one that
    // would outlive its clone function (see `on_demand_alloc`).
    super::fork::adopt_if_cloned();
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
    if LIFECYCLE.tracking() {
        spawn_collector();
    }
}

/// Called from the snapshot signal handler: only sets a flag.
pub fn request_snapshot() {
    SNAPSHOT_REQUESTED.store(true, Ordering::Release);
}

#[cfg(test)]
mod on_demand_tests {
    use super::*;

    #[test]
    fn the_collector_is_due_at_the_4096th_allocation_or_after_50_ms() {
        let after = ON_DEMAND_AFTER_NS;
        assert!(!on_demand_due(1, 0, after));
        assert!(!on_demand_due(ON_DEMAND_ALLOCATIONS - 1, after - 1, after));
        assert!(on_demand_due(ON_DEMAND_ALLOCATIONS, 0, after));
        assert!(on_demand_due(1, after, after));
        let a = coarse_now_ns();
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert!(coarse_now_ns() >= a + 20_000_000, "the coarse clock moves");
    }
}

#[cfg(test)]
mod sleep_tests {
    use super::*;

    #[test]
    fn the_collector_sleeps_longer_the_fewer_events_a_turn_finds() {
        use channel::Parked::*;
        // A training step's rate (~1.5 M events a second, ~300 a turn of 200 µs): the
        // sleep grows to find about `TURN_TARGET` a turn, and stays there.
        let rate_per_us = 1.5;
        let mut sleep = SLEEP_MIN_US;
        for _ in 0..8 {
            sleep = next_sleep_us(sleep, Some(TimedOut), (sleep as f64 * rate_per_us) as usize);
        }
        assert!((1300..=1400).contains(&sleep), "{sleep} µs");
        // Flat out (~30 M a second): the shortest sleep.
        assert_eq!(next_sleep_us(SLEEP_MIN_US, Some(TimedOut), 6000), SLEEP_MIN_US);
        assert_eq!(next_sleep_us(SLEEP_MAX_US, Some(TimedOut), TURN_MAX - 1), SLEEP_MIN_US);
        // A trickle: the longest; nothing at all: doubling up to it.
        assert_eq!(next_sleep_us(SLEEP_MAX_US, Some(TimedOut), 3), SLEEP_MAX_US);
        assert_eq!(next_sleep_us(SLEEP_MIN_US, Some(TimedOut), 0), 2 * SLEEP_MIN_US);
        assert_eq!(next_sleep_us(SLEEP_MAX_US, Some(TimedOut), 0), SLEEP_MAX_US);
        // A producer had to wake it: the shortest at once.
        assert_eq!(next_sleep_us(SLEEP_MAX_US, Some(Woken), 6000), SLEEP_MIN_US);
        // A turn right after another (events were waiting, or the turn before took
        // all it may) says nothing of the rate: a few events then change nothing.
        assert_eq!(next_sleep_us(SLEEP_MIN_US, Some(Ready), 10), SLEEP_MIN_US);
        assert_eq!(next_sleep_us(1000, None, 10), 1000);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    #[test]
    fn a_costly_report_puts_the_next_one_off_unless_the_period_was_set() {
        let now = Instant::now();
        let due = now + Duration::from_secs(1);
        // 10 ms a report: the period stands (30 x 10 ms is 0.3 s).
        assert_eq!(super::cost_bounded(due, now, Duration::from_millis(10), true), due);
        // 150 ms: 4.5 s.
        assert_eq!(super::cost_bounded(due, now, Duration::from_millis(150), true), now + Duration::from_millis(4500));
        // A set period, or a process with no final report: as it was.
        assert_eq!(super::cost_bounded(due, now, Duration::from_millis(150), false), due);
    }
}
