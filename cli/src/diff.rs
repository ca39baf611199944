//! `leaktrace diff BASE NEW`: leak groups matched by their symbolized stack (function
//! names, else module+offset), never by address, so two runs of a program compare.
use std::collections::BTreeMap;

use serde::Serialize;

use crate::model::{Frame, Group, Report};

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
}

fn frame_key(f: &Frame) -> String {
    match (&f.function, &f.module, f.offset) {
        (Some(func), _, _) => func.to_string(),
        (None, Some(m), Some(off)) => format!("{m}+{off:#x}"),
        (None, Some(m), None) => m.to_string(),
        _ => "?".into(),
    }
}

pub fn group_key(g: &Group) -> String {
    let mut k = format!("{}|{}", g.kind_label(), g.api);
    for f in &g.stack {
        k.push('|');
        k.push_str(&frame_key(f));
    }
    k
}

fn collect(reports: &[Report]) -> BTreeMap<String, (Group, u64, u64)> {
    let mut m: BTreeMap<String, (Group, u64, u64)> = BTreeMap::new();
    for r in reports {
        for g in &r.leaks {
            let e = m.entry(group_key(g)).or_insert_with(|| (g.clone(), 0, 0));
            e.1 = e.1.saturating_add(g.bytes);
            e.2 = e.2.saturating_add(g.blocks);
        }
    }
    m
}

/// Changes from `base` to `new`, largest change first.
pub fn diff(base: &[Report], new: &[Report]) -> Vec<Change> {
    let b = collect(base);
    let n = collect(new);
    let mut out = Vec::new();
    for (key, (g, nb, nk)) in &n {
        let (bb, bk) = b.get(key).map(|(_, bb, bk)| (*bb, *bk)).unwrap_or((0, 0));
        let status = match b.get(key) {
            None => "new",
            Some(_) if *nb > bb => "grew",
            Some(_) if *nb < bb => "shrank",
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
            });
        }
    }
    out.sort_by(|x, y| y.new_bytes.abs_diff(y.base_bytes).cmp(&x.new_bytes.abs_diff(x.base_bytes)).then(x.status.cmp(y.status)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn report(groups: Vec<Group>) -> Report {
        Report { leaks: groups, ..Default::default() }
    }

    #[test]
    fn matches_by_stack_not_address() {
        let base = [report(vec![group("a", 10, 0x1), group("b", 10, 0x2), group("c", 10, 0x3), group("d", 5, 0x4)])];
        let new = [report(vec![group("a", 10, 0x9), group("b", 30, 0x8), group("d", 1, 0x7), group("e", 7, 0x6)])];
        let d = diff(&base, &new);
        let st: Vec<(&str, &str)> = d.iter().map(|c| (c.status, c.stack[0].function.as_deref().unwrap())).collect();
        assert_eq!(st, vec![("grew", "b"), ("gone", "c"), ("new", "e"), ("shrank", "d")]);
    }
}
