//! A file that holds the written, never-again-written head of an append-only arena of
//! ours, so that the kernel can keep it out of the process's memory.
//!
//! The stack table's frame arena only grows (`hotpath::stacks`): a stack's frames are
//! written once and then only read — to compare a stack interned again, and to
//! symbolize a report. After `import torch` it holds 44 MB, most of it never read again.
//! Copied to a file and mapped from it (`MAP_SHARED`, same addresses, same bytes), those
//! pages become the page cache's: counted in the process's RSS only while mapped, given
//! back with `MADV_DONTNEED` at no loss, written back to disk and evicted under memory
//! pressure instead of pushing the program towards the OOM killer — as heaptrack and
//! memray keep their data in files.
//!
//! The file is unnamed (`O_TMPFILE`) in `$TMPDIR`, `/var/tmp` or `/tmp`, the first on a
//! disk (a tmpfs keeps its pages in memory: no gain), so nothing is left behind. Its
//! blocks are allocated (`fallocate`) before any page of it is mapped: a page of a
//! shared file mapping with no block behind it is a SIGBUS when the disk is full. Not
//! under a file size limit (exceeding it is SIGXFSZ). A forked child never writes to its
//! parent's file: it makes its own (`Spill::file`).

use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

/// The unit of the file's writes (see `spill`).
const PAGE: usize = 4096;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

/// One spill file, made on first use by the process that uses it.
pub struct Spill {
    fd: AtomicI32,
    /// The process that made `fd` (a forked child inherits the descriptor, not the file).
    pid: AtomicU32,
    dev: AtomicU64,
    ino: AtomicU64,
    /// Set once making or writing the file failed: never tried again.
    failed: AtomicU32,
}

impl Spill {
    pub const fn new() -> Spill {
        Spill { fd: AtomicI32::new(-1), pid: AtomicU32::new(0), dev: AtomicU64::new(0), ino: AtomicU64::new(0), failed: AtomicU32::new(0) }
    }

    /// This process's file (made now if need be), or None.
    fn file(&self) -> Option<i32> {
        let pid = std::process::id();
        let fd = self.fd.load(Ordering::Acquire);
        let ours = fd >= 0 && super::fds::identity(fd) == Some((self.dev.load(Ordering::Relaxed), self.ino.load(Ordering::Relaxed)));
        if ours && self.pid.load(Ordering::Relaxed) == pid {
            return Some(fd);
        }
        if self.failed.load(Ordering::Relaxed) == pid {
            return None;
        }
        if ours {
            // The parent's, inherited: closed here, the parent keeps its own.
            // SAFETY: checked to be the descriptor we opened.
            unsafe { libc::close(fd) };
        }
        self.fd.store(-1, Ordering::Release);
        let Some(fd) = make_file() else {
            self.failed.store(pid, Ordering::Relaxed);
            return None;
        };
        let Some((dev, ino)) = super::fds::identity(fd) else {
            // SAFETY: the descriptor made just above.
            unsafe { libc::close(fd) };
            self.failed.store(pid, Ordering::Relaxed);
            return None;
        };
        self.dev.store(dev, Ordering::Relaxed);
        self.ino.store(ino, Ordering::Relaxed);
        self.pid.store(pid, Ordering::Relaxed);
        self.fd.store(fd, Ordering::Release);
        Some(fd)
    }

    /// The bytes of disk (and page cache) this process's own file holds: a forked child
    /// maps its parent's file but counts only the one it made, whose blocks start where
    /// the parent's spill had come to (the file is sparse below). 0 without one.
    pub fn own_bytes(&self) -> u64 {
        let _errno = super::ErrnoGuard::save();
        let fd = self.fd.load(Ordering::Acquire);
        if fd < 0 || self.pid.load(Ordering::Relaxed) != std::process::id() {
            return 0;
        }
        match super::fds::stat(fd) {
            Some(st) if (st.st_dev, st.st_ino) == (self.dev.load(Ordering::Relaxed), self.ino.load(Ordering::Relaxed)) => st.st_blocks as u64 * 512,
            _ => 0,
        }
    }

    /// Moves `[from, to)` of the arena at `base` to the file (page-aligned offsets, the
    /// arena's offsets): blocks allocated, bytes copied, then the same addresses mapped
    /// from the file over the anonymous pages. The range must be written and never be
    /// written again; readers may read it meanwhile (the mapping is replaced with the
    /// same bytes at once, under the kernel's lock of the address space). Only without
    /// a seccomp filter (the caller checks). Returns false, and never tries again in
    /// this process, when any step fails (the arena is then as it was).
    ///
    /// # Safety
    /// `[base + from, base + to)` must be a private anonymous mapping of the caller's,
    /// written and never written again.
    pub unsafe fn spill(&self, base: *mut u8, from: usize, to: usize) -> bool {
        let _errno = super::ErrnoGuard::save();
        debug_assert!(from.is_multiple_of(PAGE) && to.is_multiple_of(PAGE) && from <= to);
        if from >= to {
            return true;
        }
        let Some(fd) = self.file() else { return false };
        let fail = || {
            self.failed.store(std::process::id(), Ordering::Relaxed);
            false
        };
        let len = to - from;
        // SAFETY: our descriptor; a range of the file.
        if unsafe { libc::fallocate(fd, 0, from as libc::off_t, len as libc::off_t) } != 0 {
            return fail();
        }
        // Page by page: a write makes page-cache folios as large as itself (ext4 and xfs
        // since Linux 6.x), and a read fault of a shared file mapping maps the whole
        // folio: one stack read after a 16 MB write had mapped 2 MB. From pages of one,
        // a read fault maps its page and the 15 around it that are cached.
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(PAGE);
            // SAFETY: reads [from + done, from + done + chunk) of the arena (written, see
            // above) into the file.
            let n = unsafe { libc::pwrite(fd, base.add(from + done) as *const libc::c_void, chunk, (from + done) as libc::off_t) };
            if n <= 0 {
                return fail();
            }
            done += n as usize;
        }
        // SAFETY: replaces [from, to) of our own arena with the file's copy of the same
        // bytes; its blocks are allocated (no SIGBUS), and it stays mapped for good.
        let p = unsafe {
            libc::mmap(
                base.add(from) as *mut libc::c_void,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd,
                from as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            // MAP_FIXED fails before it unmaps anything (bad arguments, no memory for
            // the mapping): the anonymous pages are still there.
            return fail();
        }
        // Reads of it are scattered (a record, a stack's frames): no read-ahead.
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(p, len, libc::MADV_RANDOM) };
        true
    }
}

impl Default for Spill {
    fn default() -> Spill {
        Spill::new()
    }
}

/// `$TMPDIR` as the library's constructor found it (`note_tmpdir`).
static TMPDIR: std::sync::OnceLock<Option<std::ffi::OsString>> = std::sync::OnceLock::new();

/// Notes `$TMPDIR` for the spill files: called from the library's constructor, as the
/// configuration is read; the collector thread, which makes the files, never reads the
/// environment (the program may `setenv` meanwhile).
pub fn note_tmpdir() {
    let _ = TMPDIR.set(std::env::var_os("TMPDIR").filter(|d| !d.is_empty()));
}

/// An unnamed file on a disk, its descriptor high and close-on-exec; None where no
/// candidate directory takes one or a file size limit is set.
fn make_file() -> Option<i32> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: writes the limit into `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut limit) } != 0 || limit.rlim_cur != libc::RLIM_INFINITY {
        return None;
    }
    let tmpdir = TMPDIR.get().cloned().flatten();
    let dirs = tmpdir.iter().map(std::path::PathBuf::from).chain(["/var/tmp", "/tmp"].map(std::path::PathBuf::from));
    for dir in dirs {
        let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { continue };
        // SAFETY: NUL-terminated path; the descriptor is ours.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC, 0o600) };
        if fd < 0 {
            continue;
        }
        let mut fs = std::mem::MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs writes the struct on success.
        let in_memory = unsafe { libc::fstatfs(fd, fs.as_mut_ptr()) } != 0 || {
            // SAFETY: initialised by the successful call.
            let t = unsafe { fs.assume_init() }.f_type;
            t == TMPFS_MAGIC || t == RAMFS_MAGIC
        };
        if in_memory {
            // SAFETY: the descriptor opened just above.
            unsafe { libc::close(fd) };
            continue;
        }
        // SAFETY: duplicating our own descriptor high, then closing the original.
        let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, super::anchor::HIGH_FD) };
        // SAFETY: as above.
        unsafe { libc::close(fd) };
        if high >= 0 {
            return Some(high);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_skip::skip_not_here;

    /// A spilled range reads the same, is a file mapping afterwards (not resident once
    /// given back), and the arena past it is still anonymous and writable.
    #[test]
    fn a_spilled_range_reads_the_same_and_can_be_given_back() {
        let len = 64 << 12;
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let base =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) } as *mut u8;
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        // SAFETY: writes inside the mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), base, len) };
        let spill = Spill::new();
        if spill.file().is_none() {
            skip_not_here("no directory on a disk takes an unnamed file (O_TMPFILE) here");
            return;
        }
        assert_eq!(spill.own_bytes(), 0);
        // SAFETY: the head of the mapping above, written, never written again.
        unsafe {
            assert!(spill.spill(base, 0, 32 << 12));
            assert!(spill.spill(base, 32 << 12, 48 << 12));
        }
        // The file's size counts (whole blocks: at least the bytes spilled).
        assert!((48 << 12..=(48 << 12) + (64 << 10)).contains(&spill.own_bytes()), "{}", spill.own_bytes());
        // SAFETY: reads inside the mapping.
        let now = unsafe { std::slice::from_raw_parts(base, len) };
        assert!(now == &bytes[..], "the same bytes after the spill");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps.lines().find(|l| l.starts_with(&format!("{:x}-", base as usize))).unwrap().to_string();
        assert!(line.contains(" rw-s "), "a shared file mapping now: {line}");
        // SAFETY: gives back the spilled pages; then reads and writes inside the mapping.
        unsafe {
            assert_eq!(libc::madvise(base as *mut libc::c_void, 48 << 12, libc::MADV_DONTNEED), 0);
            assert_eq!(std::slice::from_raw_parts(base, len), &bytes[..], "read back from the file");
            *base.add(60 << 12) = 1;
            libc::munmap(base as *mut libc::c_void, len);
        }
    }

    /// A read of one spilled page maps that page and at most the 15 around it (the
    /// kernel's fault-around), not the whole of a large page-cache folio: written in one
    /// call, 8 MiB had become 2 MiB folios, and one read mapped 2 MiB.
    #[test]
    fn a_read_of_a_spilled_page_maps_no_more_than_its_neighbours() {
        const HUGE: usize = 2 << 20;
        let len = 8 << 20;
        // SAFETY: a fresh private anonymous mapping, unmapped below.
        let raw = unsafe { libc::mmap(std::ptr::null_mut(), len + HUGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) }
            as usize;
        // Aligned as the stack table's arenas are (a folio maps whole only where aligned).
        let base = ((raw + HUGE - 1) & !(HUGE - 1)) as *mut u8;
        // SAFETY: writes inside the mapping.
        unsafe { std::ptr::write_bytes(base, 0x5a, len) };
        let spill = Spill::new();
        if spill.file().is_none() {
            skip_not_here("no directory on a disk takes an unnamed file (O_TMPFILE) here");
            return;
        }
        let pagemap = super::super::anchor::open_proc("self/pagemap", libc::O_RDONLY).expect("/proc/self/pagemap");
        // SAFETY: the range above, written, never written again; then advice on it and
        // one read inside it.
        let value = unsafe {
            assert!(spill.spill(base, 0, len));
            assert_eq!(libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTNEED), 0);
            std::ptr::read_volatile(base.add(len / 2 + 100))
        };
        assert_eq!(value, 0x5a);
        let mapped = super::super::own::mapped_pages(pagemap, base as usize, len) as usize / PAGE;
        // SAFETY: our descriptor and mapping.
        unsafe {
            libc::close(pagemap);
            libc::munmap(raw as *mut libc::c_void, len + HUGE);
        }
        assert!((1..=16).contains(&mapped), "one read mapped {mapped} pages");
    }

    #[test]
    fn a_forked_child_makes_its_own_file() {
        let spill = Spill::new();
        let Some(fd) = spill.file() else {
            skip_not_here("no directory on a disk takes an unnamed file (O_TMPFILE) here");
            return;
        };
        let parents = super::super::fds::identity(fd).unwrap();
        // The parent keeps its file open (here: a copy of the descriptor).
        // SAFETY: duplicates a descriptor of ours; closed below.
        let parent_copy = unsafe { libc::dup(fd) };
        // As a child sees it: the descriptor is its parent's, whose file it does not count.
        spill.pid.store(1, Ordering::Relaxed);
        assert_eq!(spill.own_bytes(), 0);
        let again = spill.file().unwrap();
        assert!(again >= super::super::anchor::HIGH_FD);
        let own = super::super::fds::identity(again).unwrap();
        assert_ne!(own, parents, "a file of its own");
        assert_eq!((spill.dev.load(Ordering::Relaxed), spill.ino.load(Ordering::Relaxed)), own);
        // The parent's descriptor was closed here (its number may have been reused since).
        assert_ne!(super::super::fds::identity(fd), Some(parents));
        // SAFETY: the copy made above.
        unsafe { libc::close(parent_copy) };
    }
}
