//! `/proc/self/pagemap`: one 64-bit entry per virtual page, read by the scan (which
//! pages a program wrote), by the release of the unwind tables (which pages are still
//! the file's) and by the measure of our file mappings (which pages are mapped).

/// The page is mapped.
pub const PRESENT: u64 = 1 << 63;
/// The page is swapped out.
pub const SWAPPED: u64 = 1 << 62;
/// The page is a file page or shared anonymous memory.
pub const FILE_OR_SHARED: u64 = 1 << 61;
/// The page is mapped by this process alone.
pub const EXCLUSIVE: u64 = 1 << 56;

/// Whether a page with entry `entry` is one the process wrote: present and anonymous (a
/// private file page copied on write, or anonymous memory), or swapped out.
pub fn page_written(entry: u64) -> bool {
    (entry & PRESENT != 0 && entry & FILE_OR_SHARED == 0) || entry & SWAPPED != 0
}

/// Reads the entries of `out.len()` pages from page `first_page` on through `fd` (the
/// page map's descriptor); false unless all of them were read.
pub fn read(fd: i32, first_page: u64, out: &mut [u64]) -> bool {
    if fd < 0 {
        return false;
    }
    // SAFETY: reads at most `out.len()` entries into `out`, from the entry of `first_page`.
    let got = unsafe { libc::pread(fd, out.as_mut_ptr() as *mut libc::c_void, out.len() * 8, (first_page * 8) as libc::off_t) };
    got == (out.len() * 8) as isize
}
