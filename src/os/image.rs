//! Whether this process image is one the library set up, or a child made by `fork` or a
//! raw `clone` system call that ran no `atfork` handler (bubblewrap creates its sandbox
//! that way). Such a child inherits our locks in whatever state they were: held by our
//! collector thread, which does not exist there, the child's next `fork` or its exit
//! waited for them forever (`bwrap` hung in 1 of 5 runs).
//!
//! One page marked `MADV_WIPEONFORK` tells: the kernel hands every child that does not
//! share our memory a zeroed copy, whatever made it, while a `vfork` child (which shares
//! our memory and must never take our state over) sees our page as it is.
use std::sync::atomic::{AtomicUsize, Ordering};

static PAGE: AtomicUsize = AtomicUsize::new(0);

/// Marks this process image as set up (maps the page on first use). Without
/// `MADV_WIPEONFORK` (Linux before 4.14) nothing is marked and no child is detected.
pub fn mark_own_image() {
    let mut p = PAGE.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: an anonymous private mapping of one page, ours for the process's life.
        let m = unsafe { libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        if m == libc::MAP_FAILED {
            return;
        }
        // SAFETY: advice on the page just mapped.
        if unsafe { libc::madvise(m, 4096, libc::MADV_WIPEONFORK) } != 0 {
            // SAFETY: unmapping the page just mapped.
            unsafe { libc::munmap(m, 4096) };
            return;
        }
        p = m as usize;
        PAGE.store(p, Ordering::Release);
    }
    // SAFETY: the page mapped above, readable and writable.
    unsafe { (*(p as *const AtomicUsize)).store(1, Ordering::Release) };
}

/// Whether this is a child that no `atfork` handler of ours has seen yet.
#[inline]
pub fn is_unadopted_child() -> bool {
    let p = PAGE.load(Ordering::Acquire);
    // SAFETY: the page mapped by `mark_own_image`, mapped for the process's life.
    p != 0 && unsafe { (*(p as *const AtomicUsize)).load(Ordering::Acquire) } == 0
}

/// This process's id, kept in the marked page after its first use (the second word): a
/// child made by `fork` or `clone` finds the page zeroed and asks again; a `vfork` child
/// finds its parent's, whose memory is its own. For `os::copy_own`, which a report's scan
/// calls for every chunk of roots it copies (130 calls for `git --version`, a system call
/// each to ask).
pub fn own_pid() -> i32 {
    let p = PAGE.load(Ordering::Acquire);
    if p == 0 {
        // SAFETY: getpid cannot fail.
        return unsafe { libc::getpid() };
    }
    // SAFETY: the page mapped by `mark_own_image`, mapped for the process's life; its
    // second word is only used here.
    let slot = unsafe { &*((p + 8) as *const std::sync::atomic::AtomicI32) };
    match slot.load(Ordering::Acquire) {
        0 => {
            // SAFETY: getpid cannot fail.
            let pid = unsafe { libc::getpid() };
            slot.store(pid, Ordering::Release);
            pid
        }
        pid => pid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forked_child_is_unadopted_until_marked_and_the_parent_never_is() {
        mark_own_image();
        assert!(!is_unadopted_child());
        // SAFETY: the child only reads memory, then leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let code = if is_unadopted_child() {
                mark_own_image();
                if is_unadopted_child() {
                    2
                } else {
                    0
                }
            } else {
                1
            };
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child saw a zeroed page, then its own mark");
        assert!(!is_unadopted_child());
    }

    #[test]
    fn the_kept_process_id_is_the_childs_own_after_a_fork() {
        mark_own_image();
        // SAFETY: getpid cannot fail.
        let me = unsafe { libc::getpid() };
        assert_eq!((own_pid(), own_pid()), (me, me));
        // SAFETY: the child only reads memory and makes system calls, then leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            let ok = own_pid() == unsafe { libc::getpid() } && own_pid() != me;
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child's own id, not its parent's");
        assert_eq!(own_pid(), me);
    }
}
