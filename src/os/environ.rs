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

/// The address of the C library's environment array now (`environ`): glibc's
/// `setenv`/`putenv` of a variable the array does not hold yet moves it (the first time
/// from the array the process started with, which it cannot grow), changing an existing
/// one or `unsetenv` does not.
pub fn array() -> usize {
    // SAFETY: one aligned load of the C library's pointer, never dereferenced here.
    unsafe { std::ptr::addr_of!(environ).read_volatile() as usize }
}

/// The variables whose name starts with `prefix`, as (name, value), read in one pass
/// over the environment: the constructor's 18 settings were 18 `getenv`s, each reading
/// the whole environment again and copying its name first (issue 55's start-up). A
/// name or value that is not UTF-8 is left out, as `std::env::var` leaves it out.
///
/// Only where nothing changes the environment meanwhile, as `getenv` itself: the
/// library constructor, before the program's `main` (or a test that sets nothing).
pub fn at_start_with_prefix(prefix: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    // SAFETY: `environ` is the C library's NULL-terminated array of NUL-terminated
    // strings; nothing changes it while the constructor runs (see above), so reading it
    // is what `getenv` does.
    unsafe {
        let mut at = std::ptr::addr_of!(environ).read_volatile();
        if at.is_null() {
            return out;
        }
        while !(*at).is_null() {
            let kv = std::ffi::CStr::from_ptr(*at as *const std::ffi::c_char).to_bytes();
            at = at.add(1);
            if !kv.starts_with(prefix.as_bytes()) {
                continue;
            }
            let Some(eq) = kv.iter().position(|&b| b == b'=') else { continue };
            if let (Ok(name), Ok(value)) = (std::str::from_utf8(&kv[..eq]), std::str::from_utf8(&kv[eq + 1..])) {
                if !out.iter().any(|(n, _): &(String, String)| n == name) {
                    out.push((name.to_owned(), value.to_owned()));
                }
            }
        }
    }
    out
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
        let batch: Vec<u64> = pointers[..n / 8].iter().copied().take_while(|&p| p != 0).collect();
        let ended = batch.len() < n / 8;
        at += batch.len() as u64;
        // One call for the whole batch (a process's exit report read 40 variables with
        // 40 calls); those from the first that could not be read whole, one by one.
        let mut texts = vec![0u8; batch.len() * MAX_LEN];
        let whole = copy_strings(&batch, &mut texts);
        for (i, &p) in batch.iter().enumerate() {
            let text = &mut texts[i * MAX_LEN..(i + 1) * MAX_LEN];
            let got = if i < whole { MAX_LEN } else { super::copy_own(p, text) };
            let Some(end) = text[..got].iter().position(|&b| b == 0) else { continue };
            let var = &text[..end];
            let Some(eq) = var.iter().position(|&b| b == b'=') else { continue };
            if wanted(&var[..eq]) {
                out.extend_from_slice(var);
                out.push(0);
            }
        }
        if ended {
            break 'array;
        }
    }
    Some(out)
}

/// Reads `MAX_LEN` bytes at each of `from` into consecutive slices of `into`, in one
/// `process_vm_readv`; returns how many were read whole (the kernel stops at the first
/// range it cannot read, and splits none).
fn copy_strings(from: &[u64], into: &mut [u8]) -> usize {
    if from.is_empty() {
        return 0;
    }
    let remote: Vec<libc::iovec> = from.iter().map(|&p| libc::iovec { iov_base: p as *mut libc::c_void, iov_len: MAX_LEN }).collect();
    let local = libc::iovec { iov_base: into.as_mut_ptr() as *mut libc::c_void, iov_len: (from.len() * MAX_LEN).min(into.len()) };
    // SAFETY: the kernel writes at most `local.iov_len` bytes into `into`, our own buffer
    // of plain bytes; remote ranges it cannot read fail the call, never fault.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, remote.as_ptr(), remote.len() as libc::c_ulong, 0) };
    n.max(0) as usize / MAX_LEN
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

    #[test]
    fn the_one_pass_read_finds_what_getenv_finds() {
        // Read-only: the harness's other tests may set variables of their own prefix.
        for (name, value) in at_start_with_prefix("PATH").iter().chain(&at_start_with_prefix("HOME")) {
            assert_eq!(std::env::var(name).ok().as_deref(), Some(value.as_str()), "{name}");
        }
        let path = at_start_with_prefix("PATH");
        assert_eq!(path.iter().find(|(n, _)| n == "PATH").map(|(_, v)| v.clone()), std::env::var("PATH").ok());
        assert!(at_start_with_prefix("LEAKTRACE_NO_SUCH_VARIABLE_").is_empty());
    }
}
