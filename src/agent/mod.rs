//! The in-process agent, one module per stage it runs, arrows pointing down:
//! - `record`           — the hooks' entry (`record_*`): capture and publish on the caller's thread;
//! - `fork`             — fork and raw-clone children taking the state over;
//! - `collector_thread` — the background consumer: drains, periodic reports and points;
//! - `checkpoint`       — leak checks the program asks for;
//! - `python_exit`      — the holders of growing memory, found before the interpreter's teardown;
//! - `standby`          — loaded and off until `leaktrace attach` switches it on;
//! - `reports`          — report assembly, the final report;
//! - `verdicts`         — the pointer scan's verdicts by group;
//! - `consumer`         — the collector's model, the drain order, the scan pause.
//!
//! This file holds what the lifecycle hooks (`interpose::lifecycle`) call: `start`,
//! `finish`, and the chroot and dlclose steps.
use std::panic::catch_unwind;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::collector::state::Collector;
use crate::config::Config;
use crate::hotpath::channel::{self, DrainState};
use crate::hotpath::{thread, unwind};
use crate::lifecycle::{FinalTurn, LIFECYCLE};
use crate::os::fds::stderr_line;
use crate::report::build::Reason;
use crate::report::process::{self, ProcessInfo};
use crate::report::symbolize::Symbolizer;
use crate::report::writer;

mod checkpoint;
mod collector_thread;
mod consumer;
mod fork;
mod python_exit;
mod record;
mod reports;
pub mod standby;
mod verdicts;

pub use checkpoint::checkpoint;
pub use collector_thread::{
    each_turn, no_turn, pause_collector, program_started_thread, program_starts_thread, request_snapshot, resume_collector, start_on_demand_from_signal,
};
pub use fork::{fork_child, fork_parent, fork_prepare};
pub use record::*;

use collector_thread::spawn_collector;
use consumer::{lock_bounded, Consumer, SCAN_AT_EXIT, STATE};
use reports::{write_report, ReportSide, REPORT};

/// Initialises everything from the library constructor. Returns false when tracking
/// stays off (disabled by configuration or unsupported platform).
pub fn start(config: Config, host_tracking: String, glibc_heap: bool) -> bool {
    start_tracking(config, host_tracking, glibc_heap, false, None)
}

/// Leaves out of the heap's blocks from before any that lies in one of pymalloc's
/// arenas: an arena is one anonymous mapping, which the heap's walk can read as a chunk
/// of its own when its first words look like one; its objects are read as objects.
fn drop_arenas(chunks: &mut Vec<(u64, u64)>) {
    let mut arenas = Vec::with_capacity(crate::scan::arenas::capacity());
    crate::scan::arenas::live_arenas(&mut arenas);
    if !arenas.is_empty() {
        chunks.retain(|&(a, len)| !arenas.iter().any(|&(s, l)| a < s + l && s < a + len.max(1)));
    }
}

/// `start`, from the library constructor (`before_start` false) or in a running process
/// switched on from standby (`before_start`: the main thread's TLS was recorded at load,
/// and the heap blocks live now are kept as blocks from before, `adopt_before_start`,
/// before the collector's first turn). `on_tracking` runs once the hooks record and
/// before the heap is read (a library loaded late routes the program's calls to them).
fn start_tracking(config: Config, host_tracking: String, glibc_heap: bool, before_start: bool, on_tracking: Option<fn()>) -> bool {
    thread::untracked(|| {
        if config.disabled {
            return false;
        }
        if !unwind::init() {
            stderr_line("leaktrace: this C library has no _dl_find_object (glibc >= 2.35 needed); tracking is off");
            return false;
        }
        let mut process = ProcessInfo::current(None);
        process.switched_on = before_start;
        // `%h`, `%r`, … named by where the process runs (one shared tree, many machines).
        let wanted = config.output_dir.as_ref().map(|d| leaktrace_common::launch::expand_output(&d.to_string_lossy(), &process.launch, process.pid).into());
        let (output_dir, warning) = writer::choose_output_dir(wanted);
        if let Some(w) = warning {
            stderr_line(&w);
        }
        let depth = config.stack_depth;
        reports::GLIBC_HEAP.store(glibc_heap, Ordering::Relaxed);
        crate::report::memory::init();
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
        match crate::hotpath::python::init(config.python_frames) {
            crate::hotpath::python::Found::Off(line) if !line.is_empty() => stderr_line(&line),
            _ => {}
        }
        if config.scan {
            SCAN_AT_EXIT.store(true, Ordering::Relaxed);
            if !before_start {
                crate::scan::roots::record_main_tls();
            }
            crate::scan::roots::install();
        }
        // A recording after a detach starts where the channel's tickets are.
        let order = if LIFECYCLE.phase() == crate::lifecycle::Phase::Finished { channel::reopen() } else { DrainState::default() };
        *STATE.lock() = Some(Consumer { model: Collector::new(), order });
        // A recording switched on in a running process starts its collector at once.
        let start = match config.collector.resolve(&process.argv, config.interval_set && config.interval_ms > 0) {
            crate::config::CollectorStart::OnDemand if before_start || on_tracking.is_some() => crate::config::CollectorStart::Thread,
            start => start,
        };
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
        if let Some(f) = on_tracking {
            f();
        }
        if before_start {
            // Read after tracking began: a block allocated meanwhile is both, and stays
            // the tracked one; none is neither.
            let mut chunks = if glibc_heap { crate::scan::glibc_heap::in_use_chunks() } else { Vec::new() };
            // Loaded late: the interpreter's arenas mapped before are found in its heap.
            let arena_size = crate::scan::arenas::arena_size();
            if on_tracking.is_some() && crate::scan::arenas::open_now() && arena_size > 0 {
                for (addr, size) in crate::scan::pymalloc::existing_arenas(&chunks, arena_size) {
                    crate::scan::arenas::note_if_new(addr, size);
                }
            }
            drop_arenas(&mut chunks);
            if let Some(c) = STATE.lock().as_mut() {
                c.model.adopt_before_start(&chunks);
            }
        }
        if cgo {
            write_report(Reason::Periodic);
        }
        match start {
            crate::config::CollectorStart::Lazy => LIFECYCLE.defer_collector(),
            crate::config::CollectorStart::OnDemand => {
                LIFECYCLE.collector_may_run();
                collector_thread::defer_on_demand();
            }
            _ => {
                // Asked to leave at the last detach, if there was one.
                LIFECYCLE.collector_may_run();
                spawn_collector();
            }
        }
        true
    })
}

/// Called from a termination signal handler (async-signal-safe). Returns false when the
/// caller must die at once: tracking is off, no collector runs, or this is the second
/// signal.
pub fn request_final_on_signal(sig: i32) -> bool {
    let asked = LIFECYCLE.final_on_signal(sig);
    if asked {
        // The collector may be asleep (up to 2 ms between idle turns): a futex wake,
        // which leaves errno as the interrupted code had it.
        let _errno = crate::os::ErrnoGuard::save();
        channel::wake_consumer();
    }
    asked
}

/// The final report at an exit (`exit`, `_exit`, the library's destructor). A process
/// that a termination signal asked to end before (its handler returned: an interrupted
/// `sleep` or `read` then let the program run on to its exit) ends by that signal once
/// the report is written, as it would have without us: not with the status its exit
/// gives (a test runner that stops a hung test with SIGTERM saw it exit 0).
pub fn finish() {
    fork::adopt_if_cloned();
    reports::final_report();
    if let Some(sig) = LIFECYCLE.ends_by_signal(std::process::id()) {
        crate::os::signals::die_by_signal(sig);
    }
}

/// Ends a recording that `leaktrace attach` switched on while the process runs on (on
/// a thread of ours): its last report, as at an exit (everything drained, the heap
/// scanned, `reason: "detach"`); then the hooks pass through, `undo` runs (a library
/// loaded late routes the program's calls back to the C library), the collector thread
/// leaves and its tables are given back. The report directory, or why not.
pub fn detach(undo: Option<fn()>) -> Result<String, String> {
    match LIFECYCLE.begin_final(std::process::id()) {
        FinalTurn::Mine => {}
        FinalTurn::InProgress => return Err("the process is ending: its final report is being written".into()),
        FinalTurn::NotOurs => return Err("not recording".into()),
    }
    thread::untracked(|| {
        if catch_unwind(|| write_report(Reason::Detach)).is_err() {
            stderr_line("leaktrace: internal error while writing the last report");
        }
        channel::close();
        LIFECYCLE.final_written();
        if let Some(f) = undo {
            f();
        }
        pause_collector();
        // The model's tables (the live blocks, the groups, the timeline) go back to the
        // system; a straggler still inside a hook finds no model and drains nothing.
        *STATE.lock() = None;
        collector_thread::release_unwind_tables();
        channel::release_slots();
        crate::os::procfs::close();
    });
    let dir = lock_bounded(&REPORT, Duration::from_secs(5)).and_then(|r| r.as_ref().map(|r| r.output_dir.display().to_string()));
    Ok(dir.unwrap_or_default())
}

// ---- chroot and dlclose -------------------------------------------------------------

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
pub fn before_dlclose() -> Option<u64> {
    if !active() {
        return None;
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
    crate::os::loader::unloads()
}

/// After a `dlclose`, given the loader's count of unloaded modules before it
/// (`before_dlclose`): a new epoch of stacks and unwind rules where a module went, for
/// its addresses may now hold other code. A `dlclose` that unloaded nothing — the
/// library still referenced (opened twice, a dependency of another, `RTLD_NODELETE`),
/// a probe of one already loaded — changed no code anywhere: the epoch stays, and the
/// stacks, rules and paths filed so far still hold. Each new epoch files every stack met
/// again anew: 500 rounds of `dlopen` and `dlclose` of a library kept open elsewhere
/// filed 1,009 stacks, now 11. Where the loader does not say, or another thread's
/// `dlclose` unloaded something meanwhile, a new epoch all the same.
pub fn after_dlclose(unloads_before: Option<u64>) {
    if unloads_before.is_none() || crate::os::loader::unloads() != unloads_before {
        unwind::bump_epoch();
    }
}
