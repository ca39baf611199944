//! The second way in (issue 53, `leaktrace attach` to a process started without the
//! library): loaded with `dlopen` into a running process, this library is in no
//! module's symbol lookup, so no call binds to its exports. Routing makes them bind:
//! each loaded module's slots that the loader filled with a hooked function of the C
//! library (its PLT slots and data slots for `malloc`, `free`, …, `dlsym`, `exit`,
//! the CUDA entry points) are rewritten to hold our hook — the same hooks, behind the
//! same ABI boundary, that `LD_PRELOAD` binds them to. Unrouting writes back what each
//! slot held.
//!
//! A slot is rewritten only when it holds exactly the definition our hook forwards to
//! (so another allocator's `malloc`, or another interposer's, is left alone), or, for a
//! PLT slot not yet bound under lazy binding, when the name binds to that definition.
//! Slots are written through `/proc/self/mem`, which ignores page protections (the
//! loader makes the GOT read-only after relocation, RELRO): no `mprotect` that could
//! race the loader's own on a module being loaded meanwhile. Where the kernel refuses
//! such writes, the page's protection is lifted around the store instead.
//!
//! Modules loaded later (`dlopen`) are routed when a lookup follows (`dlsym`, which is
//! routed itself: Python imports an extension and looks up its `PyInit_` at once) and on
//! the collector's next turn, whichever comes first: the loader counts the modules it
//! adds, and a change starts a walk.
use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::os::elf::{self, SlotKind};
use crate::os::loader;

/// Set once this library was found loaded after the program started (`loaded_late`).
static LATE: AtomicBool = AtomicBool::new(false);
/// Set while calls are routed to our hooks.
static ROUTING: AtomicBool = AtomicBool::new(false);
/// The loader's count of added modules at the last walk (`loader::modules_added`).
static ADDS_SEEN: AtomicU64 = AtomicU64::new(0);
/// Walks still owed after a change: the module that changed the count may have been in
/// the middle of its relocation during the first one.
static WALKS_OWED: AtomicUsize = AtomicUsize::new(0);

/// Each rewritten slot: what it held.
static ROUTED: Mutex<Option<HashMap<usize, usize>>> = Mutex::new(None);

/// Whether this library was loaded into a running process (`dlopen`, by `leaktrace
/// attach`) rather than preloaded: its own exports are not what the program's lookups
/// find. Decided once, in the constructor.
pub fn loaded_late() -> bool {
    // Preloaded, the usual case, told from the modules' tables: this library comes
    // before the C library in load order (its `malloc` is the first), so the program
    // started with it, and no module before it defines our export.
    if let [true, true] = elf::first_definitions_are_own([c"malloc", c"leaktrace_active"]) {
        LATE.store(false, Ordering::Relaxed);
        return false;
    }
    let [own] = elf::own_definitions([c"leaktrace_active"], loaded_late as *const () as usize);
    // The main program's handle searches what the program's own lookups search: the
    // program, what was loaded at its start (preloads included) and RTLD_GLOBAL loads.
    // (RTLD_DEFAULT from our own code would search our own scope too.)
    // SAFETY: dlopen(NULL) returns the main program's handle; it loads nothing.
    let program = unsafe { libc::dlopen(std::ptr::null(), libc::RTLD_LAZY) };
    let late = own != 0 && !program.is_null() && super::resolve::real_dlsym(program as usize, c"leaktrace_active") != own;
    LATE.store(late, Ordering::Relaxed);
    late
}

/// Whether calls reach this library through rewritten slots (a late load, switched on).
pub fn routing() -> bool {
    ROUTING.load(Ordering::Acquire)
}

/// The functions of ours that a slot may be routed to, besides the malloc family
/// (`malloc::hook_for`) and the CUDA wrappers (`resolve::substitute_named`).
const OWN: [&CStr; 20] = [
    c"exit",
    c"quick_exit",
    c"_exit",
    c"_Exit",
    c"dlclose",
    c"unshare",
    c"setns",
    c"chroot",
    c"pthread_create",
    c"mmap",
    c"mmap64",
    c"munmap",
    c"mremap",
    c"sigaction",
    c"signal",
    c"bsd_signal",
    c"dlsym",
    c"dlvsym",
    c"free_sized",
    c"free_aligned_sized",
];

/// Our definition of each name in `OWN` and the definition it forwards to (0: none).
struct OwnHooks {
    ours: [usize; OWN.len()],
    beneath: [usize; OWN.len()],
}

fn own_hooks() -> &'static OwnHooks {
    static HOOKS: std::sync::OnceLock<OwnHooks> = std::sync::OnceLock::new();
    HOOKS.get_or_init(|| OwnHooks {
        ours: elf::own_definitions(OWN, own_hooks as *const () as usize),
        beneath: OWN.map(|n| super::resolve::next_definition(n).unwrap_or(0)),
    })
}

/// The hook a slot named `name` that binds to `target` is routed to, if any.
fn hook_for(name: &[u8], target: usize) -> Option<usize> {
    if target == 0 || crate::os::elf::in_own_module(target) {
        return None;
    }
    if let Some(h) = super::malloc::hook_for(name, target) {
        return Some(h);
    }
    if name.starts_with(b"cu") {
        let c = std::ffi::CString::new(name).ok()?;
        return super::resolve::substitute_named(&c, target);
    }
    let hooks = own_hooks();
    let k = OWN.iter().position(|n| n.to_bytes() == name)?;
    (hooks.ours[k] != 0 && hooks.beneath[k] == target).then_some(hooks.ours[k])
}

/// The module files whose slots are never rewritten: the loader's (it calls the C
/// library's allocator through pointers of its own) and the vDSO's (it has none).
fn left_alone(path: &[u8]) -> bool {
    let file = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
    file.starts_with(b"ld-linux") || file.starts_with(b"linux-vdso") || file.starts_with(b"linux-gate")
}

/// What routing did: modules walked and slots rewritten.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Routed {
    pub modules: usize,
    pub slots: usize,
}

/// Routes the calls of every loaded module to our hooks (once switched on).
pub fn route_all() -> Routed {
    ROUTING.store(true, Ordering::Release);
    walk()
}

/// Routes the modules loaded since the last walk, if any: cheap when none was (one
/// callback of the loader's module walk).
pub fn route_new() {
    if !ROUTING.load(Ordering::Acquire) {
        return;
    }
    let adds = loader::modules_added();
    if adds != ADDS_SEEN.load(Ordering::Acquire) {
        WALKS_OWED.store(2, Ordering::Release);
    }
    if WALKS_OWED.load(Ordering::Acquire) > 0 {
        let _ = WALKS_OWED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| w.checked_sub(1));
        walk();
    }
}

/// One walk over every module: each slot that binds a hooked name to the definition our
/// hook forwards to is rewritten. A slot already ours is left as it is.
fn walk() -> Routed {
    let mut routed = ROUTED.lock().unwrap_or_else(|e| e.into_inner());
    ADDS_SEEN.store(loader::modules_added(), Ordering::Release);
    let map = routed.get_or_insert_with(HashMap::new);
    let mut done = Routed::default();
    let mut mem = SelfMemory::open();
    done.modules = each_slot(|m, slot, name, kind, now| {
        // A PLT slot not yet bound (lazy binding) points back into its module.
        let target = if kind == SlotKind::Plt && now >= m.lo && now < m.hi { global(name) } else { now };
        if let Some(hook) = hook_for(name, target) {
            if hook != now && mem.write(slot, hook) {
                map.insert(slot, now);
                done.slots += 1;
            }
        }
    });
    done
}

/// Calls `visit(module, slot, name, kind, value)` for each symbol slot of each loaded
/// module whose slots may be rewritten (not the loader's, the vDSO's or ours); returns
/// how many modules it walked.
fn each_slot(mut visit: impl FnMut(&loader::LoadedModule, usize, &[u8], SlotKind, usize)) -> usize {
    let mut modules = 0;
    for m in loader::loaded_modules() {
        if m.dynamic == 0 || left_alone(m.path.to_bytes()) || crate::os::elf::in_own_module(m.lo) {
            continue;
        }
        modules += 1;
        let mut each = |slot: usize, name: &[u8], kind: SlotKind| {
            // SAFETY: a slot the loader fills in a loaded module: mapped and aligned.
            let now = unsafe { std::ptr::read_volatile(slot as *const usize) };
            visit(&m, slot, name, kind, now);
        };
        // SAFETY: the dynamic section of a module the loader lists (not the vDSO).
        unsafe { elf::symbol_slots(m.base, m.dynamic, &mut each) };
    }
    modules
}

/// Puts back what each rewritten slot held, in the modules loaded now, where it still
/// holds our hook; calls go straight to the C library again. Returns the slots restored.
pub fn unroute_all() -> usize {
    ROUTING.store(false, Ordering::Release);
    let mut routed = ROUTED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(map) = routed.take() else { return 0 };
    let mut mem = SelfMemory::open();
    let mut restored = 0;
    each_slot(|_, slot, _, _, now| {
        if let Some(&was) = map.get(&slot) {
            if crate::os::elf::in_own_module(now) && mem.write(slot, was) {
                restored += 1;
            }
        }
    });
    restored
}

/// The address `name` binds to in the program's lookup scope.
fn global(name: &[u8]) -> usize {
    // The loader's own answer: our `dlsym` would hand out our hook for a malloc name.
    std::ffi::CString::new(name).ok().map_or(0, |c| super::resolve::real_dlsym(0, &c))
}

/// Writes to this process's own memory regardless of page protections.
struct SelfMemory {
    fd: libc::c_int,
}

impl SelfMemory {
    fn open() -> SelfMemory {
        // SAFETY: open with a NUL-terminated path.
        let fd = unsafe { libc::open(c"/proc/self/mem".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        SelfMemory { fd }
    }

    /// Stores `value` in the aligned word at `slot`; false when it could not.
    fn write(&mut self, slot: usize, value: usize) -> bool {
        let bytes = value.to_ne_bytes();
        if self.fd >= 0 {
            // SAFETY: pwrite of 8 bytes from a valid buffer.
            let n = unsafe { libc::pwrite(self.fd, bytes.as_ptr() as *const libc::c_void, 8, slot as libc::off_t) };
            if n == 8 {
                return true;
            }
        }
        write_unprotected(slot, value)
    }
}

impl Drop for SelfMemory {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: our own descriptor, closed once.
            unsafe { libc::close(self.fd) };
        }
    }
}

/// The store with the page made writable around it (a kernel that refuses writes to
/// read-only pages through `/proc/self/mem`), its protection put back after.
fn write_unprotected(slot: usize, value: usize) -> bool {
    let page = 4096usize;
    let start = slot & !(page - 1);
    let prot = protection_of(start).unwrap_or(libc::PROT_READ);
    // SAFETY: mprotect of one page of a loaded module's GOT; the store is to an aligned
    // word in it, atomic for other threads that call through it.
    unsafe {
        if prot & libc::PROT_WRITE == 0 && libc::mprotect(start as *mut libc::c_void, page, prot | libc::PROT_WRITE) != 0 {
            return false;
        }
        AtomicUsize::from_ptr(slot as *mut usize).store(value, Ordering::Release);
        if prot & libc::PROT_WRITE == 0 {
            libc::mprotect(start as *mut libc::c_void, page, prot);
        }
    }
    true
}

/// The protection of the page at `addr`, from /proc/self/maps.
fn protection_of(addr: usize) -> Option<libc::c_int> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let mut f = l.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (usize::from_str_radix(lo, 16).ok()?, usize::from_str_radix(hi, 16).ok()?);
        if addr < lo || addr >= hi {
            return None;
        }
        let perms = f.next()?.as_bytes();
        let mut p = 0;
        if perms.first() == Some(&b'r') {
            p |= libc::PROT_READ;
        }
        if perms.get(1) == Some(&b'w') {
            p |= libc::PROT_WRITE;
        }
        if perms.get(2) == Some(&b'x') {
            p |= libc::PROT_EXEC;
        }
        Some(p)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loader_and_the_vdso_are_left_alone() {
        assert!(left_alone(b"/lib64/ld-linux-x86-64.so.2"));
        assert!(left_alone(b"linux-vdso.so.1"));
        assert!(!left_alone(b"/lib/x86_64-linux-gnu/libc.so.6"));
        assert!(!left_alone(b""));
    }

    #[test]
    fn a_write_to_a_read_only_page_lands_and_keeps_its_protection() {
        // SAFETY: a private anonymous page of our own, made read-only, then unmapped.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            assert_ne!(p, libc::MAP_FAILED);
            libc::mprotect(p, 4096, libc::PROT_READ);
            let slot = p as usize + 64;
            assert!(SelfMemory::open().write(slot, 0x1234_5678));
            assert_eq!(*(slot as *const usize), 0x1234_5678);
            assert!(write_unprotected(slot + 8, 42));
            assert_eq!(*((slot + 8) as *const usize), 42);
            assert_eq!(protection_of(p as usize), Some(libc::PROT_READ));
            libc::munmap(p, 4096);
        }
    }
}
