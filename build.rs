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

fn main() {
    println!("cargo:rustc-check-cfg=cfg(has_free_sized)");
    println!("cargo:rerun-if-changed=build.rs");
    if libc_has("free_sized") {
        println!("cargo:rustc-cfg=has_free_sized");
    }
}
