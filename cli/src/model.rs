//! Reading `leaktrace-report/1`, `/2` and `/3` files (see docs/report-format.md). Unknown
//! fields are ignored; a missing file, bad JSON or another schema major version is an
//! error that says what to do.
use std::path::{Path, PathBuf};

use leaktrace_common::report_schema::{self, READABLE_MAJORS, SCHEMA_PREFIX};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Frame {
    #[serde(default)]
    pub ip: String,
    #[serde(default)]
    pub module: Option<String>,
    #[serde(default)]
    pub offset: Option<u64>,
    #[serde(default)]
    pub function: Option<String>,
    #[serde(default)]
    pub file: Option<String>,
    #[serde(default)]
    pub line: Option<u32>,
    #[serde(default)]
    pub inlined: bool,
    /// A Python frame (schema 3).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub python: bool,
}

/// The schema's own types (`common`), as the library writes them.
pub use leaktrace_common::report_schema::{Amount, Reachability};

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Group {
    pub kind: String,
    pub api: String,
    /// CUDA device ordinal (device-side groups).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// The caching allocator holding this memory (a cache, not a leak by default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_by: Option<String>,
    pub bytes: u64,
    pub blocks: u64,
    #[serde(default)]
    pub peak_bytes: u64,
    #[serde(default)]
    pub total_allocs: u64,
    #[serde(default)]
    pub stack_id: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reachability: Option<Reachability>,
    /// Its indirect leaks by the stack of the definite leak each hangs from.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indirect_from: Vec<IndirectFrom>,
    #[serde(default)]
    pub stack: Vec<Frame>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct IndirectFrom {
    pub stack_id: u32,
    pub bytes: u64,
    pub blocks: u64,
}

impl Group {
    /// `kind`, with the device for device-side groups: "device, device 1".
    pub fn kind_label(&self) -> String {
        match self.device {
            Some(d) => format!("{}, device {d}", self.kind),
            None => self.kind.clone(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct HostTotals {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub total_allocs: u64,
    pub total_frees: u64,
    pub peak_live_bytes: u64,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Summary {
    pub host: HostTotals,
    /// Groups the library did not list (over LEAKTRACE_REPORT_GROUPS), added up.
    #[serde(default)]
    pub omitted: Omitted,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct Omitted {
    #[serde(default)]
    pub groups: u64,
    #[serde(default)]
    pub leaked_bytes: u64,
    #[serde(default)]
    pub leaked_blocks: u64,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Point {
    pub unix_ms: u64,
    pub live_bytes: u64,
    #[serde(default)]
    pub live_blocks: u64,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Series {
    pub kind: String,
    pub api: String,
    pub stack_id: u32,
    #[serde(default)]
    pub stack: Option<Vec<Frame>>,
    pub bytes: Vec<u64>,
}

/// Live bytes by a line of the user's own Python code (schema 3, Python processes).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct LineSeries {
    #[serde(default)]
    pub function: String,
    #[serde(default)]
    pub file: String,
    #[serde(default)]
    pub line: u32,
    pub bytes: Vec<u64>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Timeline {
    #[serde(default)]
    pub points: Vec<Point>,
    #[serde(default)]
    pub series: Vec<Series>,
    #[serde(default)]
    pub lines: Vec<LineSeries>,
}

/// One leak check (`leaktrace_snapshot(label)`, a pytest test): what the scan found
/// among the blocks of its region.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Check {
    pub label: String,
    #[serde(default)]
    pub scope: String,
    /// `definite`, `indirect`, `reachable` at the top of the check.
    #[serde(flatten)]
    pub found: Reachability,
    #[serde(default)]
    pub suppressed: Amount,
    #[serde(default)]
    pub leak_groups: usize,
    #[serde(default)]
    pub leaks: Vec<CheckLeak>,
}

impl Check {
    pub fn leaked_bytes(&self) -> u64 {
        self.found.leaked().bytes
    }

    pub fn leaked_blocks(&self) -> u64 {
        self.found.leaked().blocks
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct CheckLeak {
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub api: String,
    #[serde(default)]
    pub reachability: Reachability,
    #[serde(default)]
    pub stack: Vec<Frame>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Fork {
    #[serde(default)]
    pub forked_from_pid: Option<u32>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Report {
    pub schema: String,
    pub pid: u32,
    #[serde(default)]
    pub ppid: u32,
    #[serde(default)]
    pub exe: String,
    #[serde(default)]
    pub argv: Vec<String>,
    pub reason: String,
    /// The signal that ended the process (final reports written for one).
    #[serde(default)]
    pub exit_signal: Option<i32>,
    /// Why this process can never get a final report (the library found out).
    #[serde(default)]
    pub no_final_report: Option<String>,
    #[serde(default)]
    pub started_unix_ms: u64,
    #[serde(default)]
    pub written_unix_ms: u64,
    #[serde(default)]
    pub fork: Fork,
    pub summary: Summary,
    #[serde(default)]
    pub timeline: Timeline,
    #[serde(default)]
    pub leaks: Vec<Group>,
    /// Leak checks the program asked for through the C API or the pytest plugin.
    #[serde(default)]
    pub checks: Vec<Check>,
    /// Where it was read from (not part of the file).
    #[serde(skip)]
    pub path: PathBuf,
}

impl Report {
    /// A short name for the process: "python3 (pid 123)".
    pub fn label(&self) -> String {
        let name = Path::new(&self.exe).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "?".into());
        format!("{name} (pid {})", self.pid)
    }

    /// The stack of a timeline series: its own, or that of the leak group it names.
    pub fn series_stack<'a>(&'a self, s: &'a Series) -> &'a [Frame] {
        match &s.stack {
            Some(st) => st,
            None => self.leaks.iter().find(|g| g.stack_id == s.stack_id).map(|g| g.stack.as_slice()).unwrap_or(&[]),
        }
    }
}

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
        if of_pid.iter().any(|r| r.reason == "exit") {
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

pub fn parse(text: &str, path: &Path) -> Result<Report, String> {
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

/// A report file, or every `leaktrace.*.json` in a directory (sorted by start time).
pub fn load(path: &Path) -> Result<Vec<Report>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot open {} ({e}); give a report file or a directory of reports", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![load_file(path)?]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| format!("cannot list {} ({e})", path.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            n.starts_with("leaktrace.") && n.ends_with(".json")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("{} holds no leaktrace.*.json reports; was the program run under leaktrace?", path.display()));
    }
    let mut reports = files.iter().map(|f| load_file(f)).collect::<Result<Vec<_>, _>>()?;
    reports.sort_by_key(|r| (r.started_unix_ms, r.pid));
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_without_a_final_report_are_named() {
        let rep = |pid: u32, reason: &str, why: Option<&str>| Report {
            pid,
            exe: "/bin/prog".into(),
            reason: reason.into(),
            no_final_report: why.map(str::to_string),
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
        assert_eq!(r.series_stack(&r.timeline.series[0])[0].ip, "0x2");
        let bad = parse(r#"{"schema":"leaktrace-report/2","frames":[],"leaks":[{"stack":[0]}]}"#, Path::new("b.json"));
        assert!(bad.unwrap_err().contains("damaged leaktrace report (the stack of leak group 0 refers to frame 0"));
    }
}
