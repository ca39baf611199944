//! Where a process ran in a distributed job: its rank, local rank and world size from
//! the launcher's variables, the host, the job and its restart count (issue 54). Read by
//! the library from the process's environment as it started (`/proc/self/environ`: the
//! launchers set them before `exec`) and written into every report as `launch`.
//!
//! Precedence, first found wins:
//! - rank: `RANK` (torch.distributed: torchrun, `mp.spawn` with `init_method=env://`,
//!   Ray Train, DeepSpeed), `OMPI_COMM_WORLD_RANK` (Open MPI), `PMI_RANK` (MPICH, Intel
//!   MPI), `PMIX_RANK`, `SLURM_PROCID`;
//! - local rank: `LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`,
//!   `SLURM_LOCALID`;
//! - world size: `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `SLURM_NTASKS`.
//!
//! Under `srun torchrun`, `SLURM_PROCID` numbers the nodes' launchers, not the ranks:
//! torchrun gives each worker `RANK`, which comes first, and a torchrun launcher itself
//! (`torchrun`, `python -m torch.distributed.run` or `.launch`) is no rank at all:
//! `launcher` is set and the SLURM numbers are left out.
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<u32>,
    /// The variable the rank came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_from: Option<String>,
    /// The host name (the process's UTS namespace's).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub host: String,
    /// The job's id: `TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`, `OMPI_MCA_ess_base_jobid`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job: Option<String>,
    /// How many times the job was restarted: `TORCHELASTIC_RESTART_COUNT`,
    /// `SLURM_RESTART_COUNT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart: Option<u32>,
    /// A launcher (torchrun's agent), not a rank.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub launcher: bool,
}

const RANK: [&str; 5] = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"];
const LOCAL_RANK: [&str; 4] = ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"];
const WORLD_SIZE: [&str; 4] = ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"];
const JOB: [&str; 3] = ["TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid"];
const RESTART: [&str; 2] = ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"];

impl Launch {
    /// From the variables `get` gives, the command line and the host name.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>, argv: &[String], host: String) -> Launch {
        let launcher = is_torchrun_launcher(argv);
        // A launcher's SLURM numbers are its node's, not a rank's.
        let usable = |name: &str| !(launcher && name.starts_with("SLURM_"));
        let first = |names: &[&str]| names.iter().filter(|n| usable(n)).find_map(|n| Some((n.to_string(), get(n)?.trim().parse::<u32>().ok()?)));
        let rank = first(&RANK);
        Launch {
            rank: rank.as_ref().map(|r| r.1),
            rank_from: rank.map(|r| r.0),
            local_rank: first(&LOCAL_RANK).map(|r| r.1),
            world_size: first(&WORLD_SIZE).map(|r| r.1),
            host,
            job: JOB.iter().find_map(|n| get(n).filter(|v| !v.trim().is_empty())),
            restart: first(&RESTART).map(|r| r.1),
            launcher,
        }
    }

    /// Whether `name` is one of the variables a launch is read from.
    pub fn reads(name: &[u8]) -> bool {
        RANK.iter().chain(&LOCAL_RANK).chain(&WORLD_SIZE).chain(&JOB).chain(&RESTART).any(|n| n.as_bytes() == name)
    }

    /// Whether `kv`, one `NAME=value` entry of an environment, is a variable this reads.
    pub fn reads_entry(kv: &[u8]) -> bool {
        kv.iter().position(|&b| b == b'=').is_some_and(|eq| Launch::reads(&kv[..eq]))
    }

    /// From the text of `/proc/PID/environ` (NUL-separated `NAME=value`).
    pub fn from_environ(environ: &[u8], argv: &[String], host: String) -> Launch {
        // The variables it reads, picked out in one pass: each of its 18 lookups would
        // read the whole environment again (every process does this at its start).
        let mut read = Vec::new();
        for kv in environ.split(|b| *b == 0).filter(|kv| Launch::reads_entry(kv)) {
            read.extend_from_slice(kv);
            read.push(0);
        }
        // Most processes have none of them: no lookup at all then.
        Launch::from_vars(|name| if read.is_empty() { None } else { environ_var(&read, name) }, argv, host)
    }

    /// "rank 1/2 on HOST" (what a process's label adds), or `None` outside a job.
    pub fn describe(&self) -> Option<String> {
        let on = if self.host.is_empty() { String::new() } else { format!(" on {}", self.host) };
        if self.launcher {
            return Some(format!("launcher{on}"));
        }
        let rank = self.rank?;
        Some(match self.world_size {
            Some(n) => format!("rank {rank}/{n}{on}"),
            None => format!("rank {rank}{on}"),
        })
    }
}

/// The value of `name` in the text of `/proc/PID/environ` (NUL-separated `NAME=value`).
pub fn environ_var(environ: &[u8], name: &str) -> Option<String> {
    environ
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(name.as_bytes()).and_then(|rest| rest.strip_prefix(b"=")).map(|v| String::from_utf8_lossy(v).into_owned()))
}

/// `LEAKTRACE_OUTPUT` with its placeholders filled in, so that many processes on many
/// machines can write into one shared tree: `%h` the host, `%r` the rank (`launcher`
/// for a launcher, `none` outside a job), `%l` the local rank, `%j` the job (`none`),
/// `%p` the process id, `%%` a `%`. Anything else after `%` stays as written.
pub fn expand_output(path: &str, launch: &Launch, pid: u32) -> String {
    let mut out = String::with_capacity(path.len());
    let mut chars = path.chars();
    let or_none = |v: Option<String>| v.unwrap_or_else(|| "none".into());
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('h') => out.push_str(if launch.host.is_empty() { "none" } else { &launch.host }),
            Some('r') if launch.launcher => out.push_str("launcher"),
            Some('r') => out.push_str(&or_none(launch.rank.map(|r| r.to_string()))),
            Some('l') => out.push_str(&or_none(launch.local_rank.map(|r| r.to_string()))),
            Some('j') => out.push_str(&or_none(launch.job.clone())),
            Some('p') => out.push_str(&pid.to_string()),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The part of an output path before its first placeholder's component: the root of
/// the tree the processes write into (`/shared/run7` of `/shared/run7/%h/%r`).
pub fn output_root(path: &str) -> &str {
    match path.find('%') {
        Some(i) => path[..i].rfind('/').map_or(".", |j| if j == 0 { "/" } else { &path[..j] }),
        None => path,
    }
}

/// Whether `argv` starts torchrun's launcher (which starts the ranks).
fn is_torchrun_launcher(argv: &[String]) -> bool {
    let base = |s: &str| s.rsplit('/').next().unwrap_or(s).to_string();
    let Some(first) = argv.first() else { return false };
    if base(first) == "torchrun" {
        return true;
    }
    // python[3[.x]] [-X ...] -m torch.distributed.run|launch, or python …/torchrun
    base(first).starts_with("python")
        && argv.iter().skip(1).take(4).any(|a| matches!(a.as_str(), "torch.distributed.run" | "torch.distributed.launch") || base(a) == "torchrun")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| pairs.iter().find(|p| p.0 == n).map(|p| p.1.to_string())
    }

    fn argv(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_variable_is_found_by_its_whole_name() {
        let environ = b"RANKS=9\0RANK_X=8\0RANK=3\0EMPTY=\0";
        assert_eq!(environ_var(environ, "RANK").as_deref(), Some("3"));
        assert_eq!(environ_var(environ, "EMPTY").as_deref(), Some(""));
        assert_eq!(environ_var(environ, "RAN"), None);
        let l = Launch::from_environ(b"PATH=/bin\0HOME=/root\0", &argv(&["x"]), String::new());
        assert_eq!((l.rank, l.job), (None, None));
        let l = Launch::from_environ(b"PATH=/bin\0RANK=2\0WORLD_SIZE=4\0", &argv(&["x"]), String::new());
        assert_eq!((l.rank, l.world_size), (Some(2), Some(4)));
    }

    #[test]
    fn torchrun_workers_mpi_and_slurm_give_their_rank_in_order() {
        let py = argv(&["python3", "train.py"]);
        let l = Launch::from_vars(vars(&[("RANK", "3"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "4"), ("TORCHELASTIC_RUN_ID", "j7")]), &py, "h1".into());
        assert_eq!((l.rank, l.local_rank, l.world_size, l.job.as_deref()), (Some(3), Some(1), Some(4), Some("j7")));
        assert_eq!(l.describe().unwrap(), "rank 3/4 on h1");
        // srun torchrun: SLURM numbers the node (1), torchrun the rank (5).
        let under_srun = vars(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("RANK", "5"), ("WORLD_SIZE", "8"), ("SLURM_JOB_ID", "99")]);
        let l = Launch::from_vars(&under_srun, &py, "n2".into());
        assert_eq!((l.rank, l.world_size, l.rank_from.as_deref(), l.job.as_deref()), (Some(5), Some(8), Some("RANK"), Some("99")));
        // ... and torchrun's own launcher there is no rank.
        for launcher in [argv(&["/usr/bin/torchrun", "--nproc_per_node", "4", "train.py"]), argv(&["python3", "-m", "torch.distributed.run", "x.py"])] {
            let l = Launch::from_vars(&under_srun, &launcher, "n2".into());
            assert!(l.launcher && l.describe().unwrap() == "launcher on n2", "{l:?}");
        }
        // Open MPI, MPICH, SLURM alone.
        let l =
            Launch::from_vars(vars(&[("OMPI_COMM_WORLD_RANK", "2"), ("OMPI_COMM_WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_LOCAL_RANK", "0")]), &py, String::new());
        assert_eq!((l.rank, l.world_size, l.local_rank), (Some(2), Some(4), Some(0)));
        assert_eq!(l.describe().unwrap(), "rank 2/4");
        let l = Launch::from_vars(vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]), &py, String::new());
        assert_eq!((l.rank, l.world_size, l.rank_from.as_deref()), (Some(1), Some(2), Some("PMI_RANK")));
        let l =
            Launch::from_vars(vars(&[("SLURM_PROCID", "7"), ("SLURM_NTASKS", "16"), ("SLURM_LOCALID", "3"), ("SLURM_RESTART_COUNT", "2")]), &py, String::new());
        assert_eq!((l.rank, l.world_size, l.local_rank, l.restart), (Some(7), Some(16), Some(3), Some(2)));
        // Outside a job: nothing to say; a value that is no number is none.
        assert_eq!(Launch::from_vars(vars(&[]), &py, "h".into()).describe(), None);
        assert_eq!(Launch::from_vars(vars(&[("RANK", "x")]), &py, String::new()).rank, None);
    }

    #[test]
    fn an_output_path_names_the_host_rank_job_and_pid() {
        let l = Launch { rank: Some(3), local_rank: Some(1), host: "gpu7".into(), job: Some("j9".into()), ..Default::default() };
        assert_eq!(expand_output("/shared/run/%h/%r-%l/%j/%p/100%%/%x", &l, 42), "/shared/run/gpu7/3-1/j9/42/100%/%x");
        assert_eq!(expand_output("/r/%r/%h", &Launch::default(), 1), "/r/none/none");
        assert_eq!(expand_output("/r/%r", &Launch { launcher: true, ..Default::default() }, 1), "/r/launcher");
        assert_eq!(expand_output("plain/dir", &l, 1), "plain/dir");
        assert_eq!(output_root("/shared/run7/%h/%r"), "/shared/run7");
        assert_eq!(output_root("/shared/run7/host-%h"), "/shared/run7");
        assert_eq!(output_root("%h/x"), ".");
        assert_eq!(output_root("/%h"), "/");
        assert_eq!(output_root("/plain"), "/plain");
    }

    #[test]
    fn the_environ_text_is_read_as_the_variables() {
        let env = b"PATH=/bin\0RANK=1\0WORLD_SIZE=2\0";
        let l = Launch::from_environ(env, &argv(&["python3"]), "h".into());
        assert_eq!(l.describe().unwrap(), "rank 1/2 on h");
    }
}
