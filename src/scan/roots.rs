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
const EMPTY: Slot = Slot { tid: AtomicU32::new(0), sp: AtomicU64::new(0), regs: [const { AtomicU64::new(0) }; GREGS] };
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
        if crate::os::signals::install_if_default(sig, on_stop as *const () as usize, true, true) {
            STOP_SIGNAL.store(sig, Ordering::Release);
            return true;
        }
    }
    false
}

/// The scan's signal back to its default (a recording ended by `leaktrace attach
/// --detach`: no scan runs any more).
pub fn uninstall() {
    let sig = STOP_SIGNAL.swap(0, Ordering::AcqRel);
    if sig != 0 {
        crate::os::signals::default_if_ours(sig, on_stop as *const () as usize);
    }
}

/// Thread ids of this process, other than the caller's. The kernel walks
/// `/proc/self/task` by position: a thread that exits during the walk (the collector
/// leaves as the final report starts) can make it skip the next one, and a thread the
/// scan misses is a stack not read — its blocks flipped to "definite" about once in 150
/// runs. So the listing is repeated until two in a row agree, and their union is taken
/// (a listed thread that is gone by the time it is stopped is simply not stopped).
pub fn other_threads() -> Vec<u32> {
    // SAFETY: gettid cannot fail.
    let me = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    let list = || {
        let mut v: Vec<u32> = crate::os::anchor::list_proc("self/task").iter().filter_map(|n| n.parse::<u32>().ok()).filter(|t| *t != me).collect();
        v.sort_unstable();
        v
    };
    let mut all = list();
    let mut last = all.clone();
    for _ in 0..8 {
        let next = list();
        let settled = next == last;
        all.extend_from_slice(&next);
        last = next;
        if settled {
            break;
        }
    }
    all.sort_unstable();
    all.dedup();
    all
}

/// Readable, writable mappings `(start, end)` from /proc/self/maps, for finding the
/// stack that holds a stopped thread's stack pointer.
pub fn writable_mappings() -> Vec<(u64, u64)> {
    let text = crate::os::anchor::read_proc_string("self/maps").unwrap_or_default();
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
    unsafe { crate::os::loader::iterate_modules(Some(visit), &mut out as *mut _ as *mut c_void) };
    out
}

/// The address range of the dynamic linker (ld.so), whose allocations (dlopen's link
/// maps and scopes, TLS blocks) are kept in places no root covers: as LeakSanitizer's
/// `use_ld_allocations`, they count as reachable.
pub fn loader_range() -> Option<(u64, u64)> {
    crate::os::loader::loaded_modules().into_iter().find(|m| is_loader(m.path.as_bytes())).map(|m| (m.lo as u64, m.hi as u64))
}

/// The last component of a module path.
fn file_name(path: &[u8]) -> &[u8] {
    path.rsplit(|c| *c == b'/').next().unwrap_or(path)
}

/// The dynamic linker (`ld-linux-x86-64.so.2`), by file name.
fn is_loader(path: &[u8]) -> bool {
    file_name(path).starts_with(b"ld-linux")
}

/// The CUDA driver (`libcuda.so.1`) and runtime (`libcudart.so.*`), by file name.
pub fn is_cuda_library(path: &[u8]) -> bool {
    let base = file_name(path);
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
///
/// A thread can also block every signal for a moment: glibc's `pthread_create` does
/// around its `clone`, and so does this library while a program thread starts the
/// collector from a hook (its 4,096th allocation). Taken for a blocking thread while
/// it ran, such a thread was neither held nor copied (a copy needs a thread asleep in
/// a system call): its stack went unread and the block only it held was reported
/// leaked (`exit_free_race.c` at 0 ms: 11 of 400 runs beside the test suite, 5 of 100
/// beside four busy loops; 0 of 600 since). So a thread that blocks the signal while
/// it runs is looked at again (`RECHECK_US`, 3.9 ms at most): once it lets the signal
/// through it is held like the others, once it sleeps in a system call its stack is
/// copied. A thread asleep with the signal blocked, a pool's, is copied at once, as
/// before.
pub fn split_blocking(tids: &[u32]) -> (Vec<u32>, Vec<u32>) {
    split_blocking_after(tids, &RECHECK_US)
}

/// `split_blocking` with the waits before each new look (microseconds).
fn split_blocking_after(tids: &[u32], rechecks: &[u64]) -> (Vec<u32>, Vec<u32>) {
    let sig = STOP_SIGNAL.load(Ordering::Acquire);
    if sig == 0 {
        return (tids.to_vec(), Vec::new());
    }
    let blocks = |t: u32| {
        let status = crate::os::anchor::read_proc_string(&format!("self/task/{t}/status")).unwrap_or_default();
        blocks_signal(&status, sig)
    };
    let (mut ask, blocked): (Vec<u32>, Vec<u32>) = tids.iter().partition(|&&t| !blocks(t));
    let (mut blocking, mut running): (Vec<u32>, Vec<u32>) = blocked.into_iter().partition(|&t| in_system_call(t));
    for &wait_us in rechecks {
        if running.is_empty() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_micros(wait_us));
        running.retain(|&t| {
            if !blocks(t) {
                ask.push(t);
                false
            } else if in_system_call(t) {
                blocking.push(t);
                false
            } else {
                true
            }
        });
    }
    // Still running with the signal blocked: neither held nor copied (its stack is
    // read by no one), as any thread that cannot be.
    blocking.extend(running);
    (ask, blocking)
}

/// The waits, in microseconds, before a thread that runs with the stop signal blocked is
/// looked at again (`split_blocking`).
const RECHECK_US: [u64; 6] = [50, 100, 200, 500, 1000, 2000];

/// Whether a thread's `/proc/.../status` text says it blocks signal `sig`.
fn blocks_signal(status: &str, sig: i32) -> bool {
    let blocked = status.lines().find_map(|l| l.strip_prefix("SigBlk:")).and_then(|m| u64::from_str_radix(m.trim(), 16).ok()).unwrap_or(0);
    (1..=64).contains(&sig) && blocked & (1u64 << (sig - 1)) != 0
}

/// Whether thread `t` is asleep in a system call that it stays in: not in the
/// `rt_sigprocmask` that changes its mask, which a thread running with the signal
/// blocked makes to let it through (taken for one asleep there, under load, it was
/// copied where it was about to be held).
fn in_system_call(t: u32) -> bool {
    syscall_of(t).is_some_and(|(nr, _)| nr != libc::SYS_rt_sigprocmask as u64)
}

/// The stack pointer of thread `t` while it is asleep in a system call.
fn asleep_sp(t: u32) -> Option<u64> {
    syscall_of(t).map(|(_, sp)| sp)
}

/// The system call thread `t` is in, and its stack pointer, from
/// `/proc/self/task/T/syscall`.
fn syscall_of(t: u32) -> Option<(u64, u64)> {
    parse_syscall(&crate::os::anchor::read_proc_string(&format!("self/task/{t}/syscall")).unwrap_or_default())
}

/// `/proc/.../syscall` reads "NR arg1 .. arg6 sp pc" while the thread is in a system
/// call, "-1 sp pc" or "running" otherwise, nothing once the thread is gone.
fn parse_syscall(text: &str) -> Option<(u64, u64)> {
    let fields: Vec<&str> = text.split_whitespace().collect();
    if fields.len() != 9 {
        return None;
    }
    let nr = fields[0].parse().ok()?;
    let sp = u64::from_str_radix(fields[7].trim_start_matches("0x"), 16).ok()?;
    Some((nr, sp))
}

/// The live stack of a thread that cannot be held, copied: its stack pointer comes from
/// `/proc/self/task/T/syscall` (it is asleep in a system call, as such threads are), the
/// copy is made with `process_vm_readv`, which fails instead of faulting should the
/// thread wake and its stack go. Its registers are not available. Returns the copies,
/// each with its thread.
pub fn copy_blocking_stacks(tids: &[u32], maps: &[(u64, u64)]) -> Vec<(u32, Vec<u64>)> {
    let mut copies = Vec::new();
    if !tids.is_empty() && !vm_readv_safe() {
        return copies;
    }
    for &t in tids {
        // With its red zone.
        let Some(sp) = asleep_sp(t).map(|sp| sp.saturating_sub(128) & !7) else {
            continue;
        };
        let Some(&(_, end)) = maps.iter().find(|(a, b)| *a <= sp && sp < *b) else { continue };
        let mut buf = vec![0u64; ((end - sp) / 8) as usize];
        let n = crate::os::copy_own(sp, &mut buf);
        if n > 0 {
            buf.truncate(n / 8);
            copies.push((t, buf));
        }
    }
    copies
}

/// Stops `tids`, adds each stopped thread's live stack (from its stack pointer, with the
/// red zone, to the end of its mapping) and registers to `roots`, and leaves them stopped
/// until `resume`. `maps` and `roots` must have spare capacity (no allocation here).
pub fn stop_threads(tids: &[u32], maps: &[(u64, u64)], roots: &mut Vec<(u64, u64)>, regs: &mut Vec<u64>, labels: &mut Vec<super::RootLabel>) -> Stopped {
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
        let tid = s.tid.load(Ordering::Relaxed);
        let sp = s.sp.load(Ordering::Relaxed).saturating_sub(128);
        if let Some(&(_, end)) = maps.iter().find(|(a, b)| *a <= sp && sp < *b) {
            if roots.len() < roots.capacity() {
                roots.push((sp, end - sp));
                if labels.len() < labels.capacity() {
                    labels.push(super::RootLabel { start: sp, len: end - sp, kind: super::RootKind::Stack { tid, ip: 0, copied: false } });
                }
            }
        }
        let at = regs.as_ptr() as u64 + 8 * regs.len() as u64;
        let before = regs.len();
        for r in &s.regs {
            if regs.len() < regs.capacity() {
                regs.push(r.load(Ordering::Relaxed));
            }
        }
        if regs.len() > before && labels.len() < labels.capacity() {
            labels.push(super::RootLabel { start: at, len: 8 * (regs.len() - before) as u64, kind: super::RootKind::Registers { tid } });
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

/// The program thread that entered the library to write the final report (destructor,
/// `exit`, `_exit`), 0 when none did (the collector thread writes it).
static ENTRY_TID: AtomicU32 = AtomicU32::new(0);

/// Called first thing in an exit hook, on the thread that will scan.
#[inline(always)]
pub fn mark_entry() {
    ENTRY_TID.store(crate::hotpath::thread::tid(), Ordering::Relaxed);
}

/// Whether a frame's code is the C library's, the loader's or ours: the frames of the
/// exit path. Their unused slots still hold whatever earlier calls at the same depth
/// left there (the malloc hook's copy of a block address, say), so only the slots where
/// they saved their callers' registers are roots.
fn is_system_frame(ip: u64) -> bool {
    if crate::hotpath::unwind::is_own_address(ip) {
        return true;
    }
    let Some(m) = crate::hotpath::unwind::module_of(ip) else { return false };
    let path = m.path.as_bytes();
    file_name(path).starts_with(b"libc.so") || is_loader(path)
}

/// The roots on the stack of the thread that writes the final report, when it is a
/// program thread: every program frame whole; of the C library's, the loader's and the
/// library's own frames, the registers the program had there; and the callee-saved
/// registers as they are now where no such frame below the program's saved them (pushed
/// onto `regs`). Where the walk cannot go on, the rest of the stack is a root whole.
/// Call before threads are stopped (the walk allocates). Each range is labelled in
/// `labels` with the function whose frame it is.
///
/// A run of such frames between two program frames saves the outer program frame's
/// registers: for each register, the slot of the outermost frame of the run that saved
/// it holds the program's value. A slot that an inner frame of the run saved the same
/// register in holds what the run's own code had put there (the report's own variables
/// among them: the address of a block it was looking at), and so does a register that
/// a frame below the innermost program frame saved. Reading those as roots kept a
/// block the program had lost "reachable" (tests/fixtures/exit_roots.c, its stale slot
/// in a dead frame, once the report's code changed which registers it saved).
pub fn own_stack(maps: &[(u64, u64)], roots: &mut Vec<(u64, u64)>, regs: &mut Vec<u64>, labels: &mut Vec<super::RootLabel>) {
    let tid = ENTRY_TID.load(Ordering::Relaxed);
    if tid == 0 || tid != crate::hotpath::thread::tid() {
        return;
    }
    let here = &tid as *const u32 as u64;
    let Some(&(_, stack_end)) = maps.iter().find(|(a, b)| *a <= here && here < *b) else { return };
    let mut spans = Vec::with_capacity(64);
    let mut callee_saved = [0u64; 6];
    let end = crate::hotpath::unwind::walk_own_stack(stack_end, &mut callee_saved, |f| spans.push(*f));
    let frame = |ip: u64| super::RootKind::Stack { tid, ip, copied: false };
    let first = roots.len();
    let saves = program_register_slots(&spans, is_system_frame);
    for (f, own) in spans.iter().zip(&saves) {
        let from = roots.len();
        // The registers a system frame saved are its caller's: no function named.
        let ip = match own {
            Some(slots) => {
                roots.extend(slots.iter().flatten().map(|&a| (a, 8)));
                0
            }
            None => {
                roots.push((f.sp, f.cfa - f.sp));
                f.ip
            }
        };
        labels.extend(roots[from..].iter().map(|&(start, len)| super::RootLabel { start, len, kind: frame(ip) }));
    }
    // What a frame below the innermost program frame saved is the program's in its slot;
    // the register itself now holds the library's value.
    for (k, value) in callee_saved.iter_mut().enumerate() {
        if spans.iter().zip(&saves).take_while(|(_, own)| own.is_some()).any(|(f, _)| f.saved[k].is_some()) {
            *value = 0;
        }
    }
    if regs.len() + callee_saved.len() <= regs.capacity() {
        let at = regs.as_ptr() as u64 + 8 * regs.len() as u64;
        regs.extend_from_slice(&callee_saved);
        labels.push(super::RootLabel { start: at, len: 8 * callee_saved.len() as u64, kind: super::RootKind::Registers { tid } });
    }
    if let crate::hotpath::unwind::WalkEnd::Unknown(from) = end {
        roots.push((from, stack_end - from));
        labels.push(super::RootLabel { start: from, len: stack_end - from, kind: frame(0) });
    }
    debug_assert!(roots.len() >= first);
}

/// Per frame of `spans` (innermost first): `None` for a program frame (a root whole);
/// for a system frame, the slots among those it saved that hold a program frame's
/// registers: the register's save by the outermost system frame of its run (the frames
/// between two program frames, or outside the last one). See `own_stack`.
fn program_register_slots(spans: &[crate::hotpath::unwind::FrameSpan], is_system: impl Fn(u64) -> bool) -> Vec<Option<[Option<u64>; 6]>> {
    let mut out: Vec<Option<[Option<u64>; 6]>> = spans.iter().map(|f| is_system(f.ip).then_some([None; 6])).collect();
    // Per register, the frame of the current run that saved it last (outermost so far).
    let mut last: [Option<usize>; 6] = [None; 6];
    let flush = |last: &mut [Option<usize>; 6], out: &mut Vec<Option<[Option<u64>; 6]>>| {
        for (k, at) in last.iter_mut().enumerate() {
            if let Some(i) = at.take() {
                if let Some(slots) = out[i].as_mut() {
                    slots[k] = spans[i].saved[k];
                }
            }
        }
    };
    for (i, f) in spans.iter().enumerate() {
        if out[i].is_none() {
            flush(&mut last, &mut out);
            continue;
        }
        for (k, slot) in f.saved.iter().enumerate() {
            if slot.is_some() {
                last[k] = Some(i);
            }
        }
    }
    flush(&mut last, &mut out);
    out
}

/// Reads live process memory word by word, skipping anything not in `readable`.
pub struct ProcessMemory<'a> {
    /// `(start, end)` of each readable mapping, sorted and disjoint (as
    /// `/proc/self/maps` lists them).
    readable: &'a [(u64, u64)],
    /// Where root memory is copied to before it is read (`process_vm_readv`); `None`:
    /// roots are read in place, as blocks are.
    root_buffer: std::cell::Cell<Option<Box<[u64]>>>,
    /// The readable mapping that holds the scanning thread's own stack, which cannot go
    /// away while the scan runs on it: its roots (the registers that the C library's and
    /// our own frames saved, 8 bytes each) are read in place, not copied one system call
    /// at a time (58 of `git --version`'s 139 copies).
    own_stack: (u64, u64),
    /// In a forked child, where the copies are made through `/proc/self/mem` instead of
    /// `process_vm_readv` (`os::OwnMemory`): the memory it reads is mostly still its
    /// parent's, which `process_vm_readv` pins at 2.5-3x the cost and, by the workers'
    /// measure, made private (a DataLoader worker's USS at its exit report 52-60 MB,
    /// through `/proc/self/mem` 24-36).
    own_memory: Option<crate::os::OwnMemory>,
}

/// Blocks this large or larger are copied before they are read (`block_words`): glibc's
/// smallest mmap threshold.
const COPY_BLOCKS_FROM: u64 = 128 << 10;

/// Words copied at a time by `root_words`.
const ROOT_CHUNK_WORDS: usize = 8192;

/// Whether `process_vm_readv` may be called at all: not under a seccomp filter, which
/// may answer it with SIGSYS instead of an error (Chromium's sandboxed renderers crash on
/// it). `/proc/self/status` says ("Seccomp: 2" for a filter); where it cannot be read (a
/// sandbox without /proc), the answer is no. Read from the descriptor the library holds
/// (`procfs::unfiltered_now`: no `openat`, which a sandbox entered since may trap, and
/// within a report the answer its first step got); opened afresh only where the program
/// closed that one.
pub fn vm_readv_safe() -> bool {
    if crate::os::procfs::status_held() {
        return crate::os::procfs::unfiltered_now();
    }
    let status = crate::os::anchor::read_proc_string("self/status").unwrap_or_default();
    crate::os::procfs::unfiltered(&status)
}

/// Whether `read_own_memory` may be called now: not under a seccomp filter, which may
/// answer `process_vm_readv` with SIGSYS. Ask once per report, not per read.
pub fn copies_allowed() -> bool {
    crate::os::procfs::unfiltered_now()
}

/// `os::copy_own`, for reading words the scan named after it ran. Only where
/// `copies_allowed` said yes.
pub fn read_own_memory(from: u64, buf: &mut [u64]) -> usize {
    crate::os::copy_own(from, buf)
}

/// `os::copy_own_words`, for reading words the scan named after it ran. Only where
/// `copies_allowed` said yes.
pub fn read_own_words(addrs: &[u64]) -> Vec<Option<u64>> {
    crate::os::copy_own_words(addrs)
}

/// `os::copy_own_ranges`, for reading many short ranges the scan named after it ran.
/// Only where `copies_allowed` said yes.
pub fn read_own_ranges(ranges: &[(u64, usize)], buf: &mut [u64]) -> Vec<usize> {
    crate::os::copy_own_ranges(ranges, buf)
}

/// Copies `buf.len()` words from `from` (`os::copy_own`) and visits those that came;
/// returns how many.
#[inline(always)]
fn copy_visit(mem: Option<&crate::os::OwnMemory>, buf: &mut [u64], from: u64, visit: &mut impl FnMut(u64, u64)) -> usize {
    let got = match mem {
        Some(m) => m.copy(from, buf) / 8,
        None => crate::os::copy_own(from, buf) / 8,
    };
    for (k, &w) in buf[..got].iter().enumerate() {
        visit(from + 8 * k as u64, w);
    }
    got
}

/// Whether the page at `addr` is mapped at all (`mincore` answers ENOMEM where it is not),
/// without touching it.
fn still_mapped(addr: u64, page: u64) -> bool {
    let mut resident = [0u8; 1];
    // SAFETY: mincore writes one byte per page of the (page-aligned) range: one here.
    unsafe { libc::mincore(addr as *mut c_void, page as usize, resident.as_mut_ptr()) == 0 }
}

impl<'a> ProcessMemory<'a> {
    /// Reads roots and blocks in place (tests, and where the copy is refused).
    pub fn new(readable: &'a [(u64, u64)]) -> Self {
        ProcessMemory { readable, root_buffer: std::cell::Cell::new(None), own_stack: (0, 0), own_memory: None }
    }

    /// Copies root memory and large blocks with `process_vm_readv` before reading them:
    /// a mapping a thread the scan does not hold unmaps meanwhile (glibc frees cached
    /// thread stacks when a detached thread exits, say) makes the copy come short
    /// instead of faulting. Smaller blocks are read in place (`block_words`). Allocates:
    /// call before threads are held. Where the system refuses the call (seccomp),
    /// everything is read in place.
    pub fn copying_roots(readable: &'a [(u64, u64)], forked_child: bool) -> Self {
        let mut buf = vec![0u64; ROOT_CHUNK_WORDS].into_boxed_slice();
        let probe = [0x5eed_u64; 1];
        let works = vm_readv_safe() && crate::os::copy_own(probe.as_ptr() as u64, &mut buf[..1]) == 8 && buf[0] == 0x5eed;
        let here = &probe as *const [u64; 1] as u64;
        let own_stack = readable.iter().copied().find(|&(lo, hi)| lo <= here && here < hi).unwrap_or((0, 0));
        let own_memory = (works && forked_child).then(crate::os::OwnMemory::open).flatten();
        ProcessMemory { readable, root_buffer: std::cell::Cell::new(works.then_some(buf)), own_stack, own_memory }
    }

    /// The parts of `[start, start + len)` inside a readable mapping, in order. A
    /// module's data segment is often two mappings (.data from the file, .bss
    /// anonymous): every piece in a known mapping is read, never a guard page or a hole.
    /// The mappings are sorted and disjoint: start at the first that ends after `start`
    /// (a PyTorch process has hundreds, and this runs once per reached block).
    #[inline(always)]
    fn pieces(&self, start: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let end = start.saturating_add(len);
        let first = self.readable.partition_point(|&(_, b)| b <= start);
        self.readable[first..].iter().take_while(move |&&(a, _)| a < end).map(move |&(a, b)| (start.max(a), end.min(b))).filter(|(lo, hi)| lo < hi)
    }
}

impl Memory for ProcessMemory<'_> {
    fn words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        let mut any = false;
        for (lo, hi) in self.pieces(start, len) {
            any = true;
            let mut p = (lo + 7) & !7;
            while p + 8 <= hi {
                // SAFETY: [p, p+8) lies inside a mapping that was readable and writable
                // when the maps were read. What is read here in place (small blocks,
                // pymalloc's arenas, everything where the copy is refused) is assumed
                // not to be unmapped during the scan: see design.md for the exceptions.
                visit(p, unsafe { std::ptr::read_volatile(p as *const u64) });
                p += 8;
            }
        }
        any
    }

    fn block_words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        // Only a block the allocator gives its own mapping can vanish whole when freed
        // (glibc maps blocks from 128 KiB up, never smaller unless the program lowers
        // the threshold): those few are copied, the rest (nearly all) read in place.
        if len >= COPY_BLOCKS_FROM {
            self.root_words(start, len, visit)
        } else {
            self.words(start, len, visit)
        }
    }

    fn root_words(&self, start: u64, len: u64, visit: &mut impl FnMut(u64, u64)) -> bool {
        if start >= self.own_stack.0 && start.saturating_add(len) <= self.own_stack.1 {
            return self.words(start, len, visit);
        }
        let Some(mut buf) = self.root_buffer.take() else { return self.words(start, len, visit) };
        // A descriptor the program closed (and maybe opened something else on) since the
        // scan opened it is not read: the copies go through `process_vm_readv` then.
        let mem = self.own_memory.as_ref().filter(|m| m.still_open());
        let page = page_size();
        let mut any = false;
        for (lo, hi) in self.pieces(start, len) {
            any = true;
            let mut p = (lo + 7) & !7;
            while p + 8 <= hi {
                let want = (((hi - p) / 8) as usize).min(ROOT_CHUNK_WORDS);
                let got = copy_visit(mem, &mut buf[..want], p, visit);
                p += got as u64 * 8;
                if got < want {
                    // Something in the chunk was unmapped since the maps were read, or
                    // is mapped in a way the copy cannot read (a driver's mapping): the
                    // rest of this page alone; if it will not copy either, it is read in
                    // place while the kernel still has it mapped, else skipped.
                    let page_start = p / page * page;
                    let end = (page_start + page).min(hi);
                    let n = ((end - p) / 8) as usize;
                    let got = copy_visit(mem, &mut buf[..n], p, visit);
                    if got < n && still_mapped(page_start, page) {
                        self.words(p + got as u64 * 8, end - (p + got as u64 * 8), visit);
                    }
                    p = end;
                }
            }
        }
        self.root_buffer.set(Some(buf));
        any
    }
}

static MAIN_TLS: std::sync::OnceLock<Vec<(u64, u64)>> = std::sync::OnceLock::new();

/// Records the calling (main) thread's static TLS blocks: ld.so allocates them outside
/// any thread stack, so the scan adds them as roots even when another thread scans.
pub fn record_main_tls() {
    record_main_tls_of(None);
}

/// `record_main_tls` from another thread than the main one (a library loaded late by
/// `leaktrace attach`, on whichever thread it was loaded), given the main thread's
/// thread pointer: every thread's static TLS lies at the same offsets from its own.
pub fn record_main_tls_of(main_tp: Option<u64>) {
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
    unsafe { crate::os::loader::iterate_modules(Some(visit), &mut out as *mut _ as *mut c_void) };
    // The main thread's control block (`struct pthread`): its `dtv` points to the TLS
    // blocks of modules loaded later (dlopen), which ld.so allocates with malloc, and its
    // first block of `pthread_setspecific` values holds what the program keeps there.
    // Other threads have their control block at the top of their stack mapping, which
    // the scan reads anyway. glibc publishes the structure's size for debuggers.
    let mut fs: u64 = 0;
    const ARCH_GET_FS: libc::c_long = 0x1003;
    let [size_sym, info] = crate::os::loader::library_symbols([c"_thread_db_sizeof_pthread", c"_dl_get_tls_static_info"]);
    // SAFETY: glibc's `const uint32_t _thread_db_sizeof_pthread`, when it exists.
    let pthread_size = size_sym.map(|p| u64::from(unsafe { *(p as *const u32) })).filter(|s| (64..1 << 16).contains(s));
    // SAFETY: arch_prctl(ARCH_GET_FS) writes the thread pointer to a valid u64.
    if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_FS, &mut fs as *mut u64) } == 0 && fs != 0 {
        out.push((fs, pthread_size.unwrap_or(64)));
        // The whole static TLS area below the thread pointer, its surplus included:
        // glibc places the TLS of a module loaded later with dlopen there when it fits,
        // and only modules loaded before now are in the list above.
        if let (Some(info), Some(tcb)) = (info, pthread_size) {
            let (mut size, mut align) = (0usize, 0usize);
            // SAFETY: ld.so's `void _dl_get_tls_static_info (size_t *, size_t *)`.
            unsafe { std::mem::transmute::<usize, extern "C" fn(*mut usize, *mut usize)>(info)(&mut size, &mut align) };
            if let Some(below) = static_tls_below_thread_pointer(size as u64, tcb, fs) {
                out.push((fs - below, below));
            }
        }
        if let Some(tp) = main_tp.filter(|&tp| tp != fs && tp != 0) {
            out = as_main_threads(&out, fs, tp, pthread_size.unwrap_or(64));
            fs = tp;
        }
        MAIN_THREAD_POINTER.store(fs, Ordering::Relaxed);
    }
    let _ = MAIN_TLS.set(out);
}

/// The calling thread's TLS ranges `own` (its thread pointer `fs`) moved to the main
/// thread's (`main_tp`): those in the static area (below the thread pointer, the
/// control block above it) at the same offsets; the others (blocks of modules loaded
/// with dlopen, allocated per thread) left out: the main thread's are found through its
/// dtv (`main_dtv`).
fn as_main_threads(own: &[(u64, u64)], fs: u64, main_tp: u64, tcb: u64) -> Vec<(u64, u64)> {
    let low = own.iter().filter(|r| r.0 <= fs && r.0.saturating_add(r.1) >= fs).map(|r| r.0).min().unwrap_or(fs);
    own.iter()
        .filter(|r| r.0 >= low && r.0.saturating_add(r.1) <= fs.saturating_add(tcb.max(r.1)))
        .map(|&(a, len)| (a.wrapping_sub(fs).wrapping_add(main_tp), len))
        .collect()
}

/// How many bytes of static TLS lie below the thread pointer (x86-64 puts the thread
/// control block after the TLS blocks). The size ld.so reports covers the control block
/// too: the area is one allocation `[fs - (size - tcb), fs + tcb)`. Taking all of `size`
/// below `fs` read up to `tcb` bytes of whatever lies under that allocation — the top of
/// a thread stack or a mapping that may be unmapped while the scan reads it (a forked
/// child's scan faulted there about once in 100 runs).
fn static_tls_below_thread_pointer(size: u64, tcb: u64, fs: u64) -> Option<u64> {
    let below = size.checked_sub(tcb)?;
    (below > 0 && below < 1 << 24 && below <= fs).then_some(below)
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

/// Root ranges cut down to the pages a program can have stored a pointer in.
///
/// A private file mapping's page that was never written still holds the file's bytes,
/// and a `.bss` page never touched is zero: neither can hold a heap address. Libraries
/// with embedded GPU code have writable segments of hundreds of MiB that are almost all
/// such pages (libcufft: 269 MiB, 10 pages written), so reading them made every scan of
/// a PyTorch process read over 500 MiB. `/proc/self/pagemap` tells written pages apart:
/// present and anonymous (copied on write), or swapped out.
pub struct WrittenPages {
    fd: libc::c_int,
    entries: Vec<u64>,
}

const PAGEMAP_CHUNK: usize = 4096;
#[cfg(test)]
use crate::os::pagemap::FILE_OR_SHARED as PM_FILE_OR_SHARED;
use crate::os::pagemap::{page_written, EXCLUSIVE as PM_EXCLUSIVE, PRESENT as PM_PRESENT, SWAPPED as PM_SWAPPED};

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as u64
    } else {
        4096
    }
}

impl WrittenPages {
    /// Opens the page map and allocates the read buffer (call before threads are
    /// stopped). Without a readable page map every range is kept whole.
    pub fn prepare() -> WrittenPages {
        // The fd is closed in Drop.
        let fd = crate::os::anchor::open_proc("self/pagemap", libc::O_RDONLY).unwrap_or(-1);
        WrittenPages { fd, entries: if fd >= 0 { vec![0; PAGEMAP_CHUNK] } else { Vec::new() } }
    }

    /// The most ranges `keep_written` can push for `ranges`: reserve this much first.
    pub fn bound(ranges: &[(u64, u64)]) -> usize {
        let page = page_size();
        ranges.iter().map(|&(_, l)| (l.div_ceil(page) as usize + 2) / 2 + 1).sum()
    }

    /// Pushes onto `out` the parts of `ranges` that lie on written pages. Never
    /// allocates: with less spare capacity than `bound` asked for, the last pushed part
    /// is widened to the end of its range instead; where the page map cannot be read, the
    /// rest of the range is kept.
    pub fn keep_written(&mut self, ranges: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
        self.keep_pages(ranges, out, page_written);
    }

    /// Like `keep_written`, for the heap a forked child inherited: pushes the parts of
    /// `ranges` on pages that may have changed since the fork. A page still shared
    /// with another process (mapped more than once) was written by no one since the
    /// fork — a write would have given the writer its own copy — so it holds no
    /// address the child allocated.
    pub fn keep_changed_since_fork(&mut self, ranges: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
        self.keep_pages(ranges, out, page_changed_since_fork);
    }

    /// `keep_written` in a forked child: only the written pages that may have changed
    /// since the fork (see `keep_changed_since_fork`).
    pub fn keep_written_since_fork(&mut self, ranges: &[(u64, u64)], out: &mut Vec<(u64, u64)>) {
        self.keep_pages(ranges, out, page_written_since_fork);
    }

    fn keep_pages(&mut self, ranges: &[(u64, u64)], out: &mut Vec<(u64, u64)>, keep: fn(u64) -> bool) {
        let page = page_size();
        'ranges: for &(start, len) in ranges {
            let end = start.saturating_add(len);
            if start >= end {
                continue;
            }
            let first_page = start / page;
            let pages = end.div_ceil(page) - first_page;
            let mut done = 0u64;
            let mut run_start: Option<u64> = None;
            while done < pages {
                let n = (pages - done).min(PAGEMAP_CHUNK as u64) as usize;
                let chunk_addr = (first_page + done) * page;
                let read_ok = crate::os::pagemap::read(self.fd, first_page + done, &mut self.entries[..n]);
                if !read_ok {
                    push_part(out, run_start.unwrap_or(chunk_addr), end, start, end);
                    continue 'ranges;
                }
                let runs = page_runs(&self.entries[..n], chunk_addr, page, &mut run_start, keep);
                for (a, b) in runs {
                    push_part(out, a, b, start, end);
                }
                done += n as u64;
            }
            if let Some(s) = run_start {
                push_part(out, s, end, start, end);
            }
        }
    }
}

/// Whether a page of inherited heap may hold something written since the fork: mapped
/// by this process alone (its own copy, or the other sharers have let go of it), or
/// swapped out (unknown). A page never touched at all reads as zeros.
fn page_changed_since_fork(entry: u64) -> bool {
    (entry & PM_PRESENT != 0 && entry & PM_EXCLUSIVE != 0) || entry & PM_SWAPPED != 0
}

/// Whether a page of module data in a forked child may hold something the child wrote:
/// written, and not shared with the parent.
fn page_written_since_fork(entry: u64) -> bool {
    page_written(entry) && page_changed_since_fork(entry)
}

/// The runs of pages among `entries` (pages from `base`) that `keep` accepts, as
/// address ranges; a run still open at the end is left in `open` for the next chunk.
fn page_runs<'a>(entries: &'a [u64], base: u64, page: u64, open: &'a mut Option<u64>, keep: fn(u64) -> bool) -> impl Iterator<Item = (u64, u64)> + 'a {
    entries.iter().enumerate().filter_map(move |(i, &e)| {
        let addr = base + i as u64 * page;
        match (keep(e), *open) {
            (true, None) => {
                *open = Some(addr);
                None
            }
            (false, Some(s)) => {
                *open = None;
                Some((s, addr))
            }
            _ => None,
        }
    })
}

/// Pushes `[a, b)` clipped to `[start, end)`, or, when `out` has no spare capacity,
/// widens its last part to reach `end` (a superset of roots is safe; allocating while
/// threads are stopped is not).
fn push_part(out: &mut Vec<(u64, u64)>, a: u64, b: u64, start: u64, end: u64) {
    let (a, b) = (a.max(start), b.min(end));
    if a >= b {
        return;
    }
    if out.len() < out.capacity() {
        out.push((a, b - a));
    } else if let Some(last) = out.last_mut().filter(|l| l.0 >= start) {
        last.1 = end.max(last.0 + last.1) - last.0;
    }
}

impl Drop for WrittenPages {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: our own descriptor, closed once.
            unsafe { libc::close(self.fd) };
        }
    }
}

/// Ranges the program registered as roots with `__lsan_register_root_region`.
static ROOT_REGIONS: crate::os::lock::SpinLock<Vec<(u64, u64)>> = crate::os::lock::SpinLock::new(Vec::new());

/// `__lsan_register_root_region`: `[start, start + size)` is read as a root by every
/// later scan, until unregistered.
pub fn register_root_region(start: u64, size: u64) {
    if size > 0 {
        ROOT_REGIONS.lock().push((start, size));
    }
}

/// `__lsan_unregister_root_region`: forgets one registration of exactly that range;
/// false when there is none (LeakSanitizer reports that as an error).
pub fn unregister_root_region(start: u64, size: u64) -> bool {
    let mut regions = ROOT_REGIONS.lock();
    match regions.iter().position(|&r| r == (start, size)) {
        Some(i) => {
            regions.swap_remove(i);
            true
        }
        None => false,
    }
}

/// The registered root regions, as the scan reads them (only the readable parts).
pub fn root_regions() -> Vec<(u64, u64)> {
    ROOT_REGIONS.lock().clone()
}

/// Threads created and not yet running: the arguments they were given. Until the new
/// thread's prologue takes it, a start argument lives only in our `Start` block and in
/// the C library's thread descriptor, neither of them read by the pointer scan; a scan
/// that stops such a thread (it is stopped before its first instruction) counted the
/// block its argument points to as leaked (CPython's thread `bootstate`), written by `interpose::threads`. The scan reads
/// a copy of this array as a root (`pending_args`). A thread created while every slot is
/// taken is not listed (its argument is then only as visible as before).
pub const PENDING: usize = 256;
#[allow(clippy::declare_interior_mutable_const)]
const NO_ARG: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PENDING_ARGS: [std::sync::atomic::AtomicUsize; PENDING] = [NO_ARG; PENDING];

/// Lists `arg` until its thread runs; returns the slot, or `PENDING` when none is free
/// (or there is nothing to list).
pub fn list_pending(arg: usize) -> usize {
    if arg == 0 {
        return PENDING;
    }
    PENDING_ARGS.iter().position(|s| s.compare_exchange(0, arg, Ordering::AcqRel, Ordering::Relaxed).is_ok()).unwrap_or(PENDING)
}

pub fn unlist_pending(slot: usize) {
    if let Some(s) = PENDING_ARGS.get(slot) {
        s.store(0, Ordering::Release);
    }
}

/// The arguments of the threads not yet running, copied now: the scan reads the copy (a
/// thread that blocks signals is not stopped by the scan, and may take its argument
/// out of the list and free the block while the scan reads).
pub fn pending_args() -> Vec<u64> {
    PENDING_ARGS.iter().map(|s| s.load(Ordering::Acquire) as u64).filter(|&a| a != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;
    const W: u64 = PM_PRESENT; // present, anonymous
    const F: u64 = PM_PRESENT | PM_FILE_OR_SHARED; // present, still the file's page
    const S: u64 = PM_SWAPPED;

    /// Roots and large blocks are copied: a page unmapped after the maps were read is skipped, the rest of
    /// the range read whole (in place, the read would fault), and where nothing changed
    /// the copy reads what an in-place read does.
    #[test]
    fn a_root_or_large_block_page_unmapped_after_the_maps_were_read_is_skipped_not_faulted_on() {
        // Copied with `process_vm_readv`, and through `/proc/self/mem` as in a forked child.
        unmapped_pages_are_skipped(false);
        unmapped_pages_are_skipped(true);
    }

    fn unmapped_pages_are_skipped(forked_child: bool) {
        let page = page_size();
        let pages = 2 * ROOT_CHUNK_WORDS as u64 * 8 / page + 3;
        // SAFETY: a fresh anonymous mapping, written and unmapped only here.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), (pages * page) as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        } as u64;
        assert_ne!(base, libc::MAP_FAILED as u64);
        let words = pages * page / 8;
        for i in 0..words {
            // SAFETY: inside the mapping made above.
            unsafe { *((base + i * 8) as *mut u64) = i };
        }
        let readable = [(base, base + pages * page)];
        let mem = ProcessMemory::copying_roots(&readable, forked_child);
        assert_eq!(mem.own_memory.is_some(), forked_child && vm_readv_safe());
        let (mut copied, mut in_place) = (Vec::new(), Vec::new());
        assert!(mem.root_words(base + 12, pages * page - 20, &mut |_, w| copied.push(w)));
        mem.words(base + 12, pages * page - 20, &mut |_, w| in_place.push(w));
        assert_eq!(copied, in_place);
        // Unmap one page in the middle of the second chunk, one at the very end.
        let gone = [ROOT_CHUNK_WORDS as u64 * 8 / page + 1, pages - 1];
        for g in gone {
            // SAFETY: pages of the mapping made above, not used again.
            unsafe { libc::munmap((base + g * page) as *mut c_void, page as usize) };
        }
        let mut seen = Vec::new();
        assert!(mem.root_words(base, pages * page, &mut |_, w| seen.push(w)));
        let expected: Vec<u64> = (0..words).filter(|i| !gone.contains(&(i * 8 / page))).collect();
        assert_eq!(seen.len(), expected.len());
        assert!(seen == expected);
        // A block as large (one the allocator maps on its own, and unmaps when it is
        // freed) is copied the same way.
        assert!(pages * page >= COPY_BLOCKS_FROM);
        let mut seen = Vec::new();
        assert!(mem.block_words(base, pages * page, &mut |_, w| seen.push(w)));
        assert!(seen == expected);
        // SAFETY: the mapping made above (its holes are fine to unmap again).
        unsafe { libc::munmap(base as *mut c_void, (pages * page) as usize) };
    }

    /// Between two program frames, each register's program value is in the slot of the
    /// outermost system frame that saved it; an inner frame's save of the same register
    /// holds the system code's own value, and is no root.
    #[test]
    fn only_the_outermost_save_of_a_run_of_system_frames_holds_the_programs_register() {
        use crate::hotpath::unwind::FrameSpan;
        let span = |ip: u64, saved: [Option<u64>; 6]| FrameSpan { ip, sp: 0, cfa: 0, saved };
        // ip 1: system frames, ip 2: program frames; innermost first.
        let spans = [
            span(1, [Some(0x10), Some(0x18), None, None, None, None]),
            span(1, [Some(0x20), None, Some(0x28), None, None, None]),
            span(2, [Some(0x30), None, None, None, None, None]),
            span(1, [None, None, None, Some(0x40), None, None]),
            span(1, [None, None, None, Some(0x50), None, Some(0x58)]),
            span(2, [None; 6]),
            span(1, [Some(0x60), None, None, None, None, None]),
        ];
        let got = program_register_slots(&spans, |ip| ip == 1);
        assert_eq!(got[0], Some([None, Some(0x18), None, None, None, None]), "rbx: saved again further out");
        assert_eq!(got[1], Some([Some(0x20), None, Some(0x28), None, None, None]));
        assert_eq!(got[2], None, "a program frame is a root whole");
        assert_eq!(got[3], Some([None; 6]), "r13: saved again further out");
        assert_eq!(got[4], Some([None, None, None, Some(0x50), None, Some(0x58)]));
        assert_eq!(got[5], None);
        assert_eq!(got[6], Some([Some(0x60), None, None, None, None, None]), "outside the last program frame");
    }

    /// Roots on the scanning thread's own stack (the registers its callers saved) are
    /// read in place: that stack cannot be unmapped while the scan runs on it.
    #[test]
    fn roots_on_the_scanning_threads_own_stack_are_read_in_place() {
        let words = std::hint::black_box([11u64, 22, 33, 44]);
        let at = words.as_ptr() as u64;
        let maps = writable_mappings();
        let mem = ProcessMemory::copying_roots(&maps, false);
        assert!(mem.own_stack.0 <= at && at + 32 <= mem.own_stack.1, "{:#x?} holds {at:#x}", mem.own_stack);
        let mut seen = Vec::new();
        for k in 0..4 {
            assert!(mem.root_words(at + 8 * k, 8, &mut |a, w| seen.push((a - at, w))));
        }
        assert_eq!(seen, vec![(0, 11), (8, 22), (16, 33), (24, 44)]);
        // Elsewhere, nothing is taken for the stack.
        assert!(mem.own_stack.1 - mem.own_stack.0 < 1 << 30);
    }

    #[test]
    fn still_mapped_tells_a_mapped_page_from_an_unmapped_one() {
        let page = page_size();
        // SAFETY: a fresh anonymous mapping of two pages, one unmapped at once.
        let base =
            unsafe { libc::mmap(std::ptr::null_mut(), 2 * page as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) }
                as u64;
        assert_ne!(base, libc::MAP_FAILED as u64);
        // SAFETY: the second page of the mapping above.
        unsafe { libc::munmap((base + page) as *mut c_void, page as usize) };
        assert!(still_mapped(base, page), "mapped, never touched");
        assert!(!still_mapped(base + page, page));
        // SAFETY: the first page of the mapping above.
        unsafe { libc::munmap(base as *mut c_void, page as usize) };
        assert!(!still_mapped(base, page));
    }

    /// glibc's static TLS size counts the thread control block: only the rest lies below
    /// the thread pointer, and every module's static TLS block of this thread is in it.
    #[test]
    fn another_threads_static_tls_moves_to_the_main_threads_offsets() {
        let fs = 0x7000_0000u64;
        let main = 0x5000_0000u64;
        // The static area below, the control block at the pointer, one module's block in
        // the area, and a dlopen'ed module's block elsewhere (left out).
        let own = [(fs - 0x1000, 0x1000), (fs, 0x900), (fs - 0x200, 0x80), (0x1234_0000, 0x40)];
        let moved = as_main_threads(&own, fs, main, 0x900);
        assert_eq!(moved, vec![(main - 0x1000, 0x1000), (main, 0x900), (main - 0x200, 0x80)]);
    }

    #[test]
    fn static_tls_below_the_thread_pointer_leaves_out_the_control_block() {
        assert_eq!(static_tls_below_thread_pointer(0x1140, 0x940, 1 << 40), Some(0x800));
        assert_eq!(static_tls_below_thread_pointer(0x900, 0x940, 1 << 40), None);
        assert_eq!(static_tls_below_thread_pointer(0x1140, 0x940, 0x100), None);
        // This thread's real numbers.
        // SAFETY (this test's blocks): dlsym with valid names; glibc's published u32 and
        // `_dl_get_tls_static_info` of that prototype; arch_prctl writing one u64; a
        // dl_iterate_phdr callback that reads the headers glibc hands it into our Vec.
        let size_sym = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_thread_db_sizeof_pthread".as_ptr()) };
        let info = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_get_tls_static_info".as_ptr()) };
        assert!(!size_sym.is_null() && !info.is_null(), "glibc publishes both");
        let tcb = u64::from(unsafe { *(size_sym as *const u32) });
        let (mut size, mut align) = (0usize, 0usize);
        unsafe { std::mem::transmute::<*mut c_void, extern "C" fn(*mut usize, *mut usize)>(info)(&mut size, &mut align) };
        let mut fs = 0u64;
        assert_eq!(unsafe { libc::syscall(libc::SYS_arch_prctl, 0x1003, &mut fs as *mut u64) }, 0);
        let below = static_tls_below_thread_pointer(size as u64, tcb, fs).unwrap();
        extern "C" fn visit(info: *mut libc::dl_phdr_info, _: usize, data: *mut c_void) -> libc::c_int {
            unsafe {
                if !(*info).dlpi_tls_data.is_null() {
                    (*(data as *mut Vec<u64>)).push((*info).dlpi_tls_data as u64);
                }
            }
            0
        }
        let mut blocks: Vec<u64> = Vec::new();
        unsafe { libc::dl_iterate_phdr(Some(visit), &mut blocks as *mut _ as *mut c_void) };
        assert!(!blocks.is_empty());
        for b in blocks {
            assert!(b >= fs - below && b < fs, "{b:#x} outside [{:#x}, {fs:#x})", fs - below);
        }
    }

    /// Every word of the asked range that lies in a listed mapping is read once, in
    /// order, and nothing outside: checked against a filter over all the mappings, on
    /// "mappings" cut from one real buffer with holes between them.
    #[test]
    fn process_memory_reads_exactly_the_mapped_words_of_a_range() {
        let buf: Vec<u64> = (0..512).map(|i| 0x5000 + i).collect();
        let base = buf.as_ptr() as u64;
        let at = |word: u64| base + word * 8;
        // Word ranges [from, to) of buf, sorted and disjoint, with holes and two that touch.
        let pieces = [(2u64, 40u64), (40, 64), (100, 101), (130, 300), (301, 302), (400, 512)];
        let readable: Vec<(u64, u64)> = pieces.iter().map(|&(a, b)| (at(a), at(b))).collect();
        let mem = ProcessMemory::new(&readable);
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2000 {
            let rng = rng.next_u64();
            // Byte ranges that may start or end mid-word, or outside the buffer.
            let start = base - 64 + rng % (520 * 8);
            let len = (rng >> 20) % (300 * 8);
            let mut seen = Vec::new();
            let any = mem.words(start, len, &mut |_, w| seen.push(w));
            let end = start + len;
            let expected: Vec<u64> = readable
                .iter()
                .flat_map(|&(a, b)| {
                    let (lo, hi) = (start.max(a), end.min(b));
                    let first = (lo + 7) & !7;
                    (first..hi.max(first)).step_by(8).filter(move |p| p + 8 <= hi)
                })
                .map(|p| 0x5000 + (p - base) / 8)
                .collect();
            assert_eq!(seen, expected, "range {:#x}+{len}", start - base);
            assert_eq!(any, readable.iter().any(|&(a, b)| start.max(a) < end.min(b)));
        }
    }

    #[test]
    fn runs_of_written_pages_continue_across_chunks() {
        let mut open = None;
        let runs: Vec<_> = page_runs(&[0, W, W, F, S, 0, W], 0x10000, P, &mut open, page_written).collect();
        assert_eq!(runs, vec![(0x11000, 0x13000), (0x14000, 0x15000)]);
        assert_eq!(open, Some(0x16000));
        let runs: Vec<_> = page_runs(&[W, 0], 0x17000, P, &mut open, page_written).collect();
        assert_eq!(runs, vec![(0x16000, 0x18000)]);
        assert_eq!(open, None);
    }

    #[test]
    fn parts_are_clipped_and_a_full_vector_is_widened_not_grown() {
        let mut out = Vec::with_capacity(2);
        push_part(&mut out, 0x1000, 0x3000, 0x1800, 0x2800);
        assert_eq!(out, vec![(0x1800, 0x1000)]);
        push_part(&mut out, 0x5000, 0x6000, 0x4000, 0x9000);
        push_part(&mut out, 0x7000, 0x8000, 0x4000, 0x9000);
        assert_eq!(out.capacity(), 2);
        assert_eq!(out, vec![(0x1800, 0x1000), (0x5000, 0x4000)]);
    }

    #[test]
    fn this_process_keeps_its_written_globals_and_drops_untouched_bss() {
        static mut WRITTEN: [u64; 4096] = [0; 4096];
        static UNTOUCHED: [u64; 8192] = [0; 8192];
        // SAFETY: a test-only global, written by this test alone.
        unsafe {
            let p = &raw mut WRITTEN;
            (*p)[100] = 42;
        }
        let written = (&raw const WRITTEN) as u64;
        let untouched = UNTOUCHED.as_ptr() as u64;
        let ranges = [(written, 4096 * 8), (untouched + P, 4096 * 8)];
        let mut pages = WrittenPages::prepare();
        let mut out = Vec::with_capacity(WrittenPages::bound(&ranges));
        pages.keep_written(&ranges, &mut out);
        let covers = |a: u64| out.iter().any(|&(s, l)| s <= a && a < s + l);
        assert!(covers(written + 800), "{out:x?}");
        assert!(!covers(untouched + 2 * P), "{out:x?}");
        assert!(out.iter().all(|&(s, l)| ranges.iter().any(|&(rs, rl)| s >= rs && s + l <= rs + rl)));
    }

    #[test]
    fn a_forked_child_keeps_the_pages_it_wrote_and_drops_those_still_shared() {
        // Eight pages of heap, every one written by the parent (so all are present and
        // shared after the fork); the child then writes page 5 only.
        let mut heap = vec![1u64; 8 * 512 + 512];
        let base = (heap.as_ptr() as u64 + P - 1) & !(P - 1);
        let ranges = [(base, 8 * P)];
        let mut pages = WrittenPages::prepare();
        let mut out = Vec::with_capacity(WrittenPages::bound(&ranges));
        let first = ((base - heap.as_ptr() as u64) / 8) as usize;
        // SAFETY: the child only touches memory prepared above, reads the page map with
        // a descriptor and buffer made before the fork, and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            heap[first + 5 * 512 + 3] = 7;
            pages.keep_changed_since_fork(&ranges, &mut out);
            let covers = |a: u64| out.iter().any(|&(s, l)| s <= a && a < s + l);
            let ok = covers(base + 5 * P + 24) && (0..8).filter(|&p| p != 5).all(|p| !covers(base + p * P));
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child saw the wrong pages (status {status})");
        // The child wrote its own copy.
        assert_eq!(heap[first + 5 * 512 + 3], 1);
    }

    #[test]
    fn pages_changed_since_fork_are_the_exclusive_and_the_swapped() {
        let mut open = None;
        const X: u64 = PM_PRESENT | PM_EXCLUSIVE;
        let runs: Vec<_> = page_runs(&[W, X, X, W, S, 0, X], 0x10000, P, &mut open, page_changed_since_fork).collect();
        assert_eq!(runs, vec![(0x11000, 0x13000), (0x14000, 0x15000)]);
        assert_eq!(open, Some(0x16000));
        // Module data in a forked child: written and not shared; a file page the child
        // alone maps is still the file's.
        let mut open = None;
        let runs: Vec<_> = page_runs(&[W, X, F | PM_EXCLUSIVE, S, 0], 0x10000, P, &mut open, page_written_since_fork).collect();
        assert_eq!(runs, vec![(0x11000, 0x12000), (0x13000, 0x14000)]);
    }

    #[test]
    fn a_system_call_and_its_stack_pointer_are_read_from_proc() {
        let asleep = "7 0x7ffc0d5e1a40 0x1 0xffffffff 0x0 0x0 0x0 0x7ffc0d5e1a18 0x7f3a5b2e8d7f\n";
        assert_eq!(parse_syscall(asleep), Some((7, 0x7ffc_0d5e_1a18)));
        assert_eq!(parse_syscall("-1 0x7ffc0d5e1a18 0x7f3a5b2e8d7f\n"), None);
        assert_eq!(parse_syscall("running\n"), None);
        assert_eq!(parse_syscall(""), None);
        assert_eq!(libc::SYS_rt_sigprocmask, 14, "x86-64's number, which `in_system_call` passes over");
    }

    #[test]
    fn the_blocked_signal_mask_is_read_from_status() {
        let status = "Name:\tx\nSigPnd:\t0000000000000000\nSigBlk:\t0000000000010000\nSigIgn:\t0\n";
        assert!(blocks_signal(status, 17));
        assert!(!blocks_signal(status, 16) && !blocks_signal(status, 0) && !blocks_signal("", 17));
    }

    /// A thread that runs with every signal blocked for a moment (as one inside
    /// `pthread_create`, or starting the collector from a hook) is held once it lets the
    /// signal through, not left unread; one asleep with the signal blocked, a pool's, is
    /// copied. Waits as long as a loaded machine needs (the library's own are shorter).
    #[test]
    fn a_thread_that_blocks_the_stop_signal_for_a_moment_is_held_not_skipped() {
        use std::sync::atomic::AtomicBool;
        use std::sync::{mpsc, Arc};
        if !install() {
            crate::test_skip::skip_not_here("no real-time signal free for the scan's stop");
            return;
        }
        let block_all = || {
            // SAFETY: this thread's own mask, from a full local set.
            unsafe {
                let mut all: libc::sigset_t = std::mem::zeroed();
                libc::sigfillset(&mut all);
                libc::pthread_sigmask(libc::SIG_SETMASK, &all, std::ptr::null_mut());
            }
        };
        let (blocked, release) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (brief_tx, brief_rx) = mpsc::channel();
        let (pool_tx, pool_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let done_rx = Arc::new(std::sync::Mutex::new(done_rx));
        let gettid = || {
            // SAFETY: gettid cannot fail.
            unsafe { libc::syscall(libc::SYS_gettid) as u32 }
        };
        let brief = {
            let (blocked, release) = (blocked.clone(), release.clone());
            std::thread::spawn(move || {
                brief_tx.send(gettid()).unwrap();
                block_all();
                blocked.store(true, Ordering::SeqCst);
                // Running, the signal blocked, until released.
                while !release.load(Ordering::SeqCst) {
                    std::hint::spin_loop();
                }
                // SAFETY: this thread's own mask, from an empty local set.
                unsafe {
                    let mut none: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut none);
                    libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            })
        };
        let pool = {
            let done_rx = done_rx.clone();
            std::thread::spawn(move || {
                pool_tx.send(gettid()).unwrap();
                block_all();
                let _ = done_rx.lock().unwrap().recv();
            })
        };
        let (brief_tid, pool_tid) = (brief_rx.recv().unwrap(), pool_rx.recv().unwrap());
        let started = std::time::Instant::now();
        while !(blocked.load(Ordering::SeqCst) && in_system_call(pool_tid)) && started.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let releaser = {
            let release = release.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(20));
                release.store(true, Ordering::SeqCst);
            })
        };
        let (ask, blocking) = split_blocking_after(&[brief_tid, pool_tid], &[5_000; 2_000]);
        release.store(true, Ordering::SeqCst);
        drop(done_tx);
        releaser.join().unwrap();
        brief.join().unwrap();
        pool.join().unwrap();
        assert_eq!((ask, blocking), (vec![brief_tid], vec![pool_tid]));
    }
}
