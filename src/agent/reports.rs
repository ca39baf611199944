//! Report assembly: a snapshot of the collector's model, the reachability scan when
//! one is due, symbolization, the JSON report written atomically, the exit summary; the
//! timeline points between reports; the final report exactly once.
// Fx maps (`util::FxMap`: no `getrandom` at a process's exit report).
use crate::util::FxMap as HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::config::Config;
use crate::hotpath::{channel, stacks, thread};
use crate::lifecycle::{FinalTurn, LIFECYCLE};
use crate::os::fds::stderr_line;
use crate::os::lock::SpinLock;
use crate::report::build::{self, Reason, RunFacts};
use crate::report::checks;
use crate::report::held::Start;
use crate::report::process::{self, ProcessInfo};
use crate::report::symbolize::Symbolizer;
use crate::report::timeline::Timeline;
use crate::report::writer;

use super::consumer::{drain_everything, drain_into, lock_bounded, wait_while, ScanPause, PREPARE_WAIT, PREPARING, SCAN_AT_EXIT, STATE};
use super::verdicts::reachability_scan;

/// A holder as reports show it: its path, named, and the second holder of the blocks
/// looked at, when they differ (`Group::also_held_by`).
pub(super) type Named = (Vec<leaktrace_common::report_schema::HeldLink>, Option<leaktrace_common::report_schema::OtherHolder>);

/// Everything the report writer needs; one lock so that reports are written one at a time.
pub(super) struct ReportSide {
    pub(super) config: Config,
    pub(super) process: ProcessInfo,
    pub(super) output_dir: PathBuf,
    pub(super) symbolizer: Symbolizer,
    pub(super) final_written: bool,
    pub(super) write_failed_once: bool,
    pub(super) host_tracking: String,
    pub(super) timeline: Timeline,
    pub(super) suppressions: leaktrace_common::Suppressions,
    /// The signal ending the process, for the final report.
    pub(super) exit_signal: Option<i32>,
    /// Why this process can never be given a final report, once the collector found out.
    pub(super) no_final_report: Option<&'static str>,
    /// The holders found before the interpreter's teardown (`held_before_exit`), by
    /// stack and api: shown where the final scan finds the memory freed.
    pub(super) held_before_exit: crate::util::FxMap<(u32, &'static str), Named>,
    /// The same for the growing lines of the user's Python code.
    pub(super) held_lines_before_exit: crate::util::FxMap<crate::report::python::UserLine, Named>,
    /// Growing lines whose holders were looked for while they grew (`held_while_growing`),
    /// with how many searches looked.
    pub(super) looked_for: crate::util::FxMap<crate::report::python::UserLine, u8>,
    /// The lines of `held_lines_before_exit` whose holder reached its end (`held::reaches_a_holder`).
    pub(super) line_holder_reached: crate::util::FxSet<crate::report::python::UserLine>,
    /// The checks the program asked for (`checkpoint`), and how many more were not kept.
    pub(super) checks: Vec<checks::Check>,
    pub(super) checks_dropped: u64,
}

impl ReportSide {
    pub(super) fn new(
        config: Config,
        process: ProcessInfo,
        output_dir: PathBuf,
        symbolizer: Symbolizer,
        host_tracking: String,
        suppressions: leaktrace_common::Suppressions,
    ) -> ReportSide {
        REPORT_GROUPS.store(config.report_groups, Ordering::Relaxed);
        if let Some(t) = &config.why_reachable {
            let _ = WHY_REACHABLE.set(t.clone());
        }
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
            held_before_exit: Default::default(),
            held_lines_before_exit: Default::default(),
            looked_for: Default::default(),
            line_holder_reached: Default::default(),
            checks: Vec::new(),
            checks_dropped: 0,
        }
    }
}

/// How many groups of each class a report lists (`Config::report_groups`, fixed at
/// start), readable without the report side's lock.
static REPORT_GROUPS: AtomicUsize = AtomicUsize::new(0);
/// `LEAKTRACE_WHY_REACHABLE`, read by the collector before a scan without the report
/// side's lock.
static WHY_REACHABLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Set when the Python interpreter's exit began (`python_exit`, an atexit callback that
/// took the last memory point before its teardown).
pub(super) static INTERPRETER_FINALIZING: AtomicBool = AtomicBool::new(false);

/// Whether the program's malloc is glibc's (its `mallinfo2` then describes the heap).
pub(super) static GLIBC_HEAP: AtomicBool = AtomicBool::new(false);
/// Whether this process is a forked child of a traced one.
pub(super) static FORKED: AtomicBool = AtomicBool::new(false);

/// The process's memory now (`report::memory`), with the live tracked bytes of
/// `totals`. Never while the scan holds the threads.
fn measure_memory(totals: &crate::collector::state::Totals) -> leaktrace_common::memory::Memory {
    // During or after the Python interpreter's teardown, not a state of the program's
    // run (the atexit callback's point, when it ran, is the last before it).
    let after_teardown = INTERPRETER_FINALIZING.load(Ordering::Acquire) || super::python_exit::teardown_began();
    leaktrace_common::memory::Memory {
        after_teardown,
        ..crate::report::memory::measure(crate::report::memory::Known {
            heap_live: totals.kind(crate::hotpath::event::Kind::Host).live_bytes,
            glibc_malloc: GLIBC_HEAP.load(Ordering::Relaxed),
            forked_child: FORKED.load(Ordering::Relaxed),
        })
    }
}

pub(super) static REPORT: SpinLock<Option<ReportSide>> = SpinLock::new(None);
/// The groups of the last report's snapshot, kept for the next one (see
/// `Collector::snapshot_unsorted_into`); empty while a report holds them.
static SNAPSHOT_BUFFER: SpinLock<Vec<crate::collector::state::GroupSnapshot>> = SpinLock::new(Vec::new());
/// The largest snapshot buffer kept from one report to the next.
const KEEP_SNAPSHOT_BYTES: usize = 4 << 20;
/// The same for the changed groups of a timeline point (`record_point`).
static CHANGES_BUFFER: SpinLock<Vec<crate::collector::state::Change>> = SpinLock::new(Vec::new());
/// The most room kept in `CHANGES_BUFFER` between timeline points: a training loop's
/// point has a few thousand changes; one during `import torch` had 262k (6 MB, which
/// stayed resident to the process's peak at exit when the buffer kept its room).
const KEEP_CHANGES_BYTES: usize = 256 << 10;

/// timeline's sums. In a training loop that is a few thousand groups, not the 600k that
/// a report copies after `import torch`.
pub(super) fn record_point() {
    crate::os::procfs::one_seccomp_check(record_point_steps);
}

/// `record_point`'s steps.
fn record_point_steps() {
    let (totals, changes) = {
        let Some(mut state) = lock_bounded(&STATE, Duration::from_secs(5)) else { return };
        let Some(c) = state.as_mut() else { return };
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
        c.model.compact();
        let mut changes = CHANGES_BUFFER.try_lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default();
        c.model.take_changes(&mut changes);
        (c.model.totals(), changes)
    };
    let memory = measure_memory(&totals);
    // The timeline must see these changes, or its sums drift until the next report
    // starts them afresh: wait as long as a report would.
    if let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) {
        if let Some(r) = report.as_mut().filter(|r| !r.final_written) {
            r.timeline.record_changes(process::unix_ms(), &totals, &changes);
            r.timeline.note_memory(memory);
        }
    }
    if let Some(mut b) = CHANGES_BUFFER.try_lock() {
        let mut kept = changes;
        kept.clear();
        kept.shrink_to(KEEP_CHANGES_BYTES / std::mem::size_of::<crate::collector::state::Change>());
        *b = kept;
    }
}

pub(super) fn write_report(reason: Reason) {
    crate::os::procfs::one_seccomp_check(|| write_report_steps(reason));
}

/// `write_report`'s steps.
fn write_report_steps(reason: Reason) {
    let final_report = reason == Reason::Exit || reason == Reason::Detach;
    if final_report {
        // Before taking the collector: the preparation needs it to install its list.
        wait_while(|| PREPARING.load(Ordering::SeqCst), PREPARE_WAIT, Duration::from_micros(200));
        // What the teardown's stacks read of the unwind tables: the report measures RSS.
        super::collector_thread::release_unwind_tables();
    }
    // The scan runs for the final report and for snapshots asked with the signal.
    let scan_now = (final_report || reason == Reason::Signal) && SCAN_AT_EXIT.load(Ordering::Relaxed);
    // What held-by needs of the report side (the followed stacks, named to tell an
    // import's growth apart), taken before the collector is: no symbolizing under it.
    let (limit, followed, growing) = if scan_now { report_limits() } else { (0, Vec::new(), Vec::new()) };
    if scan_now {
        // Before the live set is taken and the consumers are held off. The process ends:
        // a running search stops at its next round rather than hold its exit (not at a
        // detach: a later attach records again, searches included).
        wait_for_holder_search(reason == Reason::Exit);
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
        if reason == Reason::Exit {
            // Every event this report counts is in; the process ends (a detached one
            // may record again, and keeps them).
            stacks::release_index();
        }
    } else {
        // The program keeps allocating: take what is there now, never chase it (and
        // never force the order while producers are live).
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
    }
    c.model.compact();
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
    // The groups whose holders the scan names: the report's largest and the stacks the
    // timeline follows; through Python objects only for those that grew.
    let (wanted, through_python) = if scan_now { held_wanted(&snapshot, limit, &followed, &growing) } else { Default::default() };
    let live = scan_now.then(|| if final_report { c.model.take_live_blocks() } else { c.model.live_blocks() });
    // The names are found after the scan, on this thread: a thread naming them beside
    // the scan (it was, for scans of 20,000 live blocks or more) shortened the PyTorch
    // job's exit by ~70 ms but held ~12 MB more at the report's peak, from the
    // library's own heap, where this thread's naming at exit reuses what the program
    // freed in malloc (docs/benchmarks.md, twenty-first round).
    // The frees published from now until the stop (the program runs on; at exit, its
    // other threads do, and their frees are still published) are read from the rings.
    let pause = scan_now.then(ScanPause::start);
    drop(state);
    // Before the scan: it holds the program's threads, one of which may hold a lock
    // of malloc's that `mallinfo2` takes.
    let mut memory = measure_memory(&snapshot.totals);
    if !final_report && memory.heap_free.is_some() {
        // What of malloc's free memory a trim would give back, and how many arenas hold
        // it (the remedies of a finding are ranked by it).
        if let Some((trimmable, arenas)) = crate::report::memory::free_chunks() {
            memory.heap_trimmable = Some(trimmable.min(memory.heap_free.unwrap_or(0)));
            memory.heap_arenas = Some(arenas);
        }
    }
    // The scan stops the other threads: it runs holding none of our locks.
    let why = WHY_REACHABLE.get().cloned();
    let scan = live.as_ref().map(|live| reachability_scan(live, &wanted, &through_python, why.is_some(), &mut crate::report::held::Budget::unbounded()));
    // Past the scan the live blocks (one `LiveEntry` each, 21 MB of `import torch`'s at
    // an `os._exit`) serve `LEAKTRACE_WHY_REACHABLE` alone: the names and the write that
    // come next would pay for them on the process's peak.
    let live = live.filter(|_| why.is_some());
    if final_report {
        LIFECYCLE.final_threads_held();
    }
    drop(pause);
    let report_groups = REPORT_GROUPS.load(Ordering::Relaxed);
    if !final_report {
        if scan_now {
            // `select_groups` re-sorts by what the scan found: ties keep this order.
            snapshot.sort();
        } else {
            // What a periodic report reads of the order: each class's listed groups and
            // the timeline's largest.
            snapshot.sort_top(report_groups.max(crate::report::timeline::JOIN_TOP));
        }
    }
    // Groups the scan cannot classify (registrations, VMM handles and ranges) keep no
    // breakdown: they count as outstanding.
    let reach = scan.as_ref().map(|s| {
        |g: &crate::collector::state::GroupSnapshot| {
            if g.api().kind() == crate::hotpath::event::Kind::Python {
                // Not scanned (the interpreter frees them): all still reachable.
                let amount = leaktrace_common::report_schema::Amount { bytes: g.live_bytes, blocks: g.live_blocks() };
                return Some(build::Reachability { reachable: amount, ..Default::default() });
            }
            s.by_group.get(g.stack, g.api(), g.device())
        }
    });
    let (selected, omitted) = build::select_groups(&snapshot.groups, reach, report_groups);
    // The listed groups' other figures, from the collector (not under the report side's
    // lock: the collector's is taken first everywhere).
    let details: Vec<_> = match lock_bounded(&STATE, Duration::from_secs(5)) {
        Some(state) => selected.iter().map(|(g, _)| state.as_ref().map(|c| c.model.details(g)).unwrap_or_default()).collect(),
        None => vec![Default::default(); selected.len()],
    };
    let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) else {
        stderr_line("leaktrace: report writer busy for 30 s; report skipped");
        return;
    };
    let Some(r) = report.as_mut() else { return };
    if r.final_written {
        return;
    }
    let now = process::unix_ms();
    r.process.refresh_launch();
    r.timeline.record(now, &snapshot);
    r.timeline.note_memory(memory.clone());
    let mut groups = build::resolve_groups(&selected, &details, &mut r.symbolizer);
    if let Some(s) = &scan {
        for g in groups.iter_mut() {
            if let Some(from) = s.indirect_from.get(&(g.stack_id, g.api.as_ref(), g.device.and_then(|d| u8::try_from(d).ok()))) {
                g.indirect_from = from.iter().map(|(&stack_id, &(bytes, blocks))| build::IndirectFrom { stack_id, bytes, blocks }).collect();
            }
        }
    }
    let mut timeline = build::timeline_out(&r.timeline, &groups, &mut r.symbolizer);
    if let Some(s) = &scan {
        name_holders(s, &r.held_before_exit, &mut groups, &mut timeline, &mut r.symbolizer);
    }
    // Growing lines: their holders, found while the program still held the memory.
    for (out, l) in timeline.lines.iter_mut().zip(&r.timeline.lines) {
        if let Some((links, also)) = r.held_lines_before_exit.get(&l.line) {
            out.held_by = links.clone();
            out.also_held_by = also.clone();
        }
    }
    memory.devices = device_memory(&snapshot.groups, &groups);
    let why_reachable = match (&why, &live, scan.as_ref().and_then(|s| s.kept.as_ref())) {
        (Some(template), Some(live), Some(kept)) => why_reachable_of(template, &live.blocks, &live.inherited, kept, &groups, &mut r.symbolizer),
        _ => Vec::new(),
    };
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
        cuda_untracked_copies: super::record::untracked_copies(),
        releases_dropped: super::record::releases_dropped(),
        holder_searches: SEARCH_COST.now(),
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
            memory: Some(&memory),
            why_reachable: &why_reachable,
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
        let memory_text = memory_summary(r.process.pid, &r.timeline, r.process.forked_from.is_some());
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
            text.push_str(&memory_text);
            crate::os::fds::write_stderr(text.as_bytes());
        } else if r.config.summary != crate::config::Summary::Never && !memory_text.is_empty() {
            // No leak, but the memory says something: that alone.
            let shown = result.as_ref().ok().map(|_| format!("=={}==leaktrace: report {}\n", r.process.pid, path.display())).unwrap_or_default();
            crate::os::fds::write_stderr(format!("{memory_text}{shown}").as_bytes());
        }
    }
    if !final_report {
        r.symbolizer.forget_dwarf();
    }
    // Kept for the next report (plain data: the next one's `clear` costs nothing).
    drop(selected);
    if let Some(mut b) = SNAPSHOT_BUFFER.try_lock() {
        let mut kept = std::mem::take(&mut snapshot.groups);
        // Sized for this report's groups, not for the largest report's; and not kept
        // at all past `KEEP_SNAPSHOT_BYTES`: between reports it would be memory of
        // ours that the program's peak pays for (after `import torch` a report had 535k
        // live groups, 21 MB; the next one's fresh pages cost a few ms of faults).
        let len = kept.len();
        if len * std::mem::size_of::<crate::collector::state::GroupSnapshot>() > KEEP_SNAPSHOT_BYTES {
            kept = Vec::new();
        } else if kept.capacity() > 2 * len + 1024 {
            kept.clear();
            kept.shrink_to(len + len / 4);
        }
        *b = kept;
    }
}

/// How many groups of each class a report lists, the stacks the timeline follows, and
/// those of them that grew (`grew`) other than by an import (start-up, never a loop's
/// growth: `import torch` rises for seconds). None when the report side is busy for a
/// second.
type Keys = Vec<(u32, crate::hotpath::event::Api)>;

fn report_limits() -> (usize, Keys, Keys) {
    let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(1)) else { return (0, Vec::new(), Vec::new()) };
    let Some(r) = r.as_mut() else { return (0, Vec::new(), Vec::new()) };
    let followed: Keys = r.timeline.series.iter().map(|s| (s.stack, s.api)).collect();
    let rising: Keys = r.timeline.series.iter().filter(|s| grew(&s.bytes)).map(|s| (s.stack, s.api)).collect();
    let ids: Vec<u32> = rising.iter().map(|k| k.0).collect();
    let stacks = build::resolve_stacks(&ids, &mut r.symbolizer);
    let growing = rising.into_iter().zip(stacks).filter(|(_, st)| !st.iter().any(leaktrace_common::frame_text::is_import_frame)).map(|(k, _)| k).collect();
    (r.config.report_groups, followed, growing)
}

/// Groups by size whose holders a report names (growing ones come on top): each path
/// that ends at a Python object costs a pass over the interpreter's objects per round.
const HELD_TOP: usize = 25;

/// `LEAKTRACE_WHY_REACHABLE` in a report the scan ran for: the reachable blocks of the
/// listed groups whose stack `template` matches, with their paths.
fn why_reachable_of(
    template: &str,
    live: &[crate::collector::state::LiveEntry],
    inherited: &crate::spans::Spans,
    kept: &super::verdicts::KeptScan,
    groups: &[build::Group],
    sym: &mut crate::report::symbolize::Symbolizer,
) -> Vec<leaktrace_common::report_schema::WhyReachable> {
    let chosen: HashMap<(u32, &str), &build::Group> =
        groups.iter().filter(|g| super::verdicts::stack_matches(template, &g.stack)).map(|g| ((g.stack_id, g.api.as_ref()), g)).collect();
    let stacks: HashMap<u32, Vec<leaktrace_common::report_schema::Frame>> = chosen.values().map(|g| (g.stack_id, g.stack.clone())).collect();
    let blocks: Vec<usize> = (0..live.len())
        .filter(|&i| kept.verdicts[i] == crate::scan::mark::Verdict::Reachable && chosen.contains_key(&(live[i].stack, live[i].api().name())))
        .collect();
    super::verdicts::why_reachable(live, &blocks, (&kept.parent, &kept.via, crate::scan::Labels::new(&kept.labels, inherited)), &stacks, sym)
}

/// The groups a scan finds a holder for: the `limit` largest (those a report lists when
/// nothing leaked), the steadily growing ones and the followed stacks; and those whose
/// path goes on through Python objects (a pass over the interpreter's objects per
/// round: 0.3 s after `import torch` for its 25 largest): the growing ones. Python
/// groups are sampled objects, never scanned.
fn held_wanted(
    snapshot: &crate::collector::state::Snapshot,
    limit: usize,
    followed: &[(u32, crate::hotpath::event::Api)],
    growing: &[(u32, crate::hotpath::event::Api)],
) -> (HeldKeys, HeldKeys) {
    use crate::hotpath::event::Kind;
    let mut by_size: Vec<(u64, u32, crate::hotpath::event::Api)> =
        snapshot.groups.iter().filter(|g| g.api().kind() != Kind::Python).map(|g| (g.live_bytes, g.stack, g.api())).collect();
    let limit = limit.min(HELD_TOP);
    if by_size.len() > limit && limit > 0 {
        by_size.select_nth_unstable_by(limit - 1, |a, b| b.cmp(a));
    }
    let mut wanted: HeldKeys = by_size.iter().take(limit).map(|&(_, stack, api)| (stack, api)).collect();
    let steady: HeldKeys = snapshot.groups.iter().filter(|g| g.steady() && g.api().kind() != Kind::Python).map(|g| (g.stack, g.api())).collect();
    wanted.extend(steady);
    wanted.extend(followed.iter().copied());
    (wanted, growing.iter().copied().collect())
}

type HeldKeys = crate::util::FxSet<(u32, crate::hotpath::event::Api)>;

/// Python's `atexit` (`python_exit`): the holders of the stacks the timeline follows
/// that grew, found while the modules still hold them, kept for the final report.
/// Nothing when no followed stack grew (no second scan at exit for nothing).
pub(super) fn held_before_exit() {
    let started = std::time::Instant::now();
    let mut budget = crate::report::held::Budget::new(EXIT_SEARCH_BYTES, None);
    if holders_at_exit(&mut budget) {
        // At least 1 ns: the step ran.
        SEARCH_COST.exit_ns.fetch_add((started.elapsed().as_nanos() as u64).max(1), Ordering::Relaxed);
    }
    SEARCH_COST.exit_rounds.fetch_add(budget.rounds, Ordering::Relaxed);
    SEARCH_COST.exit_bytes_read.fetch_add(budget.bytes_read, Ordering::Relaxed);
}

/// `held_before_exit`'s step, its searches' rounds taken from `budget`; false when
/// there was nothing to look for.
fn holders_at_exit(budget: &mut crate::report::held::Budget<'_>) -> bool {
    let (_, _, growing) = report_limits();
    let mut wanted: HeldKeys = growing.into_iter().collect();
    let lines = growing_lines();
    if (wanted.is_empty() && lines.is_empty()) || !SCAN_AT_EXIT.load(Ordering::Relaxed) {
        return false;
    }
    let Some((live, samples)) = live_and_samples(!lines.is_empty()) else { return false };
    // The groups under each growing line, heap blocks' and sampled objects': a line's
    // holder is the path of the largest heap group that has one, or, where the samples
    // stand for more, found from one object of each of its largest groups of samples.
    let Some((by_line, samples_by_line)) = line_groups(&live, &samples, &lines) else { return false };
    let by_line: HashMap<crate::report::python::UserLine, Vec<LineGroup>> = by_line
        .into_iter()
        .map(|(line, mut groups)| {
            groups.sort_by_key(|g| (std::cmp::Reverse(g.bytes), g.key.0));
            groups.truncate(GROUPS_PER_LINE);
            (line, groups)
        })
        .collect();
    wanted.extend(by_line.values().flatten().map(|g| g.key));
    // The search running now would hold the exit until its rounds end: it stops at its
    // next one, and its lines that reached no holder are looked for below.
    wait_for_holder_search(true);
    // One budget for both searches below.
    let pause = ScanPause::start();
    // This thread's stack is the program's (the callback runs on its main thread).
    crate::scan::roots::mark_entry();
    let scan = reachability_scan(&live, &wanted, &wanted, false, budget);
    drop(pause);
    let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) else { return true };
    let Some(r) = report.as_mut() else { return true };
    let mut roots = Vec::new();
    for path in scan.held_by.values() {
        crate::report::held::data_roots(path, &mut roots);
    }
    r.symbolizer.prefetch_data_symbols(&roots);
    // The groups whose path reached a holder: one cut short (the budget's rounds spent)
    // replaces no line's holder that reached its end.
    let reached: crate::util::FxSet<(u32, &str)> =
        scan.held_by.iter().filter(|(_, p)| crate::report::held::reaches_a_holder(p)).map(|(&(stack, api, _), _)| (stack, api)).collect();
    for (&(stack, api, _), path) in &scan.held_by {
        let links = crate::report::held::resolve(path, &mut r.symbolizer);
        let also = crate::report::held::resolve_also(path, &mut r.symbolizer);
        r.held_before_exit.insert((stack, api), (links, also));
    }
    r.symbolizer.forget_data_symbols();
    // Per line, the bytes of the largest group that has a holder. A holder found while
    // the line grew stays unless the group named now stands for half the line's peak
    // (`held::exit_holder_replaces`).
    let mut named_bytes: HashMap<crate::report::python::UserLine, u64> = HashMap::default();
    for (line, groups) in by_line {
        let held = groups.iter().find_map(|g| {
            let key = (g.key.0, g.key.1.name());
            Some((r.held_before_exit.get(&key).filter(|l| !l.0.is_empty())?, g.bytes, reached.contains(&key)))
        });
        if let Some((links, n, path_reached)) = held {
            if !path_reached && r.line_holder_reached.contains(&line) {
                continue;
            }
            let series = r.timeline.lines.iter().find(|l| l.line == line).map_or(&[][..], |l| &l.bytes[..]);
            if !r.held_lines_before_exit.contains_key(&line) || crate::report::held::exit_holder_replaces(n, series) {
                r.held_lines_before_exit.insert(line, links.clone());
                if path_reached {
                    r.line_holder_reached.insert(line);
                }
                named_bytes.insert(line, n);
            }
        }
    }
    // A line whose holder was found while it grew, on a path that reached its end,
    // keeps it: searching for it again would cost the exit a search's rounds for the
    // same answer.
    let (pending, starts): (Vec<crate::report::python::UserLine>, Vec<Vec<Start>>) = samples_by_line
        .into_iter()
        .filter(|(line, _)| !r.line_holder_reached.contains(line))
        .filter(|(line, groups)| groups.iter().map(|g| g.bytes).sum::<u64>() > named_bytes.get(line).copied().unwrap_or(0))
        .map(|(line, groups)| (line, line_starts(&live.blocks, None, Some(&groups))))
        .unzip();
    drop(report);
    let found = crate::report::held::python_holders(&live.blocks, &starts, &mut live_keys, None, budget);
    drop(live);
    keep_line_holders(pending, found);
    true
}

/// The live blocks, and the sampled Python objects when `samples` (else none), after a
/// drain of what the rings hold now.
fn live_and_samples(samples: bool) -> Option<(crate::collector::state::ScanInput, Vec<crate::collector::state::LiveEntry>)> {
    let mut state = lock_bounded(&STATE, Duration::from_secs(5))?;
    let c = state.as_mut()?;
    let backlog = c.order.backlog();
    drain_into(c, backlog, false);
    Some((c.model.live_blocks(), if samples { c.model.python_samples() } else { Vec::new() }))
}

/// The stack and entry point of each of `addrs` among the live heap blocks now (none
/// when the collector is busy for a second).
fn live_keys(addrs: &[u64]) -> Vec<Option<(u32, crate::hotpath::event::Api)>> {
    let Some(mut state) = lock_bounded(&STATE, Duration::from_secs(1)) else { return vec![None; addrs.len()] };
    let Some(c) = state.as_mut() else { return vec![None; addrs.len()] };
    let backlog = c.order.backlog();
    drain_into(c, backlog, false);
    addrs.iter().map(|&a| c.model.live_key(a)).collect()
}

type LineGroups = HashMap<crate::report::python::UserLine, Vec<LineGroup>>;

/// Per line of `lines`, the groups of `live`'s heap blocks and of `samples` under it.
fn line_groups(
    live: &crate::collector::state::ScanInput,
    samples: &[crate::collector::state::LiveEntry],
    lines: &[crate::report::python::UserLine],
) -> Option<(LineGroups, LineGroups)> {
    let mut report = lock_bounded(&REPORT, Duration::from_secs(5))?;
    let r = report.as_mut()?;
    let heap = live.blocks.iter().filter(|b| b.api().kind() == crate::hotpath::event::Kind::Host);
    Some((groups_by_line(heap, lines, &mut r.timeline), groups_by_line(samples.iter(), lines, &mut r.timeline)))
}

/// Names the holders found for growing lines (`found[i]` for `lines[i]`, where one was)
/// and keeps them for the reports: in place of the one kept before, unless that one
/// reached a holder and the new one does not (`held::reaches_a_holder`).
fn keep_line_holders(lines: Vec<crate::report::python::UserLine>, found: Vec<Option<crate::report::held::RawPath>>) {
    let Some(mut report) = lock_bounded(&REPORT, Duration::from_secs(30)) else { return };
    let Some(r) = report.as_mut() else { return };
    for (line, path) in lines.into_iter().zip(found) {
        let Some(path) = path else { continue };
        let reached = crate::report::held::reaches_a_holder(&path);
        if !reached && r.line_holder_reached.contains(&line) {
            continue;
        }
        let links = crate::report::held::resolve(&path, &mut r.symbolizer);
        let also = crate::report::held::resolve_also(&path, &mut r.symbolizer);
        r.held_lines_before_exit.insert(line, (links, also));
        if reached {
            r.line_holder_reached.insert(line);
        } else {
            r.line_holder_reached.remove(&line);
        }
    }
}

/// Searches for a growing line's holder at most: a search that reached no holder for
/// it (none found, or a way cut short) is made again at a later point, while the line
/// still grows.
const LINE_SEARCHES: u8 = 3;

/// The lines that grow and have no holder that reached its end yet, looked for fewer
/// than `LINE_SEARCHES` times while growing; each is counted as looked for once more.
fn lines_to_name(never_looked_for: bool) -> Vec<crate::report::python::UserLine> {
    let lines = growing_lines();
    if lines.is_empty() {
        return lines;
    }
    let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(1)) else { return Vec::new() };
    let Some(r) = r.as_mut() else { return Vec::new() };
    let new: Vec<_> = lines
        .into_iter()
        .filter(|l| {
            let tries = r.looked_for.get(l).copied().unwrap_or(0);
            !r.line_holder_reached.contains(l) && tries < LINE_SEARCHES && (tries == 0 || !never_looked_for)
        })
        .collect();
    for l in &new {
        *r.looked_for.entry(*l).or_default() += 1;
    }
    new
}

/// After a timeline point, on the collector's thread: the holders of the lines of the
/// user's code that started to grow, found while the program holds the memory, so that
/// memory it lets go before it exits (a replay buffer cleared when `main` returns)
/// still has its holder in the final report. No scan (which holds the program's
/// threads: over a second with torch loaded): from some of the line's largest heap
/// group's blocks and sampled objects out through what refers to them, read from
/// copies (`held::python_holders`), as the interpreter runs on. Each line until a
/// search reaches its holder, at most `LINE_SEARCHES` times; the atexit callback looks
/// again where the line still grows then.
///
/// The search runs on a thread of its own (~1 s of CPU with torch loaded): the
/// collector goes on draining and taking points meanwhile (on the collector's thread it
/// cost a 5 s loop four of its points). A scan waits for it (`wait_for_holder_search`).
pub(super) fn held_while_growing() {
    // Once the process is ending (`STOP_SEARCHES`), a search would make no round, and its
    // lines' paths (their starts alone) would replace what the exit's search found.
    if !SCAN_AT_EXIT.load(Ordering::Relaxed)
        || !crate::hotpath::python::enabled()
        || STOP_SEARCHES.load(Ordering::SeqCst)
        || super::python_exit::teardown_began()
    {
        return;
    }
    if HOLDER_SEARCH.load(Ordering::SeqCst) {
        // The running search takes them in at its next round (`joining_lines`).
        let lines = lines_to_name(true);
        if !lines.is_empty() {
            if let Some(mut waiting) = lock_bounded(&JOINING, Duration::from_millis(10)) {
                waiting.extend(lines);
            }
        }
        return;
    }
    // Past what the searches may read while the program runs, none starts, and its
    // lines keep their tries for a later point.
    let Some(allowance) = run_search_allowance() else { return };
    let mut lines = lines_to_name(false);
    // Lines that came too late to join the last search.
    if let Some(mut waiting) = lock_bounded(&JOINING, Duration::from_millis(10)) {
        for line in waiting.drain(..) {
            if !lines.contains(&line) {
                lines.push(line);
            }
        }
    }
    if lines.is_empty() {
        return;
    }
    HOLDER_SEARCH.store(true, Ordering::SeqCst);
    let arg = Box::into_raw(Box::new((lines, allowance))) as *mut std::ffi::c_void;
    // SAFETY: the thread takes over the box `arg` is (or it is dropped below).
    if unsafe { crate::os::threads::spawn_raw(holder_search_main, arg) }.is_err() {
        // SAFETY: the thread did not start: the box is still ours.
        drop(unsafe { Box::from_raw(arg as *mut SearchArg) });
        HOLDER_SEARCH.store(false, Ordering::SeqCst);
    }
}

/// A search thread's lines and the bytes its rounds may read.
type SearchArg = (Vec<crate::report::python::UserLine>, u64);

/// What the holder searches made while the program runs may read in all: this much at
/// first, and `RUN_SEARCH_BYTES_PER_MINUTE` more for each minute the process has
/// recorded. A round reads every live Python object and heap block once: ~0.3 GB with
/// torch loaded (a search of 36 rounds ~11 GB), but a process that keeps 10 GB of
/// objects would read 120 GB a search, two minutes of a core in the background, for
/// each line that grows (three searches each). Past the first amount the searches take
/// at most ~1 GiB a minute, ~2% of a core at this machine's ~1 GB/s.
const RUN_SEARCH_BYTES: u64 = 64 << 30;
const RUN_SEARCH_BYTES_PER_MINUTE: u64 = 1 << 30;

/// What the searches while the program runs may still read, `elapsed_ms` after the
/// process started recording, `read` read so far: `None` where that is less than
/// `next_round` (about what the next round would read).
fn allowance_left(elapsed_ms: u64, read: u64, next_round: u64) -> Option<u64> {
    let earned = RUN_SEARCH_BYTES.saturating_add(RUN_SEARCH_BYTES_PER_MINUTE.saturating_mul(elapsed_ms / 60_000));
    let left = earned.saturating_sub(read);
    (left > 0 && left >= next_round).then_some(left)
}

/// `allowance_left` now; `None` when the report side is busy.
fn run_search_allowance() -> Option<u64> {
    let started = lock_bounded(&REPORT, Duration::from_secs(1))?.as_ref()?.process.started_unix_ms;
    allowance_left(process::unix_ms().saturating_sub(started), SEARCH_COST.bytes_read.load(Ordering::Relaxed), SEARCH_COST.last_round.load(Ordering::Relaxed))
}

/// Lines that started to grow while a holder search ran (`held_while_growing`), noted
/// as looked for: the search takes them in before its next round (`joining_lines`), or,
/// past the rounds it takes new lines in, the next search does.
static JOINING: SpinLock<Vec<crate::report::python::UserLine>> = SpinLock::new(Vec::new());

/// In a forked child: the parent's search thread, which may have held `JOINING`, is not
/// here, and its lines are the parent's to look for.
pub(super) fn forget_joining_after_fork() {
    let (mut waiting, _) = JOINING.take_over();
    // Left as it is, not freed: a thread the child does not have may have been growing
    // it.
    std::mem::forget(std::mem::take(&mut *waiting));
}

/// Set while a holder search (`held_while_growing`) runs (a scan leaves its thread out,
/// as every thread of ours: `os::threads::own_tids_settled`).
pub(super) static HOLDER_SEARCH: AtomicBool = AtomicBool::new(false);

/// Set once the process is ending (`wait_for_holder_search(true)`): a running search
/// ends before its next round, and a later one before its first. Cleared in a forked
/// child.
pub(super) static STOP_SEARCHES: AtomicBool = AtomicBool::new(false);

/// What the holder searches at Python's exit may read in all (`held::Budget`): 4 GiB,
/// 13 rounds with torch loaded (~0.31 GB a round), 3 for a program that keeps 1.2 GB of
/// Python objects (1.36 GB and ~1.45 s a round on a quiet 2-core machine).
const EXIT_SEARCH_BYTES: u64 = 4 << 30;

/// Before a scan: the holder search running now ends first (at most 10 s), so that no
/// thread of ours reads the program's memory while the scan holds it; `ending` (the
/// process is ending) stops it at its next round, and any later one.
pub(super) fn wait_for_holder_search(ending: bool) {
    if ending {
        STOP_SEARCHES.store(true, Ordering::SeqCst);
    }
    wait_while(|| HOLDER_SEARCH.load(Ordering::SeqCst), Duration::from_secs(10), Duration::from_millis(1));
}

extern "C" fn holder_search_main(arg: *mut std::ffi::c_void) -> *mut std::ffi::c_void {
    thread::mark_internal();
    // SAFETY: arg is the box `held_while_growing` leaked for this thread.
    let (lines, allowance) = *unsafe { Box::from_raw(arg as *mut SearchArg) };
    let mut budget = crate::report::held::Budget::new(allowance, Some(&STOP_SEARCHES));
    let _ = catch_unwind(AssertUnwindSafe(|| crate::os::procfs::one_seccomp_check(|| search_holders(lines, &mut budget))));
    // The thread is this search's alone: its CPU time is the search's (the clock asked
    // only where no seccomp filter may answer the call with SIGSYS).
    SEARCH_COST.searches.fetch_add(1, Ordering::Relaxed);
    if crate::scan::roots::copies_allowed() {
        SEARCH_COST.cpu_ns.fetch_add(crate::os::thread_cpu_ns(), Ordering::Relaxed);
    }
    SEARCH_COST.rounds.fetch_add(budget.rounds, Ordering::Relaxed);
    SEARCH_COST.bytes_read.fetch_add(budget.bytes_read, Ordering::Relaxed);
    if budget.last_round > 0 {
        SEARCH_COST.last_round.store(budget.last_round, Ordering::Relaxed);
    }
    HOLDER_SEARCH.store(false, Ordering::SeqCst);
    std::ptr::null_mut()
}

/// What the holder searches cost this process image (`diagnostics.holder_searches`):
/// while the program ran, and at Python's exit.
struct SearchCost {
    searches: AtomicU64,
    rounds: AtomicU64,
    bytes_read: AtomicU64,
    cpu_ns: AtomicU64,
    exit_rounds: AtomicU64,
    exit_bytes_read: AtomicU64,
    exit_ns: AtomicU64,
    /// What the last round of a search while the program ran read (not reported).
    last_round: AtomicU64,
}

static SEARCH_COST: SearchCost = SearchCost {
    searches: AtomicU64::new(0),
    rounds: AtomicU64::new(0),
    bytes_read: AtomicU64::new(0),
    cpu_ns: AtomicU64::new(0),
    exit_rounds: AtomicU64::new(0),
    exit_bytes_read: AtomicU64::new(0),
    exit_ns: AtomicU64::new(0),
    last_round: AtomicU64::new(0),
};

impl SearchCost {
    fn counters(&self) -> [&AtomicU64; 7] {
        [&self.searches, &self.rounds, &self.bytes_read, &self.cpu_ns, &self.exit_rounds, &self.exit_bytes_read, &self.exit_ns]
    }

    fn forget(&self) {
        for c in self.counters().into_iter().chain([&self.last_round]) {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// For the report; `None` while no search ran.
    fn now(&self) -> Option<leaktrace_common::report_schema::HolderSearches> {
        let [searches, rounds, bytes_read, cpu_ns, exit_rounds, exit_bytes_read, exit_ns] = self.counters().map(|c| c.load(Ordering::Relaxed));
        (searches > 0 || exit_ns > 0).then_some(leaktrace_common::report_schema::HolderSearches {
            searches,
            rounds,
            bytes_read,
            cpu_ms: cpu_ns / 1_000_000,
            exit_rounds,
            exit_bytes_read,
            exit_ms: exit_ns / 1_000_000,
        })
    }
}

/// In a forked child: the parent's searches are the parent's to count.
pub(super) fn forget_search_cost_after_fork() {
    SEARCH_COST.forget();
}

/// `held_while_growing`'s search, for `lines`: all at once (`held::python_holders`),
/// and for the lines that start to grow meanwhile, which join it (`joining_lines`).
fn search_holders(mut lines: Vec<crate::report::python::UserLine>, budget: &mut crate::report::held::Budget<'_>) {
    let Some((live, samples)) = live_and_samples(true) else { return };
    let Some(starts) = starts_of(&live, &samples, &lines) else { return };
    drop(samples);
    let mut joined = Vec::new();
    let found = {
        let mut joining = || joining_lines(&mut joined);
        crate::report::held::python_holders(&live.blocks, &starts, &mut live_keys, Some(&mut joining), budget)
    };
    drop(live);
    lines.extend(joined);
    keep_line_holders(lines, found);
}

/// Each of `lines`' starts (`line_starts`), drawn from `live`'s heap groups and
/// `samples`' under it; `None` when the report side is busy.
fn starts_of(
    live: &crate::collector::state::ScanInput,
    samples: &[crate::collector::state::LiveEntry],
    lines: &[crate::report::python::UserLine],
) -> Option<Vec<Vec<Start>>> {
    let (by_line, samples_by_line) = line_groups(live, samples, lines)?;
    Some(lines.iter().map(|line| line_starts(&live.blocks, by_line.get(line), samples_by_line.get(line))).collect())
}

/// The lines waiting to join the running search (`JOINING`), added to `joined`, with the
/// live heap blocks now and each one's starts drawn from them; `None` when none waits.
/// Where the blocks cannot be had now, the lines wait for the next search.
fn joining_lines(joined: &mut Vec<crate::report::python::UserLine>) -> Option<(Vec<crate::collector::state::LiveEntry>, Vec<Vec<Start>>)> {
    let lines: Vec<crate::report::python::UserLine> = std::mem::take(&mut *JOINING.try_lock()?);
    if lines.is_empty() {
        return None;
    }
    let drawn = live_and_samples(true).and_then(|(live, samples)| {
        let starts = starts_of(&live, &samples, &lines)?;
        Some((live.blocks, starts))
    });
    match drawn {
        Some(drawn) => {
            joined.extend(lines);
            Some(drawn)
        }
        None => {
            if let Some(mut waiting) = lock_bounded(&JOINING, Duration::from_millis(10)) {
                waiting.extend(lines);
            }
            None
        }
    }
}

/// Where a growing line's holder is looked for from: blocks spread over its largest
/// heap group (its newest alone is often also a running function's local), and one
/// sampled object of each of its largest groups of samples; the larger kind first.
fn line_starts(live: &[crate::collector::state::LiveEntry], heap: Option<&Vec<LineGroup>>, sampled: Option<&Vec<LineGroup>>) -> Vec<Start> {
    let heap = heap.and_then(|g| g.iter().max_by_key(|g| (g.bytes, g.key.0)).map(|g| (g.key, g.bytes)));
    let blocks: Vec<Start> = heap
        .map(|(key, _)| {
            let all: Vec<u64> = live.iter().filter(|b| (b.stack, b.api()) == key).map(|b| b.addr).collect();
            super::verdicts::spread(&all, OBJECTS_PER_LINE + 1).into_iter().map(Start::Block).collect()
        })
        .unwrap_or_default();
    let mut sampled: Vec<&LineGroup> = sampled.map(|g| g.iter().collect()).unwrap_or_default();
    sampled.sort_unstable_by_key(|g| (std::cmp::Reverse(g.bytes), g.addr));
    let sampled_bytes: u64 = sampled.iter().map(|g| g.bytes).sum();
    let objects: Vec<Start> = sampled.iter().take(OBJECTS_PER_LINE).map(|g| Start::Object(g.addr)).collect();
    if heap.is_some_and(|(_, bytes)| bytes >= sampled_bytes) {
        [blocks, objects].concat()
    } else {
        [objects, blocks].concat()
    }
}

/// Sampled objects of a growing line whose holders are looked for (the first to reach a
/// module names the line's holder).
const OBJECTS_PER_LINE: usize = 4;

/// The user lines whose live bytes rose over the timeline's points.
fn growing_lines() -> Vec<crate::report::python::UserLine> {
    let Some(r) = lock_bounded(&REPORT, Duration::from_secs(1)) else { return Vec::new() };
    let Some(r) = r.as_ref() else { return Vec::new() };
    r.timeline.lines.iter().filter(|l| grew(&l.bytes)).map(|l| l.line).collect()
}

/// A group of blocks under a growing line: its stack and entry point, its live bytes and
/// its highest address.
struct LineGroup {
    key: (u32, crate::hotpath::event::Api),
    bytes: u64,
    addr: u64,
}

/// Groups whose holders a line's holder is chosen from, per line.
const GROUPS_PER_LINE: usize = 4;

/// Per line of `lines`: the groups of `blocks` under it (by their user line), in no
/// order.
fn groups_by_line<'a>(
    blocks: impl Iterator<Item = &'a crate::collector::state::LiveEntry>,
    lines: &[crate::report::python::UserLine],
    timeline: &mut Timeline,
) -> HashMap<crate::report::python::UserLine, Vec<LineGroup>> {
    let mut out: HashMap<crate::report::python::UserLine, Vec<LineGroup>> = HashMap::default();
    if lines.is_empty() {
        return out;
    }
    // Only the blocks under `lines` are summed by group: a table of every live group (a
    // DDP rank's 705k blocks in ~500k groups) had made a 35 MB peak of the tracer's in
    // the middle of training, for each search. A stack's line is memoised by the
    // timeline, and neighbouring blocks often share their stack.
    let wanted: crate::util::FxSet<crate::report::python::UserLine> = lines.iter().copied().collect();
    let mut groups: HashMap<(u32, crate::hotpath::event::Api), (u64, u64, crate::report::python::UserLine)> = HashMap::default();
    let mut last: Option<(u32, Option<crate::report::python::UserLine>)> = None;
    for b in blocks {
        let line = match last {
            Some((stack, line)) if stack == b.stack => line,
            _ => {
                let line = timeline.line_of_stack(b.stack).filter(|l| wanted.contains(l));
                last = Some((b.stack, line));
                line
            }
        };
        let Some(line) = line else { continue };
        let g = groups.entry((b.stack, b.api())).or_insert((0, b.addr, line));
        g.0 += b.size();
        g.1 = g.1.max(b.addr);
    }
    for (key, (bytes, addr, line)) in groups {
        out.entry(line).or_default().push(LineGroup { key, bytes, addr });
    }
    out
}

/// Whether a followed stack's or a line's bytes rose over the points (three at least, rising as the command's
/// rule has it, `growth::rises_steadily`, at least 16 KiB more at the end than at the
/// start): a DataLoader worker of a few seconds on a loaded machine has few points, and
/// a line that appends to a list in a loop of seconds rises by tens of KiB (64 KiB had
/// its holder looked for too late or never: docs/benchmarks.md, thirty-second round).
fn grew(bytes: &[u64]) -> bool {
    let seen = &bytes[bytes.iter().position(|&b| b != 0).unwrap_or(bytes.len())..];
    seen.len() >= 3 && seen[seen.len() - 1] >= seen[0] + (16 << 10) && leaktrace_common::growth::rises_steadily(seen)
}

/// Names the paths the scan found for the listed groups and the followed stacks; where
/// the final scan found none (the interpreter freed the memory at teardown), the
/// holders found before it.
fn name_holders(
    scan: &super::verdicts::ScanResult,
    before_exit: &crate::util::FxMap<(u32, &'static str), Named>,
    groups: &mut [build::Group],
    timeline: &mut build::TimelineOut,
    sym: &mut crate::report::symbolize::Symbolizer,
) {
    // The variables that hold them, found in one pass over each module's symbols.
    let mut roots = Vec::new();
    for g in groups.iter().filter(|g| g.reachability.is_some_and(|r| r.reachable.bytes > 0)) {
        if let Some(path) = scan.held_by.get(&(g.stack_id, g.api.as_ref(), g.device.and_then(|d| u8::try_from(d).ok()))) {
            crate::report::held::data_roots(path, &mut roots);
        }
    }
    for s in timeline.series.iter() {
        if let Some(path) = scan.held_by.get(&(s.stack_id, s.api.as_ref(), None)) {
            crate::report::held::data_roots(path, &mut roots);
        }
    }
    sym.prefetch_data_symbols(&roots);
    for g in groups.iter_mut() {
        let reachable = g.reachability.is_some_and(|r| r.reachable.bytes > 0);
        if let Some(path) = scan.held_by.get(&(g.stack_id, g.api.as_ref(), g.device.and_then(|d| u8::try_from(d).ok()))).filter(|_| reachable) {
            g.held_by = crate::report::held::resolve(path, sym);
            g.also_held_by = crate::report::held::resolve_also(path, sym);
        }
    }
    for s in timeline.series.iter_mut() {
        if let Some(path) = scan.held_by.get(&(s.stack_id, s.api.as_ref(), None)) {
            s.held_by = crate::report::held::resolve(path, sym);
            s.also_held_by = crate::report::held::resolve_also(path, sym);
        }
        if s.held_by.is_empty() {
            if let Some((links, also)) = before_exit.get(&(s.stack_id, s.api.as_ref())) {
                s.held_by = links.clone();
                s.also_held_by = also.clone();
            }
        }
    }
    sym.forget_data_symbols();
}

/// Per CUDA device: the live device memory of every group, and what of it the listed
/// groups that a caching allocator holds hold.
fn device_memory(all: &[crate::collector::state::GroupSnapshot], listed: &[build::Group]) -> Vec<leaktrace_common::memory::DeviceMemory> {
    let mut by: std::collections::BTreeMap<u32, (u64, u64)> = Default::default();
    for g in all.iter().filter(|g| g.api().kind() == crate::hotpath::event::Kind::Device) {
        by.entry(g.device().map_or(0, u32::from)).or_default().0 += g.live_bytes;
    }
    for g in listed.iter().filter(|g| g.kind == "device" && g.cached_by.is_some()) {
        by.entry(g.device.unwrap_or(0)).or_default().1 += g.bytes;
    }
    by.into_iter().map(|(device, (live, cached))| leaktrace_common::memory::DeviceMemory { device, live, cached }).collect()
}

/// The exit summary's lines on the memory (`leaktrace_common::memory::explain` over
/// the timeline's points): empty when nothing stands out.
fn memory_summary(pid: u32, timeline: &Timeline, forked_child: bool) -> String {
    let points: Vec<(u64, leaktrace_common::memory::Memory)> = timeline.points.iter().filter_map(|p| p.memory.clone().map(|m| (p.unix_ms, m))).collect();
    leaktrace_common::memory::explain(&points, forked_child)
        .iter()
        .map(|f| format!("=={pid}==leaktrace: memory: {}.\n=={pid}==leaktrace:   what to do: {}\n", f.what, f.remedy))
        .collect()
}

/// The final report when the process is being ended by `sig`.
pub(super) fn finish_as(sig: i32) {
    if let Some(mut r) = lock_bounded(&REPORT, Duration::from_secs(2)) {
        if let Some(r) = r.as_mut() {
            r.exit_signal = Some(sig);
        }
    }
    final_report();
}

/// The final report: exactly once per process image, after the last event is drained.
/// A second caller (the process is ending through two paths at once: `exit` and a
/// signal, or two threads) waits for the first to finish writing, so that no exit path
/// ends the process in the middle of the report.
pub(super) fn final_report() {
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

#[cfg(test)]
mod tests {
    /// The searches while the program runs read 64 GiB at first, then 1 GiB more a
    /// minute; none starts where less is left than its last round read.
    #[test]
    fn the_searches_while_running_read_a_first_amount_then_a_gib_a_minute() {
        use super::allowance_left;
        const GIB: u64 = 1 << 30;
        assert_eq!(allowance_left(0, 0, 0), Some(64 * GIB));
        assert_eq!(allowance_left(59_999, 10 * GIB, 300 << 20), Some(54 * GIB), "a minute not yet run earns nothing");
        assert_eq!(allowance_left(60_000, 64 * GIB, 300 << 20), Some(GIB), "a minute earns a GiB");
        assert_eq!(allowance_left(30 * 60_000, 94 * GIB, 0), None, "all of it read");
        assert_eq!(allowance_left(60_000, 64 * GIB, 2 * GIB), None, "less left than a round of 2 GiB");
        assert_eq!(allowance_left(2 * 60_000, 64 * GIB, 2 * GIB), Some(2 * GIB));
        assert_eq!(allowance_left(u64::MAX, 0, 0), Some(u64::MAX), "no overflow");
    }
}
