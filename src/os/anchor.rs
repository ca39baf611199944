//! Directories held open across `chroot`. A program that changes its root (build
//! sandboxes, daemons) would otherwise take `/proc` and the report directory from us:
//! the scan would find no mappings and call every reachable block a leak, and the final
//! report could not be written. Before the program's `chroot` runs, `/proc` and the
//! output directory are opened (descriptors moved high, close-on-exec) and every later
//! access goes through them. A program that closes them later only brings back the
//! plain paths.
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

static PROC: AtomicI32 = AtomicI32::new(-1);
/// The root directory as it was before the program's first `chroot`: the module files
/// the symbolizer reads are named by paths from there.
static ROOT: AtomicI32 = AtomicI32::new(-1);
static OUTPUT: AtomicI32 = AtomicI32::new(-1);
/// The output directory's (device, inode), to tell that OUTPUT is still it.
static OUTPUT_ID: std::sync::Mutex<Option<(u64, u64, std::path::PathBuf)>> = std::sync::Mutex::new(None);

/// Descriptors from here up: out of the way of programs that expect their low numbers.
pub const HIGH_FD: i32 = 800;

fn open_dir_high(path: &Path) -> i32 {
    let Ok(c) = CString::new(path.as_os_str().as_encoded_bytes()) else { return -1 };
    // SAFETY: NUL-terminated path; the descriptor is ours.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return -1;
    }
    // SAFETY: duplicating our own descriptor, then closing the original.
    let high = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, HIGH_FD) };
    unsafe { libc::close(fd) };
    high
}

/// Holds `/proc` and `output_dir` open: called just before the program's `chroot`.
/// Errno is kept.
pub fn hold_before_chroot(output_dir: &Path) {
    let _errno = super::ErrnoGuard::save();
    if PROC.load(Ordering::Acquire) < 0 {
        PROC.store(open_dir_high(Path::new("/proc")), Ordering::Release);
    }
    if ROOT.load(Ordering::Acquire) < 0 {
        ROOT.store(open_dir_high(Path::new("/")), Ordering::Release);
    }
    if OUTPUT.load(Ordering::Acquire) < 0 {
        let _ = std::fs::create_dir_all(output_dir);
        let fd = open_dir_high(output_dir);
        if fd >= 0 {
            if let (Some((dev, ino)), Ok(mut id)) = (super::fds::identity(fd), OUTPUT_ID.lock()) {
                *id = Some((dev, ino, output_dir.to_path_buf()));
                OUTPUT.store(fd, Ordering::Release);
            } else {
                // SAFETY: our own descriptor.
                unsafe { libc::close(fd) };
            }
        }
    }
}

/// Reads `/proc/<rel>` (e.g. "self/maps"), through the held `/proc` when there is one.
pub fn read_proc(rel: &str) -> std::io::Result<Vec<u8>> {
    let fd = open_proc(rel, libc::O_RDONLY)?;
    // SAFETY: a fresh descriptor of ours, owned by the File from here (closed on drop).
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    super::read_whole(f.as_raw_fd())
}

/// `read_proc` as text (invalid UTF-8 replaced).
pub fn read_proc_string(rel: &str) -> std::io::Result<String> {
    read_proc(rel).map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// Opens `/proc/<rel>` with `flags` (close-on-exec added); the caller owns the result.
pub fn open_proc(rel: &str, flags: i32) -> std::io::Result<i32> {
    let held = PROC.load(Ordering::Acquire);
    let fd = if held >= 0 {
        let c = CString::new(rel).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: a directory descriptor of ours and a NUL-terminated relative path.
        let fd = unsafe { libc::openat(held, c.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd >= 0 {
            fd
        } else {
            plain_open(rel, flags)
        }
    } else {
        plain_open(rel, flags)
    };
    if fd < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(fd)
    }
}

fn plain_open(rel: &str, flags: i32) -> i32 {
    let Ok(c) = CString::new(format!("/proc/{rel}")) else { return -1 };
    // SAFETY: NUL-terminated path.
    unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) }
}

/// Opens the file at the absolute `path` for reading, from the root the program had
/// before its `chroot` when it made one.
pub fn open_file(path: &str) -> std::io::Result<std::fs::File> {
    let root = ROOT.load(Ordering::Acquire);
    if root >= 0 {
        if let Some(rel) = path.strip_prefix('/') {
            let c = CString::new(rel).map_err(|_| std::io::ErrorKind::InvalidInput)?;
            // SAFETY: a directory descriptor of ours and a NUL-terminated relative path.
            let fd = unsafe { libc::openat(root, c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            if fd >= 0 {
                // SAFETY: a fresh descriptor, owned by the File from here.
                return Ok(unsafe { std::fs::File::from_raw_fd(fd) });
            }
        }
    }
    std::fs::File::open(path)
}

/// The target of the link `/proc/<rel>` (e.g. "self/exe").
pub fn read_proc_link(rel: &str) -> Option<String> {
    let held = PROC.load(Ordering::Acquire);
    let (dirfd, path) = if held >= 0 { (held, rel.to_string()) } else { (libc::AT_FDCWD, format!("/proc/{rel}")) };
    let c = CString::new(path).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: a directory descriptor of ours (or AT_FDCWD), a NUL-terminated path and a
    // buffer of the given length.
    let n = unsafe { libc::readlinkat(dirfd, c.as_ptr(), buf.as_mut_ptr() as *mut libc::c_char, buf.len()) };
    if n <= 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Opens `/proc/self/maps` without allocating (it is read from inside a hook).
pub fn open_maps_no_alloc() -> i32 {
    let held = PROC.load(Ordering::Acquire);
    if held >= 0 {
        // SAFETY: a directory descriptor of ours and a NUL-terminated relative path.
        let fd = unsafe { libc::openat(held, c"self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd >= 0 {
            return fd;
        }
    }
    // SAFETY: a NUL-terminated path.
    unsafe { libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) }
}

/// Entries of `/proc/<rel>` (e.g. "self/task"), through the held `/proc` when there is one.
pub fn list_proc(rel: &str) -> Vec<String> {
    let Ok(fd) = open_proc(rel, libc::O_RDONLY | libc::O_DIRECTORY) else { return Vec::new() };
    // SAFETY: fd is a directory descriptor we own; fdopendir takes it over.
    let dir = unsafe { libc::fdopendir(fd) };
    if dir.is_null() {
        // SAFETY: still ours when fdopendir failed.
        unsafe { libc::close(fd) };
        return Vec::new();
    }
    let mut out = Vec::new();
    loop {
        // SAFETY: dir is an open directory stream.
        let e = unsafe { libc::readdir(dir) };
        if e.is_null() {
            break;
        }
        // SAFETY: d_name is NUL-terminated inside the entry.
        let name = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) };
        if let Ok(n) = name.to_str() {
            if n != "." && n != ".." {
                out.push(n.to_string());
            }
        }
    }
    // SAFETY: closing the stream we opened (and its descriptor).
    unsafe { libc::closedir(dir) };
    out
}

/// The held output directory, when `dir` is the one held and the descriptor still is it.
pub fn held_output(dir: &Path) -> Option<i32> {
    let fd = OUTPUT.load(Ordering::Acquire);
    if fd < 0 {
        return None;
    }
    let id = OUTPUT_ID.lock().ok()?;
    let (dev, ino, path) = id.as_ref()?;
    (path == dir && super::fds::identity(fd) == Some((*dev, *ino))).then_some(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_is_read_with_or_without_the_held_descriptor() {
        let before = read_proc_string("self/status").unwrap();
        assert!(before.contains("Pid:"));
        assert!(list_proc("self/task").iter().all(|t| t.parse::<u32>().is_ok()));
        let dir = std::env::temp_dir().join(format!("lt-anchor-{}", std::process::id()));
        hold_before_chroot(&dir);
        assert!(PROC.load(Ordering::Acquire) >= HIGH_FD);
        assert!(read_proc_string("self/maps").unwrap().contains("["));
        assert!(held_output(&dir).is_some());
        assert!(held_output(Path::new("/elsewhere")).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
