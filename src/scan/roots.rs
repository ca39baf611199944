//! Root memory for the mark phase, and holding the other threads still while it is
//! read. Threads are stopped the way conservative collectors do it: a real-time signal
//! whose handler records the thread's stack pointer and registers, then waits on a futex
//! until the scan is over. Nothing here allocates while threads are stopped (one of
//! them may hold the allocator's lock): every buffer is prepared before.
use std::ffi::c_void;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::mark::Memory;

const MAX_THREADS: usize = 4096;
const GREGS: usize = 23;

/// What a stopped thread left for the scanner.
struct Slot {
    tid: AtomicU32,
    sp: AtomicU64,
    regs: [AtomicU64; GREGS],
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    tid: AtomicU32::new(0),
    sp: AtomicU64::new(0),
    regs: [const { AtomicU64::new(0) }; GREGS],
};
static SLOTS: [Slot; MAX_THREADS] = [EMPTY; MAX_THREADS];
static ARRIVED: AtomicUsize = AtomicUsize::new(0);
static LEFT: AtomicUsize = AtomicUsize::new(0);
/// Futex word: 1 while threads must stay stopped.
static HOLD: AtomicU32 = AtomicU32::new(0);
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop(_sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut c_void) {
    // Async-signal-safe only: atomics, gettid, futex.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes this thread's ucontext to an SA_SIGINFO handler.
    let uc = ctx as *const libc::ucontext_t;
    let slot_index = claim_slot();
    if let Some(i) = slot_index {
        let s = &SLOTS[i];
        // SAFETY: gettid cannot fail; uc is valid for the duration of the handler.
        unsafe {
            s.tid.store(libc::syscall(libc::SYS_gettid) as u32, Ordering::Relaxed);
            let g = &(*uc).uc_mcontext.gregs;
            s.sp.store(g[libc::REG_RSP as usize] as u64, Ordering::Relaxed);
            for (r, v) in s.regs.iter().zip(g.iter()) {
                r.store(*v as u64, Ordering::Relaxed);
            }
        }
    }
    ARRIVED.fetch_add(1, Ordering::AcqRel);
    while HOLD.load(Ordering::Acquire) == 1 {
        // SAFETY: FUTEX_WAIT on a static word; spurious wake-ups loop.
        unsafe { libc::syscall(libc::SYS_futex, HOLD.as_ptr(), libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG, 1u32, std::ptr::null::<libc::timespec>()) };
    }
    LEFT.fetch_add(1, Ordering::AcqRel);
    // SAFETY: restoring this thread's errno.
    unsafe { *libc::__errno_location() = errno };
}

static NEXT_SLOT: AtomicUsize = AtomicUsize::new(0);

fn claim_slot() -> Option<usize> {
    let i = NEXT_SLOT.fetch_add(1, Ordering::AcqRel);
    (i < MAX_THREADS).then_some(i)
}

/// Installs the stop handler on a real-time signal the program leaves alone. Returns
/// false when none is free (the scan then reads only this thread and the globals).
pub fn install() -> bool {
    if STOP_SIGNAL.load(Ordering::Acquire) != 0 {
        return true;
    }
    let (lo, hi) = (libc::SIGRTMIN(), libc::SIGRTMAX());
    for sig in (lo..=hi).rev().take(8) {
        if crate::interpose::lifecycle::install_if_default(sig, on_stop as *const () as usize, true, true) {
            STOP_SIGNAL.store(sig, Ordering::Release);
            return true;
        }
    }
    false
}

/// Thread ids of this process, other than the caller's.
pub fn other_threads() -> Vec<u32> {
    // SAFETY: gettid cannot fail.
    let me = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    std::fs::read_dir("/proc/self/task")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok()).filter(|t| *t != me).collect())
        .unwrap_or_default()
}

/// Readable, writable mappings `(start, end)` from /proc/self/maps, for finding the
/// stack that holds a stopped thread's stack pointer.
pub fn writable_mappings() -> Vec<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let range = it.next()?;
            let perms = it.next()?;
            if !perms.starts_with("rw") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?))
        })
        .collect()
}

/// Writable PT_LOAD segments of every loaded module except this library.
/// Address ranges `(start, len)`.
pub type Ranges = Vec<(u64, u64)>;

/// Writable segments of every loaded module but ours: `(program, cuda)`, where `cuda`
/// are those of the CUDA driver and runtime (see `mark::classify_into`).
pub fn module_data() -> (Ranges, Ranges) {
    type Out = (Ranges, Ranges);
    extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> libc::c_int {
        // SAFETY: glibc passes a valid dl_phdr_info; data is our pair of Vecs.
        unsafe {
            let out = &mut *(data as *mut Out);
            let info = &*info;
            let name = if info.dlpi_name.is_null() { &[][..] } else { std::ffi::CStr::from_ptr(info.dlpi_name).to_bytes() };
            let into = if is_cuda_library(name) { &mut out.1 } else { &mut out.0 };
            for i in 0..info.dlpi_phnum as usize {
                let ph = &*info.dlpi_phdr.add(i);
                if ph.p_type == libc::PT_LOAD && ph.p_flags & libc::PF_W != 0 && ph.p_memsz > 0 {
                    let start = info.dlpi_addr + ph.p_vaddr;
                    if !crate::hotpath::unwind::is_own_address(start) {
                        into.push((start, ph.p_memsz));
                    }
                }
            }
        }
        0
    }
    let mut out: Out = (Vec::new(), Vec::new());
    // SAFETY: the callback only reads the headers glibc hands it.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut out as *mut _ as *mut c_void) };
    out
}

/// The address range of the dynamic linker (ld.so), whose allocations (dlopen's link
/// maps and scopes, TLS blocks) are kept in places no root covers: as LeakSanitizer's
/// `use_ld_allocations`, they count as reachable.
pub fn loader_range() -> Option<(u64, u64)> {
    crate::interpose::resolve::loaded_modules()
        .into_iter()
        .find(|m| {
            let path = m.path.as_bytes();
            path.rsplit(|c| *c == b'/').next().unwrap_or(path).starts_with(b"ld-linux")
        })
        .map(|m| (m.lo as u64, m.hi as u64))
}

/// The CUDA driver (`libcuda.so.1`) and runtime (`libcudart.so.*`), by file name.
pub fn is_cuda_library(path: &[u8]) -> bool {
    let base = path.rsplit(|c| *c == b'/').next().unwrap_or(path);
    base.starts_with(b"libcuda.so") || base.starts_with(b"libcudart.so")
}

pub struct Stopped {
    /// Threads that acknowledged; their stack ranges and registers are in `roots`.
    pub stopped: usize,
    pub asked: usize,
}

/// Threads that block the stop signal (thread pools often block every signal) can
/// never be held. `blocking(tids)` splits them off, reading `/proc/self/task/*/status`
/// (before any thread is held: this allocates).
pub fn split_blocking(tids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let sig = STOP_SIGNAL.load(Ordering::Acquire);
    if sig == 0 {
        return (tids.to_vec(), Vec::new());
    }
    tids.iter().partition(|&&t| {
        let status = std::fs::read_to_string(format!("/proc/self/task/{t}/status")).unwrap_or_default();
        let blocked = status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .unwrap_or(0);
        blocked & (1u64 << (sig - 1)) == 0
    })
}

/// The live stack of a thread that cannot be held, copied: its stack pointer comes from
/// `/proc/self/task/T/syscall` (it is asleep in a system call, as such threads are), the
/// copy is made with `process_vm_readv`, which fails instead of faulting should the
/// thread wake and its stack go. Its registers are not available. Returns the copies.
pub fn copy_blocking_stacks(tids: &[u32], maps: &[(u64, u64)]) -> Vec<Vec<u64>> {
    let mut copies = Vec::new();
    for &t in tids {
        let text = std::fs::read_to_string(format!("/proc/self/task/{t}/syscall")).unwrap_or_default();
        // "NR arg1 .. arg6 sp pc" while in a system call; "running" otherwise.
        let fields: Vec<&str> = text.split_whitespace().collect();
        if fields.len() != 9 {
            continue;
        }
        let Some(sp) = u64::from_str_radix(fields[7].trim_start_matches("0x"), 16).ok().map(|sp| sp.saturating_sub(128) & !7) else {
            continue;
        };
        let Some(&(_, end)) = maps.iter().find(|(a, b)| *a <= sp && sp < *b) else { continue };
        let mut buf = vec![0u64; ((end - sp) / 8) as usize];
        let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut c_void, iov_len: buf.len() * 8 };
        let remote = libc::iovec { iov_base: sp as *mut c_void, iov_len: buf.len() * 8 };
        // SAFETY: reads our own process's memory into a buffer of exactly that size; the
        // kernel checks the remote range and fails rather than faulting.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        if n > 0 {
            buf.truncate(n as usize / 8);
            copies.push(buf);
        }
    }
    copies
}

/// Stops `tids`, adds each stopped thread's live stack (from its stack pointer, with the
/// red zone, to the end of its mapping) and registers to `roots`, and leaves them stopped
/// until `resume`. `maps` and `roots` must have spare capacity (no allocation here).
pub fn stop_threads(tids: &[u32], maps: &[(u64, u64)], roots: &mut Vec<(u64, u64)>, regs: &mut Vec<u64>) -> Stopped {
    let sig = STOP_SIGNAL.load(Ordering::Acquire);
    if sig == 0 || tids.is_empty() {
        return Stopped { stopped: 0, asked: 0 };
    }
    NEXT_SLOT.store(0, Ordering::SeqCst);
    ARRIVED.store(0, Ordering::SeqCst);
    LEFT.store(0, Ordering::SeqCst);
    HOLD.store(1, Ordering::SeqCst);
    // SAFETY: getpid/tgkill have no memory preconditions.
    let pid = unsafe { libc::getpid() };
    let mut asked = 0;
    for &t in tids.iter().take(MAX_THREADS) {
        // SAFETY: as above; a thread that already exited answers ESRCH.
        if unsafe { libc::syscall(libc::SYS_tgkill, pid, t as libc::c_int, sig) } == 0 {
            asked += 1;
        }
    }
    let start = std::time::Instant::now();
    while ARRIVED.load(Ordering::Acquire) < asked && start.elapsed() < std::time::Duration::from_secs(2) {
        std::hint::spin_loop();
        // SAFETY: sched_yield has no preconditions (std's yield may not allocate, but be sure).
        unsafe { libc::sched_yield() };
    }
    let stopped = NEXT_SLOT.load(Ordering::Acquire).min(MAX_THREADS).min(ARRIVED.load(Ordering::Acquire));
    for s in SLOTS.iter().take(stopped) {
        let sp = s.sp.load(Ordering::Relaxed).saturating_sub(128);
        if let Some(&(_, end)) = maps.iter().find(|(a, b)| *a <= sp && sp < *b) {
            if roots.len() < roots.capacity() {
                roots.push((sp, end - sp));
            }
        }
        for r in &s.regs {
            if regs.len() < regs.capacity() {
                regs.push(r.load(Ordering::Relaxed));
            }
        }
    }
    Stopped { stopped, asked }
}

/// Lets stopped threads go and waits (briefly) until they left the handler.
pub fn resume(asked: usize) {
    HOLD.store(0, Ordering::SeqCst);
    // SAFETY: FUTEX_WAKE on a static word.
    unsafe { libc::syscall(libc::SYS_futex, HOLD.as_ptr(), libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG, i32::MAX) };
    let start = std::time::Instant::now();
    while LEFT.load(Ordering::Acquire) < ARRIVED.load(Ordering::Acquire).min(asked) && start.elapsed() < std::time::Duration::from_secs(2) {
        // SAFETY: no preconditions.
        unsafe { libc::sched_yield() };
    }
}

/// Where the program's own frames begin on the thread that writes the final report: the
/// stack pointer at the library's entry point (destructor, `_exit`). Frames below it are
/// the library's and would hold copies of block addresses; 0 = the scanning thread has
/// no program frames (the collector thread).
static ENTRY_SP: AtomicU64 = AtomicU64::new(0);

/// Called first thing in an exit hook, on the thread that will scan.
#[inline(always)]
pub fn mark_entry() {
    let sp: u64;
    // SAFETY: reads the stack pointer.
    unsafe { std::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags)) };
    ENTRY_SP.store(sp, Ordering::Relaxed);
}

/// The program's part of this thread's stack (its callee-saved registers were saved
/// there by the calls that led to the exit hook).
pub fn own_stack(maps: &[(u64, u64)], roots: &mut Vec<(u64, u64)>) {
    let sp = ENTRY_SP.load(Ordering::Relaxed);
    if sp == 0 {
        return;
    }
    if let Some(&(_, end)) = maps.iter().find(|(a, b)| *a <= sp && sp < *b) {
        roots.push((sp, end - sp));
    }
}

/// Reads live process memory word by word, skipping anything not in `readable`.
pub struct ProcessMemory<'a> {
    pub readable: &'a [(u64, u64)],
}

impl Memory for ProcessMemory<'_> {
    fn words(&self, start: u64, len: u64, visit: &mut dyn FnMut(u64)) -> bool {
        let end = start.saturating_add(len);
        let mut any = false;
        // A module's data segment is often two mappings (.data from the file, .bss
        // anonymous): read every piece of the range that lies in a known mapping, never
        // a guard page or a hole.
        for &(a, b) in self.readable {
            let lo = start.max(a);
            let hi = end.min(b);
            if lo >= hi {
                continue;
            }
            any = true;
            let mut p = (lo + 7) & !7;
            while p + 8 <= hi {
                // SAFETY: [p, p+8) lies inside a mapping that was readable and writable
                // when the maps were read; nothing unmaps memory while threads are held.
                visit(unsafe { std::ptr::read_volatile(p as *const u64) });
                p += 8;
            }
        }
        any
    }
}

static MAIN_TLS: std::sync::OnceLock<Vec<(u64, u64)>> = std::sync::OnceLock::new();

/// Records the calling (main) thread's static TLS blocks: ld.so allocates them outside
/// any thread stack, so the scan adds them as roots even when another thread scans.
pub fn record_main_tls() {
    extern "C" fn visit(info: *mut libc::dl_phdr_info, _size: usize, data: *mut c_void) -> libc::c_int {
        // SAFETY: glibc passes a valid dl_phdr_info; data is our Vec.
        unsafe {
            let out = &mut *(data as *mut Vec<(u64, u64)>);
            let info = &*info;
            if info.dlpi_tls_data.is_null() {
                return 0;
            }
            for i in 0..info.dlpi_phnum as usize {
                let ph = &*info.dlpi_phdr.add(i);
                if ph.p_type == libc::PT_TLS && ph.p_memsz > 0 {
                    out.push((info.dlpi_tls_data as u64, ph.p_memsz));
                }
            }
        }
        0
    }
    let mut out: Vec<(u64, u64)> = Vec::new();
    // SAFETY: the callback only reads the headers glibc hands it.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut out as *mut _ as *mut c_void) };
    // The thread control block's head: its `dtv` points to the TLS blocks of modules
    // loaded later (dlopen), which ld.so allocates with malloc. Other threads have their
    // control block at the top of their stack mapping, which the scan reads anyway.
    let mut fs: u64 = 0;
    const ARCH_GET_FS: libc::c_long = 0x1003;
    // SAFETY: arch_prctl(ARCH_GET_FS) writes the thread pointer to a valid u64.
    if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_FS, &mut fs as *mut u64) } == 0 && fs != 0 {
        out.push((fs, 64));
        MAIN_THREAD_POINTER.store(fs, Ordering::Relaxed);
    }
    let _ = MAIN_TLS.set(out);
}

static MAIN_THREAD_POINTER: AtomicU64 = AtomicU64::new(0);

/// The main thread's dynamic thread vector (glibc, x86-64: its address at the thread
/// pointer + 8, its length in the entry before it; 16 bytes an entry). It lists the TLS
/// blocks of modules loaded with dlopen, and may itself live in memory ld.so took
/// before malloc existed, which no other root covers. Read only inside `readable`.
pub fn main_dtv(readable: &[(u64, u64)]) -> Option<(u64, u64)> {
    let inside = |a: u64, len: u64| readable.iter().any(|&(lo, hi)| a >= lo && a.saturating_add(len) <= hi);
    let fs = MAIN_THREAD_POINTER.load(Ordering::Relaxed);
    if fs == 0 || !inside(fs + 8, 8) {
        return None;
    }
    // SAFETY: checked to lie in a readable mapping just above.
    let dtv = unsafe { std::ptr::read_volatile((fs + 8) as *const u64) };
    if dtv < 16 || !inside(dtv - 16, 8) {
        return None;
    }
    // SAFETY: as above.
    let len = unsafe { std::ptr::read_volatile((dtv - 16) as *const u64) };
    (len < 1 << 16).then_some((dtv - 16, (len + 2) * 16))
}

pub fn main_tls() -> &'static [(u64, u64)] {
    MAIN_TLS.get().map(|v| v.as_slice()).unwrap_or(&[])
}
