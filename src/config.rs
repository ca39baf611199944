//! `LEAKTRACE_*` settings. Parsing is pure (it takes a lookup function) so it is unit
//! tested; a malformed value yields one warning line and the default.
use std::path::PathBuf;

/// The deepest stack captured (`LEAKTRACE_STACK_DEPTH`).
pub const MAX_DEPTH: usize = 128;

pub const DEFAULT_INTERVAL_MS: u64 = 10_000;
/// Python objects are sampled once per this many bytes on average when sampling is
/// asked for (`LEAKTRACE_PYTHON_SAMPLE=1` means this mean).
pub const PYTHON_SAMPLE_MEAN: u64 = 64 << 10;
/// On by default. (It was off while a per-test check's verdict varied with it on: the
/// cause was stale words in memory handed out again, which the sampling's changes to
/// the heap's layout made likelier; the malloc hooks now hand out blocks cleared,
/// `interpose::malloc::fresh`.)
pub const DEFAULT_PYTHON_SAMPLE: u64 = PYTHON_SAMPLE_MEAN;
pub const DEFAULT_DEPTH: usize = 64;
pub const DEFAULT_SUMMARY_TOP: usize = 10;
pub const DEFAULT_REPORT_GROUPS: usize = 2000;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// LEAKTRACE_OUTPUT: directory for reports (default: the working directory at start).
    pub output_dir: Option<PathBuf>,
    /// LEAKTRACE_INTERVAL_MS: periodic report period, 0 = off.
    pub interval_ms: u64,
    /// Whether the period was set (`LEAKTRACE_INTERVAL_MS`): otherwise reports start
    /// every second and back off to `interval_ms` as the run grows (`report_period`).
    pub interval_set: bool,
    /// LEAKTRACE_STACK_DEPTH: frames kept per stack (1..=128).
    pub stack_depth: usize,
    /// LEAKTRACE_SUMMARY: when to print the human summary on stderr at exit.
    pub summary: Summary,
    /// LEAKTRACE_SUMMARY_TOP: leak groups shown in that summary.
    pub summary_top: usize,
    /// LEAKTRACE_SNAPSHOT_SIGNAL: signal number that requests a snapshot, None = off.
    pub snapshot_signal: Option<i32>,
    /// LEAKTRACE_FOLLOW_FORK: keep tracking in forked children.
    pub follow_fork: bool,
    /// LEAKTRACE_DISABLE: pass everything through, record nothing.
    pub disabled: bool,
    /// LEAKTRACE_SUPPRESSIONS: LeakSanitizer-style file applied to the exit summary.
    pub suppressions: Option<PathBuf>,
    /// Apply the built-in suppressions (`leaktrace_common::suppressions::BUILT_IN`) too.
    pub default_suppressions: bool,
    /// LEAKTRACE_SCAN: classify outstanding blocks as definite/indirect/reachable at exit.
    pub scan: bool,
    /// LEAKTRACE_REPORT_GROUPS: leak groups listed (with stacks) per report; the rest
    /// are added up in `summary.omitted`.
    pub report_groups: usize,
    /// LEAKTRACE_COLLECTOR: when the collector thread starts.
    pub collector: CollectorStart,
    /// LEAKTRACE_EXIT_CODE: the status a process that leaks exits with when it would
    /// have exited with 0 (LeakSanitizer's `exitcode`); None = the program's own status.
    pub exit_code: Option<u8>,
    /// LEAKTRACE_PYTHON: Python frames in the stacks of a CPython process.
    pub python_frames: bool,
    /// Mean bytes between sampled Python objects (`LEAKTRACE_PYTHON_SAMPLE`); 0: off.
    pub python_sample: u64,
    /// LEAKTRACE_WHY_REACHABLE: a LeakSanitizer-style template; the reachable blocks of
    /// the groups whose stack it matches are listed, each with the path that keeps it,
    /// in every report the scan runs for and in every check.
    pub why_reachable: Option<String>,
    /// LEAKTRACE_STANDBY: loaded, recording nothing, until `leaktrace attach PID`
    /// switches it on (`agent::standby`).
    pub standby: bool,
}

/// When the library's collector thread starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CollectorStart {
    /// At start-up (periodic reports, snapshots and the SIGTERM report work from the
    /// first instant).
    Thread,
    /// With the program's own second thread: a program that must stay single-threaded
    /// (Chromium's zygote checks `/proc/self/task`) stays so. Until then events are
    /// drained by the program's thread, and there are no periodic reports and no final
    /// report on SIGTERM.
    Lazy,
    /// When the process first needs it: its second thread, its 4,096th allocation or
    /// its first allocation after 50 ms (`agent::collector_thread::ON_DEMAND_*`), a
    /// termination or snapshot signal. A short program (`/bin/true`, `git --version`,
    /// a build's compiler runs) never pays for a thread's start and exit (~0.12 ms of
    /// each process on this machine); its exit report drains what it published.
    OnDemand,
    /// `Lazy` in processes known to require a single thread (a Chromium or Electron
    /// zygote: `--type=zygote`); `Thread` when a report period was set
    /// (`LEAKTRACE_INTERVAL_MS`: periodic reports are asked for from the start);
    /// `OnDemand` elsewhere.
    Auto,
}

impl CollectorStart {
    /// The choice for a process with these arguments, `interval_set` when
    /// `LEAKTRACE_INTERVAL_MS` was given.
    pub fn resolve(self, argv: &[String], interval_set: bool) -> CollectorStart {
        match self {
            CollectorStart::Auto if argv.iter().any(|a| a == "--type=zygote") => CollectorStart::Lazy,
            CollectorStart::Auto if interval_set => CollectorStart::Thread,
            CollectorStart::Auto => CollectorStart::OnDemand,
            other => other,
        }
    }
}

/// The first periodic reports of a run whose period was not set come this often...
pub const FIRST_PERIOD_MS: u64 = 1000;

/// The wait before the next periodic report of a run that has lasted `elapsed_ms`: the
/// set period, or — by default — one eighth of the time run so far, from 1 s up to the
/// default 10 s. A 25-second job gets ~17 points for growth detection instead of 2; an
/// hour-long one writes ~18 more reports in its first 80 s, then one every 10 s as
/// before.
pub fn report_period(config_ms: u64, set: bool, elapsed_ms: u64) -> u64 {
    if set || config_ms == 0 {
        return config_ms;
    }
    (elapsed_ms / 8).clamp(FIRST_PERIOD_MS.min(config_ms), config_ms)
}

/// Timeline points between reports come at least this often...
pub const FIRST_POINT_MS: u64 = 250;

/// The wait before the next timeline point (growth detection's data) of a run that has
/// lasted `elapsed_ms`: by default one 32nd of the time run so far, from 0.25 s up to the
/// report period; every report also records one. A point reads only the groups that
/// changed since the last one (`Collector::take_changes`). A loop that leaks for 3 s after
/// a 3 s import then has ~10 points (8 are needed to judge growth) where reports alone
/// gave it 3. A period that was set is kept as is: points come with reports only.
pub fn point_period(config_ms: u64, set: bool, elapsed_ms: u64) -> u64 {
    let report = report_period(config_ms, set, elapsed_ms);
    if set || report == 0 {
        return report;
    }
    (elapsed_ms / 32).clamp(FIRST_POINT_MS.min(report), report)
}

/// When the exit summary goes to stderr (LEAKTRACE_SUMMARY).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Summary {
    /// `0`: never.
    Never,
    /// `leaks` (the default): only when something leaked or a suppression matched, as
    /// LeakSanitizer; a clean
    /// process writes nothing to stderr (Tcl's `exec` fails on any stderr output, and
    /// `2>&1` pipelines would get our lines).
    Leaks,
    /// `1`: always, "no leaks found" included.
    Always,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            output_dir: None,
            interval_ms: DEFAULT_INTERVAL_MS,
            interval_set: false,
            stack_depth: DEFAULT_DEPTH,
            summary: Summary::Leaks,
            summary_top: DEFAULT_SUMMARY_TOP,
            snapshot_signal: Some(libc::SIGUSR2),
            follow_fork: true,
            disabled: false,
            suppressions: None,
            default_suppressions: true,
            scan: true,
            report_groups: DEFAULT_REPORT_GROUPS,
            collector: CollectorStart::Auto,
            exit_code: None,
            python_frames: true,
            python_sample: DEFAULT_PYTHON_SAMPLE,
            why_reachable: None,
            standby: false,
        }
    }
}

/// Every variable the library reads, for `--help`-like listings and the README.
pub const VARIABLES: &[(&str, &str)] = &[
    ("LEAKTRACE_OUTPUT", "directory for reports (default: working directory at start)"),
    ("LEAKTRACE_INTERVAL_MS", "periodic report every N ms, 0 = off (default: every second at first, backing off to 10000 as the run grows, and never sooner than 30 times what the last report took)"),
    ("LEAKTRACE_STACK_DEPTH", "frames per stack, 1..=128 (default 64)"),
    ("LEAKTRACE_SUMMARY", "leaks/1/0: leak summary on stderr at exit only when something leaked (default leaks), always, or never"),
    ("LEAKTRACE_SUMMARY_TOP", "leak groups in that summary (default 10)"),
    ("LEAKTRACE_SNAPSHOT_SIGNAL", "signal that asks for a snapshot: USR1, USR2, a number, or 0/off (default USR2)"),
    ("LEAKTRACE_FOLLOW_FORK", "1/0: keep tracking in forked children (default 1)"),
    ("LEAKTRACE_DISABLE", "1: record nothing, write nothing (default 0)"),
    ("LEAKTRACE_STANDBY", "1: record nothing until `leaktrace attach PID` switches the process on (default 0)"),
    ("LEAKTRACE_SUPPRESSIONS", "LeakSanitizer-style suppressions file (leak:PATTERN) for the exit summary"),
    ("LEAKTRACE_DEFAULT_SUPPRESSIONS", "1/0: also suppress the leaks that libraries make on their own in every process (PyTorch's static initializer block) (default 1)"),
    ("LEAKTRACE_REPORT_GROUPS", "leak groups listed with their stacks per report, the rest added up (default 2000)"),
    ("LEAKTRACE_COLLECTOR", "thread, demand, lazy or auto: start the collector thread at once; when first needed (a second thread, the 4,096th allocation or the first after 50 ms, a termination or snapshot signal); or only with the program's second thread (default auto: demand; lazy in a Chromium zygote, which must stay single-threaded; thread when LEAKTRACE_INTERVAL_MS is set)"),
    ("LEAKTRACE_EXIT_CODE", "1..255: a process that leaks (after suppressions) and would have exited with 0 exits with this status, as LeakSanitizer's exitcode (default: off, the program's own status)"),
    ("LEAKTRACE_PYTHON_SAMPLE", "1/0: sample Python's small objects (one per 64 KiB allocated), so that a pure-Python growth is found at its line; or the mean bytes between samples, 1024..1073741824 (default 1)"),
    ("LEAKTRACE_PYTHON", "1/0: Python frames (function, file, line) in the stacks of a CPython 3.9-3.13 process (default 1)"),
    ("LEAKTRACE_WHY_REACHABLE", "a template (leak:PATTERN's PATTERN) naming groups by a function, file or module of their stack: each of their reachable blocks is listed with the path of references that keeps it (default: none)"),
    ("LEAKTRACE_SCAN", "0: no pointer scan at exit; every outstanding block counts (default 1: definite/indirect/reachable as LeakSanitizer)"),
];

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Some(true),
        "0" | "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn parse_signal(v: &str) -> Option<Option<i32>> {
    let t = v.trim().to_ascii_uppercase();
    let t = t.strip_prefix("SIG").unwrap_or(&t);
    match t {
        "0" | "OFF" | "NONE" => Some(None),
        "USR1" => Some(Some(libc::SIGUSR1)),
        "USR2" => Some(Some(libc::SIGUSR2)),
        "HUP" => Some(Some(libc::SIGHUP)),
        "WINCH" => Some(Some(libc::SIGWINCH)),
        _ => {
            let n: i32 = t.parse().ok()?;
            // Signals that cannot be caught, or that the program needs to die by, are refused.
            let refused = [libc::SIGKILL, libc::SIGSTOP, libc::SIGSEGV, libc::SIGBUS, libc::SIGFPE, libc::SIGILL];
            if (1..=64).contains(&n) && !refused.contains(&n) {
                Some(Some(n))
            } else {
                None
            }
        }
    }
}

impl Config {
    /// Builds the configuration from `get` (normally the environment); each malformed
    /// value is reported through `warn` once and replaced by its default.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>, mut warn: impl FnMut(String)) -> Config {
        let mut c = Config::default();
        let mut bad = |name: &str, value: &str, expected: &str, default: String| {
            warn(format!("leaktrace: {name}={value:?} is not {expected}; using {default}"));
        };
        if let Some(v) = get("LEAKTRACE_OUTPUT") {
            if v.trim().is_empty() {
                bad("LEAKTRACE_OUTPUT", &v, "a directory", "the working directory".into());
            } else {
                c.output_dir = Some(PathBuf::from(v));
            }
        }
        if let Some(v) = get("LEAKTRACE_INTERVAL_MS") {
            match v.trim().parse::<u64>() {
                Ok(n) if n <= 86_400_000 * 365 => {
                    c.interval_ms = n;
                    c.interval_set = true;
                }
                _ => bad("LEAKTRACE_INTERVAL_MS", &v, "a number of milliseconds (0 = off)", DEFAULT_INTERVAL_MS.to_string()),
            }
        }
        if let Some(v) = get("LEAKTRACE_STACK_DEPTH") {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_DEPTH).contains(&n) => c.stack_depth = n,
                _ => bad("LEAKTRACE_STACK_DEPTH", &v, &format!("a depth between 1 and {}", MAX_DEPTH), DEFAULT_DEPTH.to_string()),
            }
        }
        if let Some(v) = get("LEAKTRACE_SUMMARY") {
            match (v.trim().eq_ignore_ascii_case("leaks"), parse_bool(&v)) {
                (true, _) => c.summary = Summary::Leaks,
                (_, Some(true)) => c.summary = Summary::Always,
                (_, Some(false)) => c.summary = Summary::Never,
                _ => bad("LEAKTRACE_SUMMARY", &v, "leaks, 1 or 0", "leaks".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_SUMMARY_TOP") {
            match v.trim().parse::<usize>() {
                Ok(n) if n <= 100_000 => c.summary_top = n,
                _ => bad("LEAKTRACE_SUMMARY_TOP", &v, "a count", DEFAULT_SUMMARY_TOP.to_string()),
            }
        }
        if let Some(v) = get("LEAKTRACE_REPORT_GROUPS") {
            match v.trim().parse::<usize>() {
                Ok(n) if (1..=10_000_000).contains(&n) => c.report_groups = n,
                _ => bad("LEAKTRACE_REPORT_GROUPS", &v, "a count from 1", DEFAULT_REPORT_GROUPS.to_string()),
            }
        }
        if let Some(v) = get("LEAKTRACE_SNAPSHOT_SIGNAL") {
            match parse_signal(&v) {
                Some(s) => c.snapshot_signal = s,
                None => bad("LEAKTRACE_SNAPSHOT_SIGNAL", &v, "a catchable signal (USR1, USR2, a number, or off)", "USR2".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_FOLLOW_FORK") {
            match parse_bool(&v) {
                Some(b) => c.follow_fork = b,
                None => bad("LEAKTRACE_FOLLOW_FORK", &v, "1 or 0", "1".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_SUPPRESSIONS") {
            if v.trim().is_empty() {
                bad("LEAKTRACE_SUPPRESSIONS", &v, "a file", "no suppressions".into());
            } else {
                c.suppressions = Some(PathBuf::from(v));
            }
        }
        if let Some(v) = get("LEAKTRACE_DEFAULT_SUPPRESSIONS") {
            match parse_bool(&v) {
                Some(b) => c.default_suppressions = b,
                None => bad("LEAKTRACE_DEFAULT_SUPPRESSIONS", &v, "1 or 0", "1".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_PYTHON") {
            match parse_bool(&v) {
                Some(b) => c.python_frames = b,
                None => bad("LEAKTRACE_PYTHON", &v, "1 or 0", "1".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_PYTHON_SAMPLE") {
            match v.trim().parse::<u64>() {
                Ok(1) => c.python_sample = PYTHON_SAMPLE_MEAN,
                Ok(n) if n == 0 || (1024..=1 << 30).contains(&n) => c.python_sample = n,
                _ => bad(
                    "LEAKTRACE_PYTHON_SAMPLE",
                    &v,
                    "1 (one sampled Python object per 64 KiB), or the mean bytes between them, 1024 to 1073741824 (0: off)",
                    "1".into(),
                ),
            }
        }
        if let Some(v) = get("LEAKTRACE_WHY_REACHABLE") {
            let v = v.trim();
            c.why_reachable = (!v.is_empty()).then(|| v.to_string());
        }
        if let Some(v) = get("LEAKTRACE_SCAN") {
            match parse_bool(&v) {
                Some(b) => c.scan = b,
                None => bad("LEAKTRACE_SCAN", &v, "1 or 0", "1".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_COLLECTOR") {
            match v.trim().to_ascii_lowercase().as_str() {
                "thread" => c.collector = CollectorStart::Thread,
                "lazy" => c.collector = CollectorStart::Lazy,
                "demand" | "on-demand" => c.collector = CollectorStart::OnDemand,
                "auto" => c.collector = CollectorStart::Auto,
                _ => bad("LEAKTRACE_COLLECTOR", &v, "thread, demand, lazy or auto", "auto".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_EXIT_CODE") {
            match v.trim().parse::<u8>() {
                Ok(0) => c.exit_code = None,
                Ok(n) => c.exit_code = Some(n),
                _ => bad("LEAKTRACE_EXIT_CODE", &v, "a status from 1 to 255 (0: off)", "off".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_DISABLE") {
            match parse_bool(&v) {
                Some(b) => c.disabled = b,
                None => bad("LEAKTRACE_DISABLE", &v, "1 or 0", "0".into()),
            }
        }
        if let Some(v) = get("LEAKTRACE_STANDBY") {
            match parse_bool(&v) {
                Some(b) => c.standby = b,
                None => bad("LEAKTRACE_STANDBY", &v, "1 or 0", "0".into()),
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> (Config, Vec<String>) {
        let env: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut warnings = Vec::new();
        let c = Config::from_lookup(|k| env.get(k).cloned(), |w| warnings.push(w));
        (c, warnings)
    }

    #[test]
    fn the_default_period_starts_at_a_second_and_backs_off_to_the_interval() {
        assert_eq!(report_period(DEFAULT_INTERVAL_MS, false, 0), 1000);
        assert_eq!(report_period(DEFAULT_INTERVAL_MS, false, 8_000), 1000);
        assert_eq!(report_period(DEFAULT_INTERVAL_MS, false, 24_000), 3000);
        assert_eq!(report_period(DEFAULT_INTERVAL_MS, false, 3_600_000), DEFAULT_INTERVAL_MS);
        // A period that was set is kept, and 0 stays off.
        assert_eq!(report_period(10_000, true, 0), 10_000);
        assert_eq!(report_period(0, true, 0), 0);
        let (c, _) = parse(&[("LEAKTRACE_INTERVAL_MS", "250")]);
        assert!(c.interval_set);
        assert_eq!(report_period(c.interval_ms, c.interval_set, 60_000), 250);
        // 25 s of a default run: about 17 periodic reports.
        let (mut t, mut n) = (0u64, 0);
        loop {
            t += report_period(DEFAULT_INTERVAL_MS, false, t);
            if t > 25_000 {
                break;
            }
            n += 1;
        }
        assert!((15..=20).contains(&n), "{n} reports in 25 s");
    }

    #[test]
    fn timeline_points_come_four_times_as_often_as_reports_at_first_and_never_slower() {
        assert_eq!(point_period(DEFAULT_INTERVAL_MS, false, 0), 250);
        assert_eq!(point_period(DEFAULT_INTERVAL_MS, false, 8_000), 250);
        assert_eq!(point_period(DEFAULT_INTERVAL_MS, false, 64_000), 2000);
        assert_eq!(point_period(DEFAULT_INTERVAL_MS, false, 3_600_000), DEFAULT_INTERVAL_MS);
        for t in (0..200_000).step_by(700) {
            assert!(point_period(DEFAULT_INTERVAL_MS, false, t) <= report_period(DEFAULT_INTERVAL_MS, false, t));
        }
        // Set, or off: with the reports.
        assert_eq!(point_period(250, true, 60_000), 250);
        assert_eq!(point_period(0, true, 0), 0);
        assert_eq!(point_period(0, false, 0), 0);
        // A loop from 3 s to 6 s of a default run: at least 8 points inside it.
        let (mut t, mut n) = (0u64, 0);
        while t < 6_000 {
            if t >= 3_000 {
                n += 1;
            }
            t += point_period(DEFAULT_INTERVAL_MS, false, t);
        }
        assert!(n >= 8, "{n} points in the loop");
    }

    #[test]
    fn the_exit_code_is_a_status_or_off() {
        assert_eq!(parse(&[("LEAKTRACE_EXIT_CODE", "23")]).0.exit_code, Some(23));
        assert_eq!(parse(&[("LEAKTRACE_EXIT_CODE", "0")]).0.exit_code, None);
        let (c, w) = parse(&[("LEAKTRACE_EXIT_CODE", "256")]);
        assert_eq!((c.exit_code, w.len()), (None, 1));
    }

    #[test]
    fn collector_start_is_on_demand_by_default_lazy_in_a_zygote_and_at_once_with_a_period() {
        let (c, w) = parse(&[("LEAKTRACE_COLLECTOR", "bogus")]);
        assert_eq!(c.collector, CollectorStart::Auto);
        assert_eq!(w.len(), 1);
        let zygote = ["/usr/lib/chromium/chromium".to_string(), "--type=zygote".to_string()];
        let browser = ["/usr/lib/chromium/chromium".to_string(), "--headless".to_string()];
        assert_eq!(CollectorStart::Auto.resolve(&zygote, false), CollectorStart::Lazy);
        assert_eq!(CollectorStart::Auto.resolve(&zygote, true), CollectorStart::Lazy);
        assert_eq!(CollectorStart::Auto.resolve(&browser, false), CollectorStart::OnDemand);
        assert_eq!(CollectorStart::Auto.resolve(&browser, true), CollectorStart::Thread);
        assert_eq!(CollectorStart::Thread.resolve(&zygote, false), CollectorStart::Thread);
        assert_eq!(CollectorStart::OnDemand.resolve(&browser, true), CollectorStart::OnDemand);
        let (c, _) = parse(&[("LEAKTRACE_COLLECTOR", "Lazy")]);
        assert_eq!(c.collector, CollectorStart::Lazy);
        let (c, _) = parse(&[("LEAKTRACE_COLLECTOR", "demand")]);
        assert_eq!(c.collector, CollectorStart::OnDemand);
    }

    #[test]
    fn defaults_without_variables() {
        let (c, w) = parse(&[]);
        assert_eq!(c, Config::default());
        assert!(w.is_empty());
    }

    #[test]
    fn good_values_are_taken() {
        let (c, w) = parse(&[
            ("LEAKTRACE_OUTPUT", "/tmp/x"),
            ("LEAKTRACE_INTERVAL_MS", "0"),
            ("LEAKTRACE_STACK_DEPTH", "16"),
            ("LEAKTRACE_SUMMARY", "off"),
            ("LEAKTRACE_SUMMARY_TOP", "3"),
            ("LEAKTRACE_SNAPSHOT_SIGNAL", "SIGUSR1"),
            ("LEAKTRACE_FOLLOW_FORK", "0"),
            ("LEAKTRACE_DEFAULT_SUPPRESSIONS", "0"),
        ]);
        assert!(w.is_empty(), "{w:?}");
        assert_eq!(c.output_dir, Some(PathBuf::from("/tmp/x")));
        assert_eq!(c.interval_ms, 0);
        assert_eq!(c.stack_depth, 16);
        assert_eq!(c.summary, Summary::Never);
        assert_eq!(Config::default().summary, Summary::Leaks);
        assert_eq!(parse(&[("LEAKTRACE_SUMMARY", "1")]).0.summary, Summary::Always);
        assert_eq!(parse(&[("LEAKTRACE_SUMMARY", "leaks")]).0.summary, Summary::Leaks);
        assert_eq!(c.summary_top, 3);
        assert_eq!(c.snapshot_signal, Some(libc::SIGUSR1));
        assert!(!c.follow_fork);
        assert!(!c.default_suppressions);
        assert!(Config::default().default_suppressions);
    }

    #[test]
    fn malformed_values_warn_once_each_and_fall_back() {
        let (c, w) = parse(&[
            ("LEAKTRACE_OUTPUT", " "),
            ("LEAKTRACE_INTERVAL_MS", "-5"),
            ("LEAKTRACE_STACK_DEPTH", "100000"),
            ("LEAKTRACE_SUMMARY", "maybe"),
            ("LEAKTRACE_SUMMARY_TOP", "x"),
            ("LEAKTRACE_SNAPSHOT_SIGNAL", "9"),
            ("LEAKTRACE_FOLLOW_FORK", ""),
            ("LEAKTRACE_DISABLE", "\u{1F600}"),
            ("LEAKTRACE_REPORT_GROUPS", "0"),
        ]);
        assert_eq!(w.len(), 9, "{w:#?}");
        assert!(w.iter().all(|l| l.starts_with("leaktrace: LEAKTRACE_") && !l.contains('\n')));
        assert_eq!(c, Config::default(), "every malformed value fell back to its default");
    }

    #[test]
    fn signal_names_and_numbers() {
        assert_eq!(parse_signal("usr2"), Some(Some(libc::SIGUSR2)));
        assert_eq!(parse_signal("off"), Some(None));
        assert_eq!(parse_signal("10"), Some(Some(10)));
        assert_eq!(parse_signal("65"), None);
        assert_eq!(parse_signal("SIGSEGV"), None);
    }
}
