//! Detects optional glibc entry points so that the library interposes only what
//! the C library of the build machine really has (C23 `free_sized` arrived in glibc 2.41).
use std::path::PathBuf;
use std::process::Command;

fn libc_has(symbol: &str) -> bool {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into()));
    let src = out_dir.join(format!("probe_{symbol}.c"));
    let bin = out_dir.join(format!("probe_{symbol}"));
    let code =
        format!("#include <stddef.h>\nextern void {symbol}(void *, size_t);\nint main(void) {{ void (*f)(void *, size_t) = {symbol}; return f == 0; }}\n");
    if std::fs::write(&src, code).is_err() {
        return false;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    Command::new(cc).arg(&src).arg("-o").arg(&bin).output().map(|o| o.status.success()).unwrap_or(false)
}

/// Links the unwinder statically: the standard library asks for `-lgcc_s`, and a
/// directory searched first that holds a `libgcc_s.a` (GCC's static unwinder,
/// `libgcc_eh.a`) answers it. A process that does not load libgcc_s itself then does
/// not load it for us: loading it (its constructor runs CPUID, a trap under a
/// hypervisor) was a fifth of the library's start-up (issue 55). Where the compiler has
/// no static unwinder, the shared one stays.
fn static_unwinder() {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let Ok(out) = Command::new(&cc).arg("-print-file-name=libgcc_eh.a").output() else { return };
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !out.status.success() || !path.is_absolute() || !path.is_file() {
        return;
    }
    let dir = PathBuf::from(std::env::var("OUT_DIR").unwrap_or_else(|_| ".".into())).join("static-unwinder");
    if std::fs::create_dir_all(&dir).is_err() || std::fs::copy(&path, dir.join("libgcc_s.a")).is_err() {
        return;
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
}

fn main() {
    static_unwinder();
    println!("cargo:rustc-check-cfg=cfg(has_free_sized)");
    println!("cargo:rerun-if-changed=build.rs");
    if libc_has("free_sized") {
        println!("cargo:rustc-cfg=has_free_sized");
    }
}
