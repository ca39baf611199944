//! Growth detection: stacks whose live bytes rise steadily across the periodic
//! snapshots after a warm-up — the training-loop leak that is freed at exit and so
//! never shows in the exit report.
//!
//! Rule, on one stack's series of live bytes (the final exit point and the points
//! measured during or after the Python interpreter's teardown are left out, since
//! teardown frees what the run accumulated):
//! * at least `MIN_POINTS` points; the first quarter is warm-up and ignored;
//! * after warm-up, at least 70% of the pairs of points (earlier, later) rise and at most
//!   15% of the steps go down (`leaktrace_common::growth::rises_steadily`: pairs, so that
//!   memory that grows in steps, a list's buffer, is growth wherever the points fall);
//! * it is still rising at the end: the last value exceeds the value three quarters in;
//! * it grew by at least `min_bytes` overall after warm-up.
//!
//! A decline at the very end (at most a quarter of the points, none higher than the one
//! before, ending lower than it started: a flat tail is a plateau, not teardown) is teardown, as the exit point is: Python frees a training loop's history on
//! its way out, over several snapshots when there is a lot of it. It is left out too.
//!
//! A series starts at its first non-zero point: the zeros before it mean the stack was
//! not followed yet (or had nothing), as in a job whose leak starts after a long import,
//! and would otherwise read as a flat stretch.
//!
//! A plateau (growth that stops) fails the third test; noise fails the second.
use serde::Serialize;

use crate::model::{Frame, Point, Report};

pub const MIN_POINTS: usize = 8;
pub const DEFAULT_MIN_BYTES: u64 = 1024;

#[derive(Clone, Debug, Serialize)]
pub struct Growth {
    pub kind: String,
    pub api: String,
    pub stack_id: u32,
    pub first_bytes: u64,
    pub last_bytes: u64,
    pub grown_bytes: u64,
    pub bytes_per_minute: u64,
    pub points: usize,
    /// When the points of `first_bytes` and `last_bytes` were taken (ms since the epoch):
    /// the span `bytes_per_minute` is measured over.
    pub first_unix_ms: u64,
    pub last_unix_ms: u64,
    pub stack: Vec<Frame>,
    /// The caching allocator that holds this stack's memory (a CUDA segment of
    /// PyTorch's allocator, say): the stack is then that of the allocation that found
    /// the cache empty, not that of the tensors that fill the segment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_by: Option<String>,
    /// What keeps the memory alive at the final report (`Group::held_by`), when the
    /// scan found it: for a stack, its own path; for a line, that of the largest
    /// followed stack under the line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub held_by: Vec<leaktrace_common::report_schema::HeldLink>,
    /// The second holder, when the blocks looked at are held by different things
    /// (`Group::also_held_by`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub also_held_by: Option<leaktrace_common::report_schema::OtherHolder>,
}

/// What to say under a growing stack that a caching allocator holds: its stack names
/// whichever allocation found the cache empty, and how to find the line that keeps the
/// memory instead.
pub fn cached_note(cached_by: &str) -> String {
    let how = if cached_by.contains("PyTorch") {
        "run again with PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, where each tensor is its own allocation with its own line"
    } else {
        "run again with the allocator's caching turned off to see the allocations that keep it"
    };
    format!("held by {cached_by}: a segment is allocated by whichever allocation finds the cache empty, not by the one that keeps it; to see the line that keeps it, {how}")
}

/// Whether `values` (after warm-up) grow steadily by at least `min_bytes`.
pub fn grows_steadily(values: &[u64], min_bytes: u64) -> bool {
    if values.len() < MIN_POINTS {
        return false;
    }
    let data = &values[values.len() / 4..];
    let steps = data.len() - 1;
    let first = data[0];
    let last = data[steps];
    let three_quarters = data[steps * 3 / 4];
    leaktrace_common::growth::rises_steadily(data) && last > three_quarters && last >= first.saturating_add(min_bytes)
}

/// How many points at the end are teardown: a non-increasing tail, at most a quarter of
/// the series, that ends lower than the point before it began.
fn teardown_points(values: &[u64]) -> usize {
    let n = values.len();
    let mut k = 0;
    while k + 1 < n && (k + 1) * 4 <= n && values[n - k - 1] <= values[n - k - 2] {
        k += 1;
    }
    // Shrink to the longest tail that really declined (a flat run is a plateau).
    while k > 0 && values[n - 1] >= values[n - k - 1] {
        k -= 1;
    }
    k
}

/// The `api` of a growth found on a line of the user's Python code (its `stack` is that
/// one Python frame).
pub const PYTHON_LINE: &str = "python line";
/// The `kind` of a Python line's growth, which counts host and CUDA memory together.
pub const ALL_KINDS: &str = "all";

/// A series that grows steadily, over the span its rate is measured on.
struct Steady {
    first: u64,
    last: u64,
    points: usize,
    per_minute: u64,
    first_unix_ms: u64,
    last_unix_ms: u64,
}

fn steady_growth(bytes: &[u64], points: &[Point], cut: usize, min_bytes: u64) -> Option<Steady> {
    let values = &bytes[..bytes.len().saturating_sub(cut)];
    if values.len() != points.len() {
        return None;
    }
    let followed_from = values.iter().position(|&v| v != 0).unwrap_or(values.len());
    let (values, points) = (&values[followed_from..], &points[followed_from..]);
    let end = values.len() - teardown_points(values);
    let (values, points) = (&values[..end], &points[..end]);
    if !grows_steadily(values, min_bytes) {
        return None;
    }
    let start = values.len() / 4;
    let (first, last) = (values[start], *values.last()?);
    let (first_unix_ms, last_unix_ms) = (points[start].unix_ms, points.last()?.unix_ms);
    let minutes = last_unix_ms.saturating_sub(first_unix_ms) as f64 / 60_000.0;
    let per_minute = if minutes > 0.0 { ((last - first) as f64 / minutes) as u64 } else { 0 };
    Some(Steady { first, last, points: values.len(), per_minute, first_unix_ms, last_unix_ms })
}

/// Whether a stack's Python frames pass through the import machinery.
fn made_by_an_import(stack: &[Frame]) -> bool {
    stack.iter().any(leaktrace_common::frame_text::is_import_frame)
}

/// Growing lines of the user's Python code first (most growth first), then growing
/// stacks.
/// The holder path of the largest followed stack (or listed group) whose innermost
/// Python frame of the user's is `line`: a line's growth is the sum of its stacks.
fn line_holder(report: &Report, line: &Frame) -> (Vec<leaktrace_common::report_schema::HeldLink>, Option<leaktrace_common::report_schema::OtherHolder>) {
    let own = report.timeline.lines.iter().find(|l| Some(l.line) == line.line && line.file.as_deref() == Some(l.file.as_str()) && !l.held_by.is_empty());
    if let Some(l) = own {
        return (l.held_by.clone(), l.also_held_by.clone());
    }
    let at_line = |stack: &[Frame]| stack.iter().any(|f| f.python && f.line == line.line && f.file == line.file && f.function == line.function);
    let series = report.timeline.series.iter().map(|s| (s.bytes.last().copied().unwrap_or(0), report.series_stack(s), &s.held_by, &s.also_held_by));
    let groups = report.leaks.iter().map(|g| (g.bytes, g.stack.as_slice(), &g.held_by, &g.also_held_by));
    series
        .chain(groups)
        .filter(|(_, stack, held, _)| !held.is_empty() && at_line(stack))
        .max_by_key(|(bytes, _, _, _)| *bytes)
        .map(|(_, _, held, also)| (held.clone(), also.clone()))
        .unwrap_or_default()
}

pub fn detect(report: &Report, min_bytes: u64) -> Vec<Growth> {
    let all = report.timeline.points.as_slice();
    let mut run = leaktrace_common::memory::before_teardown(all, |p| p.memory.as_ref().is_some_and(|m| m.after_teardown));
    if report.reason == "exit" {
        run = run.min(all.len().saturating_sub(1));
    }
    let (points, cut) = (&all[..run], all.len() - run);
    let growth = |kind: &str, api: &str, stack_id: u32, g: Steady, stack: Vec<Frame>| Growth {
        kind: kind.into(),
        api: api.into(),
        stack_id,
        first_bytes: g.first,
        last_bytes: g.last,
        grown_bytes: g.last - g.first,
        bytes_per_minute: g.per_minute,
        points: g.points,
        first_unix_ms: g.first_unix_ms,
        last_unix_ms: g.last_unix_ms,
        stack,
        cached_by: None,
        held_by: Vec::new(),
        also_held_by: None,
    };
    let mut lines: Vec<Growth> = report
        .timeline
        .lines
        .iter()
        .filter_map(|l| {
            let g = steady_growth(&l.bytes, points, cut, min_bytes)?;
            let frame = Frame {
                function: Some(l.function.as_str().into()),
                file: Some(l.file.as_str().into()),
                line: Some(l.line),
                python: true,
                ..Default::default()
            };
            // A line's series adds up every kind of memory allocated under it: host
            // blocks and CUDA allocations alike (a tensor made by `cudaMallocAsync`).
            Some(growth(ALL_KINDS, PYTHON_LINE, 0, g, vec![frame]))
        })
        .collect();
    let mut stacks: Vec<Growth> = report
        .timeline
        .series
        .iter()
        .filter_map(|s| {
            let stack = report.series_stack(s);
            // Memory an import made is start-up (`import torch` rises for seconds).
            if made_by_an_import(stack) {
                return None;
            }
            let mut g = growth(&s.kind, &s.api, s.stack_id, steady_growth(&s.bytes, points, cut, min_bytes)?, stack.to_vec());
            let listed = report.leaks.iter().find(|l| l.stack_id == s.stack_id && l.api == s.api);
            g.cached_by = listed.and_then(|l| l.cached_by.as_ref()).map(|c| c.to_string());
            (g.held_by, g.also_held_by) = match listed {
                Some(l) if s.held_by.is_empty() => (l.held_by.clone(), l.also_held_by.clone()),
                _ => (s.held_by.clone(), s.also_held_by.clone()),
            };
            Some(g)
        })
        .collect();
    for l in lines.iter_mut() {
        (l.held_by, l.also_held_by) = line_holder(report, &l.stack[0]);
    }
    lines.sort_by_key(|g| std::cmp::Reverse(g.grown_bytes));
    stacks.sort_by_key(|g| std::cmp::Reverse(g.grown_bytes));
    lines.extend(stacks);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_growth_is_flagged() {
        let v: Vec<u64> = (0..30).map(|i| 1000 + i * 4096).collect();
        assert!(grows_steadily(&v, 1024));
    }

    #[test]
    fn plateau_noise_and_short_runs_are_not() {
        let plateau: Vec<u64> = (0..30).map(|i| 1000 + i.min(12) * 4096).collect();
        assert!(!grows_steadily(&plateau, 1024));
        let noisy: Vec<u64> = (0..30).map(|i| if i % 2 == 0 { 10_000 } else { 50_000 }).collect();
        assert!(!grows_steadily(&noisy, 1024));
        let short: Vec<u64> = (0..5).map(|i| i * 100_000).collect();
        assert!(!grows_steadily(&short, 1024));
        let tiny: Vec<u64> = (0..30).map(|i| 1000 + i).collect();
        assert!(!grows_steadily(&tiny, 1024));
    }

    /// The bytes of a Python list's buffer (CPython's over-allocation: a ninth more and
    /// six items, rounded to four) after `items` appends.
    fn list_buffer(items: u64) -> u64 {
        let (mut size, mut allocated) = (0u64, 0u64);
        while size < items {
            size += 1;
            if size > allocated {
                allocated = (size + (size >> 3) + 6) & !3;
            }
        }
        allocated * 8
    }

    #[test]
    fn a_list_that_keeps_every_step_grows_wherever_the_points_fall() {
        // A loop appends a loss per step at a steady rate; its list's buffer grows in
        // steps. Sampled at 20 points, whatever their phase against the steps and
        // however many steps fall between two of them, it grows (the steps' rule, 70%
        // of the steps up, missed it at some phases: the verdict moved from run to run).
        let mut steps_rule_missed = 0;
        for per_point in [300u64, 450, 600, 900] {
            for phase in 0..per_point {
                let series: Vec<u64> = (0..20).map(|k| list_buffer(phase + (k + 1) * per_point)).collect();
                assert!(grows_steadily(&series, 1024), "{per_point} appends a point, phase {phase}: {series:?}");
                let data = &series[series.len() / 4..];
                let ups = data.windows(2).filter(|w| w[1] > w[0]).count() as u64;
                steps_rule_missed += !leaktrace_common::growth::mostly_rising(data.len() as u64 - 1, ups, 0) as u32;
            }
        }
        assert!(steps_rule_missed > 0, "the case the pairs rule is for no longer arises");
    }

    #[test]
    fn growth_with_a_few_dips_still_counts() {
        let v: Vec<u64> = (0..40).map(|i| 1000 + i * 4096 - if i % 10 == 5 { 2048 } else { 0 }).collect();
        assert!(grows_steadily(&v, 1024));
    }

    #[test]
    fn a_growing_python_line_comes_first() {
        use crate::model::Series;
        use leaktrace_common::report_schema::LineSeries;
        let mut r = Report { reason: "periodic".into(), ..Default::default() };
        r.timeline.points = (0..20).map(|i| Point { unix_ms: i * 1000, live_bytes: 0, live_blocks: 0, memory: None }).collect();
        r.timeline.series = vec![Series {
            kind: "host".into(),
            api: "malloc".into(),
            stack_id: 1,
            stack: None,
            bytes: (0..20).map(|i| i * 1_000_000).collect(),
            held_by: Vec::new(),
            also_held_by: None,
        }];
        r.timeline.lines = vec![
            LineSeries {
                function: "main".into(),
                file: "/w/train.py".into(),
                line: 41,
                bytes: (0..20).map(|i| i * 100_000).collect(),
                held_by: vec![],
                also_held_by: None,
            },
            LineSeries { function: "setup".into(), file: "/w/train.py".into(), line: 9, bytes: vec![5_000_000; 20], held_by: vec![], also_held_by: None },
        ];
        let found = detect(&r, 1024);
        assert_eq!(found.len(), 2);
        assert_eq!((found[0].api.as_str(), found[0].kind.as_str()), (PYTHON_LINE, ALL_KINDS));
        assert_eq!((found[0].stack[0].file.as_deref(), found[0].stack[0].line), (Some("/w/train.py"), Some(41)));
        assert!(found[0].bytes_per_minute > 5_000_000, "{}", found[0].bytes_per_minute);
        // The rate's span: from the point a quarter in (after warm-up) to the last.
        assert_eq!((found[0].first_unix_ms, found[0].last_unix_ms), (5_000, 19_000));
        assert_eq!(found[0].bytes_per_minute, (found[0].grown_bytes as f64 / (14_000.0 / 60_000.0)) as u64);
        assert_eq!(found[1].api, "malloc");
    }

    #[test]
    fn memory_an_import_makes_is_start_up_not_growth() {
        use crate::model::Series;
        let mut r = Report { reason: "periodic".into(), ..Default::default() };
        r.timeline.points = (0..20).map(|i| Point { unix_ms: i * 250, live_bytes: 0, live_blocks: 0, memory: None }).collect();
        let frame = |file: &str| Frame { function: Some("f".into()), file: Some(file.into()), line: Some(1), python: true, ..Default::default() };
        let stack = |files: &[&str]| Some(files.iter().map(|f| frame(f)).collect::<Vec<_>>());
        let rising: Vec<u64> = (0..20).map(|i| i * 1_000_000).collect();
        r.timeline.series = vec![
            Series {
                kind: "host".into(),
                api: "malloc".into(),
                stack_id: 1,
                stack: stack(&["<frozen importlib._bootstrap>", "/w/train.py"]),
                bytes: rising.clone(),
                held_by: Vec::new(),
                also_held_by: None,
            },
            Series {
                kind: "host".into(),
                api: "malloc".into(),
                stack_id: 2,
                stack: stack(&["/w/train.py"]),
                bytes: rising,
                held_by: Vec::new(),
                also_held_by: None,
            },
        ];
        let found = detect(&r, 1024);
        assert_eq!(found.iter().map(|g| g.stack_id).collect::<Vec<_>>(), [2]);
    }

    #[test]
    fn a_growing_segment_of_a_caching_allocator_says_so_and_how_to_find_its_line() {
        use crate::model::{Group, Series};
        let mut r = Report { reason: "periodic".into(), ..Default::default() };
        r.timeline.points = (0..20).map(|i| Point { unix_ms: i * 1000, live_bytes: 0, live_blocks: 0, memory: None }).collect();
        let rising: Vec<u64> = (0..20).map(|i| i * (2 << 20)).collect();
        r.timeline.series = vec![
            Series {
                kind: "device".into(),
                api: "cudaMalloc".into(),
                stack_id: 7,
                stack: None,
                bytes: rising.clone(),
                held_by: Vec::new(),
                also_held_by: None,
            },
            Series { kind: "device".into(), api: "cudaMalloc".into(), stack_id: 8, stack: None, bytes: rising, held_by: Vec::new(), also_held_by: None },
        ];
        r.leaks = vec![
            Group {
                kind: "device".into(),
                api: "cudaMalloc".into(),
                cached_by: Some("PyTorch CUDACachingAllocator".into()),
                stack_id: 7,
                ..Default::default()
            },
            Group { kind: "device".into(), api: "cudaMalloc".into(), stack_id: 8, ..Default::default() },
        ];
        let found = detect(&r, 1024);
        let cached: Vec<Option<&str>> = found.iter().map(|g| g.cached_by.as_deref()).collect();
        assert_eq!(cached, [Some("PyTorch CUDACachingAllocator"), None]);
        let note = cached_note("PyTorch CUDACachingAllocator");
        assert!(note.contains("whichever allocation finds the cache empty") && note.contains("backend:cudaMallocAsync"), "{note}");
        assert!(!cached_note("TensorFlow BFC").contains("PYTORCH"));
    }

    #[test]
    fn points_measured_after_the_interpreters_teardown_began_are_not_the_runs() {
        use crate::model::Series;
        // 16 points of a growing loop; the loop's memory freed as its function returns
        // (two points), then five points of a slow teardown on a loaded machine, exit.
        let mut bytes: Vec<u64> = (1..=16).map(|i| i * 10_000_000).collect();
        bytes.extend([90_000_000, 120_000, 120_000, 120_000, 120_000, 120_000, 115_000, 115_000]);
        let mut r = Report { reason: "exit".into(), ..Default::default() };
        r.timeline.points = (0..bytes.len() as u64).map(|i| Point { unix_ms: i * 300, ..Default::default() }).collect();
        r.timeline.series =
            vec![Series { kind: "host".into(), api: "malloc".into(), stack_id: 1, stack: None, bytes, held_by: Vec::new(), also_held_by: None }];
        assert!(detect(&r, 1024).is_empty(), "unmarked, a decline over a third of the points is no growth");
        for p in &mut r.timeline.points[18..] {
            p.memory = Some(leaktrace_common::memory::Memory { after_teardown: true, ..Default::default() });
        }
        let found = detect(&r, 1024);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].last_bytes, 160_000_000);
    }

    #[test]
    fn a_stack_that_starts_growing_late_is_flagged_from_where_it_starts() {
        use crate::model::Series;
        // 20 points of import (the stack not followed yet), 12 of a growing loop, exit.
        let bytes: Vec<u64> = (0..33).map(|i| if (20..32).contains(&i) { (i - 19) * 1_000_000 } else { 0 }).collect();
        let mut r = Report { reason: "exit".into(), ..Default::default() };
        r.timeline.points = (0..33).map(|i| Point { unix_ms: i * 100, live_bytes: 0, live_blocks: 0, memory: None }).collect();
        r.timeline.series =
            vec![Series { kind: "host".into(), api: "malloc".into(), stack_id: 1, stack: None, bytes, held_by: Vec::new(), also_held_by: None }];
        let found = detect(&r, 1024);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].points, 12);
        // Freed over the last snapshots (teardown): still flagged.
        let mut torn = r.clone();
        torn.timeline.series[0].bytes[29..32].copy_from_slice(&[3_000_000, 0, 0]);
        assert_eq!(detect(&torn, 1024).len(), 1);
        assert_eq!(teardown_points(&[1, 2, 3, 4, 5, 6, 7, 7]), 0, "a flat end is a plateau");
        assert_eq!(teardown_points(&[1, 2, 3, 4, 5, 6, 7, 0]), 1);
        assert_eq!(teardown_points(&[1, 2, 3, 4, 5, 6, 0, 0]), 2);
        assert!(found[0].grown_bytes >= 8_000_000, "{:?}", found[0].grown_bytes);
        // The same stack at a plateau is not.
        r.timeline.series[0].bytes = (0..33).map(|i| if i >= 20 { 5_000_000 } else { 0 }).collect();
        assert!(detect(&r, 1024).is_empty());
    }
}
