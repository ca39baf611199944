//! What every output format shows: per process, the leak groups left after suppressions
//! and the size threshold, the suppressed ones, and the stacks that grew during the run.
use serde::Serialize;

use crate::growth::{self, Growth};
use crate::model::{Group, Report};
use leaktrace_common::Suppressions;

#[derive(Clone, Debug, Default)]
pub struct Filters {
    pub suppressions: Option<Suppressions>,
    /// Groups smaller than this are not reported.
    pub min_bytes: u64,
    /// Growth smaller than this is not reported.
    pub growth_min_bytes: u64,
    /// Count memory the pointer scan found still reachable as leaked too.
    pub include_reachable: bool,
    /// Count memory held by known caching allocators (PyTorch, TensorFlow) as leaked too.
    pub include_cached: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct ProcessAnalysis {
    pub label: String,
    pub pid: u32,
    pub exe: String,
    pub reason: String,
    pub file: String,
    pub forked_from_pid: Option<u32>,
    /// Switched on from standby (`leaktrace attach`) at this time: its memory from
    /// before, `before_switch_bytes` of it still live, is never a leak.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switched_on_unix_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub before_switch_bytes: Option<u64>,
    /// Where it ran in a distributed job (the report's `launch`): absent outside one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub local_rank: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub leaked_bytes: u64,
    pub leaked_blocks: u64,
    pub suppressed_groups: usize,
    pub suppressed_bytes: u64,
    /// The suppression patterns that matched (LeakSanitizer's "Suppressions used:").
    #[serde(skip)]
    pub suppressions_used: Vec<leaktrace_common::suppressions::Used>,
    /// Still reachable at exit according to the pointer scan (not counted as leaked).
    pub reachable_bytes: u64,
    pub reachable_groups: usize,
    /// Held by caching allocators at exit (not counted as leaked).
    pub cached_bytes: u64,
    pub cached_groups: usize,
    /// Outstanding when a periodic report was written, the process still running and
    /// no pointer scan made: not counted as leaked (`--include-reachable` counts it).
    pub outstanding_bytes: u64,
    pub outstanding_groups: usize,
    /// Leaked in groups the report does not list (counted in `leaked_*`).
    pub unlisted_groups: u64,
    pub unlisted_bytes: u64,
    pub leaks: Vec<Group>,
    pub growth: Vec<Growth>,
    /// The leak checks the process asked for, in order.
    pub checks: Vec<crate::model::Check>,
    /// `LEAKTRACE_WHY_REACHABLE`: the reachable blocks it named and their paths.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub why_reachable: Vec<leaktrace_common::report_schema::WhyReachable>,
    /// The process's memory by part when its report was written.
    pub memory: Option<leaktrace_common::memory::Memory>,
    /// What its memory says (`leaktrace_common::memory::explain`), largest first.
    pub memory_findings: Vec<MemoryFinding>,
    /// The memory of each timeline point that has it: (unix ms, memory).
    #[serde(skip)]
    pub memory_points: Vec<(u64, leaktrace_common::memory::Memory)>,
    /// Threads whose stacks and registers the pointer scan read neither held nor copied
    /// (`unread_threads`): a leak it calls definite may be held there.
    #[serde(skip_serializing_if = "leaktrace_common::report_schema::is_zero")]
    pub unread_threads: usize,
    /// What leaktrace's holder searches cost the process (`diagnostics.holder_searches`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder_searches: Option<leaktrace_common::report_schema::HolderSearches>,
}

/// The threads of a report's pointer scan that it could neither hold nor copy: one that
/// kept its stop signal blocked while it ran, or did not stop within the scan's wait.
pub fn unread_threads(scan: Option<&leaktrace_common::report_schema::Scan>) -> usize {
    scan.filter(|s| s.ran).map_or(0, |s| s.threads.saturating_sub(s.threads_stopped + s.threads_copied))
}

/// A part of the memory that grew or holds much (`leaktrace_common::memory::Finding`).
#[derive(Clone, Debug, Serialize)]
pub struct MemoryFinding {
    pub part: &'static str,
    pub from_bytes: u64,
    pub to_bytes: u64,
    pub what: String,
    pub remedy: String,
}

impl From<leaktrace_common::memory::Finding> for MemoryFinding {
    fn from(f: leaktrace_common::memory::Finding) -> Self {
        MemoryFinding { part: f.part, from_bytes: f.from, to_bytes: f.to, what: f.what, remedy: f.remedy }
    }
}

/// A caching allocator holding much of a device's memory: at least 256 MiB and a
/// quarter of what is live there.
fn cuda_cache_finding(d: &leaktrace_common::memory::DeviceMemory) -> Option<MemoryFinding> {
    use leaktrace_common::memory::human;
    (d.cached >= 256 << 20 && d.cached * 4 >= d.live).then(|| MemoryFinding {
        part: "cuda_cache",
        from_bytes: d.cached,
        to_bytes: d.cached,
        what: format!("a CUDA caching allocator holds {} on device {} ({} live there): memory no tensor may be using", human(d.cached), d.device, human(d.live)),
        remedy: "torch.cuda.empty_cache() returns the unused part; torch.cuda.memory_summary() shows what tensors use; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragments less".into(),
    })
}

/// The memory of each timeline point of `r` that has it, oldest first.
pub fn memory_points(r: &Report) -> Vec<(u64, leaktrace_common::memory::Memory)> {
    r.timeline.points.iter().filter_map(|p| p.memory.clone().map(|m| (p.unix_ms, m))).collect()
}

#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub schema: &'static str,
    pub leaked_bytes: u64,
    pub leaked_blocks: u64,
    pub processes: Vec<ProcessAnalysis>,
    /// The view across the ranks of a distributed job (`ranks`): absent outside one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ranks: Option<crate::ranks::RankView>,
}

impl Analysis {
    pub fn has_findings(&self) -> bool {
        self.processes.iter().any(|p| !p.leaks.is_empty() || p.unlisted_bytes > 0)
    }
    pub fn growing(&self) -> usize {
        self.processes.iter().map(|p| p.growth.len()).sum()
    }
}

/// Sums of counts read from files: a damaged file must not overflow them.
pub fn sat_add(a: u64, b: u64) -> u64 {
    a.saturating_add(b)
}

pub fn analyze(reports: &[Report], filters: &Filters) -> Analysis {
    let mut ranks = crate::ranks::RankViewBuilder::default();
    let processes: Vec<ProcessAnalysis> = reports
        .iter()
        .map(|r| {
            let p = analyze_one(r, filters);
            ranks.add(r, &p);
            p
        })
        .collect();
    Analysis::of(processes, ranks)
}

/// An analysis being made one report at a time (`add`), none of them kept: what `report`
/// and `check` use over a job's many reports.
#[derive(Default)]
pub struct Streamed {
    processes: Vec<(u64, u32, ProcessAnalysis)>,
    ranks: crate::ranks::RankViewBuilder,
}

impl Streamed {
    pub fn add(&mut self, r: &Report, filters: &Filters) {
        let p = analyze_one(r, filters);
        self.ranks.add(r, &p);
        self.processes.push((r.started_unix_ms, r.pid, p));
    }

    /// The analysis, processes in the order `model::load` gives their reports.
    pub fn finish(mut self) -> Analysis {
        self.processes.sort_by_key(|(started, pid, _)| (*started, *pid));
        Analysis::of(self.processes.into_iter().map(|(_, _, p)| p).collect(), self.ranks)
    }
}

impl Analysis {
    fn of(processes: Vec<ProcessAnalysis>, ranks: crate::ranks::RankViewBuilder) -> Analysis {
        // The view across ranks, for a job of several (or one rank of several).
        let view = (!ranks.is_empty()).then(|| ranks.finish()).filter(|v| v.ranks.len() > 1 || v.world_size.is_some_and(|n| n > 1));
        let mut a = Analysis { schema: "leaktrace-analysis/1", leaked_bytes: 0, leaked_blocks: 0, processes, ranks: view };
        a.add_up();
        a
    }

    /// Keeps the processes `keep` accepts (one rank's, for `diff --base-rank`), the
    /// totals counted again over them.
    pub fn retain(&mut self, keep: impl FnMut(&ProcessAnalysis) -> bool) {
        self.processes.retain(keep);
        self.add_up();
    }

    /// The totals over the processes.
    fn add_up(&mut self) {
        self.leaked_bytes = self.processes.iter().map(|p| p.leaked_bytes).fold(0, sat_add);
        self.leaked_blocks = self.processes.iter().map(|p| p.leaked_blocks).fold(0, sat_add);
    }
}

/// One process's analysis.
pub fn analyze_one(r: &Report, filters: &Filters) -> ProcessAnalysis {
    let mut leaks = Vec::new();
    let (mut suppressed_groups, mut suppressed_bytes) = (0, 0);
    let (mut reachable_groups, mut reachable_bytes) = (0, 0);
    let (mut cached_groups, mut cached_bytes) = (0, 0);
    let (mut outstanding_groups, mut outstanding_bytes) = (0, 0);
    // A periodic report is written while the process runs, without a pointer scan: its
    // groups are what was outstanding then, which the program may still hold and free.
    // Leaks are known at exit (or at a signal's snapshot, which scans); a process
    // killed before it has only this (`model::without_final_report` says so).
    let running = r.reason == "periodic" && !filters.include_reachable;
    let applied = filters.suppressions.as_ref().map(|s| s.apply_to_groups(&r.leaks));
    for (i, g) in r.leaks.iter().enumerate() {
        // Sampled Python objects are the interpreter's to free: their growth
        // counts (below), never a leak.
        if g.kind == "python" {
            continue;
        }
        // What a caching allocator holds at exit is its cache (docs/report-format.md).
        if g.cached_by.is_some() && !filters.include_cached {
            cached_groups += 1;
            cached_bytes = sat_add(cached_bytes, g.bytes);
            continue;
        }
        // A suppressed leak takes the indirect leaks that hang from it along.
        let mut g = g.clone();
        if let (Some(a), Some(r)) = (&applied, g.reachability.as_mut()) {
            let (bytes, blocks) = a.hidden_indirect[i];
            suppressed_bytes = sat_add(suppressed_bytes, bytes.min(r.indirect.bytes));
            r.indirect.bytes -= bytes.min(r.indirect.bytes);
            r.indirect.blocks -= blocks.min(r.indirect.blocks);
        }
        // With a pointer scan, what a root still reaches is not a leak (LSan).
        let g = &match (g.reachability, filters.include_reachable) {
            (Some(reach), false) => {
                reachable_bytes = sat_add(reachable_bytes, reach.reachable.bytes);
                let mut counted = g.clone();
                counted.bytes = sat_add(reach.definite.bytes, reach.indirect.bytes);
                counted.blocks = sat_add(reach.definite.blocks, reach.indirect.blocks);
                if counted.blocks == 0 {
                    reachable_groups += 1;
                    continue;
                }
                counted
            }
            (None, _) if running => {
                outstanding_groups += 1;
                outstanding_bytes = sat_add(outstanding_bytes, g.bytes);
                continue;
            }
            _ => g.clone(),
        };
        if applied.as_ref().is_some_and(|a| a.suppressed[i]) {
            suppressed_groups += 1;
            suppressed_bytes = sat_add(suppressed_bytes, g.bytes);
            continue;
        }
        if g.bytes < filters.min_bytes {
            continue;
        }
        leaks.push(g.clone());
    }
    // The groups the report does not list: leaked, or outstanding in a periodic one.
    let unlisted = if running {
        outstanding_bytes = sat_add(outstanding_bytes, r.summary.omitted.leaked_bytes);
        Default::default()
    } else {
        r.summary.omitted
    };
    let growth = growth::detect(r, filters.growth_min_bytes)
        .into_iter()
        .filter(|gr| {
            let as_group = Group { stack: gr.stack.clone(), ..Default::default() };
            filters.suppressions.as_ref().and_then(|s| s.matching_group(&as_group)).is_none()
        })
        .collect();
    let memory_points = memory_points(r);
    let mut memory_findings: Vec<MemoryFinding> =
        leaktrace_common::memory::explain(&memory_points, r.fork.forked_from_pid.is_some()).into_iter().map(Into::into).collect();
    memory_findings.extend(r.memory.iter().flat_map(|m| m.devices.iter()).filter_map(cuda_cache_finding));
    ProcessAnalysis {
        memory: r.memory.clone(),
        memory_findings,
        memory_points,
        label: r.label(),
        pid: r.pid,
        exe: r.exe.clone(),
        reason: r.reason.to_string(),
        file: r.path.display().to_string(),
        forked_from_pid: r.fork.forked_from_pid,
        switched_on_unix_ms: r.fork.switched_on_unix_ms,
        before_switch_bytes: r.fork.switched_on_unix_ms.map(|_| r.fork.inherited_live_bytes),
        rank: r.launch.rank,
        local_rank: r.launch.local_rank,
        world_size: r.launch.world_size,
        host: (r.launch.rank.is_some() || r.launch.launcher).then(|| r.launch.host.clone()).filter(|h| !h.is_empty()),
        leaked_bytes: leaks.iter().map(|g| g.bytes).fold(unlisted.leaked_bytes, sat_add),
        leaked_blocks: leaks.iter().map(|g| g.blocks).fold(unlisted.leaked_blocks, sat_add),
        unlisted_groups: unlisted.groups,
        unlisted_bytes: unlisted.leaked_bytes,
        outstanding_bytes,
        outstanding_groups,
        suppressed_groups,
        suppressed_bytes,
        reachable_bytes,
        reachable_groups,
        cached_bytes,
        cached_groups,
        suppressions_used: applied.map(|a| a.used).unwrap_or_default(),
        leaks,
        growth,
        checks: r.checks.clone(),
        why_reachable: r.why_reachable.clone(),
        unread_threads: unread_threads(r.scan.as_ref()),
        holder_searches: r.diagnostics.holder_searches,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report whose exit scan could not read one of its threads says so beside its
    /// leaks (a thread that ran with the stop signal blocked: the block only it held was
    /// once reported definite); with every thread read, or no leak, nothing is added.
    /// What the holder searches cost is read from the report's diagnostics and told in
    /// text and in Markdown (a CI summary) once it is a second.
    #[test]
    fn the_holder_searches_cost_is_read_from_the_report_and_told_in_text_and_markdown() {
        let text = r#"{"schema":"leaktrace-report/3","pid":7,"exe":"/bin/python3","reason":"exit",
            "summary":{"host":{"live_bytes":64,"live_blocks":1}},
            "diagnostics":{"holder_searches":{"searches":1,"rounds":12,"bytes_read":880000000,"cpu_ms":1264,"exit_rounds":4,"exit_bytes_read":3513055646,"exit_ms":6615}},
            "leaks":[{"kind":"host","api":"malloc","bytes":64,"blocks":1,"stack":[]}]}"#;
        let r = crate::model::parse(text, std::path::Path::new("r.json")).unwrap();
        let a = analyze(std::slice::from_ref(&r), &Filters { include_reachable: true, ..Filters::default() });
        assert_eq!(a.processes[0].holder_searches.map(|h| (h.rounds, h.exit_ms)), Some((12, 6615)));
        for shown in [crate::render::text(&a, 10), crate::render::markdown(&a, 10)] {
            assert!(shown.contains("1 search(es) while it ran, 12 round(s)") && shown.contains("which held the exit 6.6 s"), "{shown}");
        }
    }

    #[test]
    fn a_scan_that_left_a_thread_unread_is_told_beside_the_leaks() {
        let report = |threads: usize, stopped: usize, copied: usize, definite: u64| {
            let text = format!(
                r#"{{"schema":"leaktrace-report/3","pid":7,"exe":"/bin/prog","reason":"exit",
                "summary":{{"host":{{"live_bytes":64,"live_blocks":1}}}},
                "scan":{{"ran":true,"threads":{threads},"threads_stopped":{stopped},"threads_copied":{copied}}},
                "leaks":[{{"kind":"host","api":"malloc","bytes":64,"blocks":1,"stack":[],
                  "reachability":{{"definite":{{"bytes":{definite},"blocks":{}}},"indirect":{{"bytes":0,"blocks":0}},"reachable":{{"bytes":{},"blocks":{}}}}}}}]}}"#,
                u64::from(definite > 0),
                64 - definite,
                u64::from(definite == 0)
            );
            crate::model::parse(&text, std::path::Path::new("r.json")).unwrap()
        };
        let note = "could not read 1 thread(s)";
        let shown = |r: &Report| crate::render::text(&analyze(std::slice::from_ref(r), &Filters::default()), 10);
        let unread = report(2, 1, 0, 64);
        assert_eq!(analyze_one(&unread, &Filters::default()).unread_threads, 1);
        assert!(shown(&unread).contains(note), "{}", shown(&unread));
        // A copied thread was read; a held one too.
        assert!(!shown(&report(3, 2, 1, 64)).contains(note));
        // No leak: nothing to doubt.
        assert!(!shown(&report(2, 1, 0, 0)).contains(note));
    }

    /// A periodic report lists what was outstanding while the process ran, unscanned:
    /// `check` on a running job's folder (or on a killed process's last report) called
    /// every live block a leak, and failed. At exit, unscanned (`LEAKTRACE_SCAN=0`),
    /// what was never freed is the leak, as before.
    #[test]
    fn a_periodic_reports_outstanding_blocks_are_no_leak_and_an_exit_reports_are() {
        let report = |reason: &str| {
            let text = format!(
                r#"{{"schema":"leaktrace-report/3","pid":7,"exe":"/bin/prog","reason":"{reason}",
                "summary":{{"host":{{"live_bytes":4160,"live_blocks":2}}}},
                "leaks":[{{"kind":"host","api":"malloc","bytes":4096,"blocks":1,"stack":[]}},{{"kind":"host","api":"malloc","bytes":64,"blocks":1,"stack":[]}}]}}"#
            );
            crate::model::parse(&text, std::path::Path::new("r.json")).unwrap()
        };
        let running = analyze_one(&report("periodic"), &Filters::default());
        assert_eq!((running.leaked_bytes, running.leaks.len()), (0, 0));
        assert_eq!((running.outstanding_bytes, running.outstanding_groups), (4160, 2));
        let shown = crate::render::text(&analyze(&[report("periodic")], &Filters::default()), 10);
        assert!(shown.contains("4160 byte(s) outstanding not counted: a periodic report"), "{shown}");
        let counted = analyze_one(&report("periodic"), &Filters { include_reachable: true, ..Filters::default() });
        assert_eq!(counted.leaked_bytes, 4160);
        let exited = analyze_one(&report("exit"), &Filters::default());
        assert_eq!((exited.leaked_bytes, exited.outstanding_bytes), (4160, 0));
    }
}
