//! Turns a collector snapshot into the versioned JSON report and the LeakSanitizer-style
//! text summary. Both render the same resolved groups.
use std::borrow::Cow;
use std::sync::Arc;

use leaktrace_common::report_schema as schema;

use super::process::ProcessInfo;
use super::symbolize::{RawFrame, Symbolizer};
use super::timeline::Timeline;
use crate::collector::state::{GroupDetails, GroupSnapshot, KindTotals, Totals};
use crate::hotpath::event::Kind;

pub const SCHEMA: &str = "leaktrace-report/3";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Periodic,
    Exit,
    Signal,
    /// The last report of a recording that `leaktrace attach --detach` ended, the
    /// process running on: final as an exit's is (drained, scanned), with no teardown.
    Detach,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Periodic => "periodic",
            Reason::Exit => "exit",
            Reason::Signal => "signal",
            Reason::Detach => "detach",
        }
    }
}

pub use leaktrace_common::report_schema::{Amount, Frame, Group, IndirectFrom, Omitted, Reachability};

/// Adds a scan verdict to a `Reachability` (the type is the schema's, in `common`).
pub trait Tally {
    fn add(&mut self, verdict: crate::scan::mark::Verdict, bytes: u64);
}

impl Tally for Reachability {
    fn add(&mut self, verdict: crate::scan::mark::Verdict, bytes: u64) {
        use crate::scan::mark::Verdict::*;
        match verdict {
            Definite => self.definite.add(bytes),
            Indirect => self.indirect.add(bytes),
            Reachable => self.reachable.add(bytes),
        }
    }
}

/// Extra facts the report carries besides the collector's view.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    pub stack_depth: usize,
    pub interval_ms: u64,
    pub buffer_full_waits: u64,
    pub rings_grown: u64,
    pub stacks_interned: u64,
    pub stack_table_overflows: u64,
    pub host_tracking: String,
    pub exit_signal: Option<i32>,
    /// Why this process can never be given a final report (`process::final_report_unreachable`).
    pub no_final_report: Option<&'static str>,
    /// CUDA function pointers passed through untracked: more copies of one function
    /// than there are copy wrappers.
    pub cuda_untracked_copies: u64,
    pub releases_dropped: u64,
    pub holder_searches: Option<schema::HolderSearches>,
}

/// Stacks read back between two releases of the spilled stack table's pages
/// (`stacks::release_spilled`): reading a stack maps a page or two of each record of
/// its chain and of their frames, and the 2000 stacks of a report read after `import
/// torch` had mapped 36 MB of them again.
const RELEASE_EVERY: usize = 256;

/// The raw frames of the stacks `ids`; more than `RELEASE_EVERY` of them are read in
/// chunks, the spilled table's pages given back after each.
fn raw_stacks(ids: &[u32], sym: &mut Symbolizer) -> Vec<Vec<RawFrame>> {
    let mut raws: Vec<Vec<RawFrame>> = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(RELEASE_EVERY) {
        raws.extend(chunk.iter().map(|&id| sym.raw_stack(id)));
        if ids.len() > RELEASE_EVERY {
            crate::hotpath::stacks::release_spilled();
        }
    }
    raws
}

/// The symbolized frames of interned stacks (innermost first, inlined frames expanded),
/// every address among them symbolized in one batch (see `Symbolizer::symbolize_all`).
pub fn resolve_stacks(ids: &[u32], sym: &mut Symbolizer) -> Vec<Vec<Frame>> {
    let raws = raw_stacks(ids, sym);
    sym.symbolize_all(raws.iter().flatten().filter_map(|rf| rf.module));
    raws.into_iter().map(|raw| symbolized(raw, sym)).collect()
}

/// The frames (inlined ones first) of the code at return address `ip`.
pub fn resolve_frames(ip: u64, sym: &mut Symbolizer) -> Vec<Frame> {
    let raw = sym.raw_frame(ip);
    symbolized(vec![raw], sym)
}

/// A stack's frames, named from what `symbolize_all` found (`Symbolizer::named`: the
/// names borrowed, not copied); Python frames merged in.
fn symbolized(raw: Vec<RawFrame>, sym: &mut Symbolizer) -> Vec<Frame> {
    let mut stack = Vec::with_capacity(raw.len());
    let python: Vec<u64> = raw.iter().filter_map(|rf| rf.python).collect();
    for rf in raw.into_iter().filter(|rf| rf.python.is_none()) {
        let Some((m, off)) = rf.module else {
            stack.push(Frame { ip: rf.ip, module: None, offset: None, function: None, file: None, line: None, inlined: false, python: false });
            continue;
        };
        let (module, syms) = sym.named(m, off);
        let frame = |function: Option<std::sync::Arc<str>>, file, line, inlined| Frame {
            ip: rf.ip,
            module: module.cloned(),
            offset: Some(off),
            function,
            file,
            line,
            inlined,
            python: false,
        };
        if syms.is_empty() {
            stack.push(frame(None, None, None, false));
        }
        stack.extend(syms.iter().map(|s| frame(s.function.clone(), s.file.clone(), s.line, s.inlined)));
    }
    if python.is_empty() {
        stack
    } else {
        super::python::merge(stack, &python, &mut sym.python)
    }
}

/// What a group counts as leaked: definite + indirect with a scan, else all of it.
fn leaked(g: &GroupSnapshot, r: Option<Reachability>) -> (u64, u64) {
    // Sampled Python objects are the interpreter's to free: never leaked.
    if g.api().kind() == Kind::Python {
        return (0, 0);
    }
    match r {
        Some(r) => (r.leaked().bytes, r.leaked().blocks),
        None => (g.live_bytes, g.live_blocks()),
    }
}

/// The groups a report lists, at most `limit` host groups and at most `limit` CUDA
/// groups: most leaked bytes first (with a scan, memory still reachable comes after
/// every leak), then most outstanding bytes. A process fresh from `import torch` holds
/// half a million groups of static data; the rest are added up in `Omitted`. The two
/// limits are apart because the host's small definite leaks would otherwise push out
/// every device group that the scan finds reachable (PyTorch's cache, a pointer still
/// in a dead Python object), and a report on a GPU job must show its device memory.
///
/// `reach` is `None` without a scan: then the groups are taken in the order given, which
/// must put each class's `limit` largest first (`Snapshot::sort`, or `sort_top(limit)`),
/// with no copy or sort of all of them (a periodic report after `import torch` copied
/// and sorted 600k of them here).
pub fn select_groups(
    groups: &[GroupSnapshot],
    reach: Option<impl Fn(&GroupSnapshot) -> Option<Reachability>>,
    limit: usize,
) -> (Vec<(&GroupSnapshot, Option<Reachability>)>, Omitted) {
    let Some(reach) = reach else { return take_per_class(groups.iter().map(|g| (g, None)), limit) };
    let mut all: Vec<(&GroupSnapshot, Option<Reachability>)> = groups.iter().map(|g| (g, reach(g))).collect();
    // `groups` is already in the collector's order (bytes, blocks, stack): a stable sort keeps it for ties.
    all.sort_by_key(|(g, r)| std::cmp::Reverse(leaked(g, *r).0));
    take_per_class(all.into_iter(), limit)
}

/// The first `limit` groups of each class (host, CUDA) in `groups`' order; the rest
/// added up.
fn take_per_class<'a>(
    groups: impl Iterator<Item = (&'a GroupSnapshot, Option<Reachability>)>,
    limit: usize,
) -> (Vec<(&'a GroupSnapshot, Option<Reachability>)>, Omitted) {
    let mut kept = Vec::new();
    let mut omitted = Omitted::default();
    let mut listed = [0usize; 3];
    for (g, r) in groups {
        // Host memory (and the program's own mappings), CUDA, sampled Python objects:
        // these are never listed (never leaks; a growing one is followed by the
        // timeline with its stack), only added up.
        let class = match g.api().kind() {
            Kind::Host | Kind::Mmap => 0,
            Kind::Python => 2,
            _ => 1,
        };
        if class != 2 && listed[class] < limit {
            listed[class] += 1;
            kept.push((g, r));
            continue;
        }
        let (lb, lk) = leaked(g, r);
        omitted.groups += 1;
        omitted.bytes += g.live_bytes;
        omitted.blocks += g.live_blocks();
        omitted.leaked_bytes += lb;
        omitted.leaked_blocks += lk;
    }
    (kept, omitted)
}

/// The listed groups with their stacks; `details` holds each one's other figures, in
/// the same order (`Collector::details`).
pub fn resolve_groups(selected: &[(&GroupSnapshot, Option<Reachability>)], details: &[GroupDetails], sym: &mut Symbolizer) -> Vec<Group> {
    let ids: Vec<u32> = selected.iter().map(|(g, _)| g.stack).collect();
    selected
        .iter()
        .zip(details)
        .zip(resolve_stacks(&ids, sym))
        .map(|((&(g, reachability), details), stack)| {
            let kind = g.api().kind();
            Group {
                kind: kind.name().into(),
                api: g.api().name().into(),
                device: g.device().map(u32::from),
                cached_by: super::cached::owner(kind, &stack).map(Into::into),
                bytes: g.live_bytes,
                blocks: g.live_blocks(),
                // A periodic report reads these after the snapshot: never below it.
                peak_bytes: details.peak_live_bytes.max(g.live_bytes),
                total_allocs: details.total_allocs.max(g.live_blocks()),
                total_bytes: details.total_bytes.max(g.live_bytes),
                stack_id: g.stack,
                reachability,
                indirect_from: Vec::new(),
                stack,
                held_by: Vec::new(),
                also_held_by: None,
            }
        })
        .collect()
}

fn kind_totals(t: &KindTotals, reachability: Option<Reachability>) -> schema::KindTotals {
    schema::KindTotals {
        live_bytes: t.live_bytes,
        live_blocks: t.live_blocks,
        total_allocs: t.total_allocs,
        total_frees: t.total_frees,
        peak_live_bytes: t.peak_live_bytes,
        reachability,
    }
}

/// Reachability totals of a scan, one per kind of memory.
pub type KindReachability = [Reachability; Kind::ALL.len()];

/// A report's timeline, stacks in full (`None`: the stack of a listed leak group).
pub type TimelineOut = schema::Timeline<schema::Inline>;

/// The timeline; followed stacks that are not among `groups` are symbolized here.
pub fn timeline_out(timeline: &Timeline, groups: &[Group], sym: &mut Symbolizer) -> TimelineOut {
    let listed: crate::util::FxSet<u32> = groups.iter().map(|g| g.stack_id).collect();
    let followed: Vec<u32> = timeline.series.iter().map(|s| s.stack).filter(|id| !listed.contains(id)).collect();
    // In series order, as the series below take them.
    let mut stacks = resolve_stacks(&followed, sym).into_iter();
    TimelineOut {
        points: timeline
            .points
            .iter()
            .map(|p| schema::Point { unix_ms: p.unix_ms, live_bytes: p.live_bytes, live_blocks: p.live_blocks, memory: p.memory.clone() })
            .collect(),
        series: timeline
            .series
            .iter()
            .map(|s| schema::Series {
                kind: s.api.kind().name().into(),
                api: s.api.name().into(),
                stack_id: s.stack,
                stack: (!listed.contains(&s.stack)).then(|| stacks.next().unwrap_or_default()),
                bytes: s.bytes.clone(),
                held_by: Vec::new(),
                also_held_by: None,
            })
            .collect(),
        lines: timeline
            .lines
            .iter()
            .map(|l| {
                let (function, file, line) = super::python::describe(l.line);
                schema::LineSeries { function, file, line, bytes: l.bytes.clone(), held_by: Vec::new(), also_held_by: None }
            })
            .collect(),
    }
}

/// The distinct frames of a report, each written once; stacks are lists of indices
/// into it (schema 2). `import torch` leaves 2,000 listed groups of ~100 frames, 202k
/// frame objects written in full, but only ~1,400 distinct ones: 51 MB of JSON became
/// 1.5 MB.
///
/// Frames are told apart by their ip and the identity of their shared strings: the
/// same return address resolves to the same `Arc`s (the symbolizer's cache), and every
/// frame is alive while the table is built, so no address is reused. Two equal frames
/// from separate allocations would take two entries, which a reader cannot tell apart.
#[derive(Default)]
struct FrameTable {
    frames: Vec<Frame>,
    index: crate::util::FxMap<FrameKey, u32>,
}

type FrameKey = (u64, usize, Option<u64>, usize, usize, Option<u32>, bool, bool);

fn identity(s: &Option<Arc<str>>) -> usize {
    s.as_ref().map_or(0, |a| Arc::as_ptr(a) as *const u8 as usize)
}

impl FrameTable {
    fn indices(&mut self, stack: &[Frame]) -> schema::Indexed {
        stack
            .iter()
            .map(|f| {
                let key = (f.ip, identity(&f.module), f.offset, identity(&f.function), identity(&f.file), f.line, f.inlined, f.python);
                *self.index.entry(key).or_insert_with(|| {
                    // A clone shares the frame's strings (the key's identities stay valid).
                    self.frames.push(f.clone());
                    self.frames.len() as u32 - 1
                })
            })
            .collect()
    }
}

/// The report as compact JSON bytes (a large process has thousands of frames; pretty
/// printing tripled the file and the time to write it).
/// Everything a report says, as `write_report_json` takes it.
pub struct ReportParts<'a> {
    pub process: &'a ProcessInfo,
    pub reason: Reason,
    pub written_unix_ms: u64,
    pub totals: &'a Totals,
    pub groups: &'a [Group],
    pub facts: &'a RunFacts,
    pub timeline: &'a TimelineOut,
    pub scan: Option<(&'a schema::Scan, KindReachability)>,
    pub omitted: Omitted,
    pub checks: &'a [super::checks::Check],
    pub checks_dropped: u64,
    pub memory: Option<&'a leaktrace_common::memory::Memory>,
    /// `LEAKTRACE_WHY_REACHABLE`'s blocks and their paths.
    pub why_reachable: &'a [schema::WhyReachable],
}

/// `write_report_json` into memory (tests).
#[cfg(test)]
pub fn report_bytes(parts: &ReportParts) -> Vec<u8> {
    let mut bytes = Vec::new();
    write_report_json(&mut bytes, parts).unwrap_or_default();
    bytes
}

/// The report as JSON (`leaktrace_common::report_schema::Report`, stacks as indices
/// into its frame table), written into `w` as it is serialized.
pub fn write_report_json(w: impl std::io::Write, parts: &ReportParts) -> std::io::Result<()> {
    let &ReportParts { process, reason, written_unix_ms, totals, groups, facts, timeline, scan, omitted, checks, checks_dropped, memory, why_reachable } =
        parts;
    let kind = |k: Kind| kind_totals(totals.kind(k), scan.map(|s| s.1[k.index()]));
    let mut cached = Amount::default();
    for g in groups.iter().filter(|g| g.cached_by.is_some()) {
        cached.bytes += g.bytes;
        cached.blocks += g.blocks;
    }
    let mut table = FrameTable::default();
    let leaks = groups
        .iter()
        .map(|g| {
            let mut out = g.with_stack(table.indices(&g.stack));
            out.held_by = g.held_by.iter().map(|l| l.map_stack(|st| table.indices(st))).collect();
            out.also_held_by = g.also_held_by.as_ref().map(|o| o.map_stacks(|st| table.indices(st)));
            out
        })
        .collect();
    let series = timeline
        .series
        .iter()
        .map(|s| schema::Series {
            kind: s.kind.clone(),
            api: s.api.clone(),
            stack_id: s.stack_id,
            stack: s.stack.as_deref().map(|st| table.indices(st)),
            bytes: s.bytes.clone(),
            held_by: s.held_by.iter().map(|l| l.map_stack(|st| table.indices(st))).collect(),
            also_held_by: s.also_held_by.as_ref().map(|o| o.map_stacks(|st| table.indices(st))),
        })
        .collect();
    let lines = timeline.lines.iter().map(|l| l.map_stacks(|st| table.indices(st))).collect();
    let timeline = schema::Timeline { points: timeline.points.clone(), series, lines };
    let checks = checks.iter().map(|c| c.with_stacks(|st| table.indices(st))).collect();
    let why_reachable = why_reachable.iter().map(|w| w.map_stacks(|st| table.indices(st))).collect();
    let report = schema::Report::<schema::Indexed> {
        schema: SCHEMA.into(),
        tool: schema::Tool { name: "leaktrace".into(), version: env!("CARGO_PKG_VERSION").into() },
        pid: process.pid,
        ppid: process.ppid,
        exe: process.exe.clone(),
        argv: process.argv.clone(),
        reason: reason.name().into(),
        exit_signal: facts.exit_signal,
        no_final_report: facts.no_final_report.map(Into::into),
        started_unix_ms: process.started_unix_ms,
        written_unix_ms,
        fork: schema::Fork {
            forked_from_pid: process.forked_from,
            inherited_live_bytes: totals.inherited_live_bytes,
            inherited_live_blocks: totals.inherited_live_blocks,
            inherited_frees: totals.inherited_frees,
            switched_on_unix_ms: process.switched_on.then_some(process.started_unix_ms),
        },
        launch: process.launch.clone(),
        config: schema::Config { stack_depth: facts.stack_depth, interval_ms: facts.interval_ms },
        summary: schema::Summary {
            host: kind(Kind::Host),
            device: kind(Kind::Device),
            pinned: kind(Kind::Pinned),
            managed: kind(Kind::Managed),
            reservation: kind(Kind::Reservation),
            mapping: kind(Kind::Mapping),
            python: kind(Kind::Python),
            mmap: kind(Kind::Mmap),
            cached,
            omitted,
            leak_groups: groups.len(),
        },
        diagnostics: schema::Diagnostics {
            host_tracking: facts.host_tracking.clone(),
            events: totals.events,
            buffer_full_waits: facts.buffer_full_waits,
            rings_grown: facts.rings_grown,
            unknown_frees: totals.unknown_frees,
            merged_frees: totals.merged_frees,
            frees_on_library_threads: totals.frees_on_library_threads,
            releases_dropped: facts.releases_dropped,
            stacks_interned: facts.stacks_interned,
            stack_table_overflows: facts.stack_table_overflows,
            cuda_untracked_copies: facts.cuda_untracked_copies,
            holder_searches: facts.holder_searches,
        },
        scan: scan.map(|s| *s.0),
        memory: memory.cloned(),
        frames: table.frames,
        timeline,
        leaks,
        checks,
        checks_dropped,
        why_reachable,
        path: Default::default(),
    };
    serde_json::to_writer(w, &report).map_err(std::io::Error::from)
}

pub(crate) use leaktrace_common::frame_text::frame_line as frame_text;

/// The groups the exit summary shows after `s` (LeakSanitizer's semantics: a suppressed
/// leak takes the indirect leaks that hang from it along), how many were suppressed, and
/// the patterns that matched.
pub fn apply_suppressions<'a>(
    groups: &'a [Group],
    s: &leaktrace_common::Suppressions,
) -> (Vec<Cow<'a, Group>>, usize, Vec<leaktrace_common::suppressions::Used>) {
    let applied = s.apply_to_groups(groups);
    let mut shown = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        if applied.suppressed[i] {
            continue;
        }
        let (bytes, blocks) = applied.hidden_indirect[i];
        if (bytes, blocks) == (0, 0) {
            // Nearly every group: shown as it is (copying each group's stack was ~12 ms
            // of a torch run's final report).
            shown.push(Cow::Borrowed(g));
            continue;
        }
        let mut g = g.clone();
        if let Some(r) = g.reachability.as_mut() {
            r.indirect.bytes -= bytes.min(r.indirect.bytes);
            r.indirect.blocks -= blocks.min(r.indirect.blocks);
        }
        shown.push(Cow::Owned(g));
    }
    // Counted as the command counts them: groups whose leaks a pattern hid, not groups
    // it matched that hold only reachable or cached memory.
    let suppressed = groups.iter().zip(&applied.suppressed).filter(|(g, s)| **s && counted(g).1 > 0).count();
    (shown, suppressed, applied.used)
}

/// What a group counts as leaked: definite + indirect with a scan, everything
/// outstanding without one, nothing when a caching allocator holds it.
fn counted(g: &Group) -> (u64, u64) {
    if g.cached_by.is_some() || g.kind == "python" {
        return (0, 0);
    }
    let leaked = g.leaked();
    (leaked.bytes, leaked.blocks)
}

/// Leaked bytes and blocks of `groups` (as the exit summary counts them), with the
/// groups the report does not list.
pub fn leaked_total(groups: &[&Group], omitted: Omitted) -> (u64, u64) {
    let (bytes, blocks) = groups.iter().map(|g| counted(g)).fold((0, 0), |a, c| (a.0 + c.0, a.1 + c.1));
    (bytes + omitted.leaked_bytes, blocks + omitted.leaked_blocks)
}

/// The exit summary in the shape LeakSanitizer users know. With a pointer scan, each
/// group shows its direct (definite) and indirect parts and still-reachable memory is
/// left out of the count.
pub fn summary_text(
    pid: u32,
    groups: &[&Group],
    suppressed: usize,
    used: &[leaktrace_common::suppressions::Used],
    top: usize,
    report: Option<&str>,
    omitted: Omitted,
) -> String {
    let mut out = String::new();
    let leaking: Vec<&&Group> = groups.iter().filter(|g| counted(g).1 > 0).collect();
    let (bytes, blocks) = leaked_total(groups, omitted);
    let reachable: u64 = groups.iter().filter(|g| g.cached_by.is_none()).filter_map(|g| g.reachability.map(|r| r.reachable.bytes)).sum();
    let cached: u64 = groups.iter().filter(|g| g.cached_by.is_some()).map(|g| g.bytes).sum();
    let mut notes = Vec::new();
    if suppressed > 0 {
        notes.push(format!("{suppressed} group(s) suppressed"));
    }
    if cached > 0 {
        notes.push(format!("{cached} byte(s) held by caching allocators not counted"));
    }
    if omitted.leaked_blocks > 0 {
        notes.push(format!(
            "{} of them in {} small group(s) not listed in the report; LEAKTRACE_REPORT_GROUPS raises the limit",
            omitted.leaked_bytes, omitted.groups
        ));
    }
    if reachable > 0 {
        notes.push(format!("{reachable} byte(s) still reachable not counted"));
    }
    let note = if notes.is_empty() { String::new() } else { format!(" ({})", notes.join("; ")) };
    let used = leaktrace_common::suppressions::used_table(used);
    if leaking.is_empty() && omitted.leaked_blocks == 0 {
        out.push_str(&used);
        out.push_str(&format!("=={pid}==leaktrace: no leaks found{note}"));
    } else {
        out.push_str("=================================================================\n");
        out.push_str(&format!("=={pid}==leaktrace: detected memory leaks\n"));
        for g in leaking.iter().take(top) {
            let parts: Vec<(&str, Amount)> = match g.reachability {
                Some(r) => [("Direct leak", r.definite), ("Indirect leak", r.indirect)].into_iter().filter(|p| p.1.blocks > 0).collect(),
                None => vec![("Leak", Amount { bytes: g.bytes, blocks: g.blocks })],
            };
            for (label, a) in parts {
                let device = g.device.map(|d| format!(", device {d}")).unwrap_or_default();
                out.push_str(&format!("\n{label} of {} byte(s) in {} object(s) allocated from {} ({}{device}):\n", a.bytes, a.blocks, g.api, g.kind));
                let shown = leaktrace_common::frame_text::frames_only_view(&g.stack);
                for (i, &k) in shown.iter().enumerate() {
                    out.push_str(&frame_text(i, &g.stack[k]));
                    out.push('\n');
                }
                if let Some(hidden) = leaktrace_common::frame_text::hidden_frames_text(&g.stack, &shown) {
                    out.push_str(&format!("    ({hidden}; the report has them)\n"));
                }
                if g.stack.is_empty() {
                    out.push_str("    <no stack>\n");
                }
            }
        }
        if leaking.len() > top {
            out.push_str(&format!("\n... {} more leak group(s) in the report\n", leaking.len() - top));
        }
        if !used.is_empty() {
            out.push('\n');
            out.push_str(&used);
        }
        out.push_str(&format!("\nSUMMARY: leaktrace: {bytes} byte(s) leaked in {blocks} allocation(s){note}."));
    }
    if let Some(r) = report {
        out.push_str(&format!("\n=={pid}==leaktrace: report {r}"));
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group() -> Group {
        Group {
            kind: "host".into(),
            api: "calloc".into(),
            device: None,
            cached_by: None,
            bytes: 48,
            blocks: 3,
            peak_bytes: 64,
            total_allocs: 4,
            total_bytes: 64,
            stack_id: 7,
            reachability: None,
            indirect_from: Vec::new(),
            held_by: Vec::new(),
            also_held_by: None,
            stack: vec![
                Frame {
                    ip: 0x1234,
                    module: Some("/bin/x".into()),
                    offset: Some(0x234),
                    function: Some("leak_here".into()),
                    file: Some("/src/x.c".into()),
                    line: Some(12),
                    inlined: false,
                    python: false,
                },
                Frame { ip: 0x9999, module: None, offset: None, function: None, file: None, line: None, inlined: false, python: false },
            ],
        }
    }

    #[test]
    fn json_has_the_contract_fields() {
        let p = ProcessInfo {
            pid: 10,
            ppid: 1,
            exe: "/bin/x".into(),
            argv: vec!["x".into()],
            started_unix_ms: 5,
            forked_from: None,
            switched_on: false,
            launch: Default::default(),
            file_name: "f.json".into(),
            environ_without_launch: 0,
        };
        let mut t = Totals::default();
        t.kinds[Kind::Host.index()] = KindTotals { live_bytes: 48, live_blocks: 3, total_allocs: 4, total_frees: 1, peak_live_bytes: 64 };
        t.kinds[Kind::Device.index()] = KindTotals { live_bytes: 1 << 20, live_blocks: 1, total_allocs: 2, total_frees: 1, peak_live_bytes: 2 << 20 };
        // A second group shares the first one's innermost frame (the same Arcs, as the
        // symbolizer hands them out); a followed stack that is no group's adds its own.
        let first = group();
        let mut other = first.clone();
        other.stack_id = 8;
        other.stack[1].ip = 0x7777;
        let groups = [first, other];
        let followed = vec![
            groups[0].stack[0].clone(),
            Frame { ip: 0x5555, module: None, offset: None, function: None, file: None, line: None, inlined: false, python: false },
        ];
        let timeline = TimelineOut {
            points: vec![schema::Point { unix_ms: 5, live_bytes: 48, live_blocks: 3, memory: None }],
            series: vec![
                schema::Series {
                    kind: "host".into(),
                    api: "calloc".into(),
                    stack_id: 7,
                    stack: None,
                    bytes: vec![48],
                    held_by: Vec::new(),
                    also_held_by: None,
                },
                schema::Series {
                    kind: "host".into(),
                    api: "malloc".into(),
                    stack_id: 9,
                    stack: Some(followed),
                    bytes: vec![16],
                    held_by: Vec::new(),
                    also_held_by: None,
                },
            ],
            lines: Vec::new(),
        };
        let facts = RunFacts::default();
        let bytes = report_bytes(&ReportParts {
            process: &p,
            reason: Reason::Exit,
            written_unix_ms: 6,
            totals: &t,
            groups: &groups,
            facts: &facts,
            timeline: &timeline,
            scan: None,
            omitted: Omitted::default(),
            checks: &[],
            checks_dropped: 0,
            memory: None,
            why_reachable: &[],
        });
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
        assert_eq!(&keys[..3], &["schema", "tool", "pid"]);
        assert_eq!(v["schema"], "leaktrace-report/3");
        use leaktrace_common::report_schema::{CURRENT_MAJOR, SCHEMA_PREFIX};
        assert_eq!(SCHEMA, format!("{SCHEMA_PREFIX}{CURRENT_MAJOR}"), "the readers' idea of the current version");
        assert_eq!(v["reason"], "exit");
        for k in ["pid", "ppid", "exe", "argv", "started_unix_ms", "written_unix_ms"] {
            assert!(!v[k].is_null(), "{k}");
        }
        let h = &v["summary"]["host"];
        assert_eq!((h["live_bytes"].as_u64(), h["live_blocks"].as_u64()), (Some(48), Some(3)));
        assert_eq!((h["total_allocs"].as_u64(), h["total_frees"].as_u64(), h["peak_live_bytes"].as_u64()), (Some(4), Some(1), Some(64)));
        let d = &v["summary"]["device"];
        assert_eq!((d["live_bytes"].as_u64(), d["total_frees"].as_u64(), d["peak_live_bytes"].as_u64()), (Some(1 << 20), Some(1), Some(2 << 20)));
        for k in ["pinned", "managed", "reservation", "mapping"] {
            assert_eq!(v["summary"][k]["live_bytes"], 0, "{k}");
        }
        assert_eq!(v["summary"]["cached"]["bytes"], 0);
        let l = &v["leaks"][0];
        assert!(l.get("device").is_none() && l.get("cached_by").is_none(), "host groups have neither: {l}");
        assert_eq!((l["kind"].as_str(), l["api"].as_str(), l["bytes"].as_u64(), l["blocks"].as_u64()), (Some("host"), Some("calloc"), Some(48), Some(3)));
        // Stacks are indices into one table of distinct frames.
        let frames = v["frames"].as_array().unwrap();
        let at = |i: &serde_json::Value| &frames[i.as_u64().unwrap() as usize];
        assert_eq!(l["stack"], serde_json::json!([0, 1]));
        assert_eq!(v["leaks"][1]["stack"], serde_json::json!([0, 2]), "the shared frame is written once");
        assert!(v["timeline"]["series"][0]["stack"].is_null(), "group 7's stack is in leaks");
        assert_eq!(v["timeline"]["series"][1]["stack"], serde_json::json!([0, 3]));
        let ips: Vec<&str> = frames.iter().map(|f| f["ip"].as_str().unwrap()).collect();
        assert_eq!(ips, ["0x1234", "0x9999", "0x7777", "0x5555"]);
        let f = at(&l["stack"][0]);
        assert_eq!(f["ip"], "0x1234");
        assert_eq!((f["module"].as_str(), f["offset"].as_u64(), f["function"].as_str()), (Some("/bin/x"), Some(0x234), Some("leak_here")));
        assert_eq!((f["file"].as_str(), f["line"].as_u64()), (Some("/src/x.c"), Some(12)));
        let unknown = at(&l["stack"][1]);
        for k in ["module", "offset", "function", "file", "line"] {
            assert!(unknown[k].is_null(), "{k}");
        }
    }

    #[test]
    fn summary_reads_like_lsan() {
        let g = group();
        let s = summary_text(10, &[&g], 0, &[], 10, Some("/out/r.json"), Omitted::default());
        assert!(s.contains("==10==leaktrace: detected memory leaks"));
        assert!(s.contains("Leak of 48 byte(s) in 3 object(s) allocated from calloc (host):"));
        assert!(s.contains("    #0 0x1234 in leak_here /src/x.c:12 (/bin/x+0x234)"));
        assert!(s.contains("SUMMARY: leaktrace: 48 byte(s) leaked in 3 allocation(s)."));
        assert!(s.ends_with("==10==leaktrace: report /out/r.json\n"));
        let none = summary_text(10, &[], 0, &[], 10, None, Omitted::default());
        assert_eq!(none, "==10==leaktrace: no leaks found\n");
        let (shown, n, used) = apply_suppressions(std::slice::from_ref(&g), &leaktrace_common::Suppressions { patterns: vec!["leak_*".into()] });
        assert_eq!((shown.len(), n), (0, 1));
        // A matched group that leaks nothing (all still reachable) is not "suppressed".
        let mut held = g.clone();
        held.reachability = Some(leaktrace_common::report_schema::Reachability {
            reachable: leaktrace_common::report_schema::Amount { bytes: 48, blocks: 3 },
            ..Default::default()
        });
        let (_, held_n, held_used) = apply_suppressions(std::slice::from_ref(&held), &leaktrace_common::Suppressions { patterns: vec!["leak_*".into()] });
        assert_eq!((held_n, held_used.len()), (0, 0));
        let shown: Vec<&Group> = shown.iter().map(|g| &**g).collect();
        assert_eq!(
            summary_text(10, &shown, n, &used, 10, None, Omitted::default()),
            "-----------------------------------------------------\nSuppressions used:\n  count      bytes template\n      3         48 leak_*\n-----------------------------------------------------\n==10==leaktrace: no leaks found (1 group(s) suppressed)\n"
        );
    }

    #[test]
    fn device_groups_name_their_device_and_caches_are_not_counted() {
        let mut dev = group();
        (dev.kind, dev.api, dev.device, dev.bytes, dev.blocks) = ("device".into(), "cudaMalloc".into(), Some(1), 4096, 1);
        let mut cache = dev.clone();
        cache.cached_by = Some("PyTorch CUDACachingAllocator".into());
        cache.bytes = 1 << 21;
        let s = summary_text(10, &[&dev, &cache], 0, &[], 10, None, Omitted::default());
        assert!(s.contains("Leak of 4096 byte(s) in 1 object(s) allocated from cudaMalloc (device, device 1):"), "{s}");
        assert!(s.contains("SUMMARY: leaktrace: 4096 byte(s) leaked in 1 allocation(s) (2097152 byte(s) held by caching allocators not counted)."), "{s}");
        assert_eq!(
            summary_text(10, &[&cache], 0, &[], 10, None, Omitted::default()),
            "==10==leaktrace: no leaks found (2097152 byte(s) held by caching allocators not counted)\n"
        );
    }

    #[test]
    fn a_report_lists_the_leaks_first_and_adds_up_the_rest() {
        use crate::hotpath::event::Api;
        let g = |stack: u32, bytes: u64| GroupSnapshot::new(stack, Api::Malloc, None, 0, bytes, 1);
        // Collector order: largest first. Stack 1 is big but reachable; 3 is a small leak.
        let groups = vec![g(1, 1000), g(2, 500), g(3, 10), g(4, 5)];
        let reach = |s: &GroupSnapshot| {
            let mut r = Reachability::default();
            let a = Amount { bytes: s.live_bytes, blocks: 1 };
            if s.stack == 1 || s.stack == 4 {
                r.reachable = a
            } else {
                r.definite = a
            }
            Some(r)
        };
        let (kept, omitted) = select_groups(&groups, Some(reach), 2);
        let order: Vec<u32> = kept.iter().map(|(g, _)| g.stack).collect();
        assert_eq!(order, vec![2, 3], "every leak before any reachable group");
        assert_eq!(omitted, Omitted { groups: 2, bytes: 1005, blocks: 2, leaked_bytes: 0, leaked_blocks: 0 });
        // Without a scan everything outstanding counts, largest first.
        let (kept, omitted) = select_groups(&groups, None::<fn(&GroupSnapshot) -> Option<Reachability>>, 3);
        assert_eq!(kept.iter().map(|(g, _)| g.stack).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!((omitted.groups, omitted.leaked_bytes), (1, 5));
        // Host groups do not crowd out device groups: each class has its own limit.
        let device = |stack: u32, bytes: u64| GroupSnapshot::new(stack, Api::CudaMalloc, Some(0), 0, bytes, 1);
        let groups = vec![device(7, 4000), g(1, 1000), g(2, 500), g(3, 10), device(8, 50), g(4, 5)];
        let (mixed, left_out) = select_groups(&groups, Some(reach), 2);
        assert_eq!(mixed.iter().map(|(g, _)| g.stack).collect::<Vec<_>>(), vec![7, 2, 8, 3], "two of each class, leaks first");
        assert_eq!((left_out.groups, left_out.bytes), (2, 1005));
        // The exit summary counts what was left out.
        let shown = group();
        let s = summary_text(10, &[&shown], 0, &[], 10, None, omitted);
        assert!(s.contains("SUMMARY: leaktrace: 53 byte(s) leaked in 4 allocation(s) (5 of them in 1 small group(s) not listed"), "{s}");
    }
}
