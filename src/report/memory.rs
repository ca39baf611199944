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

/// `malloc_info` and `fmemopen`, looked up at start as `mallinfo2`.
static MALLOC_INFO: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static FMEMOPEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Finds what the measure needs from the C library; call at the library's start.
pub fn init() {
    crate::os::procfs::open(false);
    // The C library's own: its heap's figures are what they give, used only where
    // malloc is glibc's.
    let [mallinfo2, malloc_info, fmemopen] = crate::os::loader::library_symbols([c"mallinfo2", c"malloc_info", c"fmemopen"]);
    if let Some(f) = mallinfo2 {
        MALLINFO2.store(f, std::sync::atomic::Ordering::Relaxed);
    }
    if let (Some(info), Some(open)) = (malloc_info, fmemopen) {
        MALLOC_INFO.store(info, std::sync::atomic::Ordering::Relaxed);
        FMEMOPEN.store(open, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The XML `malloc_info` writes, read at most this far (a heap's part is ~2 KiB: 64
/// arenas fit).
const MALLOC_INFO_BYTES: usize = 256 << 10;

/// What malloc's free chunks hold: (whole pages inside them, arenas), from glibc's
/// `malloc_info`. It takes each arena's lock in turn and walks its bins: called for
/// reports only, on the collector's thread (its allocations are untracked), never while
/// the scan holds the program's threads.
pub fn free_chunks() -> Option<(u64, u32)> {
    let (info, open) = (MALLOC_INFO.load(std::sync::atomic::Ordering::Relaxed), FMEMOPEN.load(std::sync::atomic::Ordering::Relaxed));
    if info == 0 || open == 0 || !crate::hotpath::thread::is_busy_or_internal() {
        return None;
    }
    let buf = crate::hotpath::mapping::map_zeroed(MALLOC_INFO_BYTES, crate::os::own::Part::Other)?;
    // SAFETY: glibc's `FILE *fmemopen(void *, size_t, const char *)` over our own zeroed
    // mapping of that size, and `int malloc_info(int, FILE *)`; the stream is closed
    // before the mapping is read (its last byte stays 0: the text ends there at most).
    let written = unsafe {
        let open: extern "C" fn(*mut libc::c_void, usize, *const libc::c_char) -> *mut libc::FILE = std::mem::transmute(open);
        let info: extern "C" fn(libc::c_int, *mut libc::FILE) -> libc::c_int = std::mem::transmute(info);
        let f = open(buf as *mut libc::c_void, MALLOC_INFO_BYTES - 1, c"w".as_ptr());
        if f.is_null() {
            None
        } else {
            let rc = info(0, f);
            libc::fclose(f);
            (rc == 0).then_some(())
        }
    };
    // SAFETY: the mapping above, MALLOC_INFO_BYTES long, written by the stream only.
    let text = unsafe { std::slice::from_raw_parts(buf as *const u8, MALLOC_INFO_BYTES) };
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    let out = written.map(|_| parse_malloc_info(&String::from_utf8_lossy(&text[..end])));
    crate::hotpath::mapping::unmap(buf, MALLOC_INFO_BYTES);
    out
}

/// (whole pages inside the free chunks, arenas) of `malloc_info`'s XML: each arena is a
/// `<heap nr="N">`, its free chunks by size `<size from="A" to="B" total="T"
/// count="C"/>` (and `<unsorted …/>`). A chunk of `s` bytes holds at least `s - 2 pages`
/// of whole pages (its start and end fall anywhere in a page), which `malloc_trim`
/// returns with `MADV_DONTNEED`.
pub fn parse_malloc_info(xml: &str) -> (u64, u32) {
    const PAGE: u64 = 4096;
    let (mut pages, mut arenas) = (0u64, 0u32);
    let attr = |line: &str, name: &str| -> Option<u64> {
        let at = line.find(&format!(" {name}=\""))? + name.len() + 3;
        line[at..].split('"').next()?.parse().ok()
    };
    for line in xml.lines().map(str::trim) {
        if line.starts_with("<heap nr=") {
            arenas += 1;
        } else if line.starts_with("<size ") || line.starts_with("<unsorted ") {
            if let (Some(total), Some(count)) = (attr(line, "total"), attr(line, "count")) {
                pages += total.saturating_sub(count.saturating_mul(2 * PAGE)) / PAGE * PAGE;
            }
        }
    }
    (pages, arenas)
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

/// The `kB` value of each of `keys` in a `/proc` status-like text, in bytes: a line
/// `KEY:` then blanks and the number (a value that is not a number is `None`). Bytes,
/// not `str` splits: every process's exit report reads its status text.
fn kb_fields<const N: usize>(text: &str, keys: [&str; N]) -> [Option<u64>; N] {
    let mut out = [None; N];
    for line in text.as_bytes().split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let Some(i) = keys.iter().position(|k| k.as_bytes() == &line[..colon]) else { continue };
        let rest = &line[colon + 1..];
        let start = rest.iter().position(|b| !b.is_ascii_whitespace()).unwrap_or(rest.len());
        let token = &rest[start..];
        let token = &token[..token.iter().position(|b| b.is_ascii_whitespace()).unwrap_or(token.len())];
        out[i] = std::str::from_utf8(token).ok().and_then(|v| v.parse::<u64>().ok()).map(|kb| kb * 1024);
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
        let mapped = crate::os::own::parts_resident(&crate::hotpath::stacks::touched_arenas());
        m.tracer += mapped.iter().sum::<u64>();
        // `heap`: the library's small blocks, in malloc (by their bytes) and in its own
        // heap (by its pages resident).
        use crate::os::own::Part;
        let named = Part::ALL.iter().filter(|p| **p != Part::Heap).map(|p| (p.name(), mapped[*p as usize]));
        m.tracer_parts = named
            .chain([("heap", own_heap + mapped[Part::Heap as usize])])
            .filter(|&(_, bytes)| bytes > 0)
            .map(|(part, bytes)| leaktrace_common::memory::TracerPart { part: part.into(), bytes })
            .collect();
    }
    m.tracer_files = crate::hotpath::stacks::spill_file_bytes();
    if known.glibc_malloc {
        if let Some((in_use, free)) = malloc_heap() {
            m.heap_free = Some(free);
            m.heap_other = Some(in_use.saturating_sub(known.heap_live + own_heap));
        }
    }
    if let Some((used, total)) = crate::scan::arenas::usage(copy_allowed, known.forked_child) {
        m.python_objects = Some(used);
        m.python_free = Some(total.saturating_sub(used));
    }
    if known.forked_child {
        let rollup = crate::os::procfs::smaps_rollup();
        let [pss, clean, dirty] = kb_fields(&rollup, ["Pss", "Private_Clean", "Private_Dirty"]);
        m.pss = pss;
        m.uss = clean.zip(dirty).map(|(c, d)| c + d);
    }
    if copy_allowed {
        m.static_data = static_data_now();
    }
    let explained = m.heap_live
        + m.static_data
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

/// `static_data`, measured again when the last measure is a second old: ~3 ms with
/// torch's libraries loaded, and timeline points come every 250 ms at first, while the
/// libraries' variables change little once they are loaded.
fn static_data_now() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    static AT_MS: AtomicU64 = AtomicU64::new(0);
    let now = crate::report::process::unix_ms();
    let at = AT_MS.load(Ordering::Relaxed);
    if at != 0 && now.saturating_sub(at) < 1000 {
        return LAST.load(Ordering::Relaxed);
    }
    let v = static_data();
    LAST.store(v, Ordering::Relaxed);
    AT_MS.store(now, Ordering::Relaxed);
    v
}

/// The written pages of the loaded modules' writable segments (`scan::roots::
/// module_data`: `.data`, a private file page copied on write, and `.bss` with the
/// anonymous mapping after the file's end): resident anonymous memory that the
/// libraries hold as their static variables. After `import torch` about 100 MiB (the
/// CUDA libraries' `.bss`), which `unexplained` had held.
fn static_data() -> u64 {
    const PAGE: u64 = 4096;
    let (program, cuda) = crate::scan::roots::module_data();
    // As the measure of our own mappings opens it (`os::own`): through the anchor
    // (a chroot hides /proc), closed again below.
    let Ok(pagemap) = crate::os::anchor::open_proc("self/pagemap", libc::O_RDONLY) else { return 0 };
    let mut entries = vec![0u64; 512];
    let mut total = 0;
    for &(start, len) in program.iter().chain(&cuda) {
        let (mut page, end) = (start / PAGE, start.saturating_add(len).div_ceil(PAGE));
        while page < end {
            let n = ((end - page) as usize).min(entries.len());
            if !crate::os::pagemap::read(pagemap, page, &mut entries[..n]) {
                break;
            }
            let present_anon = |e: &&u64| **e & crate::os::pagemap::PRESENT != 0 && **e & crate::os::pagemap::FILE_OR_SHARED == 0;
            total += entries[..n].iter().filter(present_anon).count() as u64 * PAGE;
            page += n as u64;
        }
    }
    // SAFETY: the descriptor opened above, ours alone.
    unsafe { libc::close(pagemap) };
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read_in_bytes() {
        let text = "Name:\tx\nVmRSS:\t  2048 kB\nRssAnon:\t1024 kB\nRssFile:\t 512 kB\nRssShmem:\t0 kB\n";
        assert_eq!(kb_fields(text, ["VmRSS", "RssAnon", "RssFile", "RssShmem", "VmStk"]), [Some(2 << 20), Some(1 << 20), Some(512 << 10), Some(0), None]);
        // A value that is not a number, a key that only starts like one, a last line
        // without its newline, blanks of both kinds.
        let text = "VmRSSX:\t9 kB\nVmRSS:\t12x kB\nRssAnon: \t 7\tkB\nVmStk:\t3 kB";
        assert_eq!(kb_fields(text, ["VmRSS", "RssAnon", "VmStk"]), [None, Some(7 << 10), Some(3 << 10)]);
    }

    #[test]
    fn this_process_is_measured_and_its_parts_stay_within_its_memory() {
        init();
        // Measured as a forked child's report: with `smaps_rollup` (USS, PSS).
        crate::os::procfs::open(true);
        let m = measure(Known { heap_live: 0, glibc_malloc: true, forked_child: true });
        assert!(m.rss > 0 && m.rss >= m.rss_anon && m.rss_anon > 0, "{m:?}");
        assert!(m.heap_free.is_some() && m.heap_other.is_some(), "{m:?}");
        assert!(m.uss.is_some_and(|u| u > 0) && m.pss.is_some_and(|p| p > 0), "{m:?}");
        assert!(m.stacks > 0, "{m:?}");
        // This test binary's own globals (libc's, at least) are written pages.
        assert!(m.static_data > 0 && m.static_data < m.rss_anon, "{m:?}");
    }
}

#[cfg(test)]
mod malloc_info_tests {
    use super::*;

    #[test]
    fn whole_pages_of_the_free_chunks_and_the_arenas_are_read_from_malloc_info() {
        let xml = r#"<malloc version="1">
<heap nr="0">
<sizes>
  <size from="17" to="32" total="64" count="2"/>
  <size from="1048577" to="1572864" total="3145728" count="2"/>
  <unsorted from="12288" to="12288" total="12288" count="1"/>
</sizes>
<total type="fast" count="2" size="64"/>
</heap>
<heap nr="1">
<sizes>
  <size from="65537" to="98304" total="81920" count="1"/>
</sizes>
</heap>
<total type="fast" count="2" size="64"/>
</malloc>"#;
        // 3 MiB in 2 chunks: 3 MiB - 4 pages; 12 KiB in 1: 1 page; 80 KiB in 1: 18 pages.
        assert_eq!(parse_malloc_info(xml), ((3 << 20) - 4 * 4096 + 4096 + 18 * 4096, 2));
    }

    #[test]
    fn the_c_librarys_own_text_parses() {
        init();
        crate::hotpath::thread::untracked(|| {
            let blocks: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 40_000]).collect();
            let mut kept: Vec<Vec<u8>> = Vec::new();
            for (i, b) in blocks.into_iter().enumerate() {
                if i % 2 == 0 {
                    kept.push(b);
                }
            }
            let (_, arenas) = free_chunks().expect("malloc_info");
            assert!(arenas >= 1);
            drop(kept);
        });
    }
}
