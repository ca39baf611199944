//! `leaktrace`: run a program under libleaktrace.so, and read, compare and check the
//! reports it writes. Exit codes follow LeakSanitizer: 23 when leaks remain under
//! `--fail-on-leak`/`check`, 2 for usage and input errors, 127 when CMD is not found.
mod analyze;
mod attach;
mod ci;
mod diff;
mod flame;
#[cfg(test)]
mod fuzz_tests;
mod growth;
mod html;
mod inject;
mod model;
mod pprof;
mod ranks;
mod render;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

use analyze::{Analysis, Filters};

const LEAK_EXIT: u8 = 23;

#[derive(Parser)]
#[command(
    name = "leaktrace",
    version,
    about = "Find memory leaks in unmodified programs (LD_PRELOAD tracer with JSON reports)",
    after_help = "Examples:\n  leaktrace run -- python3 train.py\n  leaktrace run --fail-on-leak --suppressions lsan.supp -- ./unit_tests\n  leaktrace report leaktrace-python3-20261121-101500/\n  leaktrace check --min-bytes 4096 reports/\n  leaktrace diff before/ after/"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run CMD under leaktrace, collect the reports of all its processes, print a summary.
    #[command(
        after_help = "Example:\n  leaktrace run --interval-ms 1000 --fail-on-leak -- ./service --port 0\n\nExit status: CMD's own; 23 (see --exit-code) under --fail-on-leak when leaks remain\nafter suppressions and --min-bytes; 127 if CMD is not found; 2 on other errors."
    )]
    Run(RunArgs),
    /// Print the reports of files or directories: text, JSON, Markdown, HTML, a flamegraph, GitHub annotations, JUnit XML or a pprof profile.
    #[command(
        after_help = "Examples:\n  leaktrace report --format markdown leaktrace-myprog-20261121-101500/ >> \"$GITHUB_STEP_SUMMARY\"\n  leaktrace report --format flamegraph reports/ > leaks.svg\n  leaktrace report --format html reports/ > leaks.html"
    )]
    Report(ReportArgs),
    /// Compare two runs: leak groups that are new, grew, shrank or went away.
    #[command(after_help = "Example:\n  leaktrace diff runs/main/ runs/my-branch/\n\nGroups are matched by their symbolized stacks, not by addresses.")]
    Diff(DiffArgs),
    /// Exit with 23 if leaks remain after suppressions and the size threshold (for CI).
    #[command(
        after_help = "Example:\n  leaktrace check --suppressions lsan.supp --min-bytes 1024 reports/\n\nSuppressions use LeakSanitizer's format: leak:PATTERN lines, '*' wildcard, '^'/'$' anchors,\nmatched against function, source file and module names; '#' starts a comment."
    )]
    Check(CheckArgs),
    /// Switch on a process started in standby (`leaktrace run --standby`, or
    /// LEAKTRACE_STANDBY=1 with the library preloaded): it records from now on and
    /// writes its reports as under `run`.
    #[command(
        after_help = "Examples:\n  leaktrace run --standby --output /var/tmp/lt -- python3 train.py &\n  leaktrace attach 12345\n  leaktrace attach --snapshot 12345\n  leaktrace report /var/tmp/lt\n\nNo ptrace: the process answers on a socket in /tmp/leaktrace-UID/, to its own user and root only,\nso it works in a container and under Yama. Memory allocated before the switch is never a leak;\nthe scan still reads it (a list made before that grows after is the holder of what it grows by).\nA process started without the library loaded cannot be attached to yet.\n\nExit status: 0 when switched on (or answered); 2 when the process is gone, not in standby or refuses."
    )]
    Attach(AttachArgs),
}

#[derive(Args, Clone)]
struct FilterArgs {
    /// LeakSanitizer-style suppressions file (leak:PATTERN lines).
    #[arg(long, value_name = "FILE")]
    suppressions: Option<PathBuf>,
    /// Count the leaks that libraries make on their own in every process too (by default
    /// a built-in list suppresses them, after --suppressions: PyTorch's 24-byte block
    /// from a static initializer of libtorch_cuda.so, which LeakSanitizer reports too).
    #[arg(long)]
    no_default_suppressions: bool,
    /// Ignore leak groups smaller than N bytes.
    #[arg(long, value_name = "N", default_value_t = 0)]
    min_bytes: u64,
    /// Count still-reachable memory (found by the pointer scan) as leaked too.
    #[arg(long)]
    include_reachable: bool,
    /// Count CUDA memory held by a caching allocator at exit (PyTorch's
    /// CUDACachingAllocator, TensorFlow's BFC) as leaked too.
    #[arg(long)]
    include_cached: bool,
    /// Show every frame of stacks that have Python frames (by default only the native
    /// frames where the memory was allocated, then the Python frames, each import's
    /// importlib frames folded to one).
    #[arg(long)]
    native_frames: bool,
}

#[derive(Args)]
struct RunArgs {
    /// Directory for the reports (default: ./leaktrace-<cmd>-<timestamp>/).
    #[arg(long, short, value_name = "DIR")]
    output: Option<PathBuf>,
    /// Periodic report interval in milliseconds (0 = only at exit).
    #[arg(long, value_name = "MS")]
    interval_ms: Option<u64>,
    /// Frames kept per stack (1-128).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=128))]
    depth: Option<u16>,
    /// Pointer scan at exit (the default): definite, indirect and still-reachable memory
    /// told apart. Kept for compatibility; see --no-scan.
    #[arg(long, conflicts_with = "no_scan")]
    scan: bool,
    /// No pointer scan at exit (LEAKTRACE_SCAN=0): every outstanding block counts.
    #[arg(long)]
    no_scan: bool,
    /// Exit with --exit-code when leaks remain.
    #[arg(long)]
    fail_on_leak: bool,
    /// Exit status for --fail-on-leak.
    #[arg(long, value_name = "N", default_value_t = LEAK_EXIT)]
    exit_code: u8,
    /// Summary format printed after the run (html and flamegraph are written as
    /// leaks.html / leaks.svg in the output directory).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Leak groups shown per process.
    #[arg(long, value_name = "N", default_value_t = 10)]
    top: usize,
    /// For the groups whose stack has a function, file or module matching TEMPLATE (as
    /// in a suppression, `leak:TEMPLATE`): list each block the scan finds reachable,
    /// with the path of references that keeps it (at exit, on the snapshot signal, and
    /// in every check; at most 256 blocks each).
    #[arg(long, value_name = "TEMPLATE")]
    why_reachable: Option<String>,
    /// Start CMD recording nothing (no collector, nothing wrapped) until `leaktrace
    /// attach PID` switches it on; memory allocated before that is never called a leak.
    #[arg(long)]
    standby: bool,
    #[command(flatten)]
    filters: FilterArgs,
    /// The program and its arguments.
    #[arg(required = true, last = true, value_name = "CMD")]
    cmd: Vec<String>,
}

#[derive(Args)]
struct AttachArgs {
    /// Ask the process, already recording, for a report now (written to its report
    /// directory soon after).
    #[arg(long)]
    snapshot: bool,
    /// Only say whether the process is in standby or recording.
    #[arg(long, conflicts_with = "snapshot")]
    status: bool,
    /// Directory for the reports (default: ./leaktrace-<program>-<timestamp>/ for a
    /// process started without the library; a standby process's own otherwise). The
    /// process creates it as its own user.
    #[arg(long, short, value_name = "DIR", conflicts_with_all = ["snapshot", "status", "detach"])]
    output: Option<PathBuf>,
    /// Record for this many seconds (Ctrl-C ends it sooner), then detach: the last
    /// report is written and the process runs on as before. Without it, the recording
    /// goes on until `leaktrace attach --detach PID` or the process's exit.
    #[arg(long, value_name = "SECONDS", conflicts_with_all = ["snapshot", "status", "detach"])]
    duration: Option<f64>,
    /// End the recording: the last report is written, and the process runs on with
    /// every allocation going straight to its allocator again.
    #[arg(long, conflicts_with_all = ["snapshot", "status"])]
    detach: bool,
    /// The process (its id as this machine's /proc sees it; a container's process by
    /// its id on the host works).
    #[arg(value_name = "PID")]
    pid: u32,
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Text,
    Json,
    Markdown,
    /// SVG flamegraph of outstanding bytes by stack.
    Flamegraph,
    /// One self-contained HTML page: memory over time, growth, sortable leak table.
    Html,
    /// GitHub Actions annotations (::error/::warning) at the first frame in your code.
    Github,
    /// JUnit XML: a failing test case per leak group and growing stack.
    Junit,
    /// A gzip'd pprof profile (profile.proto) for go tool pprof, Pyroscope, Parca,
    /// speedscope: inuse/alloc space and objects by stack, labelled by pid, rank, host,
    /// kind and verdict (run writes heap.pb.gz into the output directory).
    Pprof,
}

#[derive(Args)]
struct ReportArgs {
    /// Report files, or directories of reports (one per process); several may be given.
    #[arg(value_name = "FILE|DIR", required = true, num_args = 1..)]
    paths: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    format: Format,
    /// Leak groups shown per process (text and markdown).
    #[arg(long, value_name = "N", default_value_t = 10)]
    top: usize,
    #[command(flatten)]
    filters: FilterArgs,
}

#[derive(Args)]
struct DiffArgs {
    /// The earlier run: a report file or directory.
    #[arg(value_name = "BASE")]
    base: PathBuf,
    /// The later run: a report file or directory.
    #[arg(value_name = "NEW")]
    new: PathBuf,
    /// Changes shown.
    #[arg(long, value_name = "N", default_value_t = 20)]
    top: usize,
    #[arg(long, value_enum, default_value_t = DiffFormat::Text)]
    format: DiffFormat,
    /// Exit with 23 when NEW has new or grown leak groups.
    #[arg(long)]
    fail_on_new: bool,
    /// Compare only the processes of this rank in BASE (its workers included): with
    /// --new-rank, two ranks of one job (`leaktrace diff --base-rank 0 --new-rank 1 DIR DIR`).
    #[arg(long, value_name = "N")]
    base_rank: Option<u32>,
    /// Compare only the processes of this rank in NEW.
    #[arg(long, value_name = "N")]
    new_rank: Option<u32>,
    #[command(flatten)]
    filters: FilterArgs,
}

/// What `diff` prints.
#[derive(Clone, Copy, ValueEnum)]
enum DiffFormat {
    Text,
    Json,
}

/// What `check` prints (its verdict is the exit status).
#[derive(Clone, Copy, ValueEnum)]
enum CheckFormat {
    Text,
    Markdown,
    /// GitHub Actions annotations (::error/::warning) at the first frame in your code.
    Github,
    /// JUnit XML: a failing test case per leak group and growing stack.
    Junit,
}

impl From<CheckFormat> for Format {
    fn from(f: CheckFormat) -> Format {
        match f {
            CheckFormat::Text => Format::Text,
            CheckFormat::Markdown => Format::Markdown,
            CheckFormat::Github => Format::Github,
            CheckFormat::Junit => Format::Junit,
        }
    }
}

#[derive(Args)]
struct CheckArgs {
    /// Report files, or directories of reports; several may be given.
    #[arg(value_name = "FILE|DIR", required = true, num_args = 1..)]
    paths: Vec<PathBuf>,
    #[arg(long, value_enum, default_value_t = CheckFormat::Text)]
    format: CheckFormat,
    #[command(flatten)]
    filters: FilterArgs,
    /// Also fail on stacks that grew steadily during the run.
    #[arg(long)]
    fail_on_growth: bool,
    /// Also fail when a rank of a distributed job left no final report (killed by the
    /// OOM killer or a timeout, crashed) or no report at all (below its world size).
    #[arg(long)]
    fail_on_missing_rank: bool,
    /// Also fail when a part of a process's memory grew by more than SIZE in the
    /// second half of its run (from its middle to its peak); repeatable. PART is one
    /// of rss, heap_live, heap_free, heap_other, python_objects, python_free, static_data, mmap,
    /// shm, stacks, file, tracer, unexplained, uss, pss; SIZE takes B, KiB, MiB, GiB.
    #[arg(long, value_name = "PART=SIZE", value_parser = leaktrace_common::memory::parse_limit)]
    max_growth: Vec<(String, u64)>,
    /// Exit status when leaks remain.
    #[arg(long, value_name = "N", default_value_t = LEAK_EXIT)]
    exit_code: u8,
    /// Leak groups shown per process.
    #[arg(long, value_name = "N", default_value_t = 10)]
    top: usize,
}

struct Fail {
    code: u8,
    message: String,
}

fn usage(message: String) -> Fail {
    Fail { code: 2, message }
}

fn filters(f: &FilterArgs) -> Result<Filters, Fail> {
    render::NATIVE_FRAMES.store(f.native_frames, std::sync::atomic::Ordering::Relaxed);
    let suppressions = match &f.suppressions {
        Some(p) => leaktrace_common::Suppressions::load(p).map_err(usage)?,
        None => leaktrace_common::Suppressions::default(),
    }
    .with_built_in(!f.no_default_suppressions);
    let suppressions = (!suppressions.patterns.is_empty()).then_some(suppressions);
    Ok(Filters {
        suppressions,
        min_bytes: f.min_bytes,
        growth_min_bytes: growth::DEFAULT_MIN_BYTES,
        include_reachable: f.include_reachable,
        include_cached: f.include_cached,
    })
}

fn render(a: &Analysis, reports: &[model::Report], format: Format, top: usize) -> Result<String, Fail> {
    Ok(match format {
        Format::Html => html::page(a, reports),
        Format::Text => render::text(a, top),
        Format::Json => render::json(a),
        Format::Markdown => render::markdown(a, top),
        Format::Flamegraph => flame::svg(a).map_err(|e| usage(format!("cannot draw the flamegraph ({e})")))?,
        Format::Github => ci::github(a),
        Format::Junit => ci::junit(a),
        Format::Pprof => return Err(usage("the pprof format is binary: written by report_pprof".into())),
    })
}

/// The gzip'd pprof profile of `reports`, the stacks that grew labelled so.
fn pprof_of(reports: &[model::Report]) -> Vec<u8> {
    let growing: std::collections::HashMap<u32, Vec<u32>> =
        reports.iter().map(|r| (r.pid, growth::detect(r, 0).into_iter().filter(|g| g.stack_id != 0).map(|g| g.stack_id).collect())).collect();
    pprof::profile(reports, &growing)
}

/// Every report under `paths` (files or directories), in one list.
fn load_all(paths: &[PathBuf]) -> Result<Vec<model::Report>, Fail> {
    let mut all = Vec::new();
    for p in paths {
        all.extend(model::load(p).map_err(usage)?);
    }
    Ok(all)
}

/// The analysis of every report under `paths`, read one at a time and dropped once
/// analysed (a job's hundreds of ranks are never held at once).
fn analyze_all(paths: &[PathBuf], filters: &Filters) -> Result<Analysis, Fail> {
    let mut streamed = analyze::Streamed::default();
    for p in paths {
        model::each_report(p, &mut |r| streamed.add(&r, filters)).map_err(usage)?;
    }
    Ok(streamed.finish())
}

/// The formats that read the reports themselves, not only their analysis.
fn needs_reports(format: Format) -> bool {
    matches!(format, Format::Html | Format::Pprof)
}

fn cmd_report(args: &ReportArgs) -> Result<u8, Fail> {
    let filters = filters(&args.filters)?;
    if !needs_reports(args.format) {
        let a = analyze_all(&args.paths, &filters)?;
        print!("{}", render(&a, &[], args.format, args.top)?);
        return Ok(0);
    }
    let reports = load_all(&args.paths)?;
    if matches!(args.format, Format::Pprof) {
        // SAFETY: isatty on a file descriptor number.
        if unsafe { libc::isatty(1) } == 1 {
            return Err(usage("--format pprof writes a binary file: redirect it (leaktrace report --format pprof DIR > heap.pb.gz)".into()));
        }
        let _ = filters;
        std::io::Write::write_all(&mut std::io::stdout(), &pprof_of(&reports)).map_err(|e| usage(format!("cannot write the profile ({e})")))?;
        return Ok(0);
    }
    let a = analyze::analyze(&reports, &filters);
    print!("{}", render(&a, &reports, args.format, args.top)?);
    Ok(0)
}

fn cmd_check(args: &CheckArgs) -> Result<u8, Fail> {
    let filters = filters(&args.filters)?;
    let a = analyze_all(&args.paths, &filters)?;
    print!("{}", render(&a, &[], args.format.into(), args.top)?);
    let missing = args.fail_on_missing_rank && a.ranks.as_ref().is_some_and(|v| v.missing_ranks());
    if missing {
        eprintln!("leaktrace: --fail-on-missing-rank: a rank left no final report (see Ranks above)");
    }
    let mut over = false;
    for p in &a.processes {
        for (part, limit) in &args.max_growth {
            if let Some((from, to)) = leaktrace_common::memory::part_growth(&p.memory_points, part) {
                if to.saturating_sub(from) > *limit {
                    eprintln!(
                        "leaktrace: {}: {part} grew by {} ({} -> {}), more than --max-growth {part}={}",
                        p.label,
                        render::human_bytes(to - from),
                        render::human_bytes(from),
                        render::human_bytes(to),
                        render::human_bytes(*limit)
                    );
                    over = true;
                }
            }
        }
    }
    let failing = a.has_findings() || (args.fail_on_growth && a.growing() > 0) || over || missing;
    Ok(if failing { args.exit_code } else { 0 })
}

fn cmd_diff(args: &DiffArgs) -> Result<u8, Fail> {
    let filters = filters(&args.filters)?;
    let side = |path: &PathBuf, rank: Option<u32>, which: &str| -> Result<Analysis, Fail> {
        let mut a = analyze_all(std::slice::from_ref(path), &filters)?;
        if let Some(rank) = rank {
            a.retain(|p| p.rank == Some(rank));
            if a.processes.is_empty() {
                return Err(usage(format!(
                    "{} holds no report of rank {rank} (--{which}-rank); `leaktrace report {}` lists the ranks",
                    path.display(),
                    path.display()
                )));
            }
        }
        Ok(a)
    };
    let (base, new) = (side(&args.base, args.base_rank, "base")?, side(&args.new, args.new_rank, "new")?);
    let changes = diff::diff(&base, &new);
    let growth = diff::diff_growth(&base, &new);
    match args.format {
        DiffFormat::Json => {
            // The leak groups' changes, then the growth's (each with "growth": true).
            let mut all: Vec<serde_json::Value> = changes.iter().filter_map(|c| serde_json::to_value(c).ok()).collect();
            all.extend(growth.iter().filter_map(|g| serde_json::to_value(g).ok()));
            println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default())
        }
        DiffFormat::Text => {
            print!("{}", render::diff_text(&changes, args.top, filters.include_reachable));
            print!("{}", render::growth_diff_text(&growth, args.top));
        }
    }
    let worse = changes.iter().any(|c| c.status == "new" || c.status == "grew");
    Ok(if args.fail_on_new && worse { LEAK_EXIT } else { 0 })
}

fn cmd_attach(args: &AttachArgs) -> Result<u8, Fail> {
    let mut request = if args.snapshot {
        "snapshot".to_string()
    } else if args.detach {
        "off".to_string()
    } else if args.status {
        "status".to_string()
    } else {
        "on".to_string()
    };
    let mut output = args.output.clone();
    // With a duration, Ctrl-C ends the recording, whenever it comes: held off until the
    // wait that takes it (`attach::wait_interruptible`).
    let _held = args.duration.is_some().then(|| attach::HeldSignals::new(&attach::INTERRUPT, true));
    if request == "on" {
        if let Some(target) = attach::to_inject(args.pid).map_err(usage)? {
            // Started without the library: ptrace loads it, then the socket switches it on.
            let lib = run::find_library().map_err(usage)?;
            let injected = inject::inject(args.pid, target.uid, &lib).map_err(usage)?;
            eprintln!(
                "leaktrace: loaded into process {} (its thread {} stopped for {:.1} ms, the others ran on)",
                args.pid,
                injected.thread,
                injected.pause.as_secs_f64() * 1e3
            );
            request = format!("on main_tp={:x}", injected.main_tp);
            output = output.or_else(|| Some(run::default_output_dir(&target.program)));
        } else if let Some(asleep) = attach::asleep(args.pid) {
            // Detached from before, or forked by a standby process: the library listens.
            let again = inject::listen_again(args.pid).map_err(usage)?;
            eprintln!("leaktrace: process {} listens again (its thread {} stopped for {:.1} ms)", args.pid, again.thread, again.pause.as_secs_f64() * 1e3);
            if asleep == attach::Asleep::Detached {
                request = format!("on main_tp={:x}", again.main_tp);
                let program = std::fs::read_to_string(format!("/proc/{}/comm", args.pid)).map(|c| c.trim().to_string()).unwrap_or_else(|_| "process".into());
                output = output.or_else(|| Some(run::default_output_dir(&program)));
            }
        }
    }
    if let Some(dir) = output {
        let dir = if dir.is_absolute() { dir } else { std::env::current_dir().map(|d| d.join(&dir)).unwrap_or(dir) };
        request = format!("{request} output={}", dir.display());
    }
    let verb = request.split(' ').next().unwrap_or("on").to_string();
    match attach::ask(args.pid, &request) {
        Ok(reply) => {
            match verb.as_str() {
                "on" if args.duration.is_some() => {
                    let seconds = args.duration.unwrap_or(0.0);
                    eprintln!("leaktrace: process {} is recording for {seconds} s (Ctrl-C ends it sooner); its reports go to {reply}", args.pid);
                    return attach_for(args.pid, seconds, &reply);
                }
                "on" => eprintln!("leaktrace: process {} is recording; its reports go to {reply} (`leaktrace attach --detach {}` ends it)", args.pid, args.pid),
                "off" => {
                    let dir = attach::after_off(args.pid, &reply);
                    eprintln!("leaktrace: process {} is no longer recorded and runs on; its last report is in {dir}", args.pid)
                }
                "snapshot" => eprintln!("leaktrace: process {} writes a report now", args.pid),
                _ => println!("{reply}"),
            }
            Ok(0)
        }
        Err(message) => Err(usage(message)),
    }
}

/// `attach --duration`: waits `seconds` (or for Ctrl-C, or for the process's end),
/// then ends the recording.
fn attach_for(pid: u32, seconds: f64, dir: &str) -> Result<u8, Fail> {
    let ended = attach::wait_interruptible(pid, std::time::Duration::from_secs_f64(seconds.max(0.0)));
    if ended {
        eprintln!("leaktrace: process {pid} has ended; its exit report is in {dir}");
        return Ok(0);
    }
    match attach::ask(pid, "off") {
        Ok(reply) => {
            let reply = attach::after_off(pid, &reply);
            eprintln!("leaktrace: process {pid} is no longer recorded and runs on; its last report is in {reply}");
            eprintln!("leaktrace: `leaktrace report {reply}` shows what it found");
            Ok(0)
        }
        Err(message) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => {
            eprintln!("leaktrace: process {pid} has ended; its exit report is in {dir} ({message})");
            Ok(0)
        }
        Err(message) => Err(usage(message)),
    }
}

fn cmd_run(args: &RunArgs) -> Result<u8, Fail> {
    let lib = run::find_library().map_err(usage)?;
    let filters = filters(&args.filters)?;
    let output = args.output.clone().unwrap_or_else(|| run::default_output_dir(&args.cmd[0]));
    // Absolute, because the program may change directory; the library creates it.
    let output = if output.is_absolute() { output } else { std::env::current_dir().map(|d| d.join(&output)).unwrap_or(output) };
    let settings = run::RunSettings {
        output: output.clone(),
        interval_ms: args.interval_ms,
        depth: args.depth.map(usize::from),
        scan: !args.no_scan,
        suppressions: args.filters.suppressions.clone(),
        default_suppressions: !args.filters.no_default_suppressions,
        why_reachable: args.why_reachable.clone(),
        standby: args.standby,
    };
    let started_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
    let (code, pid) = match run::run(&lib, &args.cmd, &settings) {
        run::Outcome::Exited(code, pid) => (code, pid),
        run::Outcome::NotFound(m) => return Err(Fail { code: 127, message: m }),
        run::Outcome::Failed(m) => return Err(usage(m)),
    };
    // Where the output directory was unusable, the library wrote its reports to its
    // fallback (the working directory, then /tmp): found there by pid and start time.
    let fallback = || {
        let dirs: Vec<PathBuf> = std::env::current_dir().into_iter().chain([PathBuf::from("/tmp")]).filter(|d| *d != output).collect();
        model::fallback_reports(pid, started_ms, &dirs)
    };
    // With placeholders (`%h/%r`), the processes wrote into a tree under its root.
    let output = PathBuf::from(leaktrace_common::launch::output_root(&output.to_string_lossy()));
    let loaded = model::load(&output).map(|r| (r, output.clone()));
    let loaded = match loaded {
        Ok(found) => Ok(found),
        Err(e) => match fallback() {
            Some((found, dir)) => {
                eprintln!("leaktrace: --output {} was not usable; the reports were written to {} instead", output.display(), dir.display());
                Ok((found, dir))
            }
            None => Err(e),
        },
    };
    let (reports, output) = match loaded {
        Ok(found) => found,
        Err(e) => {
            // No directory at all: the library never started (it said why, if it knew).
            if output.exists() {
                eprintln!("leaktrace: {e}");
            }
            if args.standby {
                eprintln!("leaktrace: the command (pid {pid}) wrote no report: it was never switched on (leaktrace attach {pid})");
            } else {
                eprintln!("leaktrace: the command (pid {pid}) wrote no report: nothing was checked");
            }
            return Ok(if code != 0 {
                code.clamp(0, 255) as u8
            } else if args.fail_on_leak {
                args.exit_code
            } else {
                0
            });
        }
    };
    // A process whose end the library did not see may have leaked after its last report.
    let unchecked = model::without_final_report(&reports, Some(pid));
    let a = analyze::analyze(&reports, &filters);
    let rendered = match args.format {
        Format::Pprof => {
            let path = output.join("heap.pb.gz");
            std::fs::write(&path, pprof_of(&reports)).map_err(|e| usage(format!("cannot write {} ({e})", path.display())))?;
            eprintln!("leaktrace: {}", path.display());
            render::text(&a, args.top)
        }
        _ => render(&a, &reports, args.format, args.top)?,
    };
    match args.format {
        // A page or a picture is a file, not something to print on a terminal.
        // Annotations are read from the step's standard output (the program's is done).
        Format::Github => print!("{rendered}"),
        Format::Html | Format::Flamegraph | Format::Junit => {
            let name = match args.format {
                Format::Html => "leaks.html",
                Format::Junit => "leaks.xml",
                _ => "leaks.svg",
            };
            let path = output.join(name);
            std::fs::write(&path, rendered).map_err(|e| usage(format!("cannot write {} ({e})", path.display())))?;
            eprintln!("leaktrace: {}", path.display());
        }
        Format::Text | Format::Json | Format::Markdown | Format::Pprof => eprint!("{rendered}"),
    }
    for line in &unchecked {
        eprintln!("leaktrace: {line}");
    }
    eprintln!("leaktrace: reports in {}", output.display());
    if code != 0 {
        return Ok(code.clamp(0, 255) as u8);
    }
    if args.fail_on_leak && !unchecked.is_empty() {
        eprintln!("leaktrace: --fail-on-leak: failing, since a process above could not be checked to its end");
        return Ok(args.exit_code);
    }
    Ok(if args.fail_on_leak && a.has_findings() { args.exit_code } else { 0 })
}

/// For `leaktrace run ./prog ARGS` (no `--`): the line that says how to write it.
fn run_without_separator(args: &[String]) -> Option<String> {
    let run = args.iter().position(|a| a == "run")?;
    if args.iter().any(|a| a == "--") || args[1..run].iter().any(|a| !a.starts_with('-')) {
        return None;
    }
    // The command starts at the first word that is not an option (or an option's value);
    // which options take a value, `run`'s own definition says.
    let cli = <Cli as clap::CommandFactory>::command();
    let takes_value: Vec<String> = cli
        .find_subcommand("run")
        .map(|r| {
            r.get_arguments()
                .filter(|a| a.get_action().takes_values())
                .flat_map(|a| a.get_long().map(|l| format!("--{l}")).into_iter().chain(a.get_short().map(|s| format!("-{s}"))))
                .collect()
        })
        .unwrap_or_default();
    let mut i = run + 1;
    while i < args.len() && args[i].starts_with('-') {
        i += if takes_value.contains(&args[i]) { 2 } else { 1 };
    }
    let (options, cmd) = args.split_at(i.min(args.len()));
    if cmd.is_empty() {
        return None;
    }
    Some(format!("leaktrace: put -- before the program: {} -- {}", options[run..].join(" ").replacen("run", "leaktrace run", 1), cmd.join(" ")))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            if e.kind() == clap::error::ErrorKind::UnknownArgument {
                let args: Vec<String> = std::env::args().collect();
                if let Some(hint) = run_without_separator(&args) {
                    eprintln!("{hint}");
                }
            }
            return ExitCode::from(code);
        }
    };
    if !matches!(cli.command, Cmd::Run(_)) {
        // A reader that stops early (`leaktrace report … | head`) ends this process
        // quietly by SIGPIPE, as it does `cat`, instead of a panic on the write. `run`
        // keeps Rust's default: its writes go to the terminal, and its child gets the
        // default disposition from Command anyway.
        // SAFETY: setting a signal's disposition to its default.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match &cli.command {
        Cmd::Run(a) => cmd_run(a),
        Cmd::Report(a) => cmd_report(a),
        Cmd::Diff(a) => cmd_diff(a),
        Cmd::Check(a) => cmd_check(a),
        Cmd::Attach(a) => cmd_attach(a),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(f) => {
            eprintln!("leaktrace: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
