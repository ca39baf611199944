//! `/proc/self/status` and `/proc/self/smaps_rollup`, opened once per process image (at
//! the library's start, and again in a forked child before it can enter a sandbox) and
//! read with `pread` afterwards. The memory measure runs on our collector thread, which
//! blocks every signal: in a process under a seccomp filter that traps `openat` (a
//! sandboxed Chromium renderer), a trapped call there is a SIGSYS the kernel delivers
//! by force, with its default action — the renderer died so under load. `pread` on a
//! descriptor we hold is allowed where `read` is.
use std::sync::atomic::{AtomicI32, Ordering};

static STATUS: AtomicI32 = AtomicI32::new(-1);
static ROLLUP: AtomicI32 = AtomicI32::new(-1);

/// Opens both files for this process (closing those of a parent, in a forked child).
pub fn open() {
    for (slot, rel) in [(&STATUS, "self/status"), (&ROLLUP, "self/smaps_rollup")] {
        let fd = super::anchor::open_proc(rel, libc::O_RDONLY).unwrap_or(-1);
        let old = slot.swap(fd, Ordering::AcqRel);
        if old >= 0 {
            // SAFETY: a descriptor this module opened and nobody else holds.
            unsafe { libc::close(old) };
        }
    }
}

fn read(slot: &AtomicI32) -> String {
    let fd = slot.load(Ordering::Acquire);
    if fd < 0 {
        return String::new();
    }
    let mut buf = vec![0u8; 8192];
    let mut len = 0;
    loop {
        if len == buf.len() {
            buf.resize(buf.len() * 2, 0);
        }
        // SAFETY: reads into the unused tail of `buf`, from offset `len` of our descriptor.
        let n = unsafe { libc::pread(fd, buf[len..].as_mut_ptr() as *mut libc::c_void, buf.len() - len, len as libc::off_t) };
        if n <= 0 {
            break;
        }
        len += n as usize;
    }
    buf.truncate(len);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `/proc/self/status` now, or "" when it could not be opened.
pub fn status() -> String {
    read(&STATUS)
}

/// `/proc/self/smaps_rollup` now, or "".
pub fn smaps_rollup() -> String {
    read(&ROLLUP)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_files_are_read_again_each_time() {
        super::open();
        let a = super::status();
        assert!(a.contains("VmRSS:") && a.contains("Seccomp:"), "{a}");
        let _grow = vec![1u8; 8 << 20];
        assert!(super::status().contains("VmRSS:"));
        assert!(super::smaps_rollup().contains("Pss:"));
    }
}
