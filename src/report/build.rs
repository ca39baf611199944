//! Turns a collector snapshot into the versioned JSON report and the LeakSanitizer-style
//! text summary. Both render the same resolved groups.
use serde_json::{json, Value};

use super::process::ProcessInfo;
use super::symbolize::Symbolizer;
use crate::collector::state::{Snapshot, Totals};

pub const SCHEMA: &str = "leaktrace-report/1";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Periodic,
    Exit,
    Signal,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Periodic => "periodic",
            Reason::Exit => "exit",
            Reason::Signal => "signal",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub ip: u64,
    pub module: Option<String>,
    pub offset: Option<u64>,
    pub function: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
    pub inlined: bool,
}

#[derive(Clone, Debug)]
pub struct Group {
    pub kind: &'static str,
    pub api: &'static str,
    pub bytes: u64,
    pub blocks: u64,
    pub peak_bytes: u64,
    pub total_allocs: u64,
    pub total_bytes: u64,
    pub stack_id: u32,
    pub stack: Vec<Frame>,
}

/// Extra facts the report carries besides the collector's view.
#[derive(Clone, Debug, Default)]
pub struct RunFacts {
    pub stack_depth: usize,
    pub interval_ms: u64,
    pub buffer_full_waits: u64,
    pub stacks_interned: u64,
    pub stack_table_overflows: u64,
    pub host_tracking: String,
}

pub fn resolve_groups(snapshot: &Snapshot, sym: &mut Symbolizer) -> Vec<Group> {
    sym.resolve_pending();
    snapshot
        .groups
        .iter()
        .map(|g| {
            let raw = sym.raw_stack(g.stack).to_vec();
            let mut stack = Vec::with_capacity(raw.len());
            for rf in raw {
                let (module, offset) = match rf.module {
                    Some((m, off)) => (sym.module(m).map(|m| m.path.clone()), Some((m, off))),
                    None => (None, None),
                };
                let syms = match offset {
                    Some((m, off)) => sym.symbolize(m, off).to_vec(),
                    None => Vec::new(),
                };
                let off = offset.map(|(_, o)| o);
                if syms.is_empty() {
                    stack.push(Frame { ip: rf.ip, module: module.clone(), offset: off, function: None, file: None, line: None, inlined: false });
                }
                for s in syms {
                    stack.push(Frame {
                        ip: rf.ip,
                        module: module.clone(),
                        offset: off,
                        function: s.function,
                        file: s.file,
                        line: s.line,
                        inlined: s.inlined,
                    });
                }
            }
            Group {
                kind: "host",
                api: g.api.name(),
                bytes: g.stats.live_bytes,
                blocks: g.stats.live_blocks,
                peak_bytes: g.stats.peak_live_bytes,
                total_allocs: g.stats.total_allocs,
                total_bytes: g.stats.total_bytes,
                stack_id: g.stack,
                stack,
            }
        })
        .collect()
}

fn totals_json(t: &Totals) -> Value {
    json!({
        "live_bytes": t.live_bytes,
        "live_blocks": t.live_blocks,
        "total_allocs": t.total_allocs,
        "total_frees": t.total_frees,
        "peak_live_bytes": t.peak_live_bytes,
    })
}

fn frame_json(f: &Frame) -> Value {
    json!({
        "ip": format!("{:#x}", f.ip),
        "module": f.module,
        "offset": f.offset,
        "function": f.function,
        "file": f.file,
        "line": f.line,
        "inlined": f.inlined,
    })
}

pub fn report_json(
    process: &ProcessInfo,
    reason: Reason,
    written_unix_ms: u64,
    totals: &Totals,
    groups: &[Group],
    facts: &RunFacts,
) -> Value {
    json!({
        "schema": SCHEMA,
        "tool": { "name": "leaktrace", "version": env!("CARGO_PKG_VERSION") },
        "pid": process.pid,
        "ppid": process.ppid,
        "exe": process.exe,
        "argv": process.argv,
        "reason": reason.name(),
        "started_unix_ms": process.started_unix_ms,
        "written_unix_ms": written_unix_ms,
        "fork": {
            "forked_from_pid": process.forked_from,
            "inherited_live_bytes": totals.inherited_live_bytes,
            "inherited_live_blocks": totals.inherited_live_blocks,
            "inherited_frees": totals.inherited_frees,
        },
        "config": {
            "stack_depth": facts.stack_depth,
            "interval_ms": facts.interval_ms,
        },
        "summary": {
            "host": totals_json(totals),
            "leak_groups": groups.len(),
        },
        "diagnostics": {
            "host_tracking": facts.host_tracking,
            "events": totals.events,
            "buffer_full_waits": facts.buffer_full_waits,
            "unknown_frees": totals.unknown_frees,
            "stacks_interned": facts.stacks_interned,
            "stack_table_overflows": facts.stack_table_overflows,
        },
        "leaks": groups.iter().map(|g| json!({
            "kind": g.kind,
            "api": g.api,
            "bytes": g.bytes,
            "blocks": g.blocks,
            "peak_bytes": g.peak_bytes,
            "total_allocs": g.total_allocs,
            "total_bytes": g.total_bytes,
            "stack_id": g.stack_id,
            "stack": g.stack.iter().map(frame_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn frame_text(i: usize, f: &Frame) -> String {
    let mut s = format!("    #{i} {:#x}", f.ip);
    if let Some(func) = &f.function {
        s.push_str(" in ");
        s.push_str(func);
    }
    if let Some(file) = &f.file {
        s.push(' ');
        s.push_str(file);
        if let Some(line) = f.line {
            s.push_str(&format!(":{line}"));
        }
    }
    match (&f.module, f.offset) {
        (Some(m), Some(off)) => s.push_str(&format!(" ({m}+{off:#x})")),
        (Some(m), None) => s.push_str(&format!(" ({m})")),
        _ => {}
    }
    if f.inlined {
        s.push_str(" [inlined]");
    }
    s
}

/// The exit summary in the shape LeakSanitizer users know.
pub fn summary_text(pid: u32, totals: &Totals, groups: &[Group], top: usize, report: Option<&str>) -> String {
    let mut out = String::new();
    if groups.is_empty() {
        out.push_str(&format!("=={pid}==leaktrace: no leaks found"));
    } else {
        out.push_str("=================================================================\n");
        out.push_str(&format!("=={pid}==leaktrace: detected memory leaks\n"));
        for g in groups.iter().take(top) {
            out.push_str(&format!(
                "\nLeak of {} byte(s) in {} object(s) allocated from {} ({}):\n",
                g.bytes, g.blocks, g.api, g.kind
            ));
            for (i, f) in g.stack.iter().enumerate() {
                out.push_str(&frame_text(i, f));
                out.push('\n');
            }
            if g.stack.is_empty() {
                out.push_str("    <no stack>\n");
            }
        }
        if groups.len() > top {
            out.push_str(&format!("\n... {} more leak group(s) in the report\n", groups.len() - top));
        }
        out.push_str(&format!(
            "\nSUMMARY: leaktrace: {} byte(s) leaked in {} allocation(s).",
            totals.live_bytes, totals.live_blocks
        ));
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
            kind: "host",
            api: "calloc",
            bytes: 48,
            blocks: 3,
            peak_bytes: 64,
            total_allocs: 4,
            total_bytes: 64,
            stack_id: 7,
            stack: vec![
                Frame {
                    ip: 0x1234,
                    module: Some("/bin/x".into()),
                    offset: Some(0x234),
                    function: Some("leak_here".into()),
                    file: Some("/src/x.c".into()),
                    line: Some(12),
                    inlined: false,
                },
                Frame { ip: 0x9999, module: None, offset: None, function: None, file: None, line: None, inlined: false },
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
            file_name: "f.json".into(),
        };
        let t = Totals { live_bytes: 48, live_blocks: 3, total_allocs: 4, total_frees: 1, peak_live_bytes: 64, ..Default::default() };
        let v = report_json(&p, Reason::Exit, 6, &t, &[group()], &RunFacts::default());
        assert_eq!(v["schema"], "leaktrace-report/1");
        assert_eq!(v["reason"], "exit");
        for k in ["pid", "ppid", "exe", "argv", "started_unix_ms", "written_unix_ms"] {
            assert!(!v[k].is_null(), "{k}");
        }
        let h = &v["summary"]["host"];
        assert_eq!((h["live_bytes"].as_u64(), h["live_blocks"].as_u64()), (Some(48), Some(3)));
        assert_eq!((h["total_allocs"].as_u64(), h["total_frees"].as_u64(), h["peak_live_bytes"].as_u64()), (Some(4), Some(1), Some(64)));
        let l = &v["leaks"][0];
        assert_eq!((l["kind"].as_str(), l["api"].as_str(), l["bytes"].as_u64(), l["blocks"].as_u64()), (Some("host"), Some("calloc"), Some(48), Some(3)));
        let f = &l["stack"][0];
        assert_eq!(f["ip"], "0x1234");
        assert_eq!((f["module"].as_str(), f["offset"].as_u64(), f["function"].as_str()), (Some("/bin/x"), Some(0x234), Some("leak_here")));
        assert_eq!((f["file"].as_str(), f["line"].as_u64()), (Some("/src/x.c"), Some(12)));
        let unknown = &l["stack"][1];
        for k in ["module", "offset", "function", "file", "line"] {
            assert!(unknown[k].is_null(), "{k}");
        }
    }

    #[test]
    fn summary_reads_like_lsan() {
        let t = Totals { live_bytes: 48, live_blocks: 3, ..Default::default() };
        let s = summary_text(10, &t, &[group()], 10, Some("/out/r.json"));
        assert!(s.contains("==10==leaktrace: detected memory leaks"));
        assert!(s.contains("Leak of 48 byte(s) in 3 object(s) allocated from calloc (host):"));
        assert!(s.contains("    #0 0x1234 in leak_here /src/x.c:12 (/bin/x+0x234)"));
        assert!(s.contains("SUMMARY: leaktrace: 48 byte(s) leaked in 3 allocation(s)."));
        assert!(s.ends_with("==10==leaktrace: report /out/r.json\n"));
        let none = summary_text(10, &Totals::default(), &[], 10, None);
        assert_eq!(none, "==10==leaktrace: no leaks found\n");
    }
}
