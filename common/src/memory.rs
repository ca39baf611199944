//! The process's memory by part (`memory` in a report and in each timeline point), and
//! what its growth means (`explain`): shared by the library (its exit summary) and the
//! command (`report`, `check`, the HTML page).
use serde::{Deserialize, Serialize};

/// Where the process's resident memory is, in bytes, at one instant. The parts of
/// `rss` are: `file` (mapped files: code, libraries, data files), `shm` (shared memory
/// and memfd), and the anonymous memory, split into the heap (`heap_live`,
/// `heap_free`, `heap_other`), pymalloc's arenas (`python_objects`, `python_free`),
/// the libraries' static data (`static_data`),
/// tracked direct mappings (`mmap`), thread stacks (`stacks`), the tracer's own
/// memory (`tracer`) and what none of these explains (`unexplained`). Heap and arena
/// parts are what their allocators hold (touched memory, nearly always resident); the
/// sum of the parts other than `unexplained` may exceed `rss` by memory that is held
/// but not resident, and `unexplained` is then 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Resident set size (`VmRSS`).
    pub rss: u64,
    /// Its anonymous part (`RssAnon`).
    pub rss_anon: u64,
    /// Its part that maps files (`RssFile`): code, libraries, mapped data files.
    pub rss_file: u64,
    /// Its shared-memory part (`RssShmem`): `/dev/shm` segments, memfd, SysV, shared
    /// anonymous mappings.
    pub rss_shmem: u64,
    /// Live tracked host blocks of the program (malloc family).
    pub heap_live: u64,
    /// Free memory malloc keeps in its arenas (glibc's `mallinfo2`: `fordblks`); absent
    /// when the program's malloc is not glibc's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_free: Option<u64>,
    /// Of `heap_free`, the whole pages inside malloc's free chunks: about what
    /// `malloc_trim(0)` gives back (glibc's `malloc_info`, in reports only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_trimmable: Option<u64>,
    /// malloc's arenas (glibc's `malloc_info`, in reports only): one per thread that
    /// allocated at once with another, up to 8 per core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_arenas: Option<u32>,
    /// In use in malloc's heap but not a tracked block of the program: chunk headers,
    /// blocks from before tracking started or of untracked callers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_other: Option<u64>,
    /// Live Python objects in pymalloc's arenas (the used blocks of their pools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python_objects: Option<u64>,
    /// The free space of pymalloc's arenas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python_free: Option<u64>,
    /// The loaded libraries' static data: the written pages of their writable segments
    /// (`.data` copied on write, `.bss` and the anonymous mapping after it), from
    /// `/proc/self/pagemap`. After `import torch`, ~100 MiB of it, most in the CUDA
    /// libraries' `.bss` (libcublasLt's tables alone 88 MiB), none of it on the heap.
    #[serde(default)]
    pub static_data: u64,
    /// Tracked direct anonymous mappings (`mmap` outside malloc), live.
    #[serde(default)]
    pub mmap: u64,
    /// Shared memory and memfd mappings (the same as `rss_shmem`).
    #[serde(default)]
    pub shm: u64,
    /// Thread stacks, resident.
    #[serde(default)]
    pub stacks: u64,
    /// This library's own memory: its heap blocks and its mappings (rings, stack
    /// tables, the live-block index).
    #[serde(default)]
    pub tracer: u64,
    /// Anonymous resident memory none of the parts above explains.
    #[serde(default)]
    pub unexplained: u64,
    /// Private memory (USS: `Private_Clean + Private_Dirty`), for a forked child.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uss: Option<u64>,
    /// Proportional set size, for a forked child.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pss: Option<u64>,
    /// Measured after the Python interpreter's teardown (a final report): malloc then
    /// holds the memory of the modules the teardown freed, which is no state of the
    /// program's run. `explain` reads the points before it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub after_teardown: bool,
    /// Per CUDA device, in reports (not in timeline points): tracked live device memory
    /// and what of it a known caching allocator holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceMemory>,
    /// `tracer` by what it holds, resident bytes, in reports (in the timeline, only in
    /// the last point):
    /// `stack_frames` and `stack_table` (every captured call stack, interned),
    /// `python` (code objects' names and line tables), `rings` (events on their way to
    /// the collector), `unwind` (the unwinder's caches), `blocks` (the live blocks by
    /// address), `buffers` (the collector's per-stack groups, a report's snapshot and
    /// other large tables), `heap` (small heap blocks), `other`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tracer_parts: Vec<TracerPart>,
    /// The size of leaktrace's own files beside the reports: the stack table's spill
    /// files (unnamed, so no directory listing shows them), whose pages the page cache
    /// holds and charges to the process's cgroup. Part of neither `rss` nor `tracer`.
    #[serde(default, skip_serializing_if = "crate::report_schema::is_zero")]
    pub tracer_files: u64,
}

/// One part of the tracer's own memory (`Memory::tracer_parts`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TracerPart {
    pub part: String,
    pub bytes: u64,
}

/// One CUDA device's memory as the report's groups count it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemory {
    pub device: u32,
    /// Live device memory tracked on it (`cudaMalloc*`, `cuMemAlloc*`, `cuMemCreate`).
    pub live: u64,
    /// Of it, held by a known caching allocator (PyTorch's, TensorFlow's BFC) in the
    /// groups the report lists: memory no tensor may be using.
    pub cached: u64,
}

impl Memory {
    /// How many parts `parts` names.
    pub const PARTS: usize = 12;

    /// The named parts, in the order a chart stacks them (bottom first), with their
    /// bytes: what adds up to `rss`.
    pub fn parts(&self) -> [(&'static str, u64); Self::PARTS] {
        [
            ("heap_live", self.heap_live),
            ("heap_free", self.heap_free.unwrap_or(0)),
            ("heap_other", self.heap_other.unwrap_or(0)),
            ("python_objects", self.python_objects.unwrap_or(0)),
            ("python_free", self.python_free.unwrap_or(0)),
            ("static_data", self.static_data),
            ("mmap", self.mmap),
            ("shm", self.shm),
            ("stacks", self.stacks),
            ("file", self.rss_file),
            ("tracer", self.tracer),
            ("unexplained", self.unexplained),
        ]
    }

    /// One part's bytes by its name (`parts`, `rss`, `uss`, `pss`).
    pub fn part(&self, name: &str) -> Option<u64> {
        match name {
            "rss" => Some(self.rss),
            "uss" => self.uss,
            "pss" => self.pss,
            _ => self.parts().iter().find(|(n, _)| *n == name).map(|(_, b)| *b),
        }
    }
}

/// Every name `Memory::part` knows.
pub const PART_NAMES: [&str; 15] = [
    "rss",
    "heap_live",
    "heap_free",
    "heap_other",
    "python_objects",
    "python_free",
    "static_data",
    "mmap",
    "shm",
    "stacks",
    "file",
    "tracer",
    "unexplained",
    "uss",
    "pss",
];

const MIB: u64 = 1 << 20;

/// A part of the memory that grew or holds much, what it means and what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The part (`Memory::part` names), or `cuda_cache`.
    pub part: &'static str,
    /// Its bytes at the first point considered and at the last.
    pub from: u64,
    pub to: u64,
    /// What it means, one sentence with the numbers.
    pub what: String,
    /// What to do about it.
    pub remedy: String,
}

impl Finding {
    pub fn grew(&self) -> i64 {
        self.to as i64 - self.from as i64
    }
}

/// The points a growth is measured over: from the first point of the second half of
/// the run (the first half holds the start-up: imports, a model loaded, caches filled;
/// `import torch` alone is 3 s) to the point where RSS reached its peak after it (the
/// peak is what meets a memory limit; the last point may be after the program released
/// everything at its exit): the first point within `PEAK_NEAR` of the highest. Not the
/// highest itself: RSS stays at its peak when the program frees what it grew (malloc
/// keeps the pages), and the highest of a plateau is any point of it; a loop's live
/// blocks, freed when its function returned, were a finding in the runs where the
/// point before the free measured 0.3% more RSS than the one after it, and not in the
/// others.
fn span(points: &[(u64, Memory)]) -> Option<(&Memory, &Memory, u64)> {
    let (from, _, _) = span_to_peak_of(points, |m| Some(m.rss))?;
    let run = &points[..before_teardown(points, |p| p.1.after_teardown)];
    let from_at = run.iter().position(|p| std::ptr::eq(&p.1, from))?;
    let after = &run[from_at + 1..];
    let peak = after.iter().map(|p| p.1.rss).max().unwrap_or(from.rss);
    let to = after.iter().find(|p| p.1.rss >= peak - peak / PEAK_NEAR).unwrap_or(&run[from_at]);
    Some((from, &to.1, to.0.saturating_sub(run[from_at].0)))
}

/// A point within a `PEAK_NEAR`th (2%) of the highest RSS is at the peak (`span`).
const PEAK_NEAR: u64 = 50;

/// How many of `points` come before the interpreter's teardown: all but the trailing
/// run of points that `torn` says were measured during or after it (a teardown is the
/// end of a process; a marked point before unmarked ones is no teardown).
pub fn before_teardown<T>(points: &[T], torn: impl Fn(&T) -> bool) -> usize {
    points.iter().rposition(|p| !torn(p)).map_or(0, |i| i + 1)
}

/// `span`, to the point after its start where `key` is highest instead of RSS (a part
/// can peak before RSS does: malloc's free memory falls when threads end and their
/// arenas are trimmed while RSS still rises). Points measured after an interpreter's
/// teardown are left out.
fn span_to_peak_of(points: &[(u64, Memory)], key: impl Fn(&Memory) -> Option<u64>) -> Option<(&Memory, &Memory, u64)> {
    let run = before_teardown(points, |p| p.1.after_teardown);
    let points = &points[..run];
    let (first, last) = (points.first()?, points.last()?);
    let skip = first.0 + (last.0.saturating_sub(first.0)) / 2;
    // Never the last point itself: a run of two points compares the two.
    let earlier = &points[..points.len() - 1];
    let from_at = earlier.iter().position(|p| p.0 >= skip).unwrap_or(earlier.len().saturating_sub(1));
    let from = &points[from_at];
    let to = points[from_at + 1..].iter().rev().max_by_key(|p| key(&p.1).unwrap_or(0)).unwrap_or(last);
    Some((&from.1, &to.1, to.0.saturating_sub(from.0)))
}

/// A forked worker's whole life before any teardown: its first point and the later
/// point of its largest private memory (`uss`), with the milliseconds of its life (its
/// first point to its last). Copy-on-write comes at once, not as a trend: the worker's
/// first full garbage collection writes the header of every object it inherited, so
/// the peak can come a second after the start of a worker that lives for minutes.
fn worker_span(points: &[(u64, Memory)]) -> Option<(&Memory, &Memory, u64)> {
    let run = before_teardown(points, |p| p.1.after_teardown);
    let points = &points[..run];
    let (first, rest) = points.split_first()?;
    let last = rest.last().unwrap_or(first);
    let to = rest.iter().max_by_key(|p| p.1.uss.unwrap_or(0)).unwrap_or(first);
    Some((&first.1, &to.1, last.0.saturating_sub(first.0)))
}

/// How long a forked worker must have lived for its private memory to be judged: a
/// shorter one is a burst (a child that runs a command and exits).
pub const MIN_WORKER_LIFE_MS: u64 = 3000;

/// One part's bytes at the start of the span `explain` looks at and at the part's own
/// peak after it (for `rss`, the span's end; `None` when there are no points, or the
/// part is not measured).
pub fn part_growth(points: &[(u64, Memory)], part: &str) -> Option<(u64, u64)> {
    let (from, to, _) = span_to_peak_of(points, |m| m.part(part))?;
    Some((from.part(part)?, to.part(part)?))
}

/// Parses `PART=SIZE` (`heap_free=100MiB`, `rss=2G`, `python_objects=50000000`).
pub fn parse_limit(text: &str) -> Result<(String, u64), String> {
    let (part, size) = text.split_once('=').ok_or_else(|| format!("'{text}': expected PART=SIZE, e.g. heap_free=100MiB"))?;
    if !PART_NAMES.contains(&part) {
        return Err(format!("'{part}' is not a part of the memory; one of: {}", PART_NAMES.join(", ")));
    }
    let size = size.trim();
    let digits = size.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(size.len());
    let (number, unit) = size.split_at(digits);
    let number: f64 = number.parse().map_err(|_| format!("'{size}': expected a size such as 100MiB, 2G or 5000000"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("'{size}': unknown unit; use B, KiB, MiB or GiB")),
    };
    Ok((part.to_string(), (number * scale as f64) as u64))
}

/// The shortest span over which a part's growth is reported (`explain`).
pub const MIN_GROWTH_SPAN_MS: u64 = 5000;

/// Human bytes: "764.2 MiB".
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", b / (1u64 << 30) as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", b / MIB as f64)
    } else if bytes >= 1024 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

fn percent(part: u64, of: u64) -> u64 {
    (part * 100).checked_div(of).unwrap_or(0)
}

/// The remedies for malloc keeping `free` bytes, in the order of what each would give
/// back here, as the reports' `heap_trimmable` and `heap_arenas` measured it at the
/// report with the most free memory: `malloc_trim(0)` returns the whole pages of the
/// free chunks; an allocator that returns freed pages on its own (jemalloc, tcmalloc)
/// about as much without a code change, but a restart; fewer arenas
/// (`MALLOC_ARENA_MAX=2`) can only help with the rest, the pieces smaller than pages,
/// when many arenas hold them. Without those figures (not glibc, or no report measured
/// them), the three in a fixed order.
fn heap_free_remedies(points: &[(u64, Memory)], free: u64) -> String {
    let trim_how = "malloc_trim(0) after a phase that frees much (Python: ctypes.CDLL('libc.so.6').malloc_trim(0))";
    let jemalloc_how = "jemalloc or tcmalloc (LD_PRELOAD=libjemalloc.so.2), which give freed pages back on their own";
    let arenas_how = "MALLOC_ARENA_MAX=2 (fewer per-thread arenas)";
    // At the report where a trim would have returned the most: a report reads the free
    // memory (`mallinfo2`) and its whole pages (`malloc_info`) one after the other, and
    // a thread that allocates a batch between the two leaves that report's pages short
    // of its free memory (240 MiB free, 63 trimmable, in a report of four PyTorch
    // threads beside busy loops, which then ranked fewer arenas first).
    let measured = points.iter().filter_map(|(_, m)| Some((m.heap_free?, m.heap_trimmable?, m.heap_arenas.unwrap_or(0)))).max_by_key(|t| t.1);
    let Some((at, trimmable, arenas)) = measured else {
        return format!("up to {} can go back to the system: {arenas_how}, {trim_how}, or {jemalloc_how}", human(free));
    };
    let pieces = at.saturating_sub(trimmable);
    let trim = (trimmable, format!("{trim_how}: about {} here, the whole pages inside its free chunks", human(trimmable)));
    let jemalloc = (trimmable, format!("{jemalloc_how}: about as much, with a restart"));
    let fewer = if arenas > 2 {
        (pieces / 2, format!("{arenas_how}: at most the {} in pieces smaller than a page, spread over {arenas} arenas", human(pieces)))
    } else {
        (0, format!("{arenas_how}: little here, {arenas} arena(s) hold it"))
    };
    let mut remedies = [trim, jemalloc, fewer];
    // Largest return first; a trim before a restart when they tie (a stable sort).
    remedies.sort_by_key(|r| std::cmp::Reverse(r.0));
    let list: Vec<String> = remedies.into_iter().enumerate().map(|(i, r)| format!("{}. {}", i + 1, r.1)).collect();
    format!("up to {} can go back to the system, by what each would return: {}", human(free), list.join("; "))
}

/// What the memory of one process says, from its timeline points (oldest first, each
/// with its memory) and whether it is a forked child: malloc keeping freed memory,
/// copy-on-write in a worker, shared memory accumulating, Python objects, the live heap
/// or direct mappings growing, memory nothing explains, and the tracer's own share.
/// Largest first; empty when nothing stands out.
pub fn explain(points: &[(u64, Memory)], forked_child: bool) -> Vec<Finding> {
    let Some((from, to, ms)) = span(points) else { return Vec::new() };
    let mut out = Vec::new();
    // Growth over a few seconds is start-up (imports, a model loading), not a trend.
    let long_enough = ms >= MIN_GROWTH_SPAN_MS;
    let rss = to.rss;
    // malloc keeping freed memory: much free in its arenas at its peak, or its growth to
    // it.
    let free_at = span_to_peak_of(points, |m| m.heap_free).map_or(to, |s| s.1);
    let (free_from, free_to, free_rss) = (from.heap_free.unwrap_or(0), free_at.heap_free.unwrap_or(0), free_at.rss);
    if free_at.heap_free.is_some() && free_to >= 64 * MIB && (free_to * 4 >= free_rss || free_to.saturating_sub(free_from) >= 64 * MIB) {
        out.push(Finding {
            part: "heap_free",
            from: free_from,
            to: free_to,
            what: format!(
                "malloc keeps {} of freed memory in its arenas ({}% of RSS{}): memory the program freed but the process still holds (fragmentation, one arena per thread)",
                human(free_to),
                percent(free_to, free_rss),
                if free_to > free_from + 16 * MIB { format!(", up {} in the second half of the run", human(free_to - free_from)) } else { String::new() }
            ),
            remedy: heap_free_remedies(points, free_to),
        });
    }
    // Copy-on-write in a forked worker: private memory grows, its own heap does not.
    // A worker starts where its parent was (no start-up of its own): its whole life, to
    // the point of its largest private memory. Not to its RSS peak, as the other parts:
    // copying a shared page on write moves it from shared to private and leaves RSS as
    // it was, so the RSS peak can be any point (one near the start hid the growth).
    let (wfrom, wto, wms) = worker_span(points).unwrap_or((from, to, ms));
    if forked_child && wms >= MIN_WORKER_LIFE_MS {
        let (from, to) = (wfrom, wto);
        let grew = |f: fn(&Memory) -> u64| f(to).saturating_sub(f(from));
        if let (Some(u0), Some(u1)) = (from.uss, to.uss) {
            let own = grew(|m| m.heap_live) + grew(|m| m.python_objects.unwrap_or(0)) + grew(|m| m.mmap);
            let private = u1.saturating_sub(u0);
            if private >= 32 * MIB && own * 2 < private {
                out.push(Finding {
                    part: "uss",
                    from: u0,
                    to: u1,
                    what: format!(
                        "this worker's private memory grew by {} while its own allocations grew by {}: copy-on-write of memory it shares with its parent (touching Python objects the parent made writes their reference counts, and each page touched becomes the worker's own)",
                        human(private),
                        human(own)
                    ),
                    remedy: "keep the data the workers read in numpy arrays or tensors instead of lists and dicts of Python objects, or call gc.freeze() in the parent before the workers start".into(),
                });
            }
        }
    }
    let mut grows = |part: &'static str, f: fn(&Memory) -> u64, min: u64, what: &str, remedy: &str| {
        let (a, b) = (f(from), f(to));
        if long_enough && b >= a + min {
            out.push(Finding {
                part,
                from: a,
                to: b,
                what: format!("{what} grew by {} in the second half of the run ({} -> {})", human(b - a), human(a), human(b)),
                remedy: remedy.into(),
            });
        }
    };
    grows(
        "shm",
        |m| m.shm,
        32 * MIB,
        "shared memory (/dev/shm segments, memfd, shared mappings)",
        "segments accumulate: close and unlink SharedMemory objects when done; tensors a DataLoader worker returns live in shared memory until the batch is dropped",
    );
    grows(
        "python_objects",
        |m| m.python_objects.unwrap_or(0),
        16 * MIB,
        "Python objects",
        "something keeps the objects (a list, a dict, a cache): the growing lines are listed under growth, with what holds them",
    );
    grows("heap_live", |m| m.heap_live, 16 * MIB, "live heap blocks", "the growing stacks are listed under growth: something keeps the blocks allocated there");
    grows("mmap", |m| m.mmap, 16 * MIB, "direct mappings (mmap outside malloc)", "the growing mappings are listed under growth: unmap them when done");
    if to.unexplained >= 64 * MIB && to.unexplained * 5 >= rss {
        out.push(Finding {
            part: "unexplained",
            from: from.unexplained,
            to: to.unexplained,
            what: format!("{} of RSS ({}%) is memory leaktrace does not see allocated", human(to.unexplained), percent(to.unexplained, rss)),
            remedy: "memory mapped by raw system calls or by an allocator of its own (a JIT, a runtime's heap), or glibc's cache of thread stacks; /proc/PID/smaps lists the mappings".into(),
        });
    }
    // A forked child shares most of it with its parent, where it is counted.
    if !forked_child && to.tracer >= 64 * MIB && to.tracer * 4 >= rss {
        out.push(Finding {
            part: "tracer",
            from: from.tracer,
            to: to.tracer,
            what: format!(
                "leaktrace's own memory is {} ({}% of RSS){}{}",
                human(to.tracer),
                percent(to.tracer, rss),
                // The parts as last measured (only the last point keeps them).
                points.iter().rev().find(|(_, m)| !m.tracer_parts.is_empty()).map_or(String::new(), |(_, m)| largest_tracer_parts(m)),
                match to.tracer_files {
                    0 => String::new(),
                    f => format!(", and its stack table's files {} more in the page cache", human(f)),
                }
            ),
            remedy: "not the program's: subtract it from RSS; a lower LEAKTRACE_STACK_DEPTH keeps less".into(),
        });
    }
    out.sort_by_key(|f| std::cmp::Reverse(f.to.max(f.from)));
    out
}

/// "; its largest parts: buffers 117.9 MiB, stack_table 58.3 MiB, …" — the three largest
/// parts of the tracer's memory, when the report has them.
fn largest_tracer_parts(m: &Memory) -> String {
    let mut parts: Vec<&TracerPart> = m.tracer_parts.iter().filter(|p| p.bytes >= MIB).collect();
    parts.sort_by_key(|p| std::cmp::Reverse(p.bytes));
    let named: Vec<String> = parts.iter().take(3).map(|p| format!("{} {}", p.part, human(p.bytes))).collect();
    if named.is_empty() {
        String::new()
    } else {
        format!("; its largest parts: {}", named.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64, m: &Memory) -> (u64, Memory) {
        (ms, m.clone())
    }

    #[test]
    fn malloc_keeping_freed_memory_is_named_with_its_remedy() {
        let m0 = Memory { rss: 200 * MIB, heap_live: 10 * MIB, heap_free: Some(20 * MIB), ..Default::default() };
        let m1 = Memory { rss: 764 * MIB, heap_live: 10 * MIB, heap_free: Some(740 * MIB), ..Default::default() };
        let f = explain(&[at(0, &m0), at(1000, &m0), at(60_000, &m1)], false);
        assert_eq!(f[0].part, "heap_free");
        assert!(f[0].what.contains("740.0 MiB") && f[0].what.contains("96% of RSS"), "{}", f[0].what);
        assert!(f[0].remedy.contains("MALLOC_ARENA_MAX") && f[0].remedy.contains("malloc_trim(0)") && f[0].remedy.contains("jemalloc"));
    }

    /// The remedies come in the order of what they would return: a trim first when the
    /// free memory is whole pages (four threads' freed batches: malloc_trim(0) took RSS
    /// from 590 to 49 MiB, MALLOC_ARENA_MAX=2 to 550), fewer arenas first when it is
    /// small pieces spread over many.
    #[test]
    fn heap_remedies_are_ranked_by_what_they_would_give_back() {
        let m = |rss: u64, free: u64, trim: u64, arenas: u32| Memory {
            rss: rss * MIB,
            heap_live: 10 * MIB,
            heap_free: Some(free * MIB),
            heap_trimmable: Some(trim * MIB),
            heap_arenas: Some(arenas),
            ..Default::default()
        };
        let remedy = |pts: &[(u64, Memory)]| explain(pts, false).into_iter().find(|f| f.part == "heap_free").expect("heap_free finding").remedy;
        let pages = remedy(&[(0, m(100, 10, 5, 4)), (6_000, m(590, 500, 480, 4)), (12_000, m(590, 520, 500, 4))]);
        let (trim, arenas, jemalloc) = (pages.find("malloc_trim(0)").unwrap(), pages.find("MALLOC_ARENA_MAX").unwrap(), pages.find("jemalloc").unwrap());
        assert!(trim < jemalloc && jemalloc < arenas, "{pages}");
        assert!(pages.contains("about 500.0 MiB here"), "{pages}");
        // A report whose free memory was read before a batch took most of it, and whose
        // pages after, does not rank the remedies.
        let skewed = remedy(&[(0, m(100, 10, 5, 4)), (6_000, m(590, 560, 120, 4)), (12_000, m(590, 520, 500, 4))]);
        assert!(skewed.find("malloc_trim(0)").unwrap() < skewed.find("MALLOC_ARENA_MAX").unwrap(), "{skewed}");
        assert!(skewed.contains("about 500.0 MiB here"), "{skewed}");
        let pieces = remedy(&[(0, m(100, 10, 1, 8)), (6_000, m(590, 500, 20, 8)), (12_000, m(590, 520, 20, 8))]);
        assert!(pieces.find("MALLOC_ARENA_MAX").unwrap() < pieces.find("malloc_trim(0)").unwrap(), "{pieces}");
        assert!(pieces.contains("spread over 8 arenas"), "{pieces}");
        // Not measured (not glibc's malloc, or no report): the three, unranked.
        let plain = |rss: u64, free: u64| Memory { rss: rss * MIB, heap_live: 10 * MIB, heap_free: Some(free * MIB), ..Default::default() };
        let unranked = remedy(&[(0, plain(100, 10)), (6_000, plain(590, 500)), (12_000, plain(590, 520))]);
        assert!(unranked.contains("MALLOC_ARENA_MAX") && unranked.contains("malloc_trim(0)") && !unranked.contains("about"), "{unranked}");
    }

    /// The live heap's growth is measured to where RSS reached its peak, not to the
    /// highest RSS of the plateau after it: a loop's blocks freed when its function
    /// returns leave RSS where it was (two runs of the same script, the points after
    /// the free 0.3% above and 0.8% below the one before it).
    #[test]
    fn a_loops_growth_freed_before_the_end_is_measured_where_rss_reached_its_peak() {
        let m = |rss: u64, live: u64, free: u64| Memory { rss: rss * MIB, heap_live: live * MIB, heap_free: Some(free * MIB), ..Default::default() };
        let run = |after_free: u64| {
            let points = [
                at(0, &m(530, 13, 0)),
                at(6_000, &m(760, 130, 1)),
                at(12_000, &m(1_000, 311, 3)),
                at(18_000, &m(1_200, 488, 5)),
                at(18_300, &m(after_free, 131, 386)),
            ];
            explain(&points, false).iter().map(|f| f.part).collect::<Vec<_>>()
        };
        assert_eq!(run(1_204), run(1_190));
        assert!(run(1_204).contains(&"heap_live"), "{:?}", run(1_204));
        assert!(run(1_204).contains(&"heap_free"));
    }

    /// malloc's free memory at its own peak, not at RSS's: threads that end trim their
    /// arenas while RSS still rises (four PyTorch threads, a point after the first ended:
    /// the finding had come and gone with the timing).
    #[test]
    fn malloc_keeping_freed_memory_is_measured_at_its_own_peak() {
        let m = |rss: u64, free: u64| Memory { rss: rss * MIB, heap_live: 10 * MIB, heap_free: Some(free * MIB), ..Default::default() };
        let points = [at(0, &m(300, 20)), at(5_000, &m(800, 140)), at(6_000, &m(900, 250)), at(7_000, &m(985, 106))];
        let f = explain(&points, false);
        let free = f.iter().find(|f| f.part == "heap_free").expect("the heap_free finding");
        assert!(free.what.contains("250.0 MiB") && free.what.contains("27% of RSS"), "{}", free.what);
        assert_eq!(part_growth(&points, "heap_free"), Some((140 * MIB, 250 * MIB)));
        // RSS's own span is unchanged: to its peak.
        assert_eq!(part_growth(&points, "rss"), Some((800 * MIB, 985 * MIB)));
    }

    #[test]
    fn the_tracers_large_share_names_its_largest_parts_as_last_measured() {
        let part = |part: &str, mib: u64| TracerPart { part: part.into(), bytes: mib * MIB };
        let m0 = Memory { rss: 900 * MIB, tracer: 300 * MIB, ..Default::default() };
        let last = Memory {
            tracer_parts: vec![part("rings", 2), part("buffers", 120), part("stack_table", 58), part("stack_frames", 46), part("other", 0)],
            ..m0.clone()
        };
        // The peak (the point `explain` reads) is not the last point, which alone has the parts.
        let peak = Memory { rss: 1000 * MIB, tracer: 320 * MIB, ..Default::default() };
        let f = explain(&[at(0, &m0), at(6_000, &m0), at(8_000, &peak), at(10_000, &last)], false);
        let t = f.iter().find(|f| f.part == "tracer").unwrap();
        assert!(t.what.ends_with("(32% of RSS); its largest parts: buffers 120.0 MiB, stack_table 58.0 MiB, stack_frames 46.0 MiB"), "{}", t.what);
        // Without parts (an older report), the share alone.
        let f = explain(&[at(0, &m0), at(10_000, &m0)], false);
        assert!(f[0].what.ends_with("(33% of RSS)"), "{}", f[0].what);
    }

    #[test]
    fn memory_measured_after_the_interpreters_teardown_is_no_growth() {
        let m0 = Memory { rss: 600 * MIB, heap_free: Some(2 * MIB), ..Default::default() };
        let torn = Memory { rss: 700 * MIB, heap_free: Some(106 * MIB), after_teardown: true, ..m0.clone() };
        assert!(explain(&[at(0, &m0), at(6_000, &m0), at(12_000, &torn)], false).is_empty());
        // The same figures during the run are a finding.
        let f = explain(&[at(0, &m0), at(6_000, &m0), at(12_000, &Memory { after_teardown: false, ..torn.clone() })], false);
        assert_eq!(f[0].part, "heap_free");
        assert_eq!(part_growth(&[at(0, &m0), at(6_000, &m0), at(12_000, &torn)], "heap_free"), Some((2 * MIB, 2 * MIB)));
        // Only the trailing marked points are the teardown: one marked at the start
        // (measured before the interpreter was up, by an older library) is not.
        let torn_at = |v: &[bool]| before_teardown(v, |t| *t);
        assert_eq!(torn_at(&[true, false, false, true, true]), 3);
        assert_eq!(torn_at(&[false, false]), 2);
        assert_eq!(torn_at(&[true, true]), 0);
        assert_eq!(torn_at(&[]), 0);
    }

    #[test]
    fn a_workers_private_growth_without_its_own_is_copy_on_write() {
        let m0 = Memory { rss: 500 * MIB, uss: Some(20 * MIB), heap_live: MIB, ..Default::default() };
        let m1 = Memory { rss: 500 * MIB, uss: Some(220 * MIB), heap_live: 2 * MIB, ..Default::default() };
        let f = explain(&[at(0, &m0), at(10_000, &m1)], true);
        assert_eq!(f.len(), 1);
        // Over two seconds it is start-up.
        assert!(explain(&[at(0, &m0), at(2_000, &m1)], true).is_empty());
        assert_eq!(f[0].part, "uss");
        assert!(f[0].what.contains("copy-on-write"));
        // The same numbers in the parent say nothing of the kind.
        assert!(explain(&[at(0, &m0), at(10_000, &m1)], false).is_empty());
        // RSS at its peak near the start (the tracer gave file pages back since):
        // the private growth to the end is measured all the same.
        let early = Memory { rss: 510 * MIB, uss: Some(25 * MIB), heap_live: MIB, ..Default::default() };
        let late = Memory { rss: 490 * MIB, ..m1.clone() };
        let f = explain(&[at(0, &m0), at(500, &early), at(10_000, &late)], true);
        assert!(f.iter().any(|f| f.part == "uss" && f.from == 20 * MIB && f.to == 220 * MIB), "{f:?}");
        // All copied in the first second of a worker that lives on (its first full
        // collection wrote every inherited object's header): copy-on-write all the same.
        let f = explain(&[at(0, &m0), at(1_200, &m1), at(2_500, &m1), at(7_600, &Memory { uss: Some(219 * MIB), ..m1 })], true);
        assert!(f.iter().any(|f| f.part == "uss" && f.from == 20 * MIB && f.to == 220 * MIB), "{f:?}");
    }

    #[test]
    fn python_objects_and_shared_memory_growth_and_steady_memory() {
        let m0 = Memory { rss: 100 * MIB, python_objects: Some(5 * MIB), shm: 0, ..Default::default() };
        let m1 = Memory { rss: 300 * MIB, python_objects: Some(60 * MIB), shm: 100 * MIB, ..Default::default() };
        let parts: Vec<_> = explain(&[at(0, &m0), at(10_000, &m1)], false).iter().map(|f| f.part).collect();
        assert_eq!(parts, ["shm", "python_objects"]);
        assert!(explain(&[at(0, &m1), at(10_000, &m1)], false).is_empty());
        assert!(explain(&[], false).is_empty());
    }

    #[test]
    fn the_start_up_tenth_of_the_run_is_not_growth() {
        let m0 = Memory { rss: 10 * MIB, heap_live: MIB, ..Default::default() };
        let m1 = Memory { rss: 500 * MIB, heap_live: 400 * MIB, ..Default::default() };
        // Loaded in the first 40 s of a 100 s run, flat afterwards.
        let f = explain(&[at(0, &m0), at(40_000, &m1), at(50_000, &m1), at(100_000, &m1)], false);
        assert!(f.is_empty(), "{f:?}");
        // Growth to a peak, then everything released at exit: the peak counts.
        let f = explain(&[at(0, &m0), at(50_000, &m0), at(75_000, &m1), at(100_000, &m0)], false);
        assert_eq!(f.iter().map(|f| f.part).collect::<Vec<_>>(), ["heap_live"]);
    }

    #[test]
    fn limits_parse_with_units_and_name_the_parts() {
        assert_eq!(parse_limit("heap_free=100MiB"), Ok(("heap_free".into(), 100 << 20)));
        assert_eq!(parse_limit("rss=2G"), Ok(("rss".into(), 2 << 30)));
        assert_eq!(parse_limit("python_objects=5000"), Ok(("python_objects".into(), 5000)));
        assert!(parse_limit("heap=1M").unwrap_err().contains("heap_free"));
        assert!(parse_limit("rss").is_err() && parse_limit("rss=lots").is_err() && parse_limit("rss=5 parsecs").is_err());
    }

    #[test]
    fn every_part_is_named_and_parts_add_up() {
        let m = Memory {
            rss: 100,
            heap_live: 1,
            heap_free: Some(2),
            heap_other: Some(3),
            python_objects: Some(4),
            python_free: Some(5),
            mmap: 6,
            shm: 7,
            stacks: 8,
            rss_file: 9,
            tracer: 10,
            unexplained: 11,
            uss: Some(12),
            pss: Some(13),
            ..Default::default()
        };
        assert_eq!(m.parts().iter().map(|p| p.1).sum::<u64>(), 66);
        for name in PART_NAMES {
            assert!(m.part(name).is_some(), "{name}");
        }
    }
}
