//! The program's unwind tables (`.eh_frame_hdr`, `.eh_frame`), given back to the page
//! cache once the unwinder has read them.
//!
//! The hot path's unwinder computes each return address's rule once, from the module's
//! call-frame information, read where the loader mapped the module. Those reads bring
//! in file pages that the program itself never touches (it reads them only to throw a
//! C++ exception): after `import torch` ~45 MB of RSS, in libtorch_cpu, libcublasLt and
//! the other CUDA libraries, counted as the program's file memory. Clean pages of a
//! private file mapping can be dropped from the page tables at any time — the kernel
//! does so itself under memory pressure — and the next read faults them in again from
//! the page cache, with the same contents. So the collector drops them after each
//! timeline point at which the unwinder read new ones (`MADV_DONTNEED`).
//!
//! Only what is certainly clean file memory is dropped:
//! - the range runs from the unwind tables to the end of the `PT_LOAD` segment that holds
//!   them, which must not be writable (`PF_W`), overlap `PT_GNU_RELRO`, or belong to a
//!   module with text relocations (the loader writes to those);
//! - page by page, `/proc/self/pagemap` must say the page is a file page or absent (a
//!   page the program made its own with `mprotect` and a write is anonymous, and one
//!   swapped out is a swap entry: both are kept, whole runs around them too).
//!
//! Never under a seccomp filter (`madvise` may be answered with SIGSYS there) and never
//! without `/proc/self/pagemap`.

const PAGE: usize = 4096;

/// A range of one module's non-writable memory that holds its unwind tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub start: usize,
    pub end: usize,
}

const PF_W: u32 = 2;
pub(crate) const DT_TEXTREL: i64 = 22;
pub(crate) const DT_FLAGS: i64 = 30;
pub(crate) const DF_TEXTREL: u64 = 4;
const DW_EH_PE_PCREL_SDATA4: u8 = 0x1b;

/// The unwind-table range of a module loaded at `base` with program headers `phdrs`
/// (`hdr_word`: reads a 32-bit word of the module's memory, for `.eh_frame_hdr`'s
/// pointer to `.eh_frame`), if it qualifies (see the module's comment).
pub fn module_range(base: usize, phdrs: &[libc::Elf64_Phdr], textrel: bool, hdr_word: impl Fn(usize) -> Option<u32>) -> Option<Range> {
    if textrel {
        return None;
    }
    let at = |ph: &libc::Elf64_Phdr| base.wrapping_add(ph.p_vaddr as usize);
    let hdr = phdrs.iter().find(|ph| ph.p_type == libc::PT_GNU_EH_FRAME).map(at)?;
    let seg = phdrs.iter().find(|ph| ph.p_type == libc::PT_LOAD && at(ph) <= hdr && hdr < at(ph) + ph.p_memsz as usize)?;
    if seg.p_flags & PF_W != 0 {
        return None;
    }
    let (seg_start, seg_end) = (at(seg), at(seg) + seg.p_memsz as usize);
    // `.eh_frame` usually follows its header; where a linker put it before, the range
    // starts there (in the same segment only).
    let mut start = hdr;
    // The header's first two words, when the segment holds them.
    let read = |at: usize| if at + 4 <= seg_end { hdr_word(at) } else { None };
    if let Some(word) = read(hdr).filter(|_| hdr + 8 <= seg_end) {
        let (version, enc) = (word & 0xff, (word >> 8) & 0xff);
        if version == 1 && enc as u8 == DW_EH_PE_PCREL_SDATA4 {
            if let Some(rel) = read(hdr + 4) {
                let eh_frame = (hdr + 4).wrapping_add(rel as i32 as isize as usize);
                if seg_start <= eh_frame && eh_frame < start {
                    start = eh_frame;
                }
            }
        }
    }
    let mut end = seg_end;
    for relro in phdrs.iter().filter(|ph| ph.p_type == libc::PT_GNU_RELRO) {
        let (r0, r1) = (at(relro), at(relro) + relro.p_memsz as usize);
        if r0 < end && start < r1 {
            if r0 <= start {
                return None;
            }
            end = r0;
        }
    }
    // Whole pages only: the first and last ones may hold the segment's other sections,
    // which are as clean, and nothing of another segment (segments never share a page).
    let (start, end) = (start & !(PAGE - 1), (end + PAGE - 1) & !(PAGE - 1));
    (start < end).then_some(Range { start, end })
}

/// Whether the module's dynamic section (at `dynamic`, entries as `(tag, value)`)
/// asks for text relocations.
pub fn has_textrel(entries: impl Iterator<Item = (i64, u64)>) -> bool {
    for (tag, value) in entries {
        match tag {
            0 => break,
            DT_TEXTREL => return true,
            DT_FLAGS if value & DF_TEXTREL != 0 => return true,
            _ => {}
        }
    }
    false
}

/// The unwind-table ranges of every loaded module that qualifies.
pub fn ranges() -> Vec<Range> {
    extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut std::ffi::c_void) -> std::ffi::c_int {
        // SAFETY: the loader passes a valid info whose program headers and segments are
        // mapped while it calls back; `data` is our Vec.
        unsafe {
            let out = &mut *(data as *mut Vec<Range>);
            let i = &*info;
            let phdrs = std::slice::from_raw_parts(i.dlpi_phdr, i.dlpi_phnum as usize);
            let base = i.dlpi_addr as usize;
            let textrel = phdrs.iter().find(|ph| ph.p_type == libc::PT_DYNAMIC).is_some_and(|d| {
                // Elf64_Dyn: a tag and a value, 8 bytes each.
                let dynamic = base.wrapping_add(d.p_vaddr as usize) as *const [u64; 2];
                let count = d.p_memsz as usize / 16;
                has_textrel((0..count).map(|k| {
                    let [tag, value] = *dynamic.add(k);
                    (tag as i64, value)
                }))
            });
            // The header's words lie in the segment that `module_range` checks holds it.
            let word = |addr: usize| Some(std::ptr::read_unaligned(addr as *const u32));
            if let Some(r) = module_range(base, phdrs, textrel, word) {
                out.push(r);
            }
        }
        0
    }
    let mut out: Vec<Range> = Vec::new();
    // SAFETY: the callback only reads what the loader gives it.
    unsafe { super::loader::iterate_modules(Some(visit), &mut out as *mut Vec<Range> as *mut std::ffi::c_void) };
    out
}

use super::pagemap::PRESENT;

/// Whether a page with pagemap entry `e` may be dropped: one the program did not write
/// (a file page, or nothing).
fn droppable(e: u64) -> bool {
    !super::pagemap::page_written(e)
}

/// The runs `[first, last)` of droppable pages among `entries` (page `k` at `k`) that
/// hold at least one present page: what to hand to `madvise`.
pub fn droppable_runs(entries: &[u64]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut run: Option<(usize, bool)> = None;
    for (k, &e) in entries.iter().enumerate() {
        match (droppable(e), run) {
            (true, None) => run = Some((k, e & PRESENT != 0)),
            (true, Some((s, present))) => run = Some((s, present || e & PRESENT != 0)),
            (false, Some((s, present))) => {
                if present {
                    out.push((s, k));
                }
                run = None;
            }
            (false, None) => {}
        }
    }
    if let Some((s, true)) = run {
        out.push((s, entries.len()));
    }
    out
}

/// Drops the clean resident pages of `ranges`, reading `/proc/self/pagemap` through
/// `pagemap` (a descriptor). Returns the bytes of the runs given back (pages that were
/// absent inside a run count too: an upper bound, for tests and diagnostics).
pub fn release(ranges: &[Range], pagemap: i32) -> u64 {
    const CHUNK: usize = 4096;
    // Only as many entries as the longest range needs: a short program's few modules
    // need a few hundred, where 32 KiB of fresh pages cost its exit report ~8 page faults.
    let longest = ranges.iter().map(|r| r.end.saturating_sub(r.start) / PAGE).max().unwrap_or(0);
    let mut entries = vec![0u64; longest.min(CHUNK)];
    let mut released = 0u64;
    for r in ranges {
        let mut at = r.start;
        while at < r.end {
            let pages = ((r.end - at) / PAGE).min(CHUNK);
            if !super::pagemap::read(pagemap, (at / PAGE) as u64, &mut entries[..pages]) {
                return released;
            }
            for (s, e) in droppable_runs(&entries[..pages]) {
                let (p, len) = (at + s * PAGE, (e - s) * PAGE);
                // SAFETY: pages of a module's non-writable segment that pagemap says are
                // file pages or absent: dropping them changes no content (see above).
                if unsafe { libc::madvise(p as *mut libc::c_void, len, libc::MADV_DONTNEED) } == 0 {
                    released += len as u64;
                }
            }
            at += pages * PAGE;
        }
    }
    released
}

/// Drops the clean resident pages of every loaded module's unwind tables, where that is
/// safe to ask (no seccomp filter; `/proc/self/pagemap` readable). Returns the bytes
/// given back (an upper bound, as `release`).
pub fn release_all() -> u64 {
    let _errno = super::ErrnoGuard::save();
    if !super::procfs::unfiltered_now() {
        return 0;
    }
    let Ok(fd) = super::anchor::open_proc("self/pagemap", libc::O_RDONLY) else { return 0 };
    let released = release(&ranges(), fd);
    // SAFETY: the descriptor opened just above.
    unsafe { libc::close(fd) };
    // And what the unwinder read through its own views of the tables that stay.
    super::unwind_view::release();
    released
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ph(p_type: u32, p_flags: u32, p_vaddr: u64, p_memsz: u64) -> libc::Elf64_Phdr {
        libc::Elf64_Phdr { p_type, p_flags, p_offset: p_vaddr, p_vaddr, p_paddr: p_vaddr, p_filesz: p_memsz, p_memsz, p_align: 4096 }
    }

    const R: u32 = 4;
    const RX: u32 = 5;
    const RW: u32 = 6;

    #[test]
    fn the_range_runs_from_the_tables_to_the_end_of_their_read_only_segment() {
        let phdrs = [
            ph(libc::PT_LOAD, RX, 0, 0x50000),
            ph(libc::PT_LOAD, R, 0x50000, 0x20000),
            ph(libc::PT_LOAD, RW, 0x71000, 0x3000),
            ph(libc::PT_GNU_EH_FRAME, R, 0x52345, 0x100),
            ph(libc::PT_GNU_RELRO, R, 0x71000, 0x1000),
        ];
        // .eh_frame after its header (pcrel sdata4 pointer to 0x52500).
        let words = |a: usize| match a - 0x1000_0000 {
            0x52345 => Some(1 | (0x1b << 8)),
            0x52349 => Some((0x52500u32).wrapping_sub(0x52349)),
            _ => None,
        };
        let r = module_range(0x1000_0000, &phdrs, false, words).unwrap();
        assert_eq!(r, Range { start: 0x1005_2000, end: 0x1007_0000 });
        // .eh_frame before its header: the range starts there.
        let before = |a: usize| match a - 0x1000_0000 {
            0x52345 => Some(1 | (0x1b << 8)),
            0x52349 => Some((0x51000u32).wrapping_sub(0x52349)),
            _ => None,
        };
        assert_eq!(module_range(0x1000_0000, &phdrs, false, before).unwrap().start, 0x1005_1000);
        // Text relocations, or tables in a writable segment: nothing.
        assert_eq!(module_range(0x1000_0000, &phdrs, true, words), None);
        let writable = [ph(libc::PT_LOAD, RW, 0x50000, 0x20000), ph(libc::PT_GNU_EH_FRAME, R, 0x52345, 0x100)];
        assert_eq!(module_range(0, &writable, false, |_| None), None);
        // A RELRO region inside the segment ends the range before it; one over the
        // tables, none at all.
        let relro = [ph(libc::PT_LOAD, R, 0x50000, 0x20000), ph(libc::PT_GNU_EH_FRAME, R, 0x52345, 0x100), ph(libc::PT_GNU_RELRO, R, 0x60000, 0x10000)];
        assert_eq!(module_range(0, &relro, false, |_| None), Some(Range { start: 0x52000, end: 0x60000 }));
        let over = [ph(libc::PT_LOAD, R, 0x50000, 0x20000), ph(libc::PT_GNU_EH_FRAME, R, 0x52345, 0x100), ph(libc::PT_GNU_RELRO, R, 0x50000, 0x10000)];
        assert_eq!(module_range(0, &over, false, |_| None), None);
        // No unwind tables.
        assert_eq!(module_range(0, &phdrs[..3], false, |_| None), None);
    }

    #[test]
    fn text_relocations_are_found_in_either_form() {
        assert!(has_textrel([(1, 5), (DT_TEXTREL, 0), (0, 0)].into_iter()));
        assert!(has_textrel([(DT_FLAGS, DF_TEXTREL | 8), (0, 0)].into_iter()));
        assert!(!has_textrel([(DT_FLAGS, 8), (0, 0), (DT_TEXTREL, 0)].into_iter()));
    }

    #[test]
    fn runs_skip_anonymous_and_swapped_pages_and_need_a_present_page() {
        use super::super::pagemap::{FILE_OR_SHARED, SWAPPED};
        let (file, anon, none, swap) = (PRESENT | FILE_OR_SHARED, PRESENT, 0, SWAPPED);
        assert_eq!(droppable_runs(&[file, file, anon, none, file, swap, none, none]), vec![(0, 2), (3, 5)]);
        assert_eq!(droppable_runs(&[none, none]), vec![]);
        assert_eq!(droppable_runs(&[none, file, none]), vec![(0, 3)]);
    }

    /// A private file mapping: pages only read are dropped (and read back the same),
    /// a page written (copy-on-write) keeps what was written.
    #[test]
    fn clean_file_pages_are_dropped_and_written_ones_kept() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("leaktrace-unwind-tables-{}", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        let data: Vec<u8> = (0..16 * PAGE).map(|i| (i / PAGE) as u8 + 1).collect();
        f.write_all(&data).unwrap();
        drop(f);
        let f = std::fs::File::open(&path).unwrap();
        let len = 16 * PAGE;
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh private mapping of the file, unmapped below.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, f.as_raw_fd(), 0) } as usize;
        assert_ne!(p as *mut libc::c_void, libc::MAP_FAILED);
        // SAFETY: reads and one write inside the mapping.
        unsafe {
            for k in 0..16 {
                std::ptr::read_volatile((p + k * PAGE) as *const u8);
            }
            *((p + 5 * PAGE) as *mut u8) = 0xee;
        }
        // Mapped pages by pagemap (`mincore` tells the page cache's for a file mapping).
        let pagemap = std::fs::File::open("/proc/self/pagemap").unwrap();
        let present = || {
            let mut e = [0u64; 16];
            assert!(super::super::pagemap::read(pagemap.as_raw_fd(), (p / PAGE) as u64, &mut e));
            e.iter().filter(|&&e| e & PRESENT != 0).count()
        };
        assert_eq!(present(), 16);
        let released = release(&[Range { start: p, end: p + len }], pagemap.as_raw_fd());
        assert_eq!(released, 15 * PAGE as u64);
        assert_eq!(present(), 1, "the written page stays");
        // SAFETY: reads inside the mapping.
        unsafe {
            assert_eq!(*((p + 5 * PAGE) as *const u8), 0xee);
            for k in [0usize, 4, 6, 15] {
                assert_eq!(*((p + k * PAGE + 7) as *const u8), k as u8 + 1);
            }
            libc::munmap(p as *mut libc::c_void, len);
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn this_process_has_ranges_and_they_can_be_released() {
        let ranges = ranges();
        assert!(!ranges.is_empty(), "libc and the test binary have unwind tables");
        assert!(ranges.iter().all(|r| r.start < r.end && r.start % PAGE == 0));
        release_all();
        // The tables still read as before (the unwinder faults them in again).
        let trace = std::backtrace::Backtrace::force_capture().to_string();
        assert!(trace.contains("this_process_has_ranges"), "{trace}");
    }
}
