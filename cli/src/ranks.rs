//! One view across the ranks of a distributed job (issue 54): which ranks grow and which
//! do not, the same stack or line grouped across ranks ("train.py:14 grows on rank 1
//! only: 158 MB; rank 0: flat"), the worst rank for leaks, growth and RSS, the tracer's
//! own memory per rank, and the ranks that left no final report (or none at all).
//!
//! Built one process at a time (`RankViewBuilder::add`), so that `report` and `check`
//! can read a job's reports one by one without holding them all: what a rank keeps here
//! is a handful of numbers and the hashes of the stacks and lines its timeline follows.
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use serde::Serialize;

use crate::analyze::ProcessAnalysis;
use crate::growth::{Growth, PYTHON_LINE};
use crate::model::{Frame, Report};

/// One rank: its process (the largest of those that carry the rank's variables, forked
/// workers apart), and what its processes add up to.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankRow {
    pub rank: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The rank's own process.
    pub pid: u32,
    /// Whether that process wrote its final report (false: killed by the OOM killer,
    /// a timeout, SIGKILL, a crash; its leaks after the last report are unknown).
    pub final_report: bool,
    /// Other processes of the rank: its forked workers and the programs it ran.
    pub other_processes: usize,
    /// Leaked by the rank's processes, workers included (as `check` counts).
    pub leaked_bytes: u64,
    /// Growth of the rank's process and workers: the stacks that grew steadily.
    pub grown_bytes: u64,
    pub growing: usize,
    /// The rank's process's largest RSS over its timeline (its last, without one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
    /// The tracer's own resident memory in the rank's process, as last measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracer_bytes: Option<u64>,
}

/// A stack or a Python line that grows on at least one rank, with what it did on each.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SharedGrowth {
    /// The first frame of the user's code ("step (train.py:14)"), else the innermost.
    pub place: String,
    /// `python line`, or the allocation API of a stack.
    pub api: String,
    /// (rank, bytes grown) for each rank where it grows, largest first.
    pub grows_on: Vec<(u32, u64)>,
    /// Ranks whose timeline follows it without steady growth.
    pub flat_on: Vec<u32>,
    /// Ranks whose timeline does not follow it at all.
    pub absent_on: Vec<u32>,
    pub stack: Vec<Frame>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Worst {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leaks: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub growth: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracer: Option<u32>,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct RankView {
    /// The job's size as its ranks' launchers gave it (the largest seen).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    pub ranks: Vec<RankRow>,
    /// Ranks below the world size that left no report at all.
    pub never_reported: Vec<u32>,
    /// Ranks whose process left no final report.
    pub without_final_report: Vec<u32>,
    pub worst: Worst,
    /// Largest growth first.
    pub growth: Vec<SharedGrowth>,
}

impl RankView {
    /// Whether a rank is missing: no report at all, or no final one.
    pub fn missing_ranks(&self) -> bool {
        !self.never_reported.is_empty() || !self.without_final_report.is_empty()
    }
}

/// A growing stack or line as ranks share it: its API and symbolized frames (function,
/// file and line; addresses differ from rank to rank).
fn key_of(api: &str, stack: &[Frame]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::diff::growth_key(api, stack).hash(&mut h);
    h.finish()
}

/// The keys of every stack and line `r`'s timeline follows (growing or not).
fn followed_keys(r: &Report) -> HashSet<u64> {
    let mut keys = HashSet::new();
    for l in &r.timeline.lines {
        let frame =
            Frame { function: Some(l.function.as_str().into()), file: Some(l.file.as_str().into()), line: Some(l.line), python: true, ..Default::default() };
        keys.insert(key_of(PYTHON_LINE, std::slice::from_ref(&frame)));
    }
    for s in &r.timeline.series {
        keys.insert(key_of(&s.api, r.series_stack(s)));
    }
    keys
}

fn place_of(stack: &[Frame]) -> String {
    leaktrace_common::held::site(stack).or_else(|| stack.first().map(crate::diff::frame_key)).unwrap_or_else(|| "<no stack>".into())
}

/// What one process adds to its rank.
struct Member {
    pid: u32,
    forked: bool,
    final_report: bool,
    host: Option<String>,
    leaked_bytes: u64,
    peak_rss: Option<u64>,
    tracer: Option<u64>,
    /// What its growth adds to its rank's: its lines' where it has any, else its
    /// stacks' (a line and the stacks under it count the same bytes), and how many.
    grown_bytes: u64,
    growing: usize,
}

/// A growing stack or line across ranks: its API, its frames, and what it grew by on
/// each rank.
type Across = (String, Vec<Frame>, BTreeMap<u32, u64>);

/// Takes the processes of a job one at a time (`add`), then `finish`es the view.
#[derive(Default)]
pub struct RankViewBuilder {
    members: BTreeMap<u32, Vec<Member>>,
    world_size: Option<u32>,
    /// Every stack or line that grows on some rank, by its key (`key_of`).
    growing: HashMap<u64, Across>,
    /// The keys of what each rank's processes' timelines follow, growing or not.
    followed: BTreeMap<u32, HashSet<u64>>,
}

impl RankViewBuilder {
    /// One process: its report and its analysis. Processes without a rank (a launcher,
    /// a wrapper) are not part of the view.
    pub fn add(&mut self, r: &Report, p: &ProcessAnalysis) {
        let Some(rank) = r.launch.rank else { return };
        if r.launch.launcher {
            return;
        }
        self.world_size = self.world_size.max(r.launch.world_size);
        let member = Member {
            pid: p.pid,
            forked: p.forked_from_pid.is_some(),
            final_report: r.reason == "exit" || r.reason == "detach",
            host: p.host.clone(),
            leaked_bytes: p.leaked_bytes,
            peak_rss: p.memory_points.iter().map(|(_, m)| m.rss).max().or(p.memory.as_ref().map(|m| m.rss)),
            tracer: p.memory.as_ref().map(|m| m.tracer).filter(|&t| t > 0),
            grown_bytes: 0,
            growing: 0,
        };
        let growth: Vec<(&str, &[Frame], u64)> = p.growth.iter().map(|g: &Growth| (g.api.as_str(), g.stack.as_slice(), g.grown_bytes)).collect();
        self.add_member(rank, member, &growth, followed_keys(r));
    }

    /// `member` of `rank`, with its growth (API, frames, bytes) and the keys of what its
    /// timeline follows.
    fn add_member(&mut self, rank: u32, mut member: Member, growth: &[(&str, &[Frame], u64)], followed: HashSet<u64>) {
        for &(api, stack, bytes) in growth {
            let e = self.growing.entry(key_of(api, stack)).or_insert_with(|| (api.to_string(), stack.to_vec(), BTreeMap::new()));
            let at = e.2.entry(rank).or_insert(0);
            *at = at.saturating_add(bytes);
        }
        let lines = growth.iter().filter(|g| g.0 == PYTHON_LINE).count();
        let counted = growth.iter().filter(|g| lines == 0 || g.0 == PYTHON_LINE);
        member.growing = counted.clone().count();
        member.grown_bytes = counted.map(|g| g.2).fold(0, u64::saturating_add);
        self.followed.entry(rank).or_default().extend(followed);
        self.members.entry(rank).or_default().push(member);
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn finish(self) -> RankView {
        let mut rows = Vec::new();
        for (rank, members) in &self.members {
            // The rank's own process: not a forked worker, the largest by RSS.
            let own = members
                .iter()
                .filter(|m| !m.forked)
                .max_by_key(|m| (m.peak_rss.unwrap_or(0), std::cmp::Reverse(m.pid)))
                .or_else(|| members.iter().max_by_key(|m| m.peak_rss.unwrap_or(0)))
                .expect("a rank has a process");
            rows.push(RankRow {
                rank: *rank,
                host: own.host.clone(),
                pid: own.pid,
                final_report: own.final_report,
                other_processes: members.len() - 1,
                leaked_bytes: members.iter().map(|m| m.leaked_bytes).fold(0, u64::saturating_add),
                grown_bytes: members.iter().map(|m| m.grown_bytes).fold(0, u64::saturating_add),
                growing: members.iter().map(|m| m.growing).sum(),
                peak_rss_bytes: own.peak_rss,
                tracer_bytes: own.tracer,
            });
        }
        let ranks: Vec<u32> = rows.iter().map(|r| r.rank).collect();
        let followed = &self.followed;
        let mut growth: Vec<SharedGrowth> = self
            .growing
            .into_iter()
            .map(|(key, (api, stack, on))| {
                let mut grows_on: Vec<(u32, u64)> = on.into_iter().collect();
                grows_on.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                let (mut flat_on, mut absent_on) = (Vec::new(), Vec::new());
                for r in &ranks {
                    if grows_on.iter().any(|g| g.0 == *r) {
                        continue;
                    }
                    if followed.get(r).is_some_and(|k| k.contains(&key)) {
                        flat_on.push(*r);
                    } else {
                        absent_on.push(*r);
                    }
                }
                SharedGrowth { place: place_of(&stack), api, grows_on, flat_on, absent_on, stack }
            })
            .collect();
        growth.sort_by(|a, b| {
            let total = |g: &SharedGrowth| g.grows_on.iter().map(|x| x.1).fold(0u64, u64::saturating_add);
            total(b).cmp(&total(a)).then(a.place.cmp(&b.place))
        });
        let worst_by = |f: &dyn Fn(&RankRow) -> u64| rows.iter().filter(|r| f(r) > 0).max_by_key(|r| (f(r), std::cmp::Reverse(r.rank))).map(|r| r.rank);
        let worst = Worst {
            leaks: worst_by(&|r| r.leaked_bytes),
            growth: worst_by(&|r| r.grown_bytes),
            rss: worst_by(&|r| r.peak_rss_bytes.unwrap_or(0)),
            tracer: worst_by(&|r| r.tracer_bytes.unwrap_or(0)),
        };
        let never_reported = match self.world_size {
            Some(n) if n <= 1 << 20 => (0..n).filter(|r| !self.members.contains_key(r)).collect(),
            _ => Vec::new(),
        };
        let without_final_report = rows.iter().filter(|r| !r.final_report).map(|r| r.rank).collect();
        RankView { world_size: self.world_size, ranks: rows, never_reported, without_final_report, worst, growth }
    }
}

/// "0-3, 5, 7-9": ranks as ranges.
pub fn ranges(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(", ")
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        one.to_string()
    } else {
        many.to_string()
    }
}

/// A growing stack or line in one line: where, on which ranks, by how much, and what
/// the other ranks did.
pub fn growth_line(g: &SharedGrowth) -> String {
    use crate::render::human_bytes;
    let on: Vec<u32> = g.grows_on.iter().map(|x| x.0).collect();
    let total = g.grows_on.iter().map(|x| x.1).fold(0u64, u64::saturating_add);
    let only = if g.flat_on.is_empty() && g.absent_on.is_empty() { "" } else { " only" };
    let amounts = if g.grows_on.len() == 1 {
        human_bytes(total)
    } else {
        let max = g.grows_on[0];
        format!("{} in all, most on rank {} ({})", human_bytes(total), max.0, human_bytes(max.1))
    };
    let what = if g.api == PYTHON_LINE { String::new() } else { format!(" [{}]", g.api) };
    let mut line = format!("{}{what} grows on {} {}{only}: {amounts}", g.place, plural(on.len(), "rank", "ranks"), ranges(&on));
    if !g.flat_on.is_empty() {
        line.push_str(&format!("; {} {}: flat", plural(g.flat_on.len(), "rank", "ranks"), ranges(&g.flat_on)));
    }
    if !g.absent_on.is_empty() {
        line.push_str(&format!("; {} {}: not there", plural(g.absent_on.len(), "rank", "ranks"), ranges(&g.absent_on)));
    }
    line
}

/// The view as text: a table of ranks, then the growth across them, the worst ranks and
/// the missing ones. At most `top` growing stacks.
pub fn text(v: &RankView, top: usize) -> String {
    use crate::render::human_bytes;
    let mut out = String::new();
    let world = v.world_size.map(|n| format!(" of {n}")).unwrap_or_default();
    out.push_str(&format!("==== Ranks: {} reported{world}\n", v.ranks.len()));
    out.push_str(&format!("{:>6}  {:<16} {:>8}  {:>12} {:>12} {:>12} {:>12}  final\n", "rank", "host", "pid", "leaked", "grew", "peak RSS", "tracer"));
    let opt = |b: Option<u64>| b.map(human_bytes).unwrap_or_else(|| "-".into());
    for r in &v.ranks {
        let host: String = r.host.as_deref().unwrap_or("-").chars().take(16).collect();
        out.push_str(&format!(
            "{:>6}  {:<16} {:>8}  {:>12} {:>12} {:>12} {:>12}  {}\n",
            r.rank,
            host,
            r.pid,
            human_bytes(r.leaked_bytes),
            human_bytes(r.grown_bytes),
            opt(r.peak_rss_bytes),
            opt(r.tracer_bytes),
            if r.final_report { "yes" } else { "NO" }
        ));
    }
    // A rank that grew by under 1% of the most any rank grew is told apart: a few KiB
    // of a step's noise beside a rank that keeps a tensor per step.
    let most = v.ranks.iter().map(|r| r.grown_bytes).max().unwrap_or(0);
    let growing: Vec<u32> = v.ranks.iter().filter(|r| r.growing > 0 && r.grown_bytes.saturating_mul(100) >= most).map(|r| r.rank).collect();
    let little: Vec<u32> = v.ranks.iter().filter(|r| r.growing > 0 && r.grown_bytes.saturating_mul(100) < most).map(|r| r.rank).collect();
    let flat: Vec<u32> = v.ranks.iter().filter(|r| r.growing == 0).map(|r| r.rank).collect();
    out.push('\n');
    if growing.is_empty() {
        out.push_str("No rank grows.\n");
    } else {
        let little = if little.is_empty() { String::new() } else { format!("; under 1% of that: {}", ranges(&little)) };
        out.push_str(&format!(
            "Growing: {} {}{little}; flat: {}\n",
            plural(growing.len(), "rank", "ranks"),
            ranges(&growing),
            if flat.is_empty() { "none".into() } else { ranges(&flat) }
        ));
    }
    for g in v.growth.iter().take(top) {
        out.push_str(&format!("  {}\n", growth_line(g)));
    }
    if v.growth.len() > top {
        out.push_str(&format!("  ... {} more growing stack(s) or line(s); --top N shows more\n", v.growth.len() - top));
    }
    let worst = |what: &str, rank: Option<u32>, amount: &dyn Fn(&RankRow) -> String| {
        rank.and_then(|k| v.ranks.iter().find(|r| r.rank == k)).map(|r| format!("{what}: rank {} ({})", r.rank, amount(r)))
    };
    let worst: Vec<String> = [
        worst("leaks", v.worst.leaks, &|r| human_bytes(r.leaked_bytes)),
        worst("growth", v.worst.growth, &|r| human_bytes(r.grown_bytes)),
        worst("RSS", v.worst.rss, &|r| opt(r.peak_rss_bytes)),
        worst("tracer", v.worst.tracer, &|r| opt(r.tracer_bytes)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !worst.is_empty() {
        out.push_str(&format!("Worst: {}\n", worst.join("; ")));
    }
    if !v.without_final_report.is_empty() {
        out.push_str(&format!(
            "No final report from {} {}: killed (the OOM killer, a timeout, SIGKILL) or crashed; their leaks after the last report are unknown\n",
            plural(v.without_final_report.len(), "rank", "ranks"),
            ranges(&v.without_final_report)
        ));
    }
    if !v.never_reported.is_empty() {
        out.push_str(&format!(
            "No report at all from {} {}: not started under leaktrace, or writing elsewhere (LEAKTRACE_OUTPUT)\n",
            plural(v.never_reported.len(), "rank", "ranks"),
            ranges(&v.never_reported)
        ));
    }
    out.push('\n');
    out
}

/// The view as Markdown (a CI step summary): the ranks' table and the growth across them.
pub fn markdown(v: &RankView, top: usize) -> String {
    use crate::render::human_bytes;
    let opt = |b: Option<u64>| b.map(human_bytes).unwrap_or_else(|| "-".into());
    let world = v.world_size.map(|n| format!(" of {n}")).unwrap_or_default();
    let mut out = format!("\n#### Ranks: {} reported{world}\n\n| rank | host | pid | leaked | grew | peak RSS | tracer | final report |\n|---:|---|---:|---:|---:|---:|---:|---|\n", v.ranks.len());
    for r in &v.ranks {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.rank,
            r.host.as_deref().unwrap_or("-").replace('|', "\\|"),
            r.pid,
            human_bytes(r.leaked_bytes),
            human_bytes(r.grown_bytes),
            opt(r.peak_rss_bytes),
            opt(r.tracer_bytes),
            if r.final_report { "yes" } else { "**no**" }
        ));
    }
    out.push('\n');
    for g in v.growth.iter().take(top) {
        out.push_str(&format!("- {}\n", growth_line(g).replace('|', "\\|").replace('`', "'")));
    }
    if !v.without_final_report.is_empty() {
        out.push_str(&format!("- **No final report** from rank(s) {}\n", ranges(&v.without_final_report)));
    }
    if !v.never_reported.is_empty() {
        out.push_str(&format!("- **No report at all** from rank(s) {}\n", ranges(&v.never_reported)));
    }
    out
}

/// The view as an HTML section: the ranks side by side (one column each) for each
/// measure, then the growth across them.
pub fn html(v: &RankView, esc: impl Fn(&str) -> String) -> String {
    use crate::render::human_bytes;
    let opt = |b: Option<u64>| b.map(human_bytes).unwrap_or_else(|| "-".into());
    let world = v.world_size.map(|n| format!(" of {n}")).unwrap_or_default();
    let mut out = format!("<h2>Ranks ({} reported{world})</h2><div class=\"ranks\"><table><thead><tr><th></th>", v.ranks.len());
    for r in &v.ranks {
        out.push_str(&format!("<th>rank {}</th>", r.rank));
    }
    out.push_str("</tr></thead><tbody>");
    let row = |name: &str, cell: &dyn Fn(&RankRow) -> String, worst: Option<u32>| {
        let mut tr = format!("<tr><th>{name}</th>");
        for r in &v.ranks {
            let mark = if worst == Some(r.rank) { " class=\"worst\"" } else { "" };
            tr.push_str(&format!("<td{mark}>{}</td>", cell(r)));
        }
        tr + "</tr>"
    };
    out.push_str(&row("host", &|r| esc(r.host.as_deref().unwrap_or("-")), None));
    out.push_str(&row("pid", &|r| r.pid.to_string(), None));
    out.push_str(&row("leaked", &|r| human_bytes(r.leaked_bytes), v.worst.leaks));
    out.push_str(&row("grew", &|r| human_bytes(r.grown_bytes), v.worst.growth));
    out.push_str(&row("peak RSS", &|r| opt(r.peak_rss_bytes), v.worst.rss));
    out.push_str(&row("tracer", &|r| opt(r.tracer_bytes), v.worst.tracer));
    out.push_str(&row("final report", &|r| if r.final_report { "yes".into() } else { "<b>no</b>".into() }, None));
    out.push_str("</tbody></table></div><ul>");
    for g in v.growth.iter().take(50) {
        out.push_str(&format!("<li>{}</li>", esc(&growth_line(g))));
    }
    if !v.never_reported.is_empty() {
        out.push_str(&format!("<li><b>No report at all</b> from rank(s) {}</li>", ranges(&v.never_reported)));
    }
    out.push_str("</ul>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(function: &str, file: &str, line: u32) -> Frame {
        Frame { function: Some(function.into()), file: Some(file.into()), line: Some(line), python: true, ..Default::default() }
    }

    /// Adds a process of `rank` (pid 100 + rank) with its growth and what it follows.
    fn add(b: &mut RankViewBuilder, rank: u32, growth: &[(&str, &[Frame], u64)], followed: &[(&str, &[Frame])], rss: u64, final_report: bool) {
        let m = Member {
            pid: 100 + rank,
            forked: false,
            final_report,
            host: Some("node1".into()),
            leaked_bytes: 0,
            peak_rss: Some(rss),
            tracer: Some(rss / 10),
            grown_bytes: 0,
            growing: 0,
        };
        b.add_member(rank, m, growth, followed.iter().map(|(api, st)| key_of(api, st)).collect());
    }

    #[test]
    fn a_line_growing_on_one_rank_is_named_with_the_flat_ranks_and_the_missing_ones() {
        let line = vec![frame("step", "/job/train.py", 14)];
        let other = vec![frame("load", "/job/data.py", 3)];
        let mut b = RankViewBuilder { world_size: Some(4), ..Default::default() };
        add(&mut b, 0, &[], &[(PYTHON_LINE, &line)], 500 << 20, true);
        add(&mut b, 1, &[(PYTHON_LINE, &line, 158 << 20)], &[(PYTHON_LINE, &line)], 900 << 20, true);
        add(&mut b, 2, &[], &[(PYTHON_LINE, &other)], 400 << 20, false);
        let v = b.finish();
        assert_eq!(v.ranks.len(), 3);
        assert_eq!(v.never_reported, vec![3]);
        assert_eq!(v.without_final_report, vec![2]);
        assert_eq!((v.worst.growth, v.worst.rss, v.worst.leaks), (Some(1), Some(1), None));
        assert_eq!(v.growth.len(), 1);
        let g = &v.growth[0];
        assert_eq!((g.grows_on.clone(), g.flat_on.clone(), g.absent_on.clone()), (vec![(1, 158 << 20)], vec![0], vec![2]));
        assert_eq!(growth_line(g), "step (train.py:14) grows on rank 1 only: 158.0 MiB; rank 0: flat; rank 2: not there");
        let t = text(&v, 10);
        assert!(t.contains("Growing: rank 1; flat: 0, 2"), "{t}");
        assert!(t.contains("Worst: growth: rank 1 (158.0 MiB); RSS: rank 1 (900.0 MiB); tracer: rank 1 (90.0 MiB)"), "{t}");
        assert!(t.contains("No final report from rank 2") && t.contains("No report at all from rank 3"), "{t}");
    }

    #[test]
    fn the_same_stack_on_several_ranks_is_one_entry_and_a_ranks_line_is_not_counted_twice() {
        let line = vec![frame("step", "/job/train.py", 14)];
        let stack = vec![Frame { function: Some("malloc".into()), ..Default::default() }, frame("step", "/job/train.py", 14)];
        let mut b = RankViewBuilder { world_size: Some(2), ..Default::default() };
        for (rank, bytes) in [(0u32, 10u64 << 20), (1, 30 << 20)] {
            add(&mut b, rank, &[(PYTHON_LINE, &line, bytes), ("malloc", &stack, bytes)], &[], 1 << 30, true);
        }
        let v = b.finish();
        assert_eq!(v.growth.len(), 2, "the line and the stack, each once across ranks");
        let l = v.growth.iter().find(|g| g.api == PYTHON_LINE).unwrap();
        assert_eq!(l.grows_on, vec![(1, 30 << 20), (0, 10 << 20)]);
        assert_eq!(growth_line(l), "step (train.py:14) grows on ranks 0-1: 40.0 MiB in all, most on rank 1 (30.0 MiB)");
        // A rank's growth is its lines', not its lines' and the stacks under them.
        assert_eq!(v.ranks.iter().map(|r| (r.rank, r.grown_bytes, r.growing)).collect::<Vec<_>>(), vec![(0, 10 << 20, 1), (1, 30 << 20, 1)]);
    }

    #[test]
    fn ranks_read_as_ranges() {
        assert_eq!(ranges(&[7, 0, 1, 2, 3, 5, 8, 9, 3]), "0-3, 5, 7-9");
        assert_eq!(ranges(&[]), "");
    }
}
