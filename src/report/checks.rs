//! Leak checks the program asks for while it runs (the C API: `leaktrace_snapshot`,
//! `__lsan_do_recoverable_leak_check`): each classifies the outstanding blocks of a
//! region (allocated since the last `leaktrace_mark`) or of the whole process with the
//! pointer scan, and is kept under its label for every later report (`checks`).
use std::borrow::Cow;

use super::build::{Amount, Group, Reachability};
pub use leaktrace_common::report_schema::{CheckLeak, Scope};

/// Leak groups kept per check, largest first (the rest are counted in the totals).
pub const KEPT_GROUPS: usize = 8;
/// Checks kept per process; later ones are counted only.
pub const KEPT_CHECKS: usize = 20_000;

/// A check, its leaks' stacks in full (the report writes them as frame-table indices).
pub type Check = leaktrace_common::report_schema::Check;

/// A check of `groups` (every group with blocks in the checked set, each with its stack
/// and its breakdown in `reachability`), suppressions already applied by the caller:
/// `shown` are the groups left, `suppressed` what the hidden ones held.
pub fn make(label: &str, unix_ms: u64, scope: Scope, all: &[Group], shown: &[Cow<'_, Group>]) -> Check {
    let mut found = Reachability::default();
    for r in shown.iter().filter_map(|g| g.reachability) {
        found += r;
    }
    let mut suppressed = Amount::default();
    for r in all.iter().filter_map(|g| g.reachability) {
        suppressed += r.leaked();
    }
    let kept = found.leaked();
    suppressed.bytes -= kept.bytes.min(suppressed.bytes);
    suppressed.blocks -= kept.blocks.min(suppressed.blocks);
    let leaked = |g: &Group| g.reachability.map(|r| r.leaked()).unwrap_or_default();
    let mut leaking: Vec<&Group> = shown.iter().map(|g| &**g).filter(|g| leaked(g).blocks > 0).collect();
    leaking.sort_by_key(|g| std::cmp::Reverse((leaked(g).bytes, leaked(g).blocks)));
    Check {
        label: label.to_string(),
        unix_ms,
        scope,
        found,
        suppressed,
        leak_groups: leaking.len(),
        leaks: leaking
            .iter()
            .take(KEPT_GROUPS)
            .map(|g| CheckLeak {
                kind: g.kind.clone(),
                api: g.api.clone(),
                device: g.device,
                reachability: g.reachability.unwrap_or_default(),
                stack_id: g.stack_id,
                stack: g.stack.clone(),
            })
            .collect(),
        why_reachable: Vec::new(),
    }
}

/// A check as the C API hands it to the program (`leaktrace_snapshot_json`): the
/// counts, and each kept leak's stack as text lines in the frames-only view (native
/// frames up to the first Python frame, then Python frames, `frame_text::frames_only_view`).
pub fn to_json(c: &Check) -> String {
    let leaks: Vec<serde_json::Value> = c
        .leaks
        .iter()
        .map(|l| {
            let frames: Vec<String> = leaktrace_common::frame_text::frames_only_view(&l.stack)
                .into_iter()
                .enumerate()
                .map(|(i, at)| super::build::frame_text(i, &l.stack[at]).trim_start().to_string())
                .collect();
            serde_json::json!({
                "kind": l.kind,
                "api": l.api,
                "definite": l.reachability.definite,
                "indirect": l.reachability.indirect,
                "frames": frames,
            })
        })
        .collect();
    serde_json::json!({
        "label": c.label,
        "scope": c.scope,
        "definite": c.found.definite,
        "indirect": c.found.indirect,
        "reachable": c.found.reachable,
        "suppressed": c.suppressed,
        "leak_groups": c.leak_groups,
        "leaks": leaks,
    })
    .to_string()
}

/// The exit summary's lines about checks that leaked (LeakSanitizer style, one line
/// each, the first stack's top frames under it); empty when none did.
pub fn summary_lines(checks: &[Check], dropped: u64) -> String {
    let leaking: Vec<&Check> = checks.iter().filter(|c| c.leaked_blocks() > 0).collect();
    if leaking.is_empty() {
        return String::new();
    }
    let mut s = format!("leaktrace: {} of {} checks leaked:\n", leaking.len(), checks.len() as u64 + dropped);
    for c in leaking.iter().take(20) {
        s.push_str(&format!(
            "  {}: {} bytes in {} blocks ({} definite, {} indirect)\n",
            c.label,
            c.leaked_bytes(),
            c.leaked_blocks(),
            c.found.definite.bytes,
            c.found.indirect.bytes
        ));
        if let Some(l) = c.leaks.first() {
            for (i, at) in leaktrace_common::frame_text::frames_only_view(&l.stack).into_iter().take(4).enumerate() {
                s.push_str(&super::build::frame_text(i, &l.stack[at]));
                s.push('\n');
            }
        }
    }
    if leaking.len() > 20 {
        s.push_str(&format!("  ... and {} more (see the report's \"checks\")\n", leaking.len() - 20));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(stack_id: u32, definite: u64, indirect: u64, reachable: u64) -> Group {
        Group {
            kind: "host".into(),
            api: "malloc".into(),
            device: None,
            cached_by: None,
            bytes: definite + indirect + reachable,
            blocks: 3,
            peak_bytes: 0,
            total_allocs: 0,
            total_bytes: 0,
            stack_id,
            reachability: Some(Reachability {
                definite: Amount { bytes: definite, blocks: (definite > 0) as u64 },
                indirect: Amount { bytes: indirect, blocks: (indirect > 0) as u64 },
                reachable: Amount { bytes: reachable, blocks: (reachable > 0) as u64 },
            }),
            indirect_from: Vec::new(),
            stack: Vec::new(),
            held_by: Vec::new(),
            also_held_by: None,
        }
    }

    #[test]
    fn a_check_counts_what_is_shown_and_what_suppressions_hid() {
        let all = [group(1, 100, 0, 0), group(2, 0, 0, 4096), group(3, 7, 30, 0)];
        let shown = [Cow::Borrowed(&all[0]), Cow::Borrowed(&all[1])];
        let c = make("t", 0, Scope::Region, &all, &shown);
        assert_eq!(c.leaked_bytes(), 100);
        assert_eq!(c.found.reachable.bytes, 4096);
        assert_eq!(c.suppressed, Amount { bytes: 37, blocks: 2 });
        assert_eq!(c.leak_groups, 1, "the reachable-only group is no leak");
        assert_eq!(c.leaks[0].stack_id, 1);
        let json: serde_json::Value = serde_json::from_str(&to_json(&c)).unwrap();
        assert_eq!(json["definite"]["bytes"], 100);
        assert_eq!(json["label"], "t");
        assert!(summary_lines(std::slice::from_ref(&c), 0).contains("t: 100 bytes in 1 blocks"));
        let clean = make("u", 0, Scope::Region, &all[1..2], &[Cow::Borrowed(&all[1])]);
        assert_eq!(summary_lines(&[clean], 0), "");
    }
}
