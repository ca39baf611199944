//! Leak checks the program asks for through the C API (`leaktrace_check`,
//! `__lsan_do_recoverable_leak_check`).
use crate::util::FxMap as HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::hotpath::event::Api;
use crate::hotpath::thread;
use crate::lifecycle::LIFECYCLE;
use crate::report::build::{self, Tally};
use crate::report::checks;
use crate::report::process;
use crate::scan::mark::Verdict;

use super::consumer::{drain_into, lock_bounded, ScanPause, SCAN_AT_EXIT, STATE};
use super::reports::REPORT;
use super::verdicts::classify_live;

/// A leak check the program asked for (the C API): drains what was published so far,
/// runs the pointer scan over every outstanding block, and classifies those of `scope`
/// (allocated since the last `leaktrace_mark`, or all); suppressions apply. The check is
/// kept under `label` for every later report. `None` when nothing is tracked here or
/// the scan is off (`LEAKTRACE_SCAN=0`).
///
/// Runs on the calling thread, which is not stopped: its stack from here up is a root,
/// as the program's own frames are (LeakSanitizer's `__lsan_do_recoverable_leak_check`
/// does the same).
pub fn checkpoint(label: &str, scope: checks::Scope) -> Option<checks::Check> {
    if !LIFECYCLE.tracking() || !SCAN_AT_EXIT.load(Ordering::Relaxed) || LIFECYCLE.final_in_progress() {
        return None;
    }
    // A raw clone's child is taken over first: its parent's blocks are then inherited,
    // not its own leaks, and no lock of a thread it does not have is waited for.
    super::fork::adopt_if_cloned();
    thread::untracked(|| catch_unwind(AssertUnwindSafe(|| checkpoint_inner(label, scope))).ok().flatten())
}

fn checkpoint_inner(label: &str, scope: checks::Scope) -> Option<checks::Check> {
    let (input, mark, pause) = {
        let mut state = lock_bounded(&STATE, Duration::from_secs(5))?;
        let c = state.as_mut()?;
        // Every event published before this call (ours in order, other threads' up to
        // their tickets) is applied before the blocks are taken.
        let backlog = c.order.backlog();
        drain_into(c, backlog, false);
        (c.model.live_blocks(), c.model.mark(), ScanPause::start())
    };
    let out = classify_live(&input);
    drop(pause);
    let verdicts = &out.verdicts;
    let mut by_group: HashMap<(u32, Api, Option<u8>), build::Reachability> = Default::default();
    let in_scope = |b: &crate::collector::state::LiveEntry| scope != checks::Scope::Region || b.mark() == mark;
    for (b, &v) in input.blocks.iter().zip(verdicts) {
        if in_scope(b) {
            by_group.entry((b.stack, b.api(), b.device())).or_default().add(v, b.size());
        }
    }
    let mut keys: Vec<_> = by_group.into_iter().collect();
    // Leaked groups first, largest first: those are the ones named.
    keys.sort_by_key(|(_, r)| std::cmp::Reverse((r.leaked().bytes, r.leaked().blocks)));
    let named = keys.iter().take_while(|(_, r)| r.leaked().blocks > 0).count().min(CHECK_NAMED_GROUPS);
    let mut report = lock_bounded(&REPORT, Duration::from_secs(30))?;
    let r = report.as_mut()?;
    let ids: Vec<u32> = keys[..named].iter().map(|((stack, _, _), _)| *stack).collect();
    let mut stacks = build::resolve_stacks(&ids, &mut r.symbolizer).into_iter();
    let groups: Vec<build::Group> = keys
        .iter()
        .enumerate()
        .map(|(i, ((stack, api, device), reach))| build::Group {
            kind: api.kind().name().into(),
            api: api.name().into(),
            device: device.map(u32::from),
            cached_by: None,
            bytes: reach.outstanding().bytes,
            blocks: reach.outstanding().blocks,
            peak_bytes: 0,
            total_allocs: 0,
            total_bytes: 0,
            stack_id: *stack,
            reachability: Some(*reach),
            indirect_from: Vec::new(),
            stack: if i < named { stacks.next().unwrap_or_default() } else { Vec::new() },
            held_by: Vec::new(),
            also_held_by: None,
        })
        .collect();
    let (shown, _, _) = build::apply_suppressions(&groups, &r.suppressions);
    let mut check = checks::make(label, process::unix_ms(), scope, &groups, &shown);
    if let Some(template) = r.config.why_reachable.clone() {
        // The checked blocks the scan found reachable, of the groups the template names.
        let reachable = |(b, v): (&crate::collector::state::LiveEntry, &Verdict)| *v == Verdict::Reachable && in_scope(b);
        let mut ids: Vec<u32> = input.blocks.iter().zip(verdicts).filter(|&e| reachable(e)).map(|(b, _)| b.stack).collect();
        ids.sort_unstable();
        ids.dedup();
        let named = build::resolve_stacks(&ids, &mut r.symbolizer);
        let stacks: HashMap<u32, Vec<leaktrace_common::report_schema::Frame>> =
            ids.into_iter().zip(named).filter(|(_, s)| super::verdicts::stack_matches(&template, s)).collect();
        let blocks: Vec<usize> =
            (0..input.blocks.len()).filter(|&i| reachable((&input.blocks[i], &verdicts[i])) && stacks.contains_key(&input.blocks[i].stack)).collect();
        check.why_reachable = super::verdicts::why_reachable(
            &input.blocks,
            &blocks,
            (&out.parent, &out.via, crate::scan::Labels::new(&out.labels, &input.inherited)),
            &stacks,
            &mut r.symbolizer,
        );
    }
    if r.checks.len() < checks::KEPT_CHECKS {
        r.checks.push(check.clone());
    } else {
        r.checks_dropped += 1;
    }
    Some(check)
}

/// Leaked groups of a check whose stacks are named (and matched by suppressions).
const CHECK_NAMED_GROUPS: usize = 256;
