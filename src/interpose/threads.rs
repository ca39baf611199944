//! The thread family: `pthread_create`. Each thread the program starts notes its stack
//! bounds before its start routine runs (see `os::stack` for why they cannot be asked
//! for later, from inside an allocation).
//!
//! The start routine is wrapped by `leaktrace_thread_entry`, a few instructions of
//! assembly: it calls `thread_prologue` (which frees the wrapper's block, notes the
//! bounds, and returns the routine and its argument in RAX:RDX), then *jumps* to the
//! routine. No frame of ours stays under the program's thread: its return goes straight
//! back to the C library, a `pthread_exit` or cancellation unwinds through nothing of
//! ours, and debuggers see the routine where they expect it.
// C entry points: their contract is the C library's.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};

use super::real;

/// Set when the library stays off in this process: threads start as the program asked.
static PASS_THROUGH: AtomicBool = AtomicBool::new(false);

/// The library stays off in this process: `pthread_create` only forwards from now on.
pub fn pass_through() {
    PASS_THROUGH.store(true, Ordering::Relaxed);
}

/// The program's start routine and its argument, in a block of the real allocator, and
/// the slot of `scan::roots::PENDING_ARGS` that holds the argument until the thread runs.
#[repr(C)]
struct Start {
    routine: usize,
    arg: usize,
    slot: usize,
}

/// Returned in RAX (routine) and RDX (argument): a two-integer struct (SysV x86-64).
#[repr(C)]
struct Entry {
    routine: usize,
    arg: usize,
}

extern "C" fn thread_prologue(p: *mut Start) -> Entry {
    // SAFETY: p is the block `pthread_create` below filled for this thread alone.
    let start = unsafe { p.read() };
    // From here the argument is in this thread's registers, then in its frames.
    crate::scan::roots::unlist_pending(start.slot);
    if let Some(free) = real::free() {
        // SAFETY: p came from the real malloc in `pthread_create`.
        unsafe { free(p as *mut c_void) };
    }
    // The program's routine starts with errno as the C library left it.
    let errno = super::ErrnoGuard::save();
    // Untracked: the query allocates, and those blocks are the C library's business.
    let _ = std::panic::catch_unwind(|| crate::hotpath::thread::untracked(crate::hotpath::unwind::note_thread_stack));
    drop(errno);
    Entry { routine: start.routine, arg: start.arg }
}

std::arch::global_asm!(
    ".pushsection .text.leaktrace_thread_entry,\"ax\",@progbits",
    ".p2align 4",
    ".globl leaktrace_thread_entry",
    ".hidden leaktrace_thread_entry",
    ".type leaktrace_thread_entry, @function",
    "leaktrace_thread_entry:",
    ".cfi_startproc",
    // Entered with RSP = 8 mod 16 (as after a call): realign for the call.
    "sub rsp, 8",
    ".cfi_adjust_cfa_offset 8",
    "call {prologue}",
    "add rsp, 8",
    ".cfi_adjust_cfa_offset -8",
    "mov rdi, rdx",
    "jmp rax",
    ".cfi_endproc",
    ".size leaktrace_thread_entry, .-leaktrace_thread_entry",
    ".popsection",
    prologue = sym thread_prologue,
);

extern "C" {
    fn leaktrace_thread_entry(arg: *mut c_void) -> *mut c_void;
}

pub type StartRoutine = extern "C" fn(*mut c_void) -> *mut c_void;

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn pthread_create(
    thread: *mut libc::pthread_t,
    attr: *const libc::pthread_attr_t,
    routine: Option<StartRoutine>,
    arg: *mut c_void,
) -> c_int {
    let Some(create) = real::pthread_create() else { return libc::EAGAIN };
    // Off for good (LEAKTRACE_DISABLE, a sanitizer's process): the call as it was.
    if PASS_THROUGH.load(Ordering::Relaxed) {
        // SAFETY: the caller's arguments to the real pthread_create.
        return unsafe { create(thread, attr, routine, arg) };
    }
    let errno = super::ErrnoGuard::save();
    let _ = std::panic::catch_unwind(crate::agent::program_starts_thread);
    let block = match (routine, real::malloc()) {
        // SAFETY: a plain allocation of the real allocator, untracked by construction.
        (Some(_), Some(malloc)) => unsafe { malloc(std::mem::size_of::<Start>()) as *mut Start },
        _ => std::ptr::null_mut(),
    };
    let Some(routine) = routine.filter(|_| !block.is_null()) else {
        drop(errno);
        // SAFETY: forwarding the caller's arguments unchanged (no memory for the wrapper).
        return unsafe { create(thread, attr, routine, arg) };
    };
    let slot = crate::scan::roots::list_pending(arg as usize);
    // SAFETY: block is a fresh allocation of the right size and alignment (malloc's 16).
    unsafe { block.write(Start { routine: routine as usize, arg: arg as usize, slot }) };
    // SAFETY: the entry's contract is a start routine's: it takes the block as argument.
    let entry: StartRoutine = unsafe { std::mem::transmute::<unsafe extern "C" fn(*mut c_void) -> *mut c_void, StartRoutine>(leaktrace_thread_entry) };
    drop(errno);
    // SAFETY: forwarding the caller's thread and attributes with the wrapped routine.
    let rc = unsafe { create(thread, attr, Some(entry), block as *mut c_void) };
    if rc != 0 {
        crate::scan::roots::unlist_pending(slot);
        if let Some(free) = real::free() {
            // SAFETY: the thread did not start: the block is still ours.
            unsafe { free(block as *mut c_void) };
        }
    } else {
        let _errno = super::ErrnoGuard::save();
        let _ = std::panic::catch_unwind(crate::agent::program_started_thread);
    }
    rc
}
