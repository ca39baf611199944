//! The process's memory by part (`leaktrace_common::memory::Memory`), measured at a
//! report or a timeline point, on the collector's thread, never per allocation:
//! `/proc/self/status` for RSS and its anonymous, file and shared parts, glibc's own
//! accounting (`mallinfo2`) for what malloc holds, pymalloc's pool headers for the
//! Python objects, the listed thread stacks, and the library's own heap and mappings.
//! Never called while the scan holds the program's threads: `mallinfo2` takes malloc's
//! arena locks, which a held thread may own.
use leaktrace_common::memory::Memory;

/// What the collector knows that the process's counters do not.
#[derive(Clone, Copy, Debug, Default)]
pub struct Known {
    /// Live tracked host blocks.
    pub heap_live: u64,
    /// Whether the program's malloc is glibc's (else `mallinfo2` says nothing of it).
    pub glibc_malloc: bool,
    /// A forked child: its private and proportional memory are measured too.
    pub forked_child: bool,
}

/// glibc's `struct mallinfo2` (2.33+), found at run time so that the library still
/// loads with an older C library.
#[repr(C)]
#[derive(Default)]
struct MallInfo2 {
    arena: usize,
    ordblks: usize,
    smblks: usize,
    hblks: usize,
    hblkhd: usize,
    usmblks: usize,
    fsmblks: usize,
    uordblks: usize,
    fordblks: usize,
    keepcost: usize,
}

/// `mallinfo2`, looked up once at start (`init`): a `dlsym` at report time would run on
/// the thread that writes the final report (the program's main thread at `exit`), and
/// glibc's `dlsym` frees that thread's previous `dlerror` state, a block of the
/// program's, while our hooks do not look (a false 24-byte leak in the fixture that
/// calls `dlsym` itself).
static MALLINFO2: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Finds what the measure needs from the C library; call at the library's start.
pub fn init() {
    crate::os::procfs::open();
    if let Some(f) = crate::os::loader::global_symbol(c"mallinfo2") {
        MALLINFO2.store(f, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `(in use, free)` in malloc's heap: in use is `uordblks + hblkhd` (blocks in the
/// arenas and those mapped on their own), free is `fordblks`.
fn malloc_heap() -> Option<(u64, u64)> {
    let f = MALLINFO2.load(std::sync::atomic::Ordering::Relaxed);
    if f == 0 {
        return None;
    }
    // SAFETY: glibc's `struct mallinfo2 mallinfo2(void)`, returned by value.
    let info: MallInfo2 = unsafe { std::mem::transmute::<usize, extern "C" fn() -> MallInfo2>(f)() };
    Some(((info.uordblks + info.hblkhd) as u64, info.fordblks as u64))
}

/// The `kB` value of each of `keys` in a `/proc` status-like text, in bytes.
fn kb_fields<const N: usize>(text: &str, keys: [&str; N]) -> [Option<u64>; N] {
    let mut out = [None; N];
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else { continue };
        if let Some(i) = keys.iter().position(|k| *k == key) {
            out[i] = rest.split_whitespace().next().and_then(|v| v.parse::<u64>().ok()).map(|kb| kb * 1024);
        }
    }
    out
}

/// Measures the memory now.
pub fn measure(known: Known) -> Memory {
    let status = crate::os::procfs::status();
    let [rss, anon, file, shmem, stack] = kb_fields(&status, ["VmRSS", "RssAnon", "RssFile", "RssShmem", "VmStk"]);
    // Under a seccomp filter (a sandboxed Chromium renderer) only what /proc and our
    // counters say: `mincore`, `tgkill` and `process_vm_readv` may be answered with
    // SIGSYS, which kills the process.
    let copy_allowed = crate::os::procfs::unfiltered(&status);
    let probe = |f: fn() -> u64| if copy_allowed { f() } else { 0 };
    let mut m = Memory {
        rss: rss.unwrap_or(0),
        rss_anon: anon.unwrap_or(0),
        rss_file: file.unwrap_or(0),
        rss_shmem: shmem.unwrap_or(0),
        heap_live: known.heap_live,
        mmap: probe(crate::os::mapped::resident),
        shm: shmem.unwrap_or(0),
        stacks: stack.unwrap_or(0) + probe(crate::os::stack::resident_stacks),
        ..Default::default()
    };
    let own_heap = crate::os::own::heap_bytes();
    m.tracer = own_heap;
    if copy_allowed {
        let mapped = crate::os::own::parts_resident();
        m.tracer += mapped.iter().sum::<u64>();
        let named = crate::os::own::Part::ALL.iter().map(|p| (p.name(), mapped[*p as usize]));
        m.tracer_parts = named
            .chain([("heap", own_heap)])
            .filter(|&(_, bytes)| bytes > 0)
            .map(|(part, bytes)| leaktrace_common::memory::TracerPart { part: part.into(), bytes })
            .collect();
    }
    if known.glibc_malloc {
        if let Some((in_use, free)) = malloc_heap() {
            m.heap_free = Some(free);
            m.heap_other = Some(in_use.saturating_sub(known.heap_live + own_heap));
        }
    }
    if let Some((used, total)) = crate::scan::arenas::usage(copy_allowed) {
        m.python_objects = Some(used);
        m.python_free = Some(total.saturating_sub(used));
    }
    if known.forked_child {
        let rollup = crate::os::procfs::smaps_rollup();
        let [pss, clean, dirty] = kb_fields(&rollup, ["Pss", "Private_Clean", "Private_Dirty"]);
        m.pss = pss;
        m.uss = clean.zip(dirty).map(|(c, d)| c + d);
    }
    let explained = m.heap_live
        + m.heap_free.unwrap_or(0)
        + m.heap_other.unwrap_or(0)
        + m.python_objects.unwrap_or(0)
        + m.python_free.unwrap_or(0)
        + m.mmap
        + m.stacks
        + m.tracer;
    m.unexplained = m.rss_anon.saturating_sub(explained);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_in_bytes() {
        let text = "Name:\tx\nVmRSS:\t  2048 kB\nRssAnon:\t1024 kB\nRssFile:\t 512 kB\nRssShmem:\t0 kB\n";
        assert_eq!(kb_fields(text, ["VmRSS", "RssAnon", "RssFile", "RssShmem", "VmStk"]), [Some(2 << 20), Some(1 << 20), Some(512 << 10), Some(0), None]);
    }

    #[test]
    fn this_process_is_measured_and_its_parts_stay_within_its_memory() {
        init();
        let m = measure(Known { heap_live: 0, glibc_malloc: true, forked_child: true });
        assert!(m.rss > 0 && m.rss >= m.rss_anon && m.rss_anon > 0, "{m:?}");
        assert!(m.heap_free.is_some() && m.heap_other.is_some(), "{m:?}");
        assert!(m.uss.is_some_and(|u| u > 0) && m.pss.is_some_and(|p| p > 0), "{m:?}");
        assert!(m.stacks > 0, "{m:?}");
    }
}
