//! Reachability of outstanding blocks: a conservative mark phase over root memory
//! (writable module segments, every thread's live stack and registers, the main thread's
//! static TLS) and the live heap, classifying each block as LeakSanitizer does —
//! reachable, indirect (only leaked blocks point to it) or definite.
//! On by default (`LEAKTRACE_SCAN=0` turns it off).
pub mod arenas;
pub mod glibc_heap;
pub mod mark;
pub mod pymalloc;
pub mod referrers;
pub mod roots;

use std::time::{Duration, Instant};

use crate::hotpath::mapping::ZeroedArray;
use crate::spans::Spans;
use mark::{Block, Scratch};

/// The pages that blocks inherited from a parent process (sorted) lie on, as sorted,
/// disjoint ranges.
fn inherited_pages(inherited: &Spans) -> Vec<(u64, u64)> {
    const PAGE: u64 = 4096;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (start, size) in inherited.iter().filter(|b| b.1 > 0) {
        let from = start & !(PAGE - 1);
        let to = start.saturating_add(size).saturating_add(PAGE - 1) & !(PAGE - 1);
        match out.last_mut() {
            Some(last) if from <= last.0 + last.1 => last.1 = last.1.max(to - last.0),
            _ => out.push((from, to - from)),
        }
    }
    out
}

/// Room for frees published between taking the live set and stopping the threads,
/// beyond the slots of the rings there are when it is reserved (rings a thread starts or
/// grows into before the stop): 8 bytes each, reserved before the stop.
const FREED_MEANWHILE: usize = 1 << 16;

/// The most written parts of the program's mappings a scan keeps apart (1 MiB of room):
/// past it, a mapping's last part reaches to its end.
const MAPPED_PARTS: usize = 1 << 16;

/// The frees read from the rings while the program's threads are held, in the buffer
/// made for them before (`freed`), or, if the rings hold more (a ring added since it was
/// sized), in a mapping made while the threads are held (`ZeroedArray::mapped`: no malloc
/// then, a held thread may own its lock). None is left out: a free left out was a freed
/// block read as a leak.
enum FreedMeanwhile {
    /// The first `n` words of the buffer.
    InBuffer(usize),
    /// The first `n` words of the mapping.
    Mapped(ZeroedArray<u64>, usize),
}

impl FreedMeanwhile {
    /// Reads the frees into `buffer`'s spare room (never grown: no allocation here), or
    /// all of them into a new mapping if they are more.
    fn read(buffer: &mut Vec<u64>) -> FreedMeanwhile {
        let n = crate::hotpath::channel::unapplied_frees(|addr| {
            if buffer.len() < buffer.capacity() {
                buffer.push(addr);
            }
        });
        if n <= buffer.len() {
            return FreedMeanwhile::InBuffer(buffer.len());
        }
        let Some(mut room) = ZeroedArray::mapped(n + FREED_MEANWHILE) else {
            // The kernel refused: what the buffer holds (the frees past it read as leaks).
            return FreedMeanwhile::InBuffer(buffer.len());
        };
        let mut k = 0;
        crate::hotpath::channel::unapplied_frees(|addr| {
            if let Some(slot) = room.get_mut(k) {
                *slot = addr;
                k += 1;
            }
        });
        FreedMeanwhile::Mapped(room, k)
    }

    fn addresses<'a>(&'a self, buffer: &'a [u64]) -> &'a [u64] {
        match self {
            FreedMeanwhile::InBuffer(n) => &buffer[..*n],
            FreedMeanwhile::Mapped(room, n) => &room[..*n],
        }
    }
}

/// What a scan measured (the report's `scan` object, defined with the schema).
pub use leaktrace_common::report_schema::Scan as ScanInfo;

/// What a range of root memory is, to name the root a path to a block ends at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootKind {
    /// A module's writable data: global and static variables (named from its symbols).
    Module,
    /// A thread's stack, in the frame of the function at `ip` where the unwinder says
    /// (the scanning thread's own stack; 0: not known). `copied`: a thread that could
    /// not be held, read from a copy.
    Stack { tid: u32, ip: u64, copied: bool },
    /// A thread's registers, saved when it was held.
    Registers { tid: u32 },
    /// The main thread's static thread-local storage (and its DTV).
    Tls,
    /// A region the program declared a root (`__lsan_register_root_region`), an
    /// ignored block, or the argument of a thread not yet started.
    Region,
    /// A Python object in pymalloc's arenas.
    PythonObject,
    /// A chunk of a thread's Python frame stack (3.11+): running functions' locals.
    PythonFrames,
    /// A block the parent process allocated (a forked child).
    Inherited,
    /// A CUDA library's own data.
    CudaLibrary,
}

/// One labelled range of root memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootLabel {
    pub start: u64,
    pub len: u64,
    pub kind: RootKind,
}

/// `ranges`, each labelled `kind`.
fn label(ranges: &[(u64, u64)], kind: RootKind) -> impl Iterator<Item = RootLabel> + '_ {
    ranges.iter().map(move |&(start, len)| RootLabel { start, len, kind })
}

/// The labels of a scan's root memory, in the order the scan read it. The blocks
/// inherited from a parent process are read as roots at `inherited_at` in that order,
/// but they are not copied into the list: they are the scan's list of inherited blocks
/// itself (`Labels`). A DataLoader worker inherits ~120k blocks: as labels they were
/// 4.8 MB and ~10 ms of page faults in every worker's exit report, which its parent
/// waits for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RootLabels {
    pub list: Vec<RootLabel>,
    pub inherited_at: usize,
}

/// A scan's labels with the blocks it read as inherited (`RootLabels`).
#[derive(Clone, Copy, Debug)]
pub struct Labels<'a> {
    pub labels: &'a RootLabels,
    /// Sorted by address, disjoint (the scan's `inherited`).
    pub inherited: &'a Spans,
}

impl<'a> Labels<'a> {
    pub fn new(labels: &'a RootLabels, inherited: &'a Spans) -> Labels<'a> {
        Labels { labels, inherited }
    }

    /// The label of the root range that holds `addr`: the first that does, in the
    /// order the scan read them (ranges it read as copies of others, as a held thread's
    /// stack, come first).
    pub fn of(&self, addr: u64) -> Option<RootLabel> {
        let holds = |l: &&RootLabel| addr >= l.start && addr - l.start < l.len;
        let (before, after) = self.labels.list.split_at(self.labels.inherited_at.min(self.labels.list.len()));
        before.iter().find(holds).copied().or_else(|| self.inherited_of(addr)).or_else(|| after.iter().find(holds).copied())
    }

    /// The inherited block that holds `addr`, as a label: the last one starting at or
    /// below it (they are disjoint).
    fn inherited_of(&self, addr: u64) -> Option<RootLabel> {
        let (start, len) = self.inherited.holder_of(addr)?;
        Some(RootLabel { start, len, kind: RootKind::Inherited })
    }
}

/// A scan's outcome: each block's verdict, owner and path step (`mark::Scratch`), the
/// labels of the root memory it read, and what it measured.
pub struct ScanOut {
    pub verdicts: Vec<mark::Verdict>,
    pub owners: Vec<u32>,
    pub parent: Vec<u32>,
    pub via: Vec<u64>,
    pub labels: RootLabels,
    pub info: ScanInfo,
}

/// Classifies `blocks` (sorted by start, not overlapping) against the process's roots.
/// `inherited`: in a forked child, the parent's blocks (sorted), which may point to the
/// child's (see `mark::Roots`). The library's own threads (`os::threads`: the
/// collector, the namer, a holder search) are neither stopped nor roots: their stacks
/// hold the addresses of the events they just processed, which the program may not.
///
/// `extra_roots`: ranges the program declared roots (`__lsan_register_root_region`,
/// ignored blocks): read like module data.
pub fn scan(blocks: &[Block], inherited: &Spans, extra_roots: &[(u64, u64)]) -> ScanOut {
    if blocks.is_empty() && inherited.is_empty() {
        // Nothing live to classify (a process that allocated nothing, or freed it all):
        // the verdict needs no roots, and no thread of the program is stopped.
        let info = ScanInfo { ran: true, ..ScanInfo::default() };
        return ScanOut { verdicts: Vec::new(), owners: Vec::new(), parent: Vec::new(), via: Vec::new(), labels: RootLabels::default(), info };
    }
    let t0 = Instant::now();
    let have_signal = roots::install();
    let mut tids = if have_signal { roots::other_threads() } else { Vec::new() };
    // Read after the list: a thread of ours in it has written its id by now.
    let own_threads = crate::os::threads::own_tids_settled(Duration::from_secs(5));
    tids.retain(|t| !own_threads.contains(t));
    let (tids, blocking) = roots::split_blocking(&tids);
    // `/proc/self/maps` read for them only when a thread blocks (a process with
    // thousands of mappings takes milliseconds to read it; it is read again below).
    let blocking_stacks = if blocking.is_empty() { Vec::new() } else { roots::copy_blocking_stacks(&blocking, &roots::writable_mappings()) };
    let mut regs: Vec<u64> = Vec::with_capacity((tids.len() + 1) * 24);
    // Labels for every root range pushed below (no allocation once threads are held).
    let mut labels: Vec<RootLabel> = Vec::with_capacity(2 * tids.len() + blocking.len() + 64);
    let mut scratch = Scratch::new(blocks);
    // Read after the scan's own buffers exist, so that the stack copies lie inside.
    let maps = roots::writable_mappings();
    let (module_ranges, runtime_module_ranges) = roots::module_data();
    let mut pages = roots::WrittenPages::prepare();
    let memory = roots::ProcessMemory::copying_roots(&maps, !inherited.is_empty());
    let mut root_ranges = Vec::new();
    let mut runtime_ranges = Vec::with_capacity(roots::WrittenPages::bound(&runtime_module_ranges));
    let forked_child = !inherited.is_empty();
    let inherited_pages = inherited_pages(inherited);
    // The program's own mappings (`mark::Block::mapping`): read on their written pages,
    // found while the threads are held. Room for the parts of a few large reservations
    // at most: past it a range's last part is widened to its end (read, never lost).
    let mappings: Vec<(u64, u64)> = blocks.iter().filter(|b| b.is_mapping()).map(|b| (b.start, b.size())).collect();
    let mut mapped_written = Vec::with_capacity(roots::WrittenPages::bound(&mappings).min(MAPPED_PARTS));
    let mut changed_since_fork = Vec::with_capacity(roots::WrittenPages::bound(&inherited_pages));
    root_ranges.extend_from_slice(roots::main_tls());
    root_ranges.extend_from_slice(extra_roots);
    root_ranges.extend(roots::main_dtv(&maps));
    labels.extend(label(roots::main_tls(), RootKind::Tls));
    labels.extend(label(extra_roots, RootKind::Region));
    labels.extend(label(&roots::main_dtv(&maps).into_iter().collect::<Vec<_>>(), RootKind::Tls));
    for (tid, copy) in blocking_stacks.iter().map(|(t, c)| (*t, c)) {
        let range = (copy.as_ptr() as u64, (copy.len() * 8) as u64);
        root_ranges.push(range);
        labels.push(RootLabel { start: range.0, len: range.1, kind: RootKind::Stack { tid, ip: 0, copied: true } });
    }
    roots::own_stack(&maps, &mut root_ranges, &mut regs, &mut labels);
    let frames_bound = python_frames_bound();
    root_ranges.reserve(tids.len() + 8 + roots::WrittenPages::bound(&module_ranges) + frames_bound);
    let mut python_arenas = Vec::with_capacity(crate::scan::arenas::capacity());
    // The chunks of the threads' Python frame stacks (3.11+): the running functions'
    // locals, roots as a thread's stack is, up to each thread's top (the slots above
    // keep what returned calls left).
    let mut python_frames = Vec::with_capacity(frames_bound);
    // In a forked child, the arenas' pages unchanged since the fork hold only what the
    // parent had (as for inherited blocks): room for their changed parts, from the
    // arenas there are now (more made meanwhile widen the last part, never allocate).
    let mut python_changed = Vec::new();
    crate::scan::arenas::live_arenas(&mut python_arenas);
    if forked_child {
        python_changed.reserve(roots::WrittenPages::bound(&python_arenas) + 64);
    }
    // Room for the lists' item arrays (`mark::Scratch::lists`): one per 256 bytes of
    // arena (a list is 64 of them), at most 16 MiB of entries; those past it are read
    // whole, as before.
    let arena_bytes: u64 = python_arenas.iter().map(|a| a.1).sum();
    if arena_bytes > 0 {
        scratch.reserve_lists(((arena_bytes / 256) as usize).clamp(4096, 1 << 20));
    }
    python_arenas.clear();
    // Frees published after the live set was taken (see `mark::Roots::freed_meanwhile`):
    // room for every event the rings can hold. A fixed 64k was not enough in an
    // allocation storm (8 threads freeing while the scan prepared, on a loaded machine):
    // the frees past it were dropped, and the blocks they freed read as leaks (3-5 detach
    // reports in 100 called 5-60 freed blocks "definite"). More than that (a ring added
    // since) go to a mapping made while the threads are held (`FreedMeanwhile`).
    let mut freed = Vec::with_capacity(crate::hotpath::channel::slots_in_rings() + FREED_MEANWHILE);
    // From here until `resume`: no allocation.
    labels.extend(label(&module_ranges, RootKind::Module));
    labels.extend(label(&runtime_module_ranges, RootKind::CudaLibrary));
    // The inherited blocks are labelled where they are read, without a copy of the list
    // (`RootLabels`); room for the held threads' labels (no allocation once they are held).
    let inherited_at = labels.len();
    labels.reserve(2 * tids.len() + 2);
    let stopped = roots::stop_threads(&tids, &maps, &mut root_ranges, &mut regs, &mut labels);
    // With every program thread held, no free is published any more: the ones since the
    // live set was taken are all in the rings (the consumers are held off meanwhile).
    let freed_meanwhile = FreedMeanwhile::read(&mut freed);
    // Read while the interpreter's threads are held (arenas come and go under the GIL).
    crate::scan::arenas::live_arenas(&mut python_arenas);
    crate::scan::arenas::live_frame_chunks(&mut python_frames);
    crate::scan::arenas::cut_frame_chunks_to_live(&mut python_frames);
    python_frames.retain(|c| c.1 > 0);
    for &chunk in &python_frames {
        if root_ranges.len() < root_ranges.capacity() {
            root_ranges.push(chunk);
        }
    }
    // Which pages were written is read while every thread that could write is held.
    if forked_child {
        // What the child never wrote holds only what the parent had at the fork: no
        // address of a block the child allocated (inherited blocks count as reachable).
        pages.keep_written_since_fork(&module_ranges, &mut root_ranges);
        pages.keep_written_since_fork(&runtime_module_ranges, &mut runtime_ranges);
    } else {
        pages.keep_written(&module_ranges, &mut root_ranges);
        pages.keep_written(&runtime_module_ranges, &mut runtime_ranges);
    }
    pages.keep_changed_since_fork(&inherited_pages, &mut changed_since_fork);
    pages.keep_written(&mappings, &mut mapped_written);
    if forked_child {
        python_arenas.sort_unstable();
        pages.keep_changed_since_fork(&python_arenas, &mut python_changed);
    }
    let regs_range = (regs.as_ptr() as u64, (regs.len() * 8) as u64);
    if root_ranges.len() < root_ranges.capacity() {
        root_ranges.push(regs_range);
    }
    let all_roots = mark::Roots {
        program: &root_ranges,
        runtime: &runtime_ranges,
        inherited,
        changed_since_fork: &changed_since_fork,
        python_arenas: &python_arenas,
        python_changed: forked_child.then_some(&python_changed[..]),
        python_ints: crate::scan::arenas::int_layout(),
        python_types: crate::scan::arenas::object_types(),
        freed_meanwhile: freed_meanwhile.addresses(&freed),
        mapped_written: &mapped_written,
    };
    mark::classify_into(blocks, &all_roots, &memory, &mut scratch);
    roots::resume(stopped.asked);
    // The arenas read while the threads were held, labelled now that allocating is safe.
    labels.extend(label(&python_arenas, RootKind::PythonObject));
    labels.extend(label(&python_frames, RootKind::PythonFrames));
    let info = ScanInfo {
        ran: true,
        duration_ms: t0.elapsed().as_millis() as u64,
        threads: tids.len() + blocking.len() + 1,
        threads_stopped: stopped.stopped + 1,
        threads_copied: blocking_stacks.len(),
        root_bytes: root_ranges.iter().chain(&runtime_ranges).chain(&changed_since_fork).map(|r| r.1).sum(),
        heap_bytes: blocks.iter().map(|b| b.size()).sum(),
    };
    ScanOut {
        verdicts: scratch.verdicts,
        owners: scratch.owners,
        parent: scratch.parent,
        via: scratch.via,
        labels: RootLabels { list: labels, inherited_at },
        info,
    }
}

/// Room for the frame-stack chunks among the roots: those there are now and as many
/// again (threads start meanwhile), at least 64.
fn python_frames_bound() -> usize {
    2 * crate::scan::arenas::frame_chunks_now() + 64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root's label with the inherited blocks kept apart is the one the list with
    /// them copied in at their place gave: the first range that holds it, in the
    /// scan's order (an inherited block before the ranges read after it, after those
    /// read before).
    #[test]
    fn labels_find_what_one_list_with_the_inherited_blocks_found() {
        let module = |start, len| RootLabel { start, len, kind: RootKind::Module };
        let stack = |start, len| RootLabel { start, len, kind: RootKind::Stack { tid: 7, ip: 0, copied: false } };
        let inherited = [(0x1000, 0x100), (0x1200, 0x0), (0x1300, 0x80), (0x5000, 0x1000), (0x9000, 0x10)];
        // Before them: one range overlapping the second inherited block; after them: one
        // inside the fourth (it never wins) and one past every block.
        let before = [module(0x1300, 0x10), module(0x20000, 0x100)];
        let after = [stack(0x5800, 0x100), stack(0x30000, 0x1000)];
        let labels = RootLabels { list: before.iter().chain(&after).copied().collect(), inherited_at: before.len() };
        let flat: Vec<RootLabel> = before.iter().copied().chain(label(&inherited, RootKind::Inherited)).chain(after.iter().copied()).collect();
        let old = |addr: u64| flat.iter().find(|l| addr >= l.start && addr - l.start < l.len).copied();
        let spans: Spans = inherited.iter().copied().collect();
        let new = Labels::new(&labels, &spans);
        let mut rng = crate::test_rng::TestRng::new(55);
        let mut probes: Vec<u64> = vec![
            0,
            0xfff,
            0x1000,
            0x10ff,
            0x1100,
            0x1200,
            0x1300,
            0x130f,
            0x1310,
            0x137f,
            0x1380,
            0x5000,
            0x5800,
            0x58ff,
            0x5fff,
            0x6000,
            0x9000,
            0x900f,
            0x9010,
            0x20050,
            0x30fff,
            0x31000,
            u64::MAX,
        ];
        probes.extend((0..20_000).map(|_| rng.below(0x32000)));
        for addr in probes {
            assert_eq!(new.of(addr), old(addr), "{addr:#x}");
        }
        assert_eq!(new.of(0x1310).map(|l| l.kind), Some(RootKind::Inherited));
        assert_eq!(new.of(0x1305).map(|l| l.kind), Some(RootKind::Module));
        assert_eq!(new.of(0x5810).map(|l| l.kind), Some(RootKind::Inherited));
        // No inherited blocks (every process that is not a forked child).
        let none = Labels::new(&labels, &crate::spans::EMPTY);
        assert_eq!(none.of(0x5810).map(|l| l.kind), Some(RootKind::Stack { tid: 7, ip: 0, copied: false }));
        assert_eq!(Labels::new(&RootLabels::default(), &crate::spans::EMPTY).of(0x1000), None);
    }
}
