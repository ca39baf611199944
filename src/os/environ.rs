//! The process's environment as it is now (`environ`, which `setenv`/`putenv` and
//! Python's `os.environ[...] = ...` change), not as it started (`/proc/self/environ`):
//! for a rank that the launcher sets after the process started (Ray's workers, a script
//! that sets `RANK` itself before `init_process_group`).
//!
//! Another thread may change the environment meanwhile (glibc's `setenv` reallocates the
//! array and frees the old one), so nothing here dereferences it: the array and each
//! string are copied with `process_vm_readv`, which fails instead of faulting on memory
//! that went away, and a string cut short or changed under the copy is only a wrong
//! guess of a variable, never a crash. Not called under a seccomp filter (which may
//! answer `process_vm_readv` with SIGSYS).
extern "C" {
    static environ: *const *const u8;
}

/// At most this many variables are looked at, and this many bytes of each.
const MAX_VARS: u64 = 4096;
const MAX_LEN: usize = 512;

/// The variables whose name `wanted` accepts, as `/proc/self/environ` holds them
/// (`NAME=VALUE\0`...), from the environment as it is now. `None` where it cannot be read.
pub fn current(wanted: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
    if !super::procfs::unfiltered_now() {
        return None;
    }
    copied(wanted)
}

/// `current` without the seccomp check.
fn copied(wanted: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
    // SAFETY: one aligned load of the C library's pointer; what it points to is only copied.
    let array = unsafe { std::ptr::addr_of!(environ).read_volatile() } as u64;
    if array == 0 {
        return None;
    }
    let mut out = Vec::new();
    let mut pointers = [0u64; 64];
    let mut at = 0u64;
    'array: while at < MAX_VARS {
        let n = super::copy_own(array + at * 8, &mut pointers);
        if n < 8 {
            break;
        }
        for &p in &pointers[..n / 8] {
            if p == 0 {
                break 'array;
            }
            at += 1;
            let mut text = [0u8; MAX_LEN];
            let got = super::copy_own(p, &mut text);
            let Some(end) = text[..got].iter().position(|&b| b == 0) else { continue };
            let var = &text[..end];
            let Some(eq) = var.iter().position(|&b| b == b'=') else { continue };
            if wanted(&var[..eq]) {
                out.extend_from_slice(var);
                out.push(0);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_variable_set_after_start_is_read_as_it_is_now() {
        std::env::set_var("LEAKTRACE_TEST_ENVIRON_NOW", "set later");
        let got = copied(|name| name.starts_with(b"LEAKTRACE_TEST_ENVIRON")).expect("readable here");
        assert_eq!(got, b"LEAKTRACE_TEST_ENVIRON_NOW=set later\0");
        std::env::remove_var("LEAKTRACE_TEST_ENVIRON_NOW");
        assert_eq!(copied(|name| name.starts_with(b"LEAKTRACE_TEST_ENVIRON")).unwrap(), b"");
    }
}
