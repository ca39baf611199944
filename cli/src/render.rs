//! Text (LeakSanitizer style), Markdown (CI step summaries) and JSON renderings.
use crate::analyze::Analysis;
use crate::diff::Change;
use crate::model::Frame;

pub use leaktrace_common::frame_text::frame_line;
/// Set by `--native-frames`: stacks with Python frames are shown whole, not in the
/// frames-only view (`frame_text::frames_only_view`).
pub static NATIVE_FRAMES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The indices of `stack` to show: all, or the frames-only view of a Python stack.
pub fn shown_frames(stack: &[Frame]) -> Vec<usize> {
    if NATIVE_FRAMES.load(std::sync::atomic::Ordering::Relaxed) {
        return (0..stack.len()).collect();
    }
    leaktrace_common::frame_text::frames_only_view(stack)
}

/// The "held by" line under a group or a growing stack, when the scan found one.
fn held_text(out: &mut String, links: &[leaktrace_common::report_schema::HeldLink], also: Option<&leaktrace_common::report_schema::OtherHolder>) {
    if let Some(line) = leaktrace_common::held::held_by_text(links) {
        out.push_str(&format!("    {line}\n"));
        also_text(out, also);
    }
}

/// The second holder's line, when the blocks looked at are held by different things.
fn also_text(out: &mut String, also: Option<&leaktrace_common::report_schema::OtherHolder>) {
    if let Some(line) = also.and_then(leaktrace_common::held::also_held_by_text) {
        out.push_str(&format!("    {line}\n"));
    }
}

/// A listed group's "held by": the path is its still-reachable part's; a group that also
/// leaked says which part it names.
fn group_held_text(out: &mut String, g: &crate::model::Group) {
    let Some(line) = leaktrace_common::held::held_by_text(&g.held_by) else { return };
    match g.reachability {
        Some(r) if r.leaked().bytes > 0 => {
            let rest = line.trim_start_matches("held by: ");
            out.push_str(&format!("    (its {} still-reachable byte(s) are held by: {rest})\n", r.reachable.bytes));
        }
        _ => out.push_str(&format!("    {line}\n")),
    }
    also_text(out, g.also_held_by.as_ref());
}

fn stack_text(out: &mut String, stack: &[Frame]) {
    if stack.is_empty() {
        out.push_str("    <no stack>\n");
    }
    let shown = shown_frames(stack);
    for (i, &k) in shown.iter().enumerate() {
        out.push_str(&frame_line(i, &stack[k]));
        out.push('\n');
    }
    if let Some(hidden) = leaktrace_common::frame_text::hidden_frames_text(stack, &shown) {
        out.push_str(&format!("    ({hidden}; --native-frames shows them)\n"));
    }
}

/// `LEAKTRACE_WHY_REACHABLE`'s blocks: each with its size, address, allocation site and
/// the path that keeps it.
fn why_text(out: &mut String, place: &str, blocks: &[leaktrace_common::report_schema::WhyReachable]) {
    if blocks.is_empty() {
        return;
    }
    out.push_str(&format!("\nWhy reachable{place}: {} block(s)\n", blocks.len()));
    for b in blocks {
        let site = leaktrace_common::held::site(&b.stack).map(|s| format!(" from {s}")).unwrap_or_default();
        let held = leaktrace_common::held::held_by_text(&b.held_by).unwrap_or_else(|| "held by: (no path)".into());
        out.push_str(&format!("  {} B at {:#x} ({}){site}\n    {held}\n", b.size, b.address, b.api));
    }
}

/// The leak checks of a process (the C API, the pytest plugin): how many leaked, and
/// for each that did a line with the largest leak's stack under it (the clean ones are
/// only counted; `report --format json` lists every check).
fn checks_text(out: &mut String, checks: &[crate::model::Check]) {
    if checks.is_empty() {
        return;
    }
    let leaking = checks.iter().filter(|c| c.leaked_blocks() > 0).count();
    out.push_str(&format!("\nChecks: {leaking} of {} leaked\n", checks.len()));
    for c in checks {
        if c.leaked_blocks() == 0 {
            continue;
        }
        out.push_str(&format!(
            "  LEAK  {}: {} byte(s) in {} allocation(s) ({} definite, {} indirect)\n",
            c.label,
            c.leaked_bytes(),
            c.leaked_blocks(),
            c.found.definite.bytes,
            c.found.indirect.bytes
        ));
        if let Some(l) = c.leaks.first() {
            for (i, at) in shown_frames(&l.stack).into_iter().take(10).enumerate() {
                out.push_str(&frame_line(i, &l.stack[at]));
                out.push('\n');
            }
        }
    }
}

pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A process with nothing to show: no leak, no growth, nothing left unlisted. Wrappers
/// (a pyenv shim's shell helpers, `env`, `bash -c`) are such processes.
fn quiet(p: &crate::analyze::ProcessAnalysis) -> bool {
    p.leaks.is_empty() && p.growth.is_empty() && p.unlisted_bytes == 0 && p.memory_findings.is_empty()
}

/// The readable name of a part of the memory.
pub fn part_label(part: &str) -> &'static str {
    match part {
        "heap_live" => "live heap blocks",
        "heap_free" => "malloc's free memory",
        "heap_other" => "other heap",
        "python_objects" => "Python objects",
        "python_free" => "Python arenas' free space",
        "static_data" => "libraries' static data",
        "mmap" => "direct mappings",
        "shm" => "shared memory",
        "stacks" => "thread stacks",
        "file" => "mapped files",
        "tracer" => "leaktrace itself",
        "unexplained" => "unexplained",
        "uss" => "private memory (USS)",
        "cuda_cache" => "CUDA cache",
        "pss" => "proportional memory (PSS)",
        "rss" => "RSS",
        _ => "other",
    }
}

/// "RSS 455.0 MiB: Python objects 394.0 MiB, ..." — the parts of at least 1% of RSS,
/// largest first; the rest summed.
pub fn memory_line(m: &leaktrace_common::memory::Memory) -> String {
    let mut parts: Vec<(&str, u64)> = m.parts().into_iter().filter(|p| p.1 > 0).collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.1));
    let (shown, rest): (Vec<_>, Vec<_>) = parts.into_iter().partition(|p| p.1 * 100 >= m.rss.max(1));
    let mut items: Vec<String> = shown.iter().map(|(n, b)| format!("{} {}", part_label(n), human_bytes(*b))).collect();
    let rest: u64 = rest.iter().map(|p| p.1).sum();
    if rest > 0 {
        items.push(format!("smaller parts {}", human_bytes(rest)));
    }
    let private = m.uss.map(|u| format!("; private {}", human_bytes(u))).unwrap_or_default();
    let devices: String = m
        .devices
        .iter()
        .map(|d| format!("; device {}: {} live, {} of it in a caching allocator", d.device, human_bytes(d.live), human_bytes(d.cached)))
        .collect();
    format!("RSS {}{private}: {}{devices}", human_bytes(m.rss), items.join(", "))
}

/// The memory line and findings, for a process whose memory says something (a line
/// of numbers for every small program would only be noise).
fn memory_text(out: &mut String, p: &crate::analyze::ProcessAnalysis) {
    if p.memory_findings.is_empty() {
        return;
    }
    if let Some(m) = &p.memory {
        out.push_str(&format!("\nMemory: {}\n", memory_line(m)));
    }
    for f in &p.memory_findings {
        out.push_str(&format!("\nMemory: {}.\n    what to do: {}\n", f.what, f.remedy));
    }
}

/// What the holder searches cost, where it is worth a line: a second or more of CPU
/// while the program ran, or of its exit. A user who sees the exit held must be able to
/// tell the tool's share from the program's.
fn search_cost_text(h: &leaktrace_common::report_schema::HolderSearches) -> Option<String> {
    const WORTH_MS: u64 = 1000;
    if h.cpu_ms < WORTH_MS && h.exit_ms < WORTH_MS {
        return None;
    }
    let secs = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
    let mut parts = Vec::new();
    if h.searches > 0 {
        parts.push(format!(
            "{} search(es) while it ran, {} round(s) reading {} in all, {} of CPU on a thread of leaktrace's",
            h.searches,
            h.rounds,
            human_bytes(h.bytes_read),
            secs(h.cpu_ms)
        ));
    }
    if h.exit_ms > 0 {
        parts.push(format!(
            "at Python's exit a scan and {} round(s) reading {}, which held the exit {}",
            h.exit_rounds,
            human_bytes(h.exit_bytes_read),
            secs(h.exit_ms)
        ));
    }
    Some(format!(
        "
leaktrace's holder searches (what holds the growing memory) cost: {}. Each round reads every live Python object once; LEAKTRACE_SCAN=0 turns them off, with the leak verdicts.
",
        parts.join("; ")
    ))
}

/// "bash (12), sed (3)": the program names of `quiet` processes, most frequent first.
fn quiet_names(ps: &[&crate::analyze::ProcessAnalysis]) -> String {
    let mut counts: Vec<(String, usize)> = Vec::new();
    for p in ps {
        let name = std::path::Path::new(&p.exe).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "?".into());
        match counts.iter_mut().find(|(n, _)| *n == name) {
            Some(c) => c.1 += 1,
            None => counts.push((name, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    counts.iter().map(|(n, c)| if *c > 1 { format!("{n} ({c})") } else { n.clone() }).collect::<Vec<_>>().join(", ")
}

pub fn text(a: &Analysis, top: usize) -> String {
    let mut out = String::new();
    // Among several processes, those with nothing to show get one line together, so
    // that the program's own section is not lost among its wrappers'.
    let collapse = a.processes.len() > 1;
    let hidden: Vec<&crate::analyze::ProcessAnalysis> = a.processes.iter().filter(|p| collapse && quiet(p)).collect();
    for p in a.processes.iter().filter(|p| !(collapse && quiet(p))) {
        out.push_str(&format!("==== {}: {} report {}\n", p.label, p.reason, p.file));
        if let (Some(_), Some(before)) = (p.switched_on_unix_ms, p.before_switch_bytes) {
            out.push_str(&format!("(recorded since `leaktrace attach` switched it on; the {before} byte(s) still live from before are never a leak)\n"));
        }
        if p.leaks.is_empty() {
            out.push_str("no leaks\n");
        }
        for g in p.leaks.iter().take(top) {
            out.push_str(&format!("\nLeak of {} byte(s) in {} object(s) allocated from {} ({}):\n", g.bytes, g.blocks, g.api, g.kind_label()));
            stack_text(&mut out, &g.stack);
            group_held_text(&mut out, g);
        }
        if p.leaks.len() > top {
            out.push_str(&format!("\n... {} more leak group(s); --top N shows more\n", p.leaks.len() - top));
        }
        if !p.leaks.is_empty() && p.unread_threads > 0 {
            out.push_str(&format!(
                "\n(the exit scan could not read {} thread(s) of this process, which kept its stop signal blocked or did not stop: a leak above may be held on their stacks)\n",
                p.unread_threads
            ));
        }
        for gr in p.growth.iter().take(top) {
            if gr.api == crate::growth::PYTHON_LINE {
                out.push_str(&format!(
                    "\nGrowing: {} byte(s) more over {} snapshots ({}/min) allocated under this line of your code:\n",
                    gr.grown_bytes,
                    gr.points,
                    human_bytes(gr.bytes_per_minute)
                ));
            } else {
                out.push_str(&format!(
                    "\nGrowing: {} byte(s) more over {} snapshots ({}/min) allocated from {} ({}):\n",
                    gr.grown_bytes,
                    gr.points,
                    human_bytes(gr.bytes_per_minute),
                    gr.api,
                    gr.kind
                ));
            }
            stack_text(&mut out, &gr.stack);
            held_text(&mut out, &gr.held_by, gr.also_held_by.as_ref());
            if let Some(c) = &gr.cached_by {
                out.push_str(&format!("    ({})\n", crate::growth::cached_note(c)));
            }
        }
        checks_text(&mut out, &p.checks);
        why_text(&mut out, "", &p.why_reachable);
        for c in p.checks.iter().filter(|c| !c.why_reachable.is_empty()) {
            why_text(&mut out, &format!(" in check {}", c.label), &c.why_reachable);
        }
        memory_text(&mut out, p);
        if let Some(note) = p.holder_searches.as_ref().and_then(search_cost_text) {
            out.push_str(&note);
        }
        let mut notes = Vec::new();
        if p.suppressed_groups > 0 {
            notes.push(format!("{} group(s), {} byte(s) suppressed", p.suppressed_groups, p.suppressed_bytes));
        }
        if p.reachable_bytes > 0 {
            notes.push(format!("{} byte(s) still reachable not counted; --include-reachable counts them", p.reachable_bytes));
        }
        if p.unlisted_bytes > 0 {
            notes.push(format!(
                "{} of them in {} small group(s) the report does not list; LEAKTRACE_REPORT_GROUPS raises the limit",
                p.unlisted_bytes, p.unlisted_groups
            ));
        }
        if p.cached_bytes > 0 {
            notes.push(format!("{} byte(s) held by caching allocators not counted; --include-cached counts them", p.cached_bytes));
        }
        if p.outstanding_bytes > 0 {
            notes.push(format!(
                "{} byte(s) outstanding not counted: a periodic report, written while the process ran and without a pointer scan, so no leak is known yet; its exit report says which are leaks, --include-reachable counts them",
                p.outstanding_bytes
            ));
        }
        let suppressed = if notes.is_empty() { String::new() } else { format!(" ({})", notes.join("; ")) };
        let used = leaktrace_common::suppressions::used_table(&p.suppressions_used);
        if !used.is_empty() {
            out.push('\n');
            out.push_str(&used);
        }
        out.push_str(&format!("\nSUMMARY: leaktrace: {} byte(s) leaked in {} allocation(s){suppressed}.\n\n", p.leaked_bytes, p.leaked_blocks));
    }
    if !hidden.is_empty() {
        out.push_str(&format!("==== {} other process(es) without leaks: {}\n\n", hidden.len(), quiet_names(&hidden)));
    }
    let findings: usize = a.processes.iter().map(|p| p.memory_findings.len()).sum();
    let memory = if findings > 0 { format!("; {findings} memory finding(s)") } else { String::new() };
    if let Some(v) = &a.ranks {
        out.push_str(&crate::ranks::text(v, top));
    }
    out.push_str(&format!(
        "TOTAL: {} byte(s) leaked in {} allocation(s) across {} process(es); {} growing stack(s){memory}.\n",
        a.leaked_bytes,
        a.leaked_blocks,
        a.processes.len(),
        a.growing()
    ));
    out
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('`', "'")
}

fn md_site(stack: &[Frame]) -> String {
    let named: Vec<String> = stack
        .iter()
        .filter_map(|f| {
            let func = f.function.as_ref()?;
            let place = match (&f.file, f.line) {
                (Some(file), Some(line)) => {
                    let base = std::path::Path::new(&**file).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                    format!(" ({base}:{line})")
                }
                _ => String::new(),
            };
            Some(format!("`{}`{}", md_escape(func), md_escape(&place)))
        })
        .take(3)
        .collect();
    if named.is_empty() {
        "(no symbols)".into()
    } else {
        named.join(" ← ")
    }
}

pub fn markdown(a: &Analysis, top: usize) -> String {
    let mut out = format!(
        "### leaktrace: {} leaked in {} allocation(s) ({} process(es), {} growing stack(s))\n\n",
        human_bytes(a.leaked_bytes),
        a.leaked_blocks,
        a.processes.len(),
        a.growing()
    );
    out.push_str("| process | reason | leaked | allocations | groups | suppressed | growing |\n|---|---|---:|---:|---:|---:|---:|\n");
    for p in &a.processes {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            md_escape(&p.label),
            p.reason,
            human_bytes(p.leaked_bytes),
            p.leaked_blocks,
            p.leaks.len(),
            p.suppressed_groups,
            p.growth.len()
        ));
    }
    if let Some(v) = &a.ranks {
        out.push_str(&crate::ranks::markdown(v, top));
    }
    for p in &a.processes {
        let leaking_checks: Vec<&crate::model::Check> = p.checks.iter().filter(|c| c.leaked_blocks() > 0).collect();
        if p.leaks.is_empty() && p.growth.is_empty() && leaking_checks.is_empty() && p.memory_findings.is_empty() {
            continue;
        }
        out.push_str(&format!("\n#### {}\n\n", md_escape(&p.label)));
        if !p.memory_findings.is_empty() {
            if let Some(m) = &p.memory {
                out.push_str(&format!("Memory: {}\n\n", md_escape(&memory_line(m))));
            }
            out.push_str("| memory | from | to | what it means | what to do |\n|---|---:|---:|---|---|\n");
            for f in &p.memory_findings {
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} |\n",
                    part_label(f.part),
                    human_bytes(f.from_bytes),
                    human_bytes(f.to_bytes),
                    md_escape(&f.what),
                    md_escape(&f.remedy)
                ));
            }
            out.push('\n');
        }
        if let Some(note) = p.holder_searches.as_ref().and_then(search_cost_text) {
            out.push_str(&format!("{}\n\n", md_escape(note.trim())));
        }
        if !p.leaks.is_empty() {
            out.push_str("| bytes | blocks | api | allocated at |\n|---:|---:|---|---|\n");
            for g in p.leaks.iter().take(top) {
                out.push_str(&format!("| {} | {} | {} | {} |\n", g.bytes, g.blocks, g.api, md_site(&g.stack)));
            }
            let held: Vec<String> = p
                .leaks
                .iter()
                .take(top)
                .filter_map(|g| Some(format!("- {}: {}\n", md_site(&g.stack), md_escape(&leaktrace_common::held::held_by_text(&g.held_by)?))))
                .collect();
            if !held.is_empty() {
                out.push('\n');
                out.push_str(&held.concat());
            }
            if p.leaks.len() > top {
                out.push_str(&format!("\n{} more group(s) not shown.\n", p.leaks.len() - top));
            }
        }
        if !p.growth.is_empty() {
            out.push_str("\nGrowing during the run:\n\n| grew by | per minute | snapshots | api | allocated at | held by |\n|---:|---:|---:|---|---|---|\n");
            for gr in p.growth.iter().take(top) {
                let held = leaktrace_common::held::held_by_text(&gr.held_by).map(|t| md_escape(t.trim_start_matches("held by: "))).unwrap_or_default();
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} |\n",
                    human_bytes(gr.grown_bytes),
                    human_bytes(gr.bytes_per_minute),
                    gr.points,
                    gr.api,
                    md_site(&gr.stack),
                    held
                ));
            }
            for c in p.growth.iter().take(top).filter_map(|g| g.cached_by.as_deref()).collect::<std::collections::BTreeSet<_>>() {
                out.push_str(&format!("\nA growing stack {}.\n", crate::growth::cached_note(c)));
            }
        }
        if !leaking_checks.is_empty() {
            out.push_str(&format!(
                "\nChecks: {} of {} leaked\n\n| check | leaked | allocations | definite | indirect | allocated at |\n|---|---:|---:|---:|---:|---|\n",
                leaking_checks.len(),
                p.checks.len()
            ));
            for c in leaking_checks.iter().take(top) {
                let at = c.leaks.first().map(|l| md_site(&l.stack)).unwrap_or_default();
                out.push_str(&format!(
                    "| {} | {} | {} | {} | {} | {} |\n",
                    md_escape(&c.label),
                    human_bytes(c.leaked_bytes()),
                    c.leaked_blocks(),
                    human_bytes(c.found.definite.bytes),
                    human_bytes(c.found.indirect.bytes),
                    at
                ));
            }
            if leaking_checks.len() > top {
                out.push_str(&format!("\n{} more leaking check(s) not shown.\n", leaking_checks.len() - top));
            }
        }
    }
    out
}

pub fn json(a: &Analysis) -> String {
    serde_json::to_string_pretty(a).unwrap_or_default() + "\n"
}

/// The growth part of `diff`: stacks and lines that start or stop growing, or grow
/// faster or slower; nothing when none does.
pub fn growth_diff_text(changes: &[crate::diff::GrowthChange], top: usize) -> String {
    let mut out = String::new();
    if changes.is_empty() {
        return out;
    }
    for c in changes.iter().take(top) {
        let what = if c.api == crate::growth::PYTHON_LINE { "under this line".to_string() } else { format!("from {} ({})", c.api, c.kind) };
        out.push_str(&format!(
            "\n{}: grew {} -> {} {what}:\n",
            c.status.replace('_', " ").to_uppercase(),
            human_bytes(c.base_grown_bytes),
            human_bytes(c.new_grown_bytes)
        ));
        stack_text(&mut out, &c.stack);
    }
    if changes.len() > top {
        out.push_str(&format!("\n... {} more growth change(s); --top N shows more\n", changes.len() - top));
    }
    let count = |s: &str| changes.iter().filter(|c| c.status == s).count();
    out.push_str(&format!(
        "\nGROWTH: {} start growing, {} grow faster, {} grow slower, {} stop growing.\n",
        count("starts_growing"),
        count("grows_faster"),
        count("grows_slower"),
        count("stops_growing")
    ));
    out
}

pub fn diff_text(changes: &[Change], top: usize, include_reachable: bool) -> String {
    let mut out = String::new();
    let counted = if include_reachable {
        "leaked and still-reachable memory"
    } else {
        "definite and indirect leaks, as check counts them; --include-reachable adds still-reachable memory"
    };
    if changes.is_empty() {
        out.push_str(&format!("no differences in leak groups ({counted})\n"));
        return out;
    }
    for c in changes.iter().take(top) {
        out.push_str(&format!(
            "\n{}: {} -> {} byte(s), {} -> {} object(s), {} ({}):\n",
            c.status.to_uppercase(),
            c.base_bytes,
            c.new_bytes,
            c.base_blocks,
            c.new_blocks,
            c.api,
            c.kind
        ));
        stack_text(&mut out, &c.stack);
        if let Some((before, now)) = &c.holder_changed {
            out.push_str(&format!("    holder changed: {before}\n                 -> {now}\n"));
        }
    }
    if changes.len() > top {
        out.push_str(&format!("\n... {} more change(s); --top N shows more\n", changes.len() - top));
    }
    let count = |s: &str| changes.iter().filter(|c| c.status == s).count();
    let held = count("held");
    let held = if held > 0 { format!(", {held} held by something else") } else { String::new() };
    out.push_str(&format!("\nDIFF: {} new, {} grew, {} shrank, {} gone{held} ({counted}).\n", count("new"), count("grew"), count("shrank"), count("gone")));
    out
}

#[cfg(test)]
mod tests {
    use leaktrace_common::report_schema::HolderSearches;

    /// The holder searches' cost gets a line once it is a second of CPU or of the exit,
    /// with what ran while the program ran and what held its exit, each where it ran.
    #[test]
    fn the_holder_searches_cost_is_told_once_it_is_a_second() {
        let cheap = HolderSearches { searches: 2, rounds: 9, bytes_read: 3 << 30, cpu_ms: 999, exit_ms: 400, ..Default::default() };
        assert_eq!(super::search_cost_text(&cheap), None);
        let exit = HolderSearches { searches: 1, rounds: 14, bytes_read: 816 << 20, cpu_ms: 1120, exit_rounds: 3, exit_bytes_read: 4 << 30, exit_ms: 7310 };
        let t = super::search_cost_text(&exit).unwrap();
        assert!(t.contains("1 search(es) while it ran, 14 round(s) reading 816.0 MiB in all, 1.1 s of CPU"), "{t}");
        assert!(t.contains("at Python's exit a scan and 3 round(s) reading 4.0 GiB, which held the exit 7.3 s"), "{t}");
        let only_exit = HolderSearches { exit_rounds: 2, exit_bytes_read: 1 << 30, exit_ms: 2500, ..Default::default() };
        let t = super::search_cost_text(&only_exit).unwrap();
        assert!(!t.contains("while it ran") && t.contains("held the exit 2.5 s"), "{t}");
    }
}
