//! Who this report is about: pid, parent, program, arguments, and a file name that no
//! other process image can ever reuse (pid + start time in ns + random bits, so neither
//! pid reuse nor exec under the same pid collides).
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug)]
pub struct ProcessInfo {
    pub pid: u32,
    pub ppid: u32,
    pub exe: String,
    pub argv: Vec<String>,
    pub started_unix_ms: u64,
    /// Set in a child forked (without exec) from a tracked parent.
    pub forked_from: Option<u32>,
    /// Switched on from standby (`agent::standby`) at `started_unix_ms`.
    pub switched_on: bool,
    /// Rank, world size, host and job, from the environment the process started with
    /// (`/proc/self/environ`: read from any thread without the C library's lock), or as
    /// it is at a later report (`refresh_launch`).
    pub launch: leaktrace_common::launch::Launch,
    pub file_name: String,
    /// The environment array the process started with (`os::environ::array`), when it
    /// held none of the variables `Launch` reads; 0 otherwise. While the array is still
    /// that one, no such variable was added since (`refresh_launch` reads nothing).
    pub environ_without_launch: usize,
}

/// The arguments in a `/proc/PID/cmdline` text: NUL-separated, empty ones left out.
fn split_args(raw: &[u8]) -> Vec<String> {
    raw.split(|b| *b == 0).filter(|s| !s.is_empty()).map(|s| String::from_utf8_lossy(s).into_owned()).collect()
}

pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn unix_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

fn random_u32() -> u32 {
    let mut buf = [0u8; 4];
    // SAFETY: writes at most 4 bytes into `buf`. One call, no file (nor a /dev in a chroot).
    if unsafe { libc::getrandom(buf.as_mut_ptr() as *mut libc::c_void, 4, libc::GRND_NONBLOCK) } == 4 {
        return u32::from_ne_bytes(buf);
    }
    // No entropy yet (early boot) or no getrandom: the clock's low bits still differ.
    (unix_ns() as u32).rotate_left(13) ^ std::process::id()
}

pub fn sanitize_component(s: &str) -> String {
    let cleaned: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).take(40).collect();
    if cleaned.is_empty() || cleaned.starts_with('.') {
        format!("x{cleaned}")
    } else {
        cleaned
    }
}

pub fn report_file_name(exe: &str, pid: u32) -> String {
    let base = Path::new(exe).file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    // The random part's 8 digits, leading zeros included, without a width: a padded
    // number is filled one character at a time (`fmt::Write::write_char`), which then
    // ran in 1 process of 16 (a value under 0x10000000) and was missing from the
    // start-up list (tests/environment.rs failed 2 runs of 14).
    let random = format!("{:x}", 1u64 << 32 | u64::from(random_u32()));
    format!("leaktrace.{}.{}.{:x}{}.json", sanitize_component(&base), pid, unix_ns(), &random[1..])
}

impl ProcessInfo {
    pub fn current(forked_from: Option<u32>) -> ProcessInfo {
        let pid = std::process::id();
        let exe = crate::os::anchor::read_proc_link("self/exe").unwrap_or_default();
        // In the library's constructor, from the arguments the C library gave it.
        let argv = crate::os::startup::WINDOW
            .cmdline()
            .map_or_else(|| crate::os::anchor::read_proc("self/cmdline"), Ok)
            .map(|raw| split_args(&raw))
            .unwrap_or_default();
        // Only the variables `Launch` reads: most processes have none, and the rest of
        // the environment is not copied.
        let window = &crate::os::startup::WINDOW;
        let reads = leaktrace_common::launch::Launch::reads_entry;
        let launch_vars = window
            .environ_where(reads)
            .map_or_else(|| crate::os::anchor::read_proc("self/environ").map(|e| crate::os::startup::environ_keeping(&e, reads)), Ok)
            .unwrap_or_default();
        // The array the constructor was given, still the C library's (no constructor
        // before ours added a variable), holding no variable that `Launch` reads.
        let initial = window.envp();
        let environ_without_launch = if initial != 0 && initial == crate::os::environ::array() && launch_vars.is_empty() { initial } else { 0 };
        let host = hostname();
        let launch = leaktrace_common::launch::Launch::from_environ(&launch_vars, &argv, host);
        ProcessInfo {
            launch,
            pid,
            ppid: std::os::unix::process::parent_id(),
            file_name: report_file_name(&exe, pid),
            exe,
            argv,
            started_unix_ms: unix_ms(),
            forked_from,
            switched_on: false,
            environ_without_launch,
        }
    }

    /// The process in a child that `parent` forked (no exec): its image, its machine and
    /// its environment are the parent's, and so is its launch (as the parent knows it
    /// now), unless its arguments differ from the parent's (a server that retitles its
    /// workers), when all is read as `current` reads it. Only the arguments are read
    /// again: `current`'s link, environment, host name and parent were ~30 us of every
    /// child of a traced process, most of which `exec` at once.
    pub fn forked(parent: &ProcessInfo) -> ProcessInfo {
        let pid = std::process::id();
        match crate::os::anchor::read_proc("self/cmdline").map(|raw| split_args(&raw)) {
            Ok(argv) if argv == parent.argv => ProcessInfo {
                launch: parent.launch.clone(),
                pid,
                ppid: parent.pid,
                file_name: report_file_name(&parent.exe, pid),
                exe: parent.exe.clone(),
                argv,
                started_unix_ms: unix_ms(),
                forked_from: Some(parent.pid),
                switched_on: false,
                environ_without_launch: parent.environ_without_launch,
            },
            _ => ProcessInfo::current(Some(parent.pid)),
        }
    }

    /// A process that started outside a job may be given its rank later (Ray's workers,
    /// a script that sets `RANK` before `init_process_group`): until it has one, each
    /// report reads the environment as it is now. A rank once found stays.
    pub fn refresh_launch(&mut self) {
        if self.launch.rank.is_some() || self.launch.launcher {
            return;
        }
        // Nothing added to the environment since the start, which had no such variable:
        // a read of `/proc/self/status` and a copy of the environment saved (every
        // process's exit report).
        if self.environ_without_launch != 0 && crate::os::environ::array() == self.environ_without_launch {
            return;
        }
        let Some(now) = crate::os::environ::current(leaktrace_common::launch::Launch::reads) else { return };
        let later = leaktrace_common::launch::Launch::from_environ(&now, &self.argv, self.launch.host.clone());
        if later.rank.is_some() {
            self.launch = later;
        }
    }

    pub fn report_path(&self, dir: &Path) -> PathBuf {
        dir.join(&self.file_name)
    }
}

/// The host's name (`uname`'s node name: one call, no file to open), or `""`.
fn hostname() -> String {
    // SAFETY: an all-zero utsname is a valid out value; uname fills it.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: valid out pointer.
    if unsafe { libc::uname(&mut u) } != 0 {
        return String::new();
    }
    let bytes: Vec<u8> = u.nodename.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).trim().to_string()
}

/// Whether the running program is a Go program that links the C library (cgo), told
/// by the symbols every such program exports; a cheap check for the constructor.
pub fn is_cgo_program() -> bool {
    crate::os::loader::global_symbols([c"_cgo_get_context_function", c"x_cgo_init", c"_cgo_init"]).iter().any(Option::is_some)
}

/// Why a process running `exe` can never be given a final report, if it cannot: the
/// Go runtime (a Go program that links the C library: cgo) ends the process with the
/// `exit_group` system call itself, past every exit path a library can hook. Found by
/// the `.go.buildinfo` section that every Go executable since Go 1.13 carries.
pub fn final_report_unreachable(exe: &str) -> Option<&'static str> {
    let file = crate::os::anchor::open_file(exe).ok()?;
    crate::os::elf::has_section(&file, b".go.buildinfo")?.then_some(GO_EXIT)
}

pub const GO_EXIT: &str =
    "the Go runtime ends the process with the exit_group system call, which no library hook sees: the last periodic report is the last word";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_childs_process_is_what_reading_it_again_finds() {
        let parent = ProcessInfo::current(None);
        // SAFETY: the child reads /proc and compares, allocating with glibc's malloc
        // (safe after fork), and leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let forked = ProcessInfo::forked(&parent);
            let read = ProcessInfo::current(Some(parent.pid));
            let same = [
                forked.pid == read.pid && forked.pid == std::process::id(),
                forked.ppid == read.ppid && forked.ppid == parent.pid,
                forked.exe == read.exe && !forked.exe.is_empty(),
                forked.argv == read.argv && !forked.argv.is_empty(),
                forked.forked_from == Some(parent.pid) && read.forked_from == forked.forked_from,
                forked.launch == read.launch,
                forked.environ_without_launch == read.environ_without_launch,
                !forked.switched_on && !read.switched_on,
                forked.file_name.starts_with(&format!(
                    "leaktrace.{}.{}.",
                    sanitize_component(Path::new(&forked.exe).file_name().unwrap().to_str().unwrap()),
                    forked.pid
                )),
            ];
            // Which of them differs, as the exit status (0: none).
            let code = same.iter().position(|s| !s).map_or(0, |i| i as i32 + 1);
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "{status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "the field that differs, counted from 1");
    }

    #[test]
    fn names_are_safe_and_unique() {
        let a = report_file_name("/usr/bin/python3.11", 42);
        let b = report_file_name("/usr/bin/python3.11", 42);
        assert_ne!(a, b);
        assert!(a.starts_with("leaktrace.python3.11.42."));
        assert!(a.ends_with(".json"));
        // The random part keeps its 8 digits (leading zeros too): every name is as long.
        assert!((0..2000).all(|_| report_file_name("/usr/bin/python3.11", 42).len() == a.len()));
        let weird = report_file_name("/x/../..evil name/\u{e9}", 1);
        assert!(!weird.contains('/') && !weird.contains(' '));
        assert_eq!(sanitize_component(""), "x");
        assert_eq!(sanitize_component(".."), "x..");
    }

    #[test]
    fn a_go_executable_is_recognised_and_others_are_not() {
        assert_eq!(final_report_unreachable("/proc/self/exe"), None);
        assert_eq!(final_report_unreachable("/nonexistent"), None);
        // A minimal ELF with a `.go.buildinfo` section, made by the C compiler.
        let dir = std::env::temp_dir().join(format!("lt-go-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("g.c");
        std::fs::write(
            &src,
            "__attribute__((section(\".go.buildinfo\"), used)) static const char info[32] = \"\\xff Go buildinf:\";\nint main(void) { return 0; }\n",
        )
        .unwrap();
        let bin = dir.join("g");
        let ok = std::process::Command::new("cc").arg(&src).arg("-o").arg(&bin).status().map(|s| s.success()).unwrap_or(false);
        if ok {
            assert!(final_report_unreachable(bin.to_str().unwrap()).unwrap().contains("exit_group"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A rank set after the start is read at the next report; an environment array that
    /// is still the one the process started with, which held no launch variable, is not
    /// read again.
    #[test]
    fn a_rank_set_later_is_read_unless_the_environment_is_the_one_that_had_none() {
        // The copy of the environment is made once /proc/self/status says no seccomp filter.
        crate::os::procfs::open(false);
        let mut p = ProcessInfo::current(None);
        if p.launch.rank.is_some() || p.launch.launcher {
            crate::test_skip::skip_not_here("this test process runs under a launcher (a rank is set)");
            return;
        }
        std::env::set_var("RANK", "7");
        // As if the array were still the first one: nothing is read.
        p.environ_without_launch = crate::os::environ::array();
        p.refresh_launch();
        assert_eq!(p.launch.rank, None);
        p.environ_without_launch = 0;
        p.refresh_launch();
        std::env::remove_var("RANK");
        assert_eq!(p.launch.rank, Some(7));
    }

    #[test]
    fn current_process_is_described() {
        let p = ProcessInfo::current(None);
        assert_eq!(p.pid, std::process::id());
        assert!(!p.exe.is_empty());
        assert!(!p.argv.is_empty());
    }
}
