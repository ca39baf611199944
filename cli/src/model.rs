//! Reading `leaktrace-report/1`, `/2` and `/3` files (see docs/report-format.md). Unknown
//! fields are ignored; a missing file, bad JSON or another schema major version is an
//! error that says what to do.
use std::path::{Path, PathBuf};

use leaktrace_common::report_schema::{self, READABLE_MAJORS, SCHEMA_PREFIX};

/// The schema's own types (`common`), as the library writes them; stacks read in full.
pub use leaktrace_common::report_schema::{Frame, Point};
pub type Group = leaktrace_common::report_schema::Group;
pub type Series = leaktrace_common::report_schema::Series;
pub type Check = leaktrace_common::report_schema::Check;
pub type Report = leaktrace_common::report_schema::Report;

/// Processes whose last image left no final report, each as a sentence: their last
/// report is older than their end, so leaks after it are unknown. `top` is the pid of the
/// command `run` started: one that wrote no report at all is named too.
pub fn without_final_report(reports: &[Report], top: Option<u32>) -> Vec<String> {
    let mut pids: Vec<u32> = reports.iter().map(|r| r.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let mut out = Vec::new();
    for pid in pids {
        let of_pid: Vec<&Report> = reports.iter().filter(|r| r.pid == pid).collect();
        if of_pid.iter().any(|r| r.reason == "exit" || r.reason == "detach") {
            continue;
        }
        let last = of_pid.iter().max_by_key(|r| r.written_unix_ms).expect("one report at least");
        let why = last
            .no_final_report
            .clone()
            .unwrap_or_else(|| "it ended where no exit path of the library runs (killed with SIGKILL, a crash, or an exec into an untraced program)".into());
        out.push(format!("{} left no final report: {why}", last.label()));
    }
    if let Some(top) = top {
        if !reports.iter().any(|r| r.pid == top) {
            out.push(format!(
                "the command (pid {top}) wrote no report: a statically linked or setuid program does not load the library, and a Go program that exits within its first moments leaves nothing"
            ));
        }
    }
    out
}

/// The reports of the run whose command had pid `top` and started at `since_ms`, from
/// the first of `dirs` that holds any (the library's fallback directories, used when
/// the output directory was unusable): the command's own, and those of every process
/// whose parent or forking process is one of them.
pub fn fallback_reports(top: u32, since_ms: u64, dirs: &[PathBuf]) -> Option<(Vec<Report>, PathBuf)> {
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        // Only files written since the run started are read (/tmp may hold many old ones).
        let written_since = |e: &std::fs::DirEntry| {
            let modified = e.metadata().and_then(|m| m.modified()).ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            modified.is_some_and(|t| t.as_millis() as u64 + 1000 >= since_ms)
        };
        let candidates: Vec<Report> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("leaktrace.") && n.ends_with(".json")) && written_since(e))
            .filter_map(|e| load_file(&e.path()).ok())
            .filter(|r| r.started_unix_ms + 1000 >= since_ms)
            .collect();
        let mut family = std::collections::BTreeSet::from([top]);
        loop {
            let before = family.len();
            for r in &candidates {
                if family.contains(&r.ppid) || r.fork.forked_from_pid.is_some_and(|p| family.contains(&p)) {
                    family.insert(r.pid);
                }
            }
            if family.len() == before {
                break;
            }
        }
        let mut ours: Vec<Report> = candidates.into_iter().filter(|r| family.contains(&r.pid)).collect();
        if !ours.is_empty() {
            ours.sort_by_key(|r| (r.started_unix_ms, r.pid));
            return Some((ours, dir.clone()));
        }
    }
    None
}

pub fn parse(text: &str, path: &Path) -> Result<Report, String> {
    // Versions 2 and 3, whole and sound: read with their stacks as indices, then written
    // out from the frame table, sharing its names (a PyTorch rank's 2 MiB report in
    // a tenth of the time of the general path below, which says what is wrong).
    if let Ok(indexed) = serde_json::from_str::<report_schema::Report<report_schema::Indexed>>(text) {
        let major = indexed.schema.strip_prefix(SCHEMA_PREFIX).and_then(|m| m.parse::<u32>().ok());
        if matches!(major, Some(2 | 3)) {
            if let Some(mut report) = indexed.inline() {
                report.path = path.to_path_buf();
                return Ok(report);
            }
        }
    }
    parse_general(text, path)
}

/// Any version, sound or not: a damaged report's error names what is wrong.
fn parse_general(text: &str, path: &Path) -> Result<Report, String> {
    let mut value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("{} is not valid JSON ({e}); is it a leaktrace report?", path.display()))?;
    let schema = value.get("schema").and_then(|s| s.as_str()).unwrap_or("").to_owned();
    if !schema.starts_with(SCHEMA_PREFIX) {
        return Err(format!("{} is not a leaktrace report (no \"schema\": \"{SCHEMA_PREFIX}N\")", path.display()));
    }
    if !report_schema::major_of(&value).is_some_and(|m| READABLE_MAJORS.contains(&m)) {
        return Err(format!(
            "{} uses schema {schema}, which this leaktrace ({}) cannot read; use a leaktrace of that version",
            path.display(),
            env!("CARGO_PKG_VERSION")
        ));
    }
    report_schema::inline_frames(&mut value).map_err(|e| format!("{} is a damaged leaktrace report ({e})", path.display()))?;
    let mut report: Report = serde_json::from_value(value).map_err(|e| format!("{} is a damaged leaktrace report ({e})", path.display()))?;
    report.path = path.to_path_buf();
    Ok(report)
}

pub fn load_file(path: &Path) -> Result<Report, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {} ({e}); check the path", path.display()))?;
    parse(&text, path)
}

/// A report file, or every `leaktrace.*.json` in a directory (sorted by start time). In
/// a directory, a file that cannot be read (truncated, damaged, another schema) is named
/// on stderr and skipped, and the others are read; an error only if none can be.
pub fn load(path: &Path) -> Result<Vec<Report>, String> {
    load_with(path, &mut |skipped| eprintln!("leaktrace: skipped: {skipped}"))
}

/// How deep `load` looks into a directory's subdirectories (a shared output tree such as
/// `LEAKTRACE_OUTPUT=/shared/run7/%h/%r`: one directory per host and rank).
const TREE_DEPTH: usize = 8;

/// The `leaktrace.*.json` files in `dir` and its subdirectories, `depth` levels down at
/// most; links to directories are not followed (no loops).
fn report_files(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir {
            if depth > 0 {
                report_files(&p, depth - 1, out);
            }
            continue;
        }
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with("leaktrace.") && n.ends_with(".json") {
            out.push(p);
        }
    }
}

/// `load`, telling each skipped file's error to `skipped`.
pub fn load_with(path: &Path, skipped: &mut dyn FnMut(&str)) -> Result<Vec<Report>, String> {
    let mut reports = Vec::new();
    each_report_with(path, skipped, &mut |r| reports.push(r))?;
    reports.sort_by_key(|r| (r.started_unix_ms, r.pid));
    Ok(reports)
}

/// Every report under `path` (a file, or a directory or tree of them), handed to `each`
/// one at a time in file-name order and dropped after it: a job's hundreds of reports
/// are never all held at once. The same files and errors as `load`.
pub fn each_report(path: &Path, each: &mut dyn FnMut(Report)) -> Result<(), String> {
    each_report_with(path, &mut |skipped| eprintln!("leaktrace: skipped: {skipped}"), each)
}

/// `each_report`, telling each skipped file's error to `skipped`. In a directory, a file
/// that cannot be read (truncated, damaged, another schema) is skipped and the others are
/// read; an error only if none can be.
fn each_report_with(path: &Path, skipped: &mut dyn FnMut(&str), each: &mut dyn FnMut(Report)) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot open {} ({e}); give a report file or a directory of reports", path.display()))?;
    if !meta.is_dir() {
        each(load_file(path)?);
        return Ok(());
    }
    std::fs::read_dir(path).map_err(|e| format!("cannot list {} ({e})", path.display()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    report_files(path, TREE_DEPTH, &mut files);
    // By file name (program, pid, start time), wherever in the tree each lies.
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()).then_with(|| a.cmp(b)));
    if files.is_empty() {
        return Err(format!("{} holds no leaktrace.*.json reports; was the program run under leaktrace?", path.display()));
    }
    let mut read = 0usize;
    let mut first_error = None;
    for f in &files {
        match load_file(f) {
            Ok(r) => {
                read += 1;
                each(r);
            }
            Err(e) => {
                skipped(&e);
                first_error.get_or_insert(e);
            }
        }
    }
    if read == 0 {
        return Err(first_error.unwrap_or_else(|| format!("{} holds no readable report", path.display())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_without_a_final_report_are_named() {
        let rep = |pid: u32, reason: &str, why: Option<&str>| Report {
            pid,
            exe: "/bin/prog".into(),
            reason: reason.to_string().into(),
            no_final_report: why.map(|w| w.to_string().into()),
            ..Default::default()
        };
        let reports =
            vec![rep(1, "periodic", None), rep(1, "exit", None), rep(2, "periodic", Some("the Go runtime ends the process")), rep(3, "periodic", None)];
        let lines = without_final_report(&reports, Some(1));
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("pid 2") && lines[0].contains("Go runtime"));
        assert!(lines[1].contains("pid 3") && lines[1].contains("SIGKILL"));
        let lines = without_final_report(&reports, Some(9));
        assert!(lines[2].contains("pid 9) wrote no report"));
    }

    #[test]
    fn rejects_what_is_not_a_readable_report() {
        let p = Path::new("x.json");
        assert!(parse("{", p).unwrap_err().contains("not valid JSON"));
        assert!(parse("{\"a\":1}", p).unwrap_err().contains("not a leaktrace report"));
        assert!(parse("{\"schema\":\"leaktrace-report/4\"}", p).unwrap_err().contains("cannot read"));
        assert!(parse("{\"schema\":\"leaktrace-report/x\"}", p).unwrap_err().contains("cannot read"));
        assert!(parse("{\"schema\":\"leaktrace-report/1\"}", p).unwrap_err().contains("damaged"));
        assert!(parse("{\"schema\":\"leaktrace-report/2\"}", p).unwrap_err().contains("damaged"));
        assert!(parse("[]", p).is_err());
        assert!(parse("{\"schema\": 5}", p).is_err());
    }

    #[test]
    fn reads_a_minimal_report_and_ignores_unknown_fields() {
        let r = parse(
            r#"{"schema":"leaktrace-report/1","pid":5,"reason":"exit","future":true,
                "summary":{"host":{"live_bytes":1,"live_blocks":1,"total_allocs":1,"total_frees":0,"peak_live_bytes":1}},
                "leaks":[{"kind":"host","api":"malloc","bytes":1,"blocks":1,"stack":[{"ip":"0x1","function":"f"}]}]}"#,
            Path::new("r.json"),
        )
        .unwrap();
        assert_eq!(r.pid, 5);
        assert_eq!(r.leaks[0].stack[0].function.as_deref(), Some("f"));
        assert!(r.timeline.points.is_empty());
    }

    #[test]
    fn reads_version_2_frame_tables() {
        let r = parse(
            r#"{"schema":"leaktrace-report/2","pid":5,"reason":"exit",
                "summary":{"host":{"live_bytes":1,"live_blocks":1,"total_allocs":1,"total_frees":0,"peak_live_bytes":1}},
                "frames":[{"ip":"0x1","function":"f"},{"ip":"0x2","function":"main"}],
                "timeline":{"points":[],"series":[{"kind":"host","api":"malloc","stack_id":3,"stack":[1],"bytes":[1]}]},
                "leaks":[{"kind":"host","api":"malloc","bytes":1,"blocks":1,"stack":[0,1]}]}"#,
            Path::new("r.json"),
        )
        .unwrap();
        let names: Vec<_> = r.leaks[0].stack.iter().map(|f| f.function.as_deref().unwrap()).collect();
        assert_eq!(names, ["f", "main"]);
        assert_eq!(r.series_stack(&r.timeline.series[0])[0].ip, 0x2);
        let bad = parse(r#"{"schema":"leaktrace-report/2","frames":[],"leaks":[{"stack":[0]}]}"#, Path::new("b.json"));
        assert!(bad.unwrap_err().contains("damaged leaktrace report (the stack of leak group 0 refers to frame 0"));
    }

    /// The quick path (stacks read as indices, then written out) reads a version 2 report
    /// as the general one does: every stack, holder link, line holder and check.
    #[test]
    fn version_2_reads_the_same_by_either_path() {
        let text = r#"{"schema":"leaktrace-report/2","pid":5,"reason":"exit",
            "summary":{"host":{"live_bytes":1,"live_blocks":1,"total_allocs":1,"total_frees":0,"peak_live_bytes":1}},
            "launch":{"rank":1,"world_size":2,"host":"n1"},
            "frames":[{"ip":"0x1","function":"f","file":"a.c","line":3},{"ip":"0x2","function":"main"},{"ip":"0x3","function":"step","file":"t.py","line":9,"python":true}],
            "timeline":{"points":[],"series":[{"kind":"host","api":"malloc","stack_id":3,"stack":[1,0],"bytes":[1],
                "held_by":[{"kind":"host","offset":8,"api":"malloc","size":16,"stack_id":2,"stack":[0]},{"kind":"global","offset":0,"symbol":"g"}]}],
              "lines":[{"function":"step","file":"t.py","line":9,"bytes":[1],"held_by":[{"kind":"host","offset":0,"stack":[2,1]}],
                "also_held_by":{"blocks":1,"held_by_blocks":2,"looked_at":5,"held_by":[{"kind":"host","offset":0,"stack":[1]}]}}]},
            "leaks":[{"kind":"host","api":"malloc","bytes":1,"blocks":1,"stack":[0,1],"held_by":[{"kind":"host","offset":4,"stack":[2]}]}],
            "checks":[{"label":"t","unix_ms":1,"leaks":[{"kind":"host","api":"malloc","stack_id":1,"stack":[0]}]}]}"#;
        let p = Path::new("r.json");
        assert!(serde_json::from_str::<report_schema::Report<report_schema::Indexed>>(text).unwrap().inline().is_some(), "the quick path reads it");
        let quick = serde_json::to_value(parse(text, p).unwrap()).unwrap();
        let general = serde_json::to_value(parse_general(text, p).unwrap()).unwrap();
        assert_eq!(quick, general);
        assert_eq!(quick["timeline"]["lines"][0]["held_by"][0]["stack"][0]["function"], "step");
    }

    #[test]
    fn a_damaged_report_in_a_directory_is_skipped_and_named() {
        let dir = std::env::temp_dir().join(format!("leaktrace-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = r#"{"schema":"leaktrace-report/1","pid":5,"reason":"exit","summary":{"host":{"live_bytes":0,"live_blocks":0,"total_allocs":0,"total_frees":0,"peak_live_bytes":0}},"leaks":[]}"#;
        std::fs::write(dir.join("leaktrace.a.5.json"), good).unwrap();
        std::fs::write(dir.join("leaktrace.b.6.json"), &good[..40]).unwrap();
        let mut said = Vec::new();
        let r = load_with(&dir, &mut |e| said.push(e.to_string())).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(said.len(), 1);
        assert!(said[0].contains("leaktrace.b.6.json") && said[0].contains("not valid JSON"), "{said:?}");
        std::fs::remove_file(dir.join("leaktrace.a.5.json")).unwrap();
        let e = load_with(&dir, &mut |_| {}).unwrap_err();
        assert!(e.contains("leaktrace.b.6.json"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A shared output tree (one directory per host and rank): every report in it.
    #[test]
    fn a_tree_of_directories_is_read_whole() {
        let dir = std::env::temp_dir().join(format!("leaktrace-tree-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let report = |pid: u32| {
            format!(
                r#"{{"schema":"leaktrace-report/1","pid":{pid},"reason":"exit","summary":{{"host":{{"live_bytes":0,"live_blocks":0,"total_allocs":0,"total_frees":0,"peak_live_bytes":0}}}},"leaks":[]}}"#
            )
        };
        for (sub, pid) in [("hostA/0", 10), ("hostA/1", 11), ("hostB/2", 12)] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
            std::fs::write(dir.join(sub).join(format!("leaktrace.p.{pid}.json")), report(pid)).unwrap();
        }
        let r = load_with(&dir, &mut |_| {}).unwrap();
        assert_eq!(r.iter().map(|r| r.pid).collect::<Vec<_>>(), vec![10, 11, 12]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
