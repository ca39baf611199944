//! `pip install .` into a fresh virtual environment gives a `leaktrace` command that
//! works with nothing else: no Rust on PATH, no checkout beside it, a fresh HOME. It
//! runs a Python program with a planted ctypes leak and fails `--fail-on-leak`, and its
//! pytest plugin (an entry point of the wheel) fails the one test of a suite that leaks.
//! Needs python3 with venv and pip, and the network for maturin (PyPI): a missing piece
//! is a counted skip, except under CI.
mod common;
use common::*;
use std::process::Command;

#[test]
fn pip_install_gives_a_command_that_finds_a_planted_leak() {
    let venv = fresh_dir("wheel-venv");
    let made = Command::new("python3").args(["-m", "venv"]).arg(&venv).timed_output();
    if !made.as_ref().is_ok_and(|o| o.status.success()) {
        skip::missing("python3 -m venv", "apt-get install python3-venv");
        return;
    }
    let pip = venv.join("bin/pip");
    // A target directory of its own: the test run's cargo may hold the workspace's.
    let target = fresh_dir("wheel-target");
    // It compiles the crate from nothing: 2 to 3 minutes on 2 cores, more beside busy
    // loops (over 180 s once, 2026-12-05), so four times a traced program's limit.
    let out = Command::new(&pip).args(["install", "-q"]).arg(root()).env("CARGO_TARGET_DIR", &target).timed_output_within(4 * time_limit()).unwrap();
    assert!(out.status.success(), "pip install . failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let leaktrace = venv.join("bin/leaktrace");
    assert!(leaktrace.is_file());
    let work = fresh_dir("wheel-run");
    std::fs::write(
        work.join("planted.py"),
        // Four staging buffers from one line, each dropped: the last one's address may
        // stay in a dead slot of a live frame at exit, which the conservative scan
        // counts as a reference (docs/design.md); the earlier ones are overwritten.
        "import ctypes\nlibc = ctypes.CDLL('libc.so.6')\nlibc.malloc.restype = ctypes.c_void_p\nfor _ in range(4):\n    staging = libc.malloc(1 << 20)\ndel staging\nprint('trained')\n",
    )
    .unwrap();
    let home = work.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    // The installed command in the venv alone: its own PATH, a fresh HOME, nothing that
    // points at this checkout.
    let installed = |args: &[&str]| {
        Command::new(&leaktrace)
            .args(args)
            .current_dir(&work)
            .env("PATH", &path)
            .env("HOME", &home)
            .env_remove("XDG_CACHE_HOME")
            .env_remove("LEAKTRACE_LIB")
            .env_remove("LD_PRELOAD")
            .env_remove("PYTHONPATH")
            .timed_output()
            .unwrap()
    };
    let out = installed(&["run", "--fail-on-leak", "--output", "r", "--", "python", "planted.py"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "trained\n");
    assert_eq!(out.status.code(), Some(23), "{err}");
    let found = ["Leak of 4194304 byte(s) in 4 object(s) allocated from malloc", "Leak of 3145728 byte(s) in 3 object(s) allocated from malloc"];
    assert!(found.iter().any(|f| err.contains(f)), "{err}");
    assert!(err.contains("planted.py:5"), "the leak is named at the script's line: {err}");

    // The pytest plugin comes with the wheel (an entry point): `pytest --leaktrace`
    // with no `-p`, in the same environment.
    let out = Command::new(&pip).args(["install", "-q", "pytest"]).timed_output().unwrap();
    assert!(out.status.success(), "pip install pytest failed:\n{}", String::from_utf8_lossy(&out.stderr));
    std::fs::copy(root().join("tests/fixtures/pytest/test_user_suite.py"), work.join("test_user_suite.py")).unwrap();
    let out = installed(&[
        "run",
        "--output",
        "p",
        "--",
        "python",
        "-m",
        "pytest",
        "--leaktrace",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        ".",
        "test_user_suite.py",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    // The plugin came through the entry point and its verdicts fail tests: the growth
    // limit's always. `test_leaks` (one ctypes block dropped) fails too, but with the
    // pytest and pluggy that pip picks today a stale copy of its pointer in a reachable
    // 688-byte block, under pytest's output capture, can keep it "reachable" for the
    // conservative scan (README, the scan's limits): the CLI test, with a fixed pytest,
    // checks that verdict and its line.
    assert!(stdout.contains("FAILED test_user_suite.py::test_grows_a_global_list - leaktrace:"), "{stdout}");
    assert!(stdout.contains("2 failed, 5 passed") || stdout.contains("1 failed, 6 passed"), "{stdout}");
}
