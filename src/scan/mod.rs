//! Reachability of outstanding blocks: a conservative mark phase over root memory
//! (writable module segments, every thread's live stack and registers, the main thread's
//! static TLS) and the live heap, classifying each block as LeakSanitizer does —
//! reachable, indirect (only leaked blocks point to it) or definite.
//! Opt-in for now (`LEAKTRACE_SCAN=1`).
pub mod mark;
pub mod roots;

use std::time::Instant;

use mark::{Block, Scratch, Verdict};

#[derive(Clone, Debug, Default)]
pub struct ScanInfo {
    pub duration_ms: u64,
    pub threads: usize,
    pub threads_stopped: usize,
    /// Threads that block the stop signal: their stacks were copied while they slept.
    pub threads_copied: usize,
    pub root_bytes: u64,
    pub heap_bytes: u64,
}

/// Classifies `blocks` (sorted by start, not overlapping) against the process's roots.
/// `own_threads` (the library's collector) are neither stopped nor roots: their stacks
/// hold the addresses of the events they just processed, which the program does not.
pub fn scan(blocks: &[Block], own_threads: &[u32]) -> (Vec<Verdict>, ScanInfo) {
    let t0 = Instant::now();
    let have_signal = roots::install();
    let mut tids = if have_signal { roots::other_threads() } else { Vec::new() };
    tids.retain(|t| !own_threads.contains(t));
    let (tids, blocking) = roots::split_blocking(&tids);
    let blocking_stacks = roots::copy_blocking_stacks(&blocking, &roots::writable_mappings());
    let mut regs: Vec<u64> = Vec::with_capacity((tids.len() + 1) * 24);
    let mut scratch = Scratch::new(blocks);
    // Read after the scan's own buffers exist, so that the stack copies lie inside.
    let maps = roots::writable_mappings();
    let (module_ranges, runtime_module_ranges) = roots::module_data();
    let mut pages = roots::WrittenPages::prepare();
    let mut root_ranges = Vec::new();
    let mut runtime_ranges = Vec::with_capacity(roots::WrittenPages::bound(&runtime_module_ranges));
    root_ranges.extend_from_slice(roots::main_tls());
    root_ranges.extend(roots::main_dtv(&maps));
    root_ranges.extend(blocking_stacks.iter().map(|s| (s.as_ptr() as u64, (s.len() * 8) as u64)));
    roots::own_stack(&maps, &mut root_ranges, &mut regs);
    root_ranges.reserve(tids.len() + 8 + roots::WrittenPages::bound(&module_ranges));
    // From here until `resume`: no allocation.
    let stopped = roots::stop_threads(&tids, &maps, &mut root_ranges, &mut regs);
    // Which pages were written is read while every thread that could write is held.
    pages.keep_written(&module_ranges, &mut root_ranges);
    pages.keep_written(&runtime_module_ranges, &mut runtime_ranges);
    let regs_range = (regs.as_ptr() as u64, (regs.len() * 8) as u64);
    if root_ranges.len() < root_ranges.capacity() {
        root_ranges.push(regs_range);
    }
    mark::classify_into(blocks, &root_ranges, &runtime_ranges, &roots::ProcessMemory { readable: &maps }, &mut scratch);
    roots::resume(stopped.asked);
    let info = ScanInfo {
        duration_ms: t0.elapsed().as_millis() as u64,
        threads: tids.len() + blocking.len() + 1,
        threads_stopped: stopped.stopped + 1,
        threads_copied: blocking_stacks.len(),
        root_bytes: root_ranges.iter().chain(&runtime_ranges).map(|r| r.1).sum(),
        heap_bytes: blocks.iter().map(|b| b.size).sum(),
    };
    (scratch.verdicts, info)
}
