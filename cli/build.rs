//! Embeds the preload library in the `leaktrace` binary, so that a command installed on
//! its own (`cargo install --path cli`, a wheel's script) still finds it: `run` unpacks
//! it on first use into a per-version cache (see `src/run.rs`, `embedded_library`).
//!
//! The library is built here with a nested `cargo build --release --lib -p leaktrace`
//! in a target directory of this build script's own (no lock shared with the outer
//! build). `LEAKTRACE_EMBED_LIB=PATH` embeds a library built elsewhere instead. When
//! neither works, nothing is embedded and the command says so when it needs one.
use std::path::{Path, PathBuf};
use std::process::Command;

/// FNV-1a of the library's bytes: names its cache directory, so that two builds never
/// share one.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn embed(lib: &Path, dest: &Path) -> bool {
    match std::fs::read(lib) {
        Ok(bytes) if !bytes.is_empty() => {
            println!("cargo:rustc-env=LEAKTRACE_EMBED_HASH={:016x}", fnv1a(&bytes));
            std::fs::write(dest, bytes).is_ok()
        }
        _ => false,
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dest = out.join("libleaktrace.so");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LEAKTRACE_EMBED_LIB");
    if let Some(lib) = std::env::var_os("LEAKTRACE_EMBED_LIB") {
        if embed(Path::new(&lib), &dest) {
            return;
        }
        println!("cargo:warning=LEAKTRACE_EMBED_LIB={} cannot be read; building the library instead", Path::new(&lib).display());
    }
    let root = manifest.parent().expect("cli/ lives in the repository");
    for watched in ["src", "common/src", "Cargo.toml", "Cargo.lock", "build.rs"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let target = out.join("lib-target");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .args(["build", "--release", "--lib", "-p", "leaktrace", "--manifest-path"])
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        // The outer build's settings for this crate are not the library's.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !(built && embed(&target.join("release/libleaktrace.so"), &dest)) {
        println!("cargo:warning=the preload library could not be built for embedding; leaktrace will look for it beside itself or in LEAKTRACE_LIB");
        let _ = std::fs::write(&dest, b"");
        println!("cargo:rustc-env=LEAKTRACE_EMBED_HASH=none");
    }
}
