//! Anonymous memory for the hot path's tables and rings: zero-filled, never touching
//! the allocator the library interposes.
use std::sync::atomic::{AtomicBool, Ordering};

pub use crate::os::own::Part;

/// Maps `bytes` of zeroed, private, read-write memory (reserved lazily: untouched pages
/// cost nothing). Returns `None` when the kernel refuses.
pub fn map_zeroed(bytes: usize, part: Part) -> Option<*mut u8> {
    // SAFETY: an anonymous private mapping has no preconditions; failure is checked.
    let p = unsafe {
        libc::syscall(
            libc::SYS_mmap,
            std::ptr::null_mut::<libc::c_void>(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        ) as *mut libc::c_void
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    crate::os::own::mapped(p as usize, bytes, part);
    Some(p as *mut u8)
}

/// A page.
pub const PAGE: usize = 4096;
/// The library's own heap allocations from this size on are mappings of their own
/// (`interpose::malloc::RealAllocator`): glibc's own threshold for mmapped chunks, until
/// it raises it for the program's frees.
pub const OWN_MAPPING_MIN: usize = 128 << 10;

/// A buffer of the library's own heap (`RealAllocator`): zeroed pages, page-aligned,
/// registered as `Part::Buffers`.
pub fn map_buffer(bytes: usize) -> Option<*mut u8> {
    map_zeroed(bytes.next_multiple_of(PAGE), Part::Buffers)
}

/// Frees a buffer of `map_buffer(bytes)`.
pub fn unmap_buffer(p: *mut u8, bytes: usize) {
    unmap(p, bytes.next_multiple_of(PAGE));
}

/// Resizes a buffer of `map_buffer(old)` to `new` bytes: a new mapping, the contents
/// copied, the old one unmapped; `None`, the old one untouched, when the kernel refuses.
/// Not `mremap`, which would move the pages without a copy: Chromium's baseline seccomp
/// policy (its utility and GPU processes) answers `mremap` with SIGSYS, and a sandbox
/// may be entered at any time; `mmap` and `munmap` are allowed everywhere the library
/// runs (its rings are mapped the same way). A growing vector copies what it holds, as
/// it would in malloc.
///
/// # Safety
/// `p` must be a live buffer of `map_buffer(old)` that nothing else frees.
pub unsafe fn remap_buffer(p: *mut u8, old: usize, new: usize) -> Option<*mut u8> {
    if old.next_multiple_of(PAGE) == new.next_multiple_of(PAGE) {
        return Some(p);
    }
    let q = map_buffer(new)?;
    // SAFETY: `p` holds `old` readable bytes (`map_buffer(old)`), `q` at least `new`;
    // two distinct mappings, so the ranges do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(p, q, old.min(new)) };
    unmap_buffer(p, old);
    Some(q)
}

/// A transparent huge page.
pub const HUGE_PAGE: usize = 2 << 20;
/// `MADV_COLLAPSE` (Linux 6.1), not in every libc crate version.
const MADV_COLLAPSE: libc::c_int = 25;

/// `map_zeroed`, aligned to 2 MiB so that `promote_to_huge_pages` can later back it with
/// transparent huge pages. `bytes` must be a multiple of 2 MiB. The result can be
/// handed to `unmap`.
pub fn map_zeroed_aligned(bytes: usize, part: Part) -> Option<*mut u8> {
    debug_assert!(bytes.is_multiple_of(HUGE_PAGE));
    let raw = map_zeroed(bytes + HUGE_PAGE, part)? as usize;
    let start = (raw + HUGE_PAGE - 1) & !(HUGE_PAGE - 1);
    // SAFETY: the head [raw, start) and tail [start + bytes, raw + bytes + HUGE_PAGE)
    // are parts of the fresh mapping above that nothing refers to.
    unsafe {
        if start > raw {
            sys_munmap(raw, start - raw);
            crate::os::own::unmapped(raw, start - raw);
        }
        let tail = raw + bytes + HUGE_PAGE - (start + bytes);
        if tail > 0 {
            sys_munmap(start + bytes, tail);
            crate::os::own::unmapped(start + bytes, tail);
        }
    }
    Some(start as *mut u8)
}

/// Asks the kernel to back a table probed at random (a mapping from
/// `map_zeroed_aligned`) with 2 MiB pages from now on, and to collapse the parts already
/// touched: a probe then costs a memory miss and not also a page walk (most of the miss
/// on a virtual machine). The whole range becomes resident. Best effort: kernels without
/// transparent huge pages or before 6.1 (no `MADV_COLLAPSE`) refuse, and the table
/// keeps working on small pages. Returns whether the collapse succeeded.
pub fn promote_to_huge_pages(p: *mut u8, bytes: usize) -> bool {
    // `MADV_COLLAPSE` ignores the system's setting; an administrator's `never` stands.
    if huge_pages_disabled(std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok().as_deref()) {
        return true;
    }
    advise_huge_pages(p, bytes);
    // SAFETY: as in `advise_huge_pages`; the collapse copies the touched pages into huge
    // ones without changing their contents.
    unsafe { libc::madvise(p as *mut libc::c_void, bytes, MADV_COLLAPSE) == 0 }
}

/// Asks for 2 MiB pages at the next faults in `[p, p + bytes)`, a mapping of ours.
/// Refused (no transparent huge pages, or the administrator's `never`): small pages.
pub fn advise_huge_pages(p: *mut u8, bytes: usize) {
    // SAFETY: madvise only gives the kernel a hint about a live anonymous mapping of
    // ours; it changes no contents.
    unsafe { libc::madvise(p as *mut libc::c_void, bytes, libc::MADV_HUGEPAGE) };
}

/// Asks for small pages at the next faults in `[p, p + bytes)`, a mapping of ours that
/// asked for huge ones, or where they are the kernel's default (`always`).
pub fn advise_small_pages(p: *mut u8, bytes: usize) {
    // SAFETY: as above: a hint about a live anonymous mapping of ours.
    unsafe { libc::madvise(p as *mut libc::c_void, bytes, libc::MADV_NOHUGEPAGE) };
}

/// `MADV_POPULATE_WRITE` (Linux 5.14), not in every libc crate version.
const MADV_POPULATE_WRITE: libc::c_int = 23;

/// Faults in `[p, p + bytes)` of a mapping of ours, writable, as a write would, without
/// changing a byte: a thread writing there meanwhile is unaffected, and a later write
/// there takes no fault. Returns false where the kernel refuses (before 5.14, or out of
/// memory: the pages then fault in when written, as before).
///
/// One 2 MiB piece a call: the kernel holds the process's memory-map lock while it
/// populates, and the program's `mmap`, `munmap` and `mprotect` wait for it. Populating
/// 8 MiB (or a 48 MB table) in one call kept `import torch`'s main thread waiting
/// 0.2–0.35 s in all (its `dlopen`s map hundreds of times); a piece holds the lock for
/// the time of zeroing 2 MiB (one huge page, or 512 small ones).
pub fn populate_writable(p: *mut u8, bytes: usize) -> bool {
    let mut done = 0;
    while done < bytes {
        let n = (bytes - done).min(POPULATE_PIECE);
        // SAFETY: madvise on a live anonymous mapping of ours (`done + n <= bytes`);
        // populating changes no contents.
        if unsafe { libc::madvise(p.wrapping_add(done) as *mut libc::c_void, n, MADV_POPULATE_WRITE) } != 0 {
            return false;
        }
        done += n;
    }
    true
}

/// The most `populate_writable` asks the kernel for at once: one huge page.
const POPULATE_PIECE: usize = 2 << 20;

/// Whether the kernel's transparent-huge-page setting (the text of
/// `/sys/kernel/mm/transparent_hugepage/enabled`, e.g. `always [madvise] never`) says
/// `never`. No file: no such pages at all, and madvise refuses by itself.
pub fn huge_pages_disabled(setting: Option<&str>) -> bool {
    setting.is_some_and(|s| s.contains("[never]"))
}

/// Starts loading the cache line of `p` (a hint for a probe about to miss).
#[inline(always)]
pub fn prefetch_line<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it never faults and changes no state the program
    // can observe; `p` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const T as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Whether the CPU has `PREFETCHW` (CPUID 0x8000_0001, ECX bit 8: AMD since the K8,
/// Intel since Broadwell); set once by `detect_prefetch_for_write`.
static PREFETCHW: AtomicBool = AtomicBool::new(false);

/// Looks the CPU up for `prefetch_line_for_write`, in the C library's own copy of the
/// answer where it has one; called once from the library constructor (before that, it
/// prefetches for reading).
pub fn detect_prefetch_for_write() {
    #[cfg(target_arch = "x86_64")]
    {
        let has = match glibc_extended_ecx() {
            Some(ecx) => ecx & (1 << 8) != 0,
            None => {
                use std::arch::x86_64::__cpuid;
                __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
            }
        };
        PREFETCHW.store(has, Ordering::Relaxed);
    }
}

/// ECX of CPUID leaf 0x8000_0001 as the C library read it at its start
/// (`__x86_get_cpuid_feature_leaf`, glibc 2.33+, `<sys/platform/x86.h>`): a `CPUID`
/// instruction traps to the hypervisor on a virtual machine, 5.6 µs each here, and the
/// two the check took were 11 µs of every process's start (issue 55). `None` where the
/// C library has no such entry point.
#[cfg(target_arch = "x86_64")]
fn glibc_extended_ecx() -> Option<u32> {
    /// `struct cpuid_feature`: the registers as read, then the ones the C library uses.
    #[repr(C)]
    struct CpuidFeature {
        cpuid: [u32; 4],
        active: [u32; 4],
    }
    /// `CPUID_INDEX_80000001` of glibc's enum.
    const INDEX_80000001: u32 = 2;
    const ECX: usize = 2;
    let [Some(f)] = crate::os::loader::library_symbols([c"__x86_get_cpuid_feature_leaf"]) else { return None };
    // SAFETY: the C library's `const struct cpuid_feature *__x86_get_cpuid_feature_leaf
    // (unsigned int)`, found by its name; it reads a table filled before any constructor.
    let leaf = unsafe { std::mem::transmute::<usize, extern "C" fn(u32) -> *const CpuidFeature>(f)(INDEX_80000001) };
    // SAFETY: a non-null answer points to the C library's static table, never freed.
    (!leaf.is_null()).then(|| unsafe { (*leaf).cpuid[ECX] })
}

/// Starts taking the cache line of `p` for writing: a line another core read last
/// (a ring slot the consumer drained a lap ago) is then owned again before the store,
/// instead of stalling the next locked instruction (the ticket's `fetch_add` waits for
/// earlier stores to complete). Without `PREFETCHW`, a prefetch for reading.
#[inline(always)]
pub fn prefetch_line_for_write<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    if PREFETCHW.load(Ordering::Relaxed) {
        // SAFETY: a prefetch is a hint: it never faults and changes no state the
        // program can observe; the CPU has the instruction (`detect_prefetch_for_write`).
        unsafe { std::arch::asm!("prefetchw [{0}]", in(reg) p as *const T, options(nostack, preserves_flags, readonly)) };
        return;
    }
    prefetch_line(p);
}

/// Gives back the whole pages inside `[start, end)` (`MADV_DONTNEED`: they read as zeros
/// when next touched); the bytes given back. Not under a seccomp filter, which may answer
/// `madvise` with SIGSYS (callers check).
///
/// # Safety
/// `[start, end)` must lie inside a private anonymous mapping of ours whose contents
/// there read as empty when zero, and that nothing reads expecting what was there.
pub unsafe fn give_back_pages(start: usize, end: usize) -> usize {
    let (from, to) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
    if to <= from {
        return 0;
    }
    // SAFETY: whole pages inside the caller's range, as it promises.
    unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) };
    to - from
}

/// Returns a mapping made by `map_zeroed` that was never shared.
pub fn unmap(p: *mut u8, bytes: usize) {
    // SAFETY: callers pass a mapping of exactly `bytes` that no one else references.
    unsafe { sys_munmap(p as usize, bytes) };
    crate::os::own::unmapped(p as usize, bytes);
}

/// `munmap` as a system call: the library's own mappings never pass through its
/// `munmap` hook (`interpose::mmap`).
///
/// # Safety
/// `[p, p + bytes)` must be a mapping of ours that nothing refers to.
unsafe fn sys_munmap(p: usize, bytes: usize) {
    // SAFETY: as the caller promises.
    unsafe { libc::syscall(libc::SYS_munmap, p, bytes) };
}

/// Maps a file read-only (the symbolizer reads module files this way: a PyTorch library
/// is 450 MB, of which a lookup touches little).
pub fn map_file(path: &str) -> Option<memmap2::Mmap> {
    let file = crate::os::anchor::open_file(path).ok()?;
    // SAFETY: a read-only private mapping; module files are not rewritten in place while
    // loaded (the loader maps them too), and a truncated file gives SIGBUS in the loader
    // first.
    unsafe { memmap2::Mmap::map(&file) }.ok()
}

/// A type whose all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for plain integers and arrays of them.
pub unsafe trait Zeroable: Copy {
    const ZERO: Self;
}

// SAFETY: integers, and arrays of them, are valid as all-zero bytes.
unsafe impl Zeroable for u64 {
    const ZERO: u64 = 0;
}

// SAFETY: as above.
unsafe impl Zeroable for [u64; 2] {
    const ZERO: [u64; 2] = [0; 2];
}

// SAFETY: all zero bits are three valid u32s.
unsafe impl Zeroable for [u32; 3] {
    const ZERO: [u32; 3] = [0; 3];
}

/// A fixed-length array of `T`, all zero at first, in a mapping of its own: pages come
/// from the kernel already zeroed when first touched, nothing is written up front, and
/// arrays of 2 MiB or more are backed by huge pages (one fault per 2 MiB, not 512).
/// For the collector's large tables, which it rebuilds at twice the size while producers
/// wait: a `Vec` of that size from the allocator may be recycled heap memory that
/// `calloc` has to clear, and fills by 4 KiB faults.
pub struct ZeroedArray<T: Zeroable> {
    backing: Backing<T>,
}

enum Backing<T> {
    Mapped {
        ptr: std::ptr::NonNull<T>,
        len: usize,
        bytes: usize,
    },
    /// Where the kernel refused a mapping: an ordinary vector.
    Heap(Vec<T>),
}

// SAFETY: the array owns its memory exclusively, as a Vec<T> does.
unsafe impl<T: Zeroable + Send> Send for ZeroedArray<T> {}
// SAFETY: shared access only reads, as for &[T].
unsafe impl<T: Zeroable + Sync> Sync for ZeroedArray<T> {}

impl<T: Zeroable> ZeroedArray<T> {
    pub fn new(len: usize) -> ZeroedArray<T> {
        ZeroedArray::mapped(len).unwrap_or_else(|| ZeroedArray { backing: Backing::Heap(vec![T::ZERO; len]) })
    }

    /// `new` without the heap: `None` where the kernel refuses the mapping (or `len` is
    /// 0). Allocates nothing from malloc, so it may be called while the pointer scan
    /// holds the program's threads (one of which may own malloc's lock).
    pub fn mapped(len: usize) -> Option<ZeroedArray<T>> {
        let size = len.saturating_mul(std::mem::size_of::<T>());
        let (p, bytes) = if size == 0 {
            return None;
        } else if size >= HUGE_PAGE {
            let bytes = size.next_multiple_of(HUGE_PAGE);
            let p = map_zeroed_aligned(bytes, Part::Blocks)?;
            advise_huge_pages(p, bytes);
            (p, bytes)
        } else {
            (map_zeroed(size, Part::Blocks)?, size)
        };
        let ptr = std::ptr::NonNull::new(p as *mut T)?;
        Some(ZeroedArray { backing: Backing::Mapped { ptr, len, bytes } })
    }

    /// `new`, with every page faulted in at once: for an array about to be written all
    /// over (a table being rehashed into), whose probes would otherwise first map the
    /// shared zero page on a read and then fault again on the write.
    pub fn populated(len: usize) -> ZeroedArray<T> {
        let a = ZeroedArray::new(len);
        if let Backing::Mapped { ptr, bytes, .. } = &a.backing {
            populate_writable(ptr.as_ptr() as *mut u8, *bytes);
        }
        a
    }
}

impl<T: Zeroable> std::ops::Deref for ZeroedArray<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.backing {
            // SAFETY: the mapping holds `len` values of T (zeroed: valid, as T is
            // Zeroable), is page-aligned, lives as long as self, and is only reached
            // through self.
            Backing::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts(ptr.as_ptr(), *len) },
            Backing::Heap(v) => v,
        }
    }
}

impl<T: Zeroable> std::ops::DerefMut for ZeroedArray<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.backing {
            // SAFETY: as in deref; &mut self makes this the only reference.
            Backing::Mapped { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), *len) },
            Backing::Heap(v) => v,
        }
    }
}

impl<T: Zeroable> Drop for ZeroedArray<T> {
    fn drop(&mut self) {
        if let Backing::Mapped { ptr, bytes, .. } = self.backing {
            unmap(ptr.as_ptr() as *mut u8, bytes);
        }
    }
}

impl<T: Zeroable> Default for ZeroedArray<T> {
    fn default() -> Self {
        ZeroedArray::new(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_c_librarys_copy_of_the_extended_cpuid_leaf_is_what_cpuid_says() {
        let Some(ecx) = glibc_extended_ecx() else {
            crate::test_skip::skip_not_here("this C library has no __x86_get_cpuid_feature_leaf (glibc < 2.33)");
            return;
        };
        use std::arch::x86_64::__cpuid;
        assert!(__cpuid(0x8000_0000).eax >= 0x8000_0001, "glibc filled a leaf the CPU does not have");
        // Bit 8, PREFETCHW (the C library may clear bits it must not use elsewhere).
        assert_eq!(ecx & (1 << 8), __cpuid(0x8000_0001).ecx & (1 << 8));
    }

    #[test]
    fn a_buffer_keeps_its_contents_as_it_grows_and_shrinks_and_the_heap_goes_through_it() {
        let n = 200 << 10;
        let p = map_buffer(n).unwrap();
        // SAFETY: a fresh mapping of at least n bytes.
        unsafe { (0..n).for_each(|i| *p.add(i) = (i % 251) as u8) };
        // SAFETY: p is the buffer just mapped, q and r the buffers these calls return.
        let q = unsafe { remap_buffer(p, n, 3 * n) }.unwrap();
        // SAFETY: q holds 3n bytes: the first n copied, the rest zero.
        let grown = unsafe { std::slice::from_raw_parts(q, 3 * n) };
        assert!(grown[..n].iter().enumerate().all(|(i, &b)| b == (i % 251) as u8) && grown[n..].iter().all(|&b| b == 0));
        // SAFETY: as above.
        let r = unsafe { remap_buffer(q, 3 * n, 130 << 10) }.unwrap();
        // SAFETY: r holds 130 KiB.
        let shrunk = unsafe { std::slice::from_raw_parts(r, 130 << 10) };
        assert!(shrunk.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        unmap_buffer(r, 130 << 10);
        // The library's own vectors cross the threshold both ways (`RealAllocator`).
        let mut v: Vec<u32> = (0..1000).collect();
        v.extend(1000..200_000);
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
        v.truncate(10);
        v.shrink_to_fit();
        assert_eq!(v, (0..10).collect::<Vec<u32>>());
        let z = vec![0u64; 1 << 20];
        assert!(z.iter().all(|&x| x == 0));
    }

    /// The CPUID check agrees with the kernel's flag for the instruction, and taking a
    /// line for writing changes none of its bytes (either instruction).
    #[test]
    fn prefetch_for_write_is_detected_as_the_kernel_sees_it_and_changes_nothing() {
        detect_prefetch_for_write();
        if cfg!(target_arch = "x86_64") {
            let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
            let flags = cpuinfo.lines().find(|l| l.starts_with("flags")).expect("a flags line");
            let kernel_says = flags.split_whitespace().any(|f| f == "3dnowprefetch");
            assert_eq!(PREFETCHW.load(Ordering::Relaxed), kernel_says);
        }
        let line = [0x1234_5678_9abc_def0u64; 8];
        // Only a CPU that has the instruction is asked to run it.
        let detected = PREFETCHW.load(Ordering::Relaxed);
        for has in [detected, false] {
            PREFETCHW.store(has, Ordering::Relaxed);
            for word in &line {
                prefetch_line_for_write(word);
            }
            assert!(line.iter().all(|&w| w == 0x1234_5678_9abc_def0));
        }
        detect_prefetch_for_write();
    }

    #[test]
    fn zeroed_arrays_start_zero_and_keep_what_is_written() {
        for len in [0, 1, 1000, (HUGE_PAGE / 16) + 3] {
            let mut a = ZeroedArray::<[u64; 2]>::new(len);
            assert_eq!(a.len(), len);
            assert!(a.iter().all(|v| *v == [0, 0]));
            for (i, v) in a.iter_mut().enumerate() {
                *v = [i as u64, !(i as u64)];
            }
            assert!(a.iter().enumerate().all(|(i, v)| *v == [i as u64, !(i as u64)]));
        }
    }

    /// Resident pages of `[p, p + bytes)` (page-aligned), from `mincore`.
    fn resident_pages(p: *mut u8, bytes: usize) -> usize {
        let page = 4096;
        let mut vec = vec![0u8; bytes.div_ceil(page)];
        // SAFETY: `p` is the start of a live mapping of `bytes`; `vec` has one byte per page.
        assert_eq!(unsafe { libc::mincore(p as *mut libc::c_void, bytes, vec.as_mut_ptr()) }, 0);
        vec.iter().filter(|&&v| v & 1 == 1).count()
    }

    #[test]
    fn populating_faults_pages_in_and_keeps_every_byte() {
        let len = 4 * HUGE_PAGE / 8 + 5;
        let mut a = ZeroedArray::<u64>::new(len);
        for i in (0..len).step_by(4096) {
            a[i] = i as u64 ^ 0x5a5a;
        }
        let Backing::Mapped { ptr, bytes, .. } = a.backing else { panic!("a mapping") };
        if !populate_writable(ptr.as_ptr() as *mut u8, bytes) {
            return; // a kernel before 5.14: nothing to check beyond the fallback
        }
        assert_eq!(resident_pages(ptr.as_ptr() as *mut u8, bytes), bytes / 4096);
        assert!(a.iter().enumerate().all(|(i, &v)| v == if i % 4096 == 0 { i as u64 ^ 0x5a5a } else { 0 }));
        let b = ZeroedArray::<u64>::populated(len);
        assert!(b.iter().all(|&v| v == 0));
        if let Backing::Mapped { ptr, bytes, .. } = b.backing {
            assert_eq!(resident_pages(ptr.as_ptr() as *mut u8, bytes), bytes / 4096);
        }
    }

    #[test]
    fn an_administrators_never_keeps_small_pages() {
        assert!(huge_pages_disabled(Some("always madvise [never]\n")));
        assert!(!huge_pages_disabled(Some("always [madvise] never\n")));
        assert!(!huge_pages_disabled(Some("[always] madvise never\n")));
        assert!(!huge_pages_disabled(None));
    }
}
