//! `leaktrace diff BASE NEW`: leak groups matched by their symbolized stack (function
//! names with their file and line, else module+offset), never by address, so two runs
//! of a program compare. Both sides are counted as `run` and `check` count them
//! (`analyze`): definite and indirect leaks after suppressions and `--min-bytes`, still
//! reachable memory only with `--include-reachable`.
use std::collections::BTreeMap;

use serde::Serialize;

use crate::analyze::Analysis;
use crate::model::{Frame, Group};

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Change {
    pub status: &'static str,
    pub kind: String,
    pub api: String,
    pub base_bytes: u64,
    pub new_bytes: u64,
    pub base_blocks: u64,
    pub new_blocks: u64,
    pub stack: Vec<Frame>,
    /// What holds the group's reachable memory in each run (`held by`), when the two
    /// differ: the root or the container changed, not only a list index.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub holder_changed: Option<(String, String)>,
}

/// A group's holder as a path reads in words, with its numbers left out (a list's
/// index, an offset and a size change from run to run; the holder does not).
fn holder_key(g: &Group) -> Option<String> {
    let text = leaktrace_common::held::held_by_text(&g.held_by)?;
    Some(text.chars().map(|c| if c.is_ascii_digit() { '#' } else { c }).collect())
}

/// `(base, new)` holders in words when both runs named one and they differ.
fn holder_change(base: &Group, new: &Group) -> Option<(String, String)> {
    let (b, n) = (holder_key(base)?, holder_key(new)?);
    (b != n).then(|| {
        let text = |g: &Group| leaktrace_common::held::held_by_text(&g.held_by).unwrap_or_default().trim_start_matches("held by: ").to_string();
        (text(base), text(new))
    })
}

/// A frame as a group's identity sees it: the function and its line (two leaks in one
/// function at two lines are two groups, as `run` and `check` show them).
pub fn frame_key(f: &Frame) -> String {
    let place = match (&f.file, f.line) {
        (Some(file), Some(line)) => format!(" {file}:{line}"),
        _ => String::new(),
    };
    match (&f.function, &f.module, f.offset) {
        (Some(func), _, _) => format!("{func}{place}"),
        (None, Some(m), Some(off)) => format!("{m}+{off:#x}"),
        (None, Some(m), None) => m.to_string(),
        _ => "?".into(),
    }
}

/// `prefix`, then each frame's `frame_key`: a stack's identity across runs and ranks.
fn stack_key(mut prefix: String, stack: &[Frame]) -> String {
    for f in stack {
        prefix.push('|');
        prefix.push_str(&frame_key(f));
    }
    prefix
}

pub fn group_key(g: &Group) -> String {
    stack_key(format!("{}|{}", g.kind_label(), g.api), &g.stack)
}

fn collect(a: &Analysis) -> BTreeMap<String, (Group, u64, u64)> {
    let mut m: BTreeMap<String, (Group, u64, u64)> = BTreeMap::new();
    for p in &a.processes {
        for g in &p.leaks {
            let e = m.entry(group_key(g)).or_insert_with(|| (g.clone(), 0, 0));
            e.1 = e.1.saturating_add(g.bytes);
            e.2 = e.2.saturating_add(g.blocks);
        }
    }
    m
}

/// Changes from `base` to `new` (each analysed with the same filters), largest change
/// first.
pub fn diff(base: &Analysis, new: &Analysis) -> Vec<Change> {
    let b = collect(base);
    let n = collect(new);
    let mut out = Vec::new();
    for (key, (g, nb, nk)) in &n {
        let (bb, bk) = b.get(key).map(|(_, bb, bk)| (*bb, *bk)).unwrap_or((0, 0));
        let holder_changed = b.get(key).and_then(|(base, _, _)| holder_change(base, g));
        let status = match b.get(key) {
            None => "new",
            Some(_) if *nb > bb => "grew",
            Some(_) if *nb < bb => "shrank",
            Some(_) if holder_changed.is_some() => "held",
            Some(_) => continue,
        };
        out.push(Change {
            status,
            kind: g.kind.to_string(),
            api: g.api.to_string(),
            base_bytes: bb,
            new_bytes: *nb,
            base_blocks: bk,
            new_blocks: *nk,
            stack: g.stack.clone(),
            holder_changed,
        });
    }
    for (key, (g, bb, bk)) in &b {
        if !n.contains_key(key) {
            out.push(Change {
                status: "gone",
                kind: g.kind.to_string(),
                api: g.api.to_string(),
                base_bytes: *bb,
                new_bytes: 0,
                base_blocks: *bk,
                new_blocks: 0,
                stack: g.stack.clone(),
                holder_changed: None,
            });
        }
    }
    out.sort_by(|x, y| y.new_bytes.abs_diff(y.base_bytes).cmp(&x.new_bytes.abs_diff(x.base_bytes)).then(x.status.cmp(y.status)));
    out
}

/// A stack or Python line whose growth differs between two runs (or two ranks).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct GrowthChange {
    /// `starts_growing` (grows only in NEW), `stops_growing` (only in BASE),
    /// `grows_faster`, `grows_slower` (by a quarter or more, and 1 KiB).
    pub status: &'static str,
    /// Always true: tells these entries from leak groups' in `diff --format json`.
    pub growth: bool,
    pub kind: String,
    pub api: String,
    pub base_grown_bytes: u64,
    pub new_grown_bytes: u64,
    pub stack: Vec<Frame>,
}

/// A growing stack's or line's identity across runs and ranks: its API and frames.
pub fn growth_key(api: &str, stack: &[Frame]) -> String {
    stack_key(api.to_string(), stack)
}

fn collect_growth(a: &Analysis) -> BTreeMap<String, (crate::growth::Growth, u64)> {
    let mut m: BTreeMap<String, (crate::growth::Growth, u64)> = BTreeMap::new();
    for p in &a.processes {
        for g in &p.growth {
            let e = m.entry(growth_key(&g.api, &g.stack)).or_insert_with(|| (g.clone(), 0));
            e.1 = e.1.saturating_add(g.grown_bytes);
        }
    }
    m
}

/// Growth from `base` to `new`: stacks and lines that start or stop growing, or grow by a
/// quarter more or less; largest change first.
pub fn diff_growth(base: &Analysis, new: &Analysis) -> Vec<GrowthChange> {
    let (b, n) = (collect_growth(base), collect_growth(new));
    let change = |status, g: &crate::growth::Growth, base_grown_bytes, new_grown_bytes| GrowthChange {
        status,
        growth: true,
        kind: g.kind.clone(),
        api: g.api.clone(),
        base_grown_bytes,
        new_grown_bytes,
        stack: g.stack.clone(),
    };
    let mut out = Vec::new();
    for (key, (g, nb)) in &n {
        match b.get(key) {
            None => out.push(change("starts_growing", g, 0, *nb)),
            Some((_, bb)) if nb.abs_diff(*bb) >= 1024 && *nb >= bb.saturating_add(bb / 4) => out.push(change("grows_faster", g, *bb, *nb)),
            Some((_, bb)) if nb.abs_diff(*bb) >= 1024 && nb.saturating_add(nb / 4) <= *bb => out.push(change("grows_slower", g, *bb, *nb)),
            Some(_) => {}
        }
    }
    for (key, (g, bb)) in &b {
        if !n.contains_key(key) {
            out.push(change("stops_growing", g, *bb, 0));
        }
    }
    out.sort_by(|x, y| y.new_grown_bytes.abs_diff(y.base_grown_bytes).cmp(&x.new_grown_bytes.abs_diff(x.base_grown_bytes)).then(x.status.cmp(y.status)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Report;
    use leaktrace_common::report_schema::{Amount, Reachability};

    fn group(func: &str, bytes: u64, ip: u64) -> Group {
        Group {
            kind: "host".into(),
            api: "malloc".into(),
            bytes,
            blocks: 1,
            stack: vec![Frame { ip, function: Some(func.into()), ..Default::default() }],
            ..Default::default()
        }
    }

    fn run(groups: Vec<Group>) -> Analysis {
        let reports = [Report { leaks: groups, ..Default::default() }];
        crate::analyze::analyze(&reports, &Default::default())
    }

    #[test]
    fn matches_by_stack_not_address() {
        let base = run(vec![group("a", 10, 0x1), group("b", 10, 0x2), group("c", 10, 0x3), group("d", 5, 0x4)]);
        let new = run(vec![group("a", 10, 0x9), group("b", 30, 0x8), group("d", 1, 0x7), group("e", 7, 0x6)]);
        let d = diff(&base, &new);
        let st: Vec<(&str, &str)> = d.iter().map(|c| (c.status, c.stack[0].function.as_deref().unwrap())).collect();
        assert_eq!(st, vec![("grew", "b"), ("gone", "c"), ("new", "e"), ("shrank", "d")]);
    }

    #[test]
    fn a_group_held_by_something_else_is_said_and_a_new_list_index_is_not() {
        use leaktrace_common::report_schema::HeldLink;
        let global = |name: &str| HeldLink { kind: "global".into(), symbol: Some(name.into()), module: Some("/bin/server".into()), ..Default::default() };
        let item = |i: u64| HeldLink { kind: "host".into(), offset: 8 * i, size: Some(1024), ..Default::default() };
        let held = |links: Vec<HeldLink>| Group { held_by: links, ..group("a", 10, 0x1) };
        let base = run(vec![held(vec![item(3), global("g_cache")])]);
        let same = run(vec![held(vec![item(7), global("g_cache")])]);
        assert!(diff(&base, &same).is_empty(), "another index in the same holder is no change");
        let moved = run(vec![held(vec![item(3), global("g_sessions")])]);
        let d = diff(&base, &moved);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].status, "held");
        let (before, now) = d[0].holder_changed.clone().unwrap();
        assert!(before.ends_with("global g_cache (server)") && now.ends_with("global g_sessions (server)"), "{before} / {now}");
    }

    fn at_line(g: Group, line: u32) -> Group {
        let mut g = g;
        g.stack[0].file = Some("f.c".into());
        g.stack[0].line = Some(line);
        g
    }

    #[test]
    fn a_leak_at_another_line_of_the_same_function_is_new() {
        let base = run(vec![at_line(group("f", 10, 0x1), 3)]);
        let new = run(vec![at_line(group("f", 10, 0x1), 3), at_line(group("f", 7, 0x2), 9)]);
        let d = diff(&base, &new);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].status, d[0].new_bytes, d[0].stack[0].line), ("new", 7, Some(9)));
    }

    #[test]
    fn still_reachable_memory_is_not_counted_unless_asked() {
        let scanned = |definite: u64, reachable: u64| {
            let mut g = group("f", definite + reachable, 0x1);
            g.reachability = Some(Reachability {
                definite: Amount { bytes: definite, blocks: u64::from(definite > 0) },
                reachable: Amount { bytes: reachable, blocks: 1 },
                ..Default::default()
            });
            g
        };
        let base = run(vec![scanned(0, 5000)]);
        let new = run(vec![scanned(1000, 6777)]);
        let d = diff(&base, &new);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].status, d[0].base_bytes, d[0].new_bytes), ("new", 0, 1000));
        let with = crate::analyze::Filters { include_reachable: true, ..Default::default() };
        let analyse = |groups| crate::analyze::analyze(&[Report { leaks: groups, ..Default::default() }], &with);
        let d = diff(&analyse(vec![scanned(0, 5000)]), &analyse(vec![scanned(1000, 6777)]));
        assert_eq!((d[0].status, d[0].base_bytes, d[0].new_bytes), ("grew", 5000, 7777));
    }

    #[test]
    fn growth_that_starts_stops_or_changes_by_a_quarter_is_told() {
        let g = |line: u32, grown: u64| crate::growth::Growth {
            kind: "all".into(),
            api: crate::growth::PYTHON_LINE.into(),
            stack_id: 0,
            first_bytes: 0,
            last_bytes: grown,
            grown_bytes: grown,
            bytes_per_minute: 0,
            points: 10,
            first_unix_ms: 0,
            last_unix_ms: 0,
            stack: vec![Frame { function: Some("step".into()), file: Some("train.py".into()), line: Some(line), ..Default::default() }],
            cached_by: None,
            held_by: vec![],
            also_held_by: None,
        };
        let side = |gs: Vec<crate::growth::Growth>| {
            let mut a = run(vec![]);
            a.processes[0].growth = gs;
            a
        };
        let base = side(vec![g(1, 10 << 20), g(2, 10 << 20), g(3, 10 << 20), g(4, 10 << 20)]);
        let new = side(vec![g(1, 10 << 20), g(2, 20 << 20), g(3, 2 << 20), g(5, 1 << 20)]);
        let st: Vec<(&str, u32)> = diff_growth(&base, &new).iter().map(|c| (c.status, c.stack[0].line.unwrap())).collect();
        assert_eq!(st, vec![("grows_faster", 2), ("stops_growing", 4), ("grows_slower", 3), ("starts_growing", 5)]);
        assert!(diff_growth(&base, &base).is_empty());
    }
}
