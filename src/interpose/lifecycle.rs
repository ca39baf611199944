//! Process lifecycle: library constructor and destructor, `exit`, `quick_exit`,
//! `_exit`/`_Exit`, `dlclose`,
//! fork handlers and the snapshot signal.
// In unit-test builds the constructor is left out, and with it the code it reaches.
#![cfg_attr(test, allow(dead_code))]
// C entry points (`_exit`, `dlclose`): their contract is the C library's.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::real;
use crate::agent;
use crate::config::Config;
use crate::lifecycle::LIFECYCLE;

extern "C" fn on_load(argc: c_int, argv: *const *const std::ffi::c_char, envp: *const *const std::ffi::c_char) {
    // SAFETY: glibc calls each `.init_array` entry with its `argc`, `argv` and `envp`,
    // valid for the constructor's run (`note` checks their shape, `forget` ends it).
    unsafe { crate::os::startup::WINDOW.note(argc, argv, envp) };
    // The constructor must never unwind into the dynamic loader.
    let _ = std::panic::catch_unwind(on_load_steps);
    crate::os::startup::WINDOW.forget();
}

/// The constructor's work, inside its `catch_unwind`.
fn on_load_steps() {
    real::ensure_resolved();
    crate::os::fds::note_stderr();
    // An internal error is one line on the program's stderr, never a backtrace.
    std::panic::set_hook(Box::new(|info| crate::os::fds::stderr_line(&format!("leaktrace: internal error: {info}"))));
    let vars = crate::os::environ::at_start_with_prefix("LEAKTRACE_");
    let config = Config::from_lookup(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()), |w| crate::os::fds::stderr_line(&w));
    // Read here, in the constructor: the collector thread must not read the
    // environment while the program's threads may `setenv`.
    crate::os::spill::note_tmpdir();
    if config.disabled {
        super::threads::pass_through();
        return;
    }
    // For counting the library's instructions with callgrind or cachegrind, which leave
    // malloc alone (`scripts/bench_instructions.sh`): on this machine's shared cores a
    // wall or CPU time moves by 5-10% from run to run, an instruction count does not.
    let counting = vars.iter().any(|(n, v)| n == "LEAKTRACE_TEST_UNDER_CALLGRIND" && v == "1");
    // The names of the runtimes the library gives way to, looked up in one walk.
    let [valgrind, runtimes @ ..] =
        crate::os::loader::global_symbols([c"_vgnU_freeres", c"__asan_init", c"__tsan_init", c"__msan_init", c"__hwasan_init", c"__lsan_init"]);
    if !counting && valgrind.is_some() {
        // valgrind's preloaded core: its tools replace malloc and check memory
        // themselves (helgrind called our spin lock's atomics "possible data races"
        // and failed --error-exitcode); the library stays off, as under a sanitizer.
        super::threads::pass_through();
        crate::os::fds::stderr_line("leaktrace: this program runs under valgrind, which replaces malloc and checks memory itself: leaktrace stays off in this process (use valgrind's own leak check)");
        return;
    }
    if let Some(sanitizer) = sanitizer_runtime(runtimes) {
        super::threads::pass_through();
        crate::os::fds::stderr_line(&format!(
            "leaktrace: this program runs {sanitizer}, which replaces malloc and tracks allocations itself: leaktrace stays off in this process (use the sanitizer's own leak report, or a build without it)"
        ));
        return;
    }
    // Loaded into a running process (`leaktrace attach`): it waits for the switch as
    // in standby, and the program's calls reach the hooks once routed to them.
    let late = super::got::loaded_late();
    let host_tracking = if late { late_host_tracking() } else { host_tracking_state() };
    // pymalloc's arenas are known from before the interpreter maps its first one
    // (in standby too: one table update per arena); the object allocator is wrapped
    // only once tracking runs (`pyalloc::sample_from_now`).
    if (config.scan || config.python_sample > 0) && !config.disabled {
        super::pymalloc::install(if config.standby { 0 } else { config.python_sample });
    }
    let glibc_heap = host_tracking == "active" && malloc_is_glibcs();
    super::mmap::enable(glibc_heap);
    if config.standby || late {
        // Nothing recorded until `leaktrace attach` switches it on.
        let route = late.then_some(route_calls as fn());
        agent::standby::listen(config, host_tracking, glibc_heap, route, started_from_standby, stopped_recording);
        return;
    }
    let c = config.clone();
    if agent::start(config, host_tracking, glibc_heap) {
        after_start(&c);
    }
}

/// Once tracking runs: the exit status handler, the fork handlers, the signals.
fn after_start(config: &Config) {
    if let Some(sig) = config.snapshot_signal {
        SNAPSHOT_SIGNAL.store(sig, Ordering::Relaxed);
        install_snapshot_signal(sig);
    }
    install_termination_signals(config.snapshot_signal);
    // Once per process image: a second recording (attached again after a detach) keeps
    // the handlers the first registered (they do nothing while nothing records).
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if REGISTERED.swap(true, Ordering::AcqRel) {
        return;
    }
    if config.exit_code.is_some() {
        extern "C" {
            fn on_exit(f: extern "C" fn(c_int, *mut c_void), arg: *mut c_void) -> c_int;
        }
        // SAFETY: registering an extern "C" handler that never unwinds.
        unsafe { on_exit(record_exit_status, std::ptr::null_mut()) };
    }
    // SAFETY: the three handlers are extern "C" functions that never unwind.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_parent), Some(fork_child)) };
}

/// A process switched on from standby (on the standby thread, the program running):
/// as `after_start`, and Python's objects sampled from the interpreter's next arena on.
fn started_from_standby(config: &Config) {
    super::pyalloc::sample_from_now(config.python_sample);
    after_start(config);
}

/// The snapshot signal set up once tracking runs (0: none).
static SNAPSHOT_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// A recording switched on by `leaktrace attach` has ended (`--detach`), the process
/// running on: the program's calls go straight to the C library again (a library loaded
/// late puts back the GOT slots it rewrote), and the signal handlers installed when it
/// was switched on give way to the defaults they replaced.
fn stopped_recording() {
    super::got::unroute_all();
    agent::no_turn();
    let snapshot = Some(SNAPSHOT_SIGNAL.load(Ordering::Relaxed)).filter(|&s| s != 0);
    for sig in TERMINATION_SIGNALS.into_iter().filter(|&s| snapshot != Some(s)) {
        crate::os::signals::default_if_ours(sig, on_termination_signal as *const () as usize);
    }
    if let Some(sig) = snapshot {
        crate::os::signals::default_if_ours(sig, on_snapshot_signal as *const () as usize);
    }
    crate::scan::roots::uninstall();
}

/// Writes the final report on the calling thread (an exit path), whose stack the scan
/// then reads as the exiting thread's; never unwinds.
fn final_report_here() {
    if !crate::os::threads::tls_is_glibcs() {
        // A raw clone's helper with a TLS block of its own (see `tls_is_glibcs`): its
        // memory is its parent's (CLONE_VM), and its exit is not the process's end.
        return;
    }
    crate::scan::roots::mark_entry();
    let _ = std::panic::catch_unwind(agent::finish);
}

extern "C" fn on_unload() {
    agent::standby::remove_socket();
    final_report_here();
    // LEAKTRACE_EXIT_CODE: `exit` (or the return from main) with status 0, and leaks:
    // end with the code now, as LeakSanitizer does (the destructors left are skipped).
    if let Some(code) = LIFECYCLE.status_after_final(std::process::id(), None) {
        end_now(code);
    }
}

/// The status `exit` runs with, for `exit` and the return from `main` alike: an
/// `on_exit` handler registered by the constructor. glibc registers its `_dl_fini` (our
/// destructor's caller) after it, so this runs once the final report is written: the
/// place to end with LEAKTRACE_EXIT_CODE. Where it runs first, the status is kept for
/// the destructor.
extern "C" fn record_exit_status(status: c_int, _arg: *mut c_void) {
    LIFECYCLE.exit_status_is(status);
    if let Some(code) = LIFECYCLE.status_after_final(std::process::id(), Some(status)) {
        end_now(code);
    }
}

/// Ends the process with `status` through the C library's `_exit`.
fn end_now(status: c_int) -> ! {
    leave(real::exit_now(), status)
}

/// Ends the process with `status` through `real_exit`, or the system call without it.
fn leave(real_exit: Option<real::ExitFn>, status: c_int) -> ! {
    match real_exit {
        // SAFETY: forwarding to the real _exit/_Exit.
        Some(f) => unsafe { f(status) },
        // SAFETY: exit_group never returns.
        None => unsafe {
            libc::syscall(libc::SYS_exit_group, status);
            std::hint::unreachable_unchecked()
        },
    }
}

// Not in unit-test binaries: there the agent must not start and consume the rings
// that the tests drive themselves.
#[cfg(not(test))]
#[used]
#[link_section = ".init_array"]
static CONSTRUCTOR: extern "C" fn(c_int, *const *const std::ffi::c_char, *const *const std::ffi::c_char) = on_load;

#[cfg(not(test))]
#[used]
#[link_section = ".fini_array"]
static DESTRUCTOR: extern "C" fn() = on_unload;

/// The sanitizer runtime in this process that owns the allocator, if any. Each keeps
/// its own heap and intercepts the thread and loader functions we hook, and none is
/// made to have another interposer in front of it: a ThreadSanitizer program under us
/// hung (or got NULL from `malloc`), a `-fsanitize=leak` one aborted on a failed
/// allocation. With the library off the hooks only forward, and these programs run as
/// they do without it (AddressSanitizer refuses any preload before it, with its own
/// message). UndefinedBehaviorSanitizer has no allocator and is traced as usual.
/// `found`: the addresses of `__asan_init`, `__tsan_init`, `__msan_init`,
/// `__hwasan_init` and `__lsan_init`, in that order.
fn sanitizer_runtime(found: [Option<usize>; 5]) -> Option<&'static str> {
    ["AddressSanitizer", "ThreadSanitizer", "MemorySanitizer", "HWAddressSanitizer", "LeakSanitizer"]
        .into_iter()
        .zip(found)
        .find(|(_, f)| f.is_some())
        .map(|(name, _)| name)
}

/// The module owning `addr`, and whether `addr` is that module's own definition of
/// `malloc`: a symbol of that name, at that address, in a section of the module. (A
/// program built without PIE that takes malloc's address holds an *undefined*
/// `malloc` whose value is its PLT stub — the canonical address that `dlsym`
/// returns — and that stub jumps to whatever the calls bind to: us.)
fn owner(addr: *const c_void) -> Option<(usize, String, bool)> {
    use crate::os::loader::{dladdr1, RTLD_DL_SYMENT};
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let mut sym: *mut c_void = std::ptr::null_mut();
    // SAFETY: dladdr1 fills info (and sym, the matching ElfW(Sym) or null) for any
    // address; dli_fname and dli_sname are loader-owned C strings.
    unsafe {
        if dladdr1(addr, info.as_mut_ptr(), &mut sym, RTLD_DL_SYMENT) == 0 || (*info.as_ptr()).dli_fname.is_null() {
            return None;
        }
        let i = &*info.as_ptr();
        let named = !i.dli_sname.is_null() && CStr::from_ptr(i.dli_sname) == c"malloc" && std::ptr::eq(i.dli_saddr, addr);
        // Elf64_Sym: st_name (4), st_info (1), st_other (1), st_shndx (2), ...
        let defined = !sym.is_null() && std::ptr::read_unaligned((sym as *const u8).add(6) as *const u16) != 0;
        Some((i.dli_fbase as usize, CStr::from_ptr(i.dli_fname).to_string_lossy().into_owned(), named && defined))
    }
}

/// Whether the program's calls to `malloc` reach us: when another allocator is
/// preloaded *before* this library, they bind to it and we see nothing.
fn host_tracking_state() -> String {
    // The usual case, told from the modules' tables: no module before us defines
    // `malloc`, so the program's calls reach our hook.
    if let [true] = crate::os::elf::first_definitions_are_own([c"malloc"]) {
        return "active".into();
    }
    // Our own address of `malloc` cannot be taken directly: references from inside a
    // shared object to its exported symbols are themselves interposed. Compare the
    // owning modules instead, found with dladdr.
    // SAFETY: dlsym with a valid handle and NUL-terminated name.
    let bound = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) };
    if crate::os::elf::in_own_module(bound as usize) {
        // Our own hook (the usual case): no module to name.
        return "active".into();
    }
    let ours = owner(host_tracking_state as *const () as *const c_void);
    let theirs = owner(bound);
    // Only another module's own definition of `malloc` means that allocator comes first,
    // and only if it does not itself call ours (a wrapper preloaded before us that finds
    // the next malloc with `dlsym(RTLD_NEXT)` forwards every call to us).
    match (ours, theirs) {
        (Some((our_base, _, _)), Some((their_base, their_name, true))) if our_base != their_base && !reaches_us(bound as usize) => {
            let msg = why_not_ours(&their_name);
            crate::os::fds::stderr_line(&format!("leaktrace: host allocations are not seen: {msg}"));
            msg
        }
        _ => "active".into(),
    }
}

/// A library loaded late, switched on: the program's calls go to the hooks from now
/// on, and the modules it loads later are routed on the collector's turns.
fn route_calls() {
    super::got::route_all();
    agent::each_turn(super::got::route_new);
}

/// `host_tracking_state` for a library loaded late: its hooks forward to the definition
/// after it, which must be the one the program's calls bind to.
fn late_host_tracking() -> String {
    // The loader's own answer (our `dlsym` would hand out our hook).
    let bound = Some(super::resolve::real_dlsym(0, c"malloc")).filter(|&p| p != 0);
    if bound.is_some() && bound == super::real::malloc().map(|f| f as usize) {
        return "active".into();
    }
    // A program built without PIE that takes malloc's address: its PLT stub, which
    // jumps through the GOT slot routing rewrites (Debian's python3.11).
    if bound.is_some_and(|b| owner(b as *const c_void).is_some_and(|(_, _, own_definition)| !own_definition)) {
        return "active".into();
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr fills info for any address; dli_fname is a loader-owned C string.
    let name = unsafe {
        if libc::dladdr(bound.unwrap_or(0) as *const c_void, info.as_mut_ptr()) == 0 || (*info.as_ptr()).dli_fname.is_null() {
            "an unknown module".to_string()
        } else {
            CStr::from_ptr((*info.as_ptr()).dli_fname).to_string_lossy().into_owned()
        }
    };
    let msg = why_not_ours(&name);
    crate::os::fds::stderr_line(&format!("leaktrace: host allocations are not seen: {msg}"));
    msg
}

/// Whether the malloc our hooks forward to is the C library's (and so `mallinfo2`
/// describes the heap the program uses), not another allocator preloaded after us.
fn malloc_is_glibcs() -> bool {
    let Some(f) = super::real::malloc() else { return false };
    let is_libc = |path: &[u8]| path.rsplit(|&b| b == b'/').next().is_some_and(|base| base.starts_with(b"libc.so"));
    // The module by its mapped range (`_dl_find_object`): `dladdr` would also look for
    // the nearest symbol, a walk over the C library's whole symbol table (~25 us, at the
    // start of every process).
    if crate::hotpath::unwind::resolve_find_object() {
        if let Some(m) = crate::hotpath::unwind::module_of(f as usize as u64) {
            return is_libc(m.path.as_bytes());
        }
    }
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr fills info for any address; dli_fname is a loader-owned C string.
    unsafe {
        if libc::dladdr(f as *const c_void, info.as_mut_ptr()) == 0 || (*info.as_ptr()).dli_fname.is_null() {
            return false;
        }
        is_libc(CStr::from_ptr((*info.as_ptr()).dli_fname).to_bytes())
    }
}

/// Why the program's `malloc` is `their_name`'s: preloaded before us (the user can fix
/// that), or the program's own — defined in the executable (rustc with jemalloc,
/// Chromium's PartitionAlloc) or in a library it links — which no preload comes before.
fn why_not_ours(their_name: &str) -> String {
    let same_file = |a: &str, b: &std::path::Path| std::fs::canonicalize(a).ok().is_some_and(|a| std::fs::canonicalize(b).ok().is_some_and(|b| a == b));
    let preloaded = std::env::var("LD_PRELOAD").unwrap_or_default();
    let in_preload = preloaded.split([':', ' ']).filter(|p| !p.is_empty()).any(|p| p == their_name || same_file(their_name, std::path::Path::new(p)));
    let is_executable = their_name.is_empty() || std::env::current_exe().is_ok_and(|exe| same_file(their_name, &exe));
    let cuda = "CUDA allocations are still tracked";
    if in_preload {
        format!("inactive: malloc is bound to {their_name}, preloaded before leaktrace; put libleaktrace.so first in LD_PRELOAD")
    } else if is_executable {
        let exe = std::env::current_exe().map(|e| e.display().to_string()).unwrap_or_else(|_| their_name.to_string());
        format!("inactive: the program has its own malloc (defined in {exe}, e.g. a linked-in jemalloc or PartitionAlloc), which no preloaded library comes before; {cuda}")
    } else {
        format!("inactive: the program's malloc is {their_name}'s (an allocator it links), which no preloaded library comes before; {cuda}")
    }
}

/// Whether a call to `bound` (the program's `malloc`, another module's) comes through
/// our hook: for one call, our hook forwards to a probe that notes it was reached. Our
/// own code allocates nothing meanwhile; another thread's call that reaches our hook in
/// that moment is equally a call that reaches us.
///
/// One call is made first with our table as it is: an interposer that finds the next
/// `malloc` at its first call (with `dlvsym(RTLD_NEXT, "malloc", "GLIBC_2.2.5")`, which
/// our `dlvsym` answers with our hook only when the definition found is the one our
/// table holds) must not find it while the probe stands there. Nothing records yet:
/// the block goes to the C library and back.
fn reaches_us(bound: usize) -> bool {
    static REAL: AtomicUsize = AtomicUsize::new(0);
    static REACHED: AtomicBool = AtomicBool::new(false);
    extern "C" fn probe(size: usize) -> *mut c_void {
        REACHED.store(true, Ordering::Relaxed);
        // SAFETY: REAL is the real malloc (set before the probe is put in place).
        unsafe { std::mem::transmute::<usize, real::MallocFn>(REAL.load(Ordering::Acquire))(size) }
    }
    let Some(saved) = real::malloc().map(|f| f as usize) else { return false };
    // SAFETY: the program's free, as dlsym(RTLD_DEFAULT) returned it.
    let free = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"free".as_ptr()) };
    // SAFETY: `bound` is the program's malloc, as dlsym(RTLD_DEFAULT) returned it.
    let allocate = || unsafe { std::mem::transmute::<usize, real::MallocFn>(bound)(24) };
    let release = |p: *mut c_void| {
        if !free.is_null() {
            // SAFETY: the program's free for the program's malloc's block (NULL is fine).
            unsafe { std::mem::transmute::<*mut c_void, real::FreeFn>(free)(p) };
        }
    };
    release(allocate());
    REAL.store(saved, Ordering::Release);
    REACHED.store(false, Ordering::Relaxed);
    real::swap_malloc(probe as *const () as usize);
    let p = allocate();
    real::swap_malloc(saved);
    release(p);
    REACHED.load(Ordering::Relaxed)
}

extern "C" fn fork_prepare() {
    agent::fork_prepare();
}

extern "C" fn fork_parent() {
    agent::fork_parent();
}

extern "C" fn fork_child() {
    agent::fork_child();
}

extern "C" fn on_snapshot_signal(_sig: c_int) {
    // Async-signal-safe: one atomic store; the collector thread does the work (started
    // now if it waits on demand).
    start_collector_for_signal();
    agent::request_snapshot();
}

fn install_snapshot_signal(sig: c_int) {
    crate::os::signals::install_if_default(sig, on_snapshot_signal as *const () as usize, false, false);
}

/// The signals whose default action ends the process and that a program commonly dies
/// of: the terminal's (SIGINT, SIGQUIT, SIGHUP), a supervisor's (SIGTERM), and a reader
/// that went away (SIGPIPE: `seq 1 300000 | sort -rn | head -1` ends `sort` by it).
const TERMINATION_SIGNALS: [c_int; 5] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT, libc::SIGPIPE];

/// Each termination signal the program leaves at its default action: the handler only
/// records the signal; the collector thread writes the final report and then lets the
/// signal end the process as it would have (`die_by_signal`: the same status, a core
/// for SIGQUIT). A second signal, or one arriving when no collector runs, kills at once.
///
/// Runtimes decide at start-up what to do with a signal by looking at its disposition —
/// CPython installs its KeyboardInterrupt handler for SIGINT only when SIGINT is still at
/// its default, and ignores SIGPIPE — and they read it through `sigaction` or `signal`,
/// which answer `SIG_DFL` for these (`interpose::signals`): the program installs what it
/// would have, and its handler replaces ours.
fn install_termination_signals(snapshot: Option<c_int>) {
    for sig in TERMINATION_SIGNALS.into_iter().filter(|&s| snapshot != Some(s)) {
        crate::os::signals::manage(sig);
        if crate::os::signals::install_if_default(sig, on_termination_signal as *const () as usize, true, false) {
            // A later request of the program for the default keeps ours.
            crate::os::signals::hold(sig);
        }
    }
}

/// Our action for a termination signal, installed where the program asks for its
/// default (`interpose::signals`).
pub fn termination_action() -> libc::sigaction {
    crate::os::signals::action(on_termination_signal as *const () as usize, true, false)
}

/// A collector that waits on demand starts now, from a signal's handler, so that the
/// report the signal asks for is written: `pthread_create`'s one allocation comes from
/// the static arena, not from a malloc whose lock the interrupted code may hold.
fn start_collector_for_signal() {
    if LIFECYCLE.collector_on_demand() {
        real::with_calloc_from_arena(agent::start_on_demand_from_signal);
    }
}

extern "C" fn on_termination_signal(sig: c_int, info: *mut libc::siginfo_t, _context: *mut c_void) {
    // Async-signal-safe: atomics, sigaction, nanosleep and kill only — and, in a
    // process whose collector waits on demand, its start (`start_collector_for_signal`).
    start_collector_for_signal();
    if !agent::request_final_on_signal(sig) {
        crate::os::signals::die_by_signal(sig);
        return;
    }
    // SAFETY: the kernel's siginfo for this delivery (SA_SIGINFO), or null.
    let self_sent = unsafe { info.as_ref() }.is_some_and(|i| {
        // SAFETY: si_pid is valid for SI_USER and SI_TKILL, the codes checked first.
        (i.si_code == libc::SI_USER || i.si_code == libc::SI_TKILL) && unsafe { i.si_pid() } == std::process::id() as i32
    });
    if self_sent {
        // Raised by the program itself (`raise`, `kill(getpid())`) or by its own failed
        // write (SIGPIPE): without us it would end right here, so it must not go on —
        // returning would let `raise` return, or the write report EPIPE and the program
        // print an error and exit 2. This thread waits here until the collector, done
        // with the report, ends the process by the signal; the scan reads this stack like
        // any held thread's. A signal from outside (a supervisor's SIGTERM, the
        // terminal's SIGINT) returns instead: the thread it interrupted may hold a lock
        // the report needs.
        crate::os::signals::wait_to_die(sig, 60);
    }
}

/// `_exit` and `_Exit` skip atexit handlers and destructors (PyTorch DataLoader workers
/// end with `os._exit`): write the final report, then leave through the real function.
#[inline(always)]
fn final_report_then(real_exit: Option<real::ExitFn>, status: c_int) -> ! {
    final_report_here();
    let status = LIFECYCLE.status_after_final(std::process::id(), Some(status)).unwrap_or(status);
    leave(real_exit, status)
}

/// `exit`: the first caller goes on as usual (its destructors write the final report);
/// any later caller from another thread writes the report first (or waits for the one
/// being written), so that its own exit can no longer end the process mid-report.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn exit(status: c_int) -> ! {
    LIFECYCLE.exit_status_is(status);
    if !crate::os::threads::tls_is_glibcs() {
        // No thread state of ours to read here (see `tls_is_glibcs`); the destructor's
        // final report checks the same.
        match real::exit() {
            // SAFETY: forwarding to the C library's exit.
            Some(f) => unsafe { f(status) },
            None => leave(real::exit_now(), status),
        }
    }
    // SAFETY: gettid has no preconditions and cannot fail.
    let me = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
    if LIFECYCLE.exit_called(me, std::process::id()) {
        final_report_here();
    }
    match real::exit() {
        // SAFETY: forwarding to the C library's exit.
        Some(f) => unsafe { f(status) },
        None => final_report_then(real::exit_now(), status),
    }
}

/// `quick_exit` runs its handlers and leaves through the C library's internal `_exit`,
/// no destructor in between: the final report is written first.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn quick_exit(status: c_int) -> ! {
    final_report_here();
    let status = LIFECYCLE.status_after_final(std::process::id(), Some(status)).unwrap_or(status);
    match real::quick_exit() {
        // SAFETY: forwarding to the C library's quick_exit.
        Some(f) => unsafe { f(status) },
        None => final_report_then(real::exit_now(), status),
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn _exit(status: c_int) -> ! {
    final_report_then(real::exit_now(), status)
}

#[cfg_attr(not(test), no_mangle)]
#[allow(non_snake_case)]
pub unsafe extern "C" fn _Exit(status: c_int) -> ! {
    final_report_then(real::exit_now_c99(), status)
}

/// `chroot`: `/proc` and the report directory are held open first (`os::anchor`), so
/// that the scan and the final report work inside the new root.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn chroot(path: *const std::ffi::c_char) -> c_int {
    let Some(f) = real::chroot() else {
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    {
        let _errno = super::ErrnoGuard::save();
        let _ = std::panic::catch_unwind(agent::before_chroot);
    }
    // SAFETY: forwarding the caller's path to the real chroot.
    unsafe { f(path) }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn dlclose(handle: *mut c_void) -> c_int {
    let Some(f) = real::dlclose() else { return -1 };
    let unloads = std::panic::catch_unwind(agent::before_dlclose).ok().flatten();
    // SAFETY: forwarding the caller's handle to the real dlclose.
    let rc = unsafe { f(handle) };
    let _errno = super::ErrnoGuard::save();
    let _ = std::panic::catch_unwind(|| agent::after_dlclose(unloads));
    rc
}

/// `unshare` with flags the kernel refuses to a multi-threaded process (a new user
/// namespace, as `unshare -r` and sandboxes do): our collector thread steps aside for
/// the call and comes back after it, so the program sees the single-threaded process it
/// would have been without us.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn unshare(flags: c_int) -> c_int {
    let Some(f) = real::unshare() else {
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    let needs_one_thread = flags & (libc::CLONE_NEWUSER | libc::CLONE_VM | libc::CLONE_SIGHAND | libc::CLONE_THREAD) != 0;
    // SAFETY: forwarding the caller's flags to the real unshare.
    single_threaded_while(needs_one_thread, || unsafe { f(flags) })
}

/// `setns` into a user namespace (`nstype` 0 may be one) has the same rule.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn setns(fd: c_int, nstype: c_int) -> c_int {
    let Some(f) = real::setns() else {
        // SAFETY: this thread's errno.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    let may_be_user_ns = nstype == 0 || nstype & libc::CLONE_NEWUSER != 0;
    // SAFETY: forwarding the caller's arguments to the real setns.
    single_threaded_while(may_be_user_ns, || unsafe { f(fd, nstype) })
}

/// Runs `call` with the collector thread out of the way when `needed`, keeping the
/// call's errno.
fn single_threaded_while(needed: bool, call: impl FnOnce() -> c_int) -> c_int {
    let paused = needed && std::panic::catch_unwind(agent::pause_collector).unwrap_or(false);
    let rc = call();
    if paused {
        let _errno = super::ErrnoGuard::save();
        let _ = std::panic::catch_unwind(agent::resume_collector);
    }
    rc
}
