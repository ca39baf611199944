//! Flamegraph (SVG, via inferno) of outstanding bytes by stack: one stack per leak
//! group, outermost frame at the bottom, width = bytes still allocated.
use crate::analyze::Analysis;
use crate::model::Frame;

fn frame_name(f: &Frame) -> String {
    let name = match (&f.function, &f.module, f.offset) {
        (Some(func), _, _) => func.to_string(),
        (None, Some(m), Some(off)) => {
            let base = std::path::Path::new(&**m).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            format!("{base}+{off:#x}")
        }
        _ => format!("{:#x}", f.ip),
    };
    // ';' separates frames, lines end records, and a trailing number is the count in the
    // collapsed format.
    name.replace(';', ":").replace(['\n', '\r'], " ")
}

fn line(root: &str, stack: &[Frame], api: &str, weight: u64) -> String {
    let mut frames: Vec<String> = stack.iter().rev().map(frame_name).collect();
    frames.insert(0, root.replace(';', ":").replace(['\n', '\r'], " "));
    frames.push(format!("[{api}]"));
    format!("{} {weight}", frames.join(";"))
}

/// Collapsed stacks ("outer;...;inner bytes"), one line per leak group, per process;
/// stacks that grew during the run are drawn under their own root, weighted by growth.
pub fn collapsed(a: &Analysis) -> Vec<String> {
    // inferno adds the weights up in u64: keep any total of a damaged report in range.
    let n = a.processes.iter().map(|p| p.leaks.len() + p.growth.len()).sum::<usize>().max(1) as u64;
    let cap = (u64::MAX >> 8) / n;
    let mut lines = Vec::new();
    for p in &a.processes {
        for g in &p.leaks {
            lines.push(line(&p.label, &g.stack, &g.api, g.bytes.min(cap)));
        }
        for g in &p.growth {
            lines.push(line(&format!("grew during the run: {}", p.label), &g.stack, &g.api, g.grown_bytes.min(cap)));
        }
    }
    lines
}

pub fn svg(a: &Analysis) -> Result<String, String> {
    let lines = collapsed(a);
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = format!("leaktrace: {} bytes outstanding", a.leaked_bytes);
    opts.count_name = "bytes".into();
    let mut out = Vec::new();
    if lines.is_empty() {
        // inferno refuses an empty profile; an empty graph still says so.
        let empty = ["no-leaks 1"];
        inferno::flamegraph::from_lines(&mut opts, empty.iter().copied(), &mut out).map_err(|e| e.to_string())?;
    } else {
        inferno::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut out).map_err(|e| e.to_string())?;
    }
    String::from_utf8(out).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::ProcessAnalysis;
    use crate::model::Group;

    fn analysis() -> Analysis {
        let g = Group {
            kind: "host".into(),
            api: "malloc".into(),
            bytes: 4096,
            blocks: 1,
            stack: vec![
                Frame { ip: 0x1, function: Some("inner;x".into()), ..Default::default() },
                Frame { ip: 0x2, module: Some("/lib/libz.so".into()), offset: Some(0x20), ..Default::default() },
                Frame { ip: 0x3, function: Some("main".into()), ..Default::default() },
            ],
            ..Default::default()
        };
        Analysis {
            schema: "leaktrace-analysis/1",
            leaked_bytes: 4096,
            leaked_blocks: 1,
            processes: vec![ProcessAnalysis {
                label: "prog (pid 1)".into(),
                pid: 1,
                exe: "/bin/prog".into(),
                reason: "exit".into(),
                file: "r.json".into(),
                forked_from_pid: None,
                switched_on_unix_ms: None,
                before_switch_bytes: None,
                rank: None,
                local_rank: None,
                world_size: None,
                host: None,
                memory: None,
                memory_findings: Vec::new(),
                memory_points: Vec::new(),
                unread_threads: 0,
                holder_searches: None,
                leaked_bytes: 4096,
                leaked_blocks: 1,
                suppressed_groups: 0,
                suppressed_bytes: 0,
                suppressions_used: Vec::new(),
                reachable_bytes: 0,
                reachable_groups: 0,
                cached_bytes: 0,
                cached_groups: 0,
                outstanding_bytes: 0,
                outstanding_groups: 0,
                unlisted_groups: 0,
                unlisted_bytes: 0,
                leaks: vec![g],
                growth: vec![],
                checks: vec![],
                why_reachable: vec![],
            }],
            ranks: None,
        }
    }

    #[test]
    fn collapsed_stacks_are_outermost_first_with_byte_counts() {
        assert_eq!(collapsed(&analysis()), vec!["prog (pid 1);main;libz.so+0x20;inner:x;[malloc] 4096"]);
    }

    #[test]
    fn renders_an_svg_with_the_frames() {
        let svg = svg(&analysis()).unwrap();
        assert!(svg.starts_with("<?xml") && svg.contains("<svg"));
        assert!(svg.contains("main") && svg.contains("libz.so+0x20") && svg.contains("4,096 bytes"));
    }
}
