//! Atomic report files: a private temp file in the target directory (created with
//! O_EXCL|O_NOFOLLOW, mode 0600), written whole, then renamed over the target. A reader
//! sees the old report or the new one, never half a file; a planted symlink at either
//! name is replaced, never followed.
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static COUNTER: AtomicU64 = AtomicU64::new(0);
const WRITE_BUFFER: usize = 64 << 10;

/// The buffered file a report is written into. A concrete type, not `dyn Write`: the
/// serializer's many small writes (a key, a comma) then copy into the buffer inline
/// instead of each making an indirect call (a short process's exit report: 95k -> 62k
/// instructions, callgrind).
pub type ReportFile = std::io::BufWriter<std::fs::File>;

/// Writes the report that `write` produces straight into the file (through a 64 KiB
/// buffer): a 50 MB report is never held in memory whole, and a short process's few
/// kilobytes take no large mapping.
pub fn write_atomic_with(target: &Path, write: impl FnOnce(&mut ReportFile) -> std::io::Result<()>) -> std::io::Result<()> {
    let dir = target.parent().unwrap_or(Path::new("."));
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp_name = format!(".{}.{}.{}.tmp", name, std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed));
    if let Some(dirfd) = crate::os::anchor::held_output(dir) {
        return write_atomic_at(dirfd, &tmp_name, &name, write);
    }
    let tmp = dir.join(&tmp_name);
    let result = (|| {
        let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(&tmp)?;
        let mut buffered = std::io::BufWriter::with_capacity(WRITE_BUFFER, f);
        write(&mut buffered)?;
        buffered.flush()?;
        drop(buffered.into_inner().map_err(|e| e.into_error())?);
        std::fs::rename(&tmp, target)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `write_atomic_with` in a directory held open across the program's `chroot`
/// (`os::anchor`): the same steps through `openat` and `renameat`.
fn write_atomic_at(dirfd: i32, tmp: &str, name: &str, write: impl FnOnce(&mut ReportFile) -> std::io::Result<()>) -> std::io::Result<()> {
    use std::os::fd::FromRawFd;
    let c = |s: &str| std::ffi::CString::new(s).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput));
    let (ctmp, cname) = (c(tmp)?, c(name)?);
    // SAFETY: a directory descriptor of ours, a NUL-terminated name, a fresh file.
    let fd = unsafe { libc::openat(dirfd, ctmp.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0o600) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let result = (|| {
        // SAFETY: fd is the file just created, owned by the File from here.
        let f = unsafe { std::fs::File::from_raw_fd(fd) };
        let mut buffered = std::io::BufWriter::with_capacity(WRITE_BUFFER, f);
        write(&mut buffered)?;
        buffered.flush()?;
        drop(buffered.into_inner().map_err(|e| e.into_error())?);
        // SAFETY: renaming inside our directory descriptor, NUL-terminated names.
        if unsafe { libc::renameat(dirfd, ctmp.as_ptr(), dirfd, cname.as_ptr()) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    })();
    if result.is_err() {
        // SAFETY: removing our own temporary file.
        unsafe { libc::unlinkat(dirfd, ctmp.as_ptr(), 0) };
    }
    result
}

/// Whether reports can be created in `dir` (creating it if missing): a real probe file,
/// because permission bits do not tell about read-only mounts or root.
pub fn probe_dir(dir: &Path) -> Result<(), String> {
    // One `stat` (every process of a build or a test suite does this at its start).
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err("it is not a directory".into()),
        Err(_) => {
            std::fs::create_dir_all(dir).map_err(|e| format!("cannot create it ({e})"))?;
            if !dir.is_dir() {
                return Err("it is not a directory".into());
            }
        }
    }
    // Asked of the kernel with this process's effective ids (ACLs and read-only mounts
    // included), without creating a file: every process of a build or a test suite
    // does this at its start.
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(|_| "its name holds a NUL byte".to_string())?;
    // SAFETY: a NUL-terminated path that outlives the call; no memory is written.
    if unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK | libc::X_OK, libc::AT_EACCESS) } != 0 {
        return Err(format!("cannot write there ({})", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Picks the first usable directory: the wanted one, then the working directory, then
/// /tmp. Returns the directory and, if it is not the wanted one, the warning to print.
pub fn choose_output_dir(wanted: Option<PathBuf>) -> (PathBuf, Option<String>) {
    // Asked of the system only where needed (a `getcwd` in every process's start).
    let cwd = || std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/tmp"));
    let first = match wanted {
        Some(w) if w.is_absolute() => w,
        Some(w) => cwd().join(w),
        None => cwd(),
    };
    let why = match probe_dir(&first) {
        Ok(()) => return (first, None),
        Err(why) => why,
    };
    for fallback in [cwd(), PathBuf::from("/tmp")] {
        if fallback != first && probe_dir(&fallback).is_ok() {
            let msg = format!(
                "leaktrace: output directory {} is unusable: {why}; writing reports to {} instead (set LEAKTRACE_OUTPUT to a writable directory)",
                first.display(),
                fallback.display()
            );
            return (fallback, Some(msg));
        }
    }
    let msg = format!(
        "leaktrace: output directory {} is unusable: {why}, and neither the working directory nor /tmp is writable; reports will be attempted there anyway",
        first.display()
    );
    (first, Some(msg))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write_atomic(target: &Path, bytes: &[u8]) -> std::io::Result<()> {
        write_atomic_with(target, |w| w.write_all(bytes))
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("leaktrace-writer-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn writes_whole_private_file_and_replaces_it() {
        let d = tmpdir("a");
        let t = d.join("r.json");
        write_atomic(&t, b"{\"a\":1}").unwrap();
        write_atomic(&t, b"{\"a\":2}").unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), b"{\"a\":2}");
        assert_eq!(std::fs::metadata(&t).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "no temp file left behind");
    }

    #[test]
    fn a_report_that_fails_halfway_leaves_the_old_one_and_no_temp_file() {
        let d = tmpdir("d");
        let t = d.join("r.json");
        write_atomic(&t, b"{\"old\":1}").unwrap();
        // More than the buffer holds, so part of it reached the temp file first.
        let failed = write_atomic_with(&t, |w| {
            w.write_all(&vec![b' '; 3 << 20])?;
            Err(std::io::Error::other("disk full"))
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read(&t).unwrap(), b"{\"old\":1}");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "no temp file left behind");
        // A streamed report arrives whole.
        let big: Vec<u8> = (0..5_000_000u32).map(|i| b'a' + (i % 26) as u8).collect();
        write_atomic_with(&t, |w| big.chunks(7777).try_for_each(|c| w.write_all(c))).unwrap();
        assert_eq!(std::fs::read(&t).unwrap(), big);
    }

    #[test]
    fn planted_symlink_is_replaced_not_followed() {
        let d = tmpdir("b");
        let victim = d.join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let t = d.join("r.json");
        std::os::unix::fs::symlink(&victim, &t).unwrap();
        write_atomic(&t, b"{}").unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(!std::fs::symlink_metadata(&t).unwrap().file_type().is_symlink());
    }

    #[test]
    fn missing_dir_is_created_and_bad_dir_falls_back() {
        let d = tmpdir("c");
        let want = d.join("new/sub");
        assert_eq!(choose_output_dir(Some(want.clone())), (want.clone(), None));
        let file = d.join("plainfile");
        std::fs::write(&file, b"").unwrap();
        let (dir, warn) = choose_output_dir(Some(file.join("x")));
        assert_ne!(dir, file.join("x"));
        let warn = warn.unwrap();
        assert!(warn.starts_with("leaktrace: output directory") && !warn.contains('\n'));
    }
}
