//! Operating-system utilities that belong to no stage: the calling thread's stack, the
//! library's own threads (started with every signal blocked), signal dispositions, the
//! loader's module list and the modules' own symbol tables, a spin lock, and the files
//! the program may move under us (standard error, `/proc` and the report directory
//! across `chroot`), the program's unwind tables' pages, a file for an arena's written head,
//! copies of the process's own memory that never fault, and the constructor's arguments. Nothing here imports from the stages.
pub mod anchor;
pub mod elf;
pub mod environ;
pub mod fds;
pub mod image;
pub mod loader;
pub mod lock;
pub mod mapped;
pub mod own;
pub mod own_heap;
pub mod pagemap;
pub mod procfs;
pub mod signals;
pub mod spill;
pub mod stack;
pub mod startup;
pub mod threads;
pub mod unwind_tables;
pub mod unwind_view;

/// Types that any bytes are a valid value of: what `copy_own` may write into.
pub trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u32 {}
impl Plain for u64 {}

/// This process's own memory read through `/proc/self/mem`: as `copy_own`, a read of a
/// page that is not mapped fails or comes short instead of faulting, but without
/// `process_vm_readv`'s pinning of each page, which in a forked child costs 2.5-3x what
/// it costs in the parent for memory still shared with it (docs/benchmarks.md, fifteenth
/// round), where `/proc/self/mem` costs the same in both. Unlike `copy_own` it reads a
/// page mapped without read access (`PROT_NONE`) too. Opened by the process that reads:
/// a descriptor inherited across fork reads the parent's memory. Not under a seccomp
/// filter, as `copy_own`.
pub struct OwnMemory {
    fd: i32,
    id: (u64, u64),
}

impl OwnMemory {
    pub fn open() -> Option<OwnMemory> {
        let fd = anchor::open_proc("self/mem", libc::O_RDONLY).ok()?;
        match fds::identity(fd) {
            Some(id) => Some(OwnMemory { fd, id }),
            None => {
                // SAFETY: the descriptor opened just above, ours alone.
                unsafe { libc::close(fd) };
                None
            }
        }
    }

    /// Copies `buf` from `from`; returns how many bytes came, from the start.
    pub fn copy<T: Plain>(&self, from: u64, buf: &mut [T]) -> usize {
        let Ok(offset) = libc::off_t::try_from(from) else { return 0 };
        let len = std::mem::size_of_val(buf);
        // SAFETY: writes at most `len` bytes, `buf`'s own, of a type any bytes are a value
        // of (`Plain`); the kernel checks the range and fails rather than faulting.
        let n = unsafe { libc::pread(self.fd, buf.as_mut_ptr() as *mut libc::c_void, len, offset) };
        n.max(0) as usize
    }

    /// Whether the descriptor is still the file opened: a thread of the program may close
    /// it and open another on its number meanwhile. Reads made before a `false` are not
    /// to be trusted.
    pub fn still_open(&self) -> bool {
        fds::identity(self.fd) == Some(self.id)
    }
}

impl Drop for OwnMemory {
    fn drop(&mut self) {
        if self.still_open() {
            // SAFETY: our descriptor (checked: not one the program opened on its number).
            unsafe { libc::close(self.fd) };
        }
    }
}

/// Copies `buf` from this process's own memory at `from` with `process_vm_readv`, which
/// fails, or stops at the first page that is not mapped, instead of faulting: memory the
/// program may unmap or free meanwhile. Returns how many bytes came, from the start. Not
/// under a seccomp filter, which may answer the call with SIGSYS
/// (`procfs::unfiltered_now`).
pub fn copy_own<T: Plain>(from: u64, buf: &mut [T]) -> usize {
    let len = std::mem::size_of_val(buf);
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut std::ffi::c_void, iov_len: len };
    let remote = libc::iovec { iov_base: from as *mut std::ffi::c_void, iov_len: len };
    // SAFETY: writes at most `len` bytes, `buf`'s own, of a type any bytes are a value of
    // (`Plain`); the kernel checks the remote range and fails rather than faulting.
    let n = unsafe { libc::process_vm_readv(image::own_pid(), &local, 1, &remote, 1, 0) };
    n.max(0) as usize
}

/// The words at `addrs` (each 8-byte aligned) of this process's own memory, as
/// `copy_own` reads them, in as few system calls as the kernel allows
/// (`copy_own_ranges`, a word a range); one that is not mapped is `None`.
pub fn copy_own_words(addrs: &[u64]) -> Vec<Option<u64>> {
    let ranges: Vec<(u64, usize)> = addrs.iter().map(|&a| (a, 1)).collect();
    let mut values = vec![0u64; addrs.len()];
    let got = copy_own_ranges(&ranges, &mut values);
    got.iter().zip(values).map(|(&n, v)| (n == 1).then_some(v)).collect()
}

/// Copies each of `ranges` (`(address, words)`) of this process's own memory into `buf`,
/// one after another from its start, as `copy_own` would copy each alone, in as few
/// system calls as the kernel allows (one `process_vm_readv` takes up to 1,024 ranges);
/// returns how many whole words of each came, from its start. A call stops at the first
/// range it cannot read whole; that range is then copied alone (what `copy_own` gives
/// it) and the next call starts after it. Ranges past `buf`'s end get nothing.
pub fn copy_own_ranges(ranges: &[(u64, usize)], buf: &mut [u64]) -> Vec<usize> {
    const MAX_IOV: usize = 1024;
    let mut got = vec![0; ranges.len()];
    // Where each range goes in `buf`: those that fit, in order.
    let mut offsets = Vec::with_capacity(ranges.len() + 1);
    offsets.push(0usize);
    for &(_, words) in ranges {
        let end = offsets[offsets.len() - 1] + words;
        if end > buf.len() {
            break;
        }
        offsets.push(end);
    }
    let fit = offsets.len() - 1;
    let mut at = 0;
    while at < fit {
        let end = (at + MAX_IOV).min(fit);
        let remote: Vec<libc::iovec> =
            ranges[at..end].iter().map(|&(a, words)| libc::iovec { iov_base: a as *mut std::ffi::c_void, iov_len: words * 8 }).collect();
        let local = libc::iovec { iov_base: buf[offsets[at]..].as_mut_ptr() as *mut std::ffi::c_void, iov_len: (offsets[end] - offsets[at]) * 8 };
        // SAFETY: writes at most `offsets[end] - offsets[at]` words, inside `buf` (each
        // offset was checked against its length above); the kernel checks each remote
        // range and stops at the first it cannot read instead of faulting.
        let n = unsafe { libc::process_vm_readv(image::own_pid(), &local, 1, remote.as_ptr(), remote.len() as libc::c_ulong, 0) };
        let mut left = n.max(0) as usize;
        let mut k = at;
        while k < end && left >= ranges[k].1 * 8 {
            got[k] = ranges[k].1;
            left -= ranges[k].1 * 8;
            k += 1;
        }
        if k < end {
            // The range the call stopped in: alone, as `copy_own` reads it.
            got[k] = copy_own(ranges[k].0, &mut buf[offsets[k]..offsets[k + 1]]) / 8;
            k += 1;
        }
        at = k;
    }
    got
}

/// The whole of `fd` from offset 0, a page at a time (`pread`: a descriptor held and
/// read again, as `/proc/self/status`, needs no seek). A `/proc` file has no size to ask
/// for, and the standard library's probing reads (32 bytes, then doubling) took nine
/// calls for a small process's maps; every short process reads some at its start and
/// its exit.
pub fn read_whole(fd: i32) -> std::io::Result<Vec<u8>> {
    read_until_end(fd, 4096, false)
}

/// `read_whole` of a `/proc` file made by one `show` (`/proc/self/status`,
/// `smaps_rollup`): the kernel makes its text whole at each read and hands out as much
/// as the buffer takes, so a read that leaves the buffer short is the end. The read
/// that would return 0 made the whole text again (~9 us for `status` here, at every
/// report and every process's exit).
pub fn read_single_record(fd: i32) -> std::io::Result<Vec<u8>> {
    read_until_end(fd, 8192, true)
}

fn read_until_end(fd: i32, first: usize, short_is_end: bool) -> std::io::Result<Vec<u8>> {
    let mut out: Vec<u8> = Vec::with_capacity(first);
    loop {
        if out.capacity() - out.len() < 1024 {
            out.reserve(out.capacity());
        }
        let spare = out.spare_capacity_mut();
        let wanted = spare.len();
        // SAFETY: reads at most `spare.len()` bytes into the vector's spare capacity.
        let n = unsafe { libc::pread(fd, spare.as_mut_ptr() as *mut libc::c_void, spare.len(), out.len() as libc::off_t) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Ok(out);
        }
        let short = (n as usize) < wanted;
        // SAFETY: the kernel wrote `n` bytes there.
        unsafe { out.set_len(out.len() + n as usize) };
        if short && short_is_end {
            return Ok(out);
        }
    }
}

/// Saves errno and puts it back when dropped: the program sees exactly what it (or the
/// real function a hook forwarded to) left there, whatever our bookkeeping did to it.
pub struct ErrnoGuard(i32);

impl ErrnoGuard {
    #[inline(always)]
    pub fn save() -> ErrnoGuard {
        // SAFETY: __errno_location always returns this thread's valid errno slot.
        ErrnoGuard(unsafe { *libc::__errno_location() })
    }
}

impl Drop for ErrnoGuard {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { *libc::__errno_location() = self.0 };
    }
}

/// This thread's errno now.
pub fn errno() -> i32 {
    // SAFETY: __errno_location always returns this thread's valid errno slot.
    unsafe { *libc::__errno_location() }
}

/// The CPU time this thread has taken, in nanoseconds (0 where the clock fails).
pub fn thread_cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec to write; the clock id is a constant of the kernel's.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_threads_cpu_time_grows_as_it_works() {
        let before = super::thread_cpu_ns();
        let mut x = 0u64;
        while super::thread_cpu_ns() < before + 2_000_000 {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        assert!(super::thread_cpu_ns() >= before + 2_000_000 && x > 0);
    }

    #[test]
    fn a_proc_text_of_one_record_is_read_whole_in_one_read() {
        use std::os::fd::AsRawFd;
        let keys = |t: &[u8]| String::from_utf8_lossy(t).lines().map(|l| l.split(':').next().unwrap_or("").to_string()).collect::<Vec<_>>();
        let f = std::fs::File::open("/proc/self/status").unwrap();
        let one = super::read_single_record(f.as_raw_fd()).unwrap();
        let whole = super::read_whole(f.as_raw_fd()).unwrap();
        // The values move between the reads; the lines are the same ones, the last whole.
        assert_eq!(keys(&one), keys(&whole));
        assert!(one.ends_with(b"\n") && keys(&one).len() > 20, "{}", String::from_utf8_lossy(&one));
        // A text longer than the first buffer is read on while reads come back full.
        let path = std::env::temp_dir().join(format!("leaktrace-record-{}", std::process::id()));
        let text: Vec<u8> = (0..20_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(&path, &text).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        assert_eq!(super::read_single_record(f.as_raw_fd()).unwrap(), text);
        let _ = std::fs::remove_file(&path);
    }

    /// `OwnMemory` reads what `copy_own` reads, up to a page that is not mapped, and the
    /// calling process's own memory in a forked child.
    #[test]
    fn own_memory_reads_what_copy_own_reads_and_stops_at_an_unmapped_page() {
        let data: Vec<u64> = (0..5000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        let mem = super::OwnMemory::open().expect("/proc/self/mem");
        let (mut a, mut b) = (vec![0u64; 4000], vec![0u64; 4000]);
        let from = data.as_ptr() as u64 + 8 * 999;
        assert_eq!(mem.copy(from, &mut a), 32000);
        assert_eq!(super::copy_own(from, &mut b), 32000);
        assert_eq!(a, b);
        assert_eq!(a[..], data[999..4999]);
        // SAFETY: two fresh pages, the second unmapped again: a read across them stops at
        // its start. Kept out of reach of other tests' mappings by staying reserved below.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            *(p as *mut u64) = 7;
            libc::munmap((p as *mut u8).add(4096) as *mut libc::c_void, 4096);
            let mut buf = vec![0u8; 8192];
            let got = mem.copy(p as u64, &mut buf);
            assert_eq!(got, 4096);
            assert_eq!(buf[0], 7);
            assert_eq!(mem.copy((p as u64) + 4096, &mut buf[..8]), 0);
            libc::munmap(p, 4096);
        }
        assert!(mem.still_open());
        // A child reads its own memory, which it changed after the fork, through a file
        // it opened; the parent's descriptor would read the parent's.
        let mut value: u64 = 1;
        let at = &mut value as *mut u64 as u64;
        // SAFETY: the child only reads, writes its own copy of `value` and leaves with `_exit`.
        unsafe {
            let pid = libc::fork();
            assert!(pid >= 0);
            if pid == 0 {
                std::ptr::write_volatile(at as *mut u64, 2);
                let mut own = [0u64; 1];
                let mut parents = [0u64; 1];
                let ok = super::OwnMemory::open().is_some_and(|m| m.copy(at, &mut own) == 8) && mem.copy(at, &mut parents) == 8;
                libc::_exit(if ok && own[0] == 2 && parents[0] == 1 { 0 } else { 1 });
            }
            let mut status = 0;
            assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "status {status:#x}");
        }
        assert_eq!(std::hint::black_box(value), 1);
    }

    #[test]
    fn ranges_are_read_as_each_alone_would_be_with_an_unreadable_one_anywhere() {
        let data: Vec<u64> = (0..6000u64).map(|i| i * 13 + 5).collect();
        // SAFETY: two fresh pages, the second unreadable, kept mapped until the end.
        let page = unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 8192, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            assert_eq!(libc::mprotect((p as usize + 4096) as *mut libc::c_void, 4096, libc::PROT_NONE), 0);
            std::ptr::write_bytes(p as *mut u8, 0x5a, 4096);
            p as u64
        };
        let at = |i: usize| data.as_ptr() as u64 + 8 * i as u64;
        // More than one call's worth (1,024 ranges), of 0 to 6 words; among them one that
        // runs into the unreadable page (2 words come), and ones wholly in it.
        let mut ranges: Vec<(u64, usize)> = (0..2600).map(|i| (at((i * 7) % 5990), i % 7)).collect();
        ranges.insert(0, (page + 4096, 2));
        ranges.insert(900, (page + 4096 - 16, 4));
        ranges.insert(2000, (page + 4096 + 64, 1));
        ranges.push((page + 4096 - 8, 3));
        let words: usize = ranges.iter().map(|r| r.1).sum();
        let mut buf = vec![0u64; words];
        let got = super::copy_own_ranges(&ranges, &mut buf);
        let mut off = 0;
        for (k, &(a, n)) in ranges.iter().enumerate() {
            let mut alone = vec![0u64; n];
            let want = super::copy_own(a, &mut alone) / 8;
            assert_eq!(got[k], want, "range {k}");
            assert_eq!(&buf[off..off + want], &alone[..want], "range {k}");
            off += n;
        }
        assert_eq!(got[900], 2);
        // Ranges past the buffer's end get nothing.
        let mut small = vec![0u64; 5];
        assert_eq!(super::copy_own_ranges(&[(at(0), 3), (at(10), 3), (at(20), 2)], &mut small), vec![3, 0, 0]);
        assert!(super::copy_own_ranges(&[], &mut small).is_empty());
        // SAFETY: the pages mapped above.
        unsafe { libc::munmap(page as *mut libc::c_void, 8192) };
    }

    #[test]
    fn words_are_read_in_one_call_and_an_unmapped_one_is_skipped_not_the_rest() {
        let data: Vec<u64> = (0..3000u64).map(|i| i * 7 + 1).collect();
        // SAFETY: one fresh page that nothing may read, kept mapped until the end (an
        // unmapped one could be mapped again meanwhile by another test's thread).
        let gone = unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            p as u64
        };
        let at = |i: usize| data.as_ptr() as u64 + 8 * i as u64;
        // More than one call's worth (1,024), with unreadable words first, inside and last.
        let mut addrs: Vec<u64> = vec![gone];
        addrs.extend((0..2500).map(|i| at(i % 3000)));
        addrs.insert(1500, gone + 8);
        addrs.push(gone + 16);
        let got = super::copy_own_words(&addrs);
        assert_eq!(got.len(), addrs.len());
        for (k, (&a, v)) in addrs.iter().zip(&got).enumerate() {
            if a >= gone && a < gone + 4096 {
                assert_eq!(*v, None, "word {k}");
            } else {
                // SAFETY: an address inside `data`.
                assert_eq!(*v, Some(unsafe { *(a as *const u64) }), "word {k}");
            }
        }
        assert!(super::copy_own_words(&[]).is_empty());
        // SAFETY: the page mapped above.
        unsafe { libc::munmap(gone as *mut libc::c_void, 4096) };
    }
}
