#!/usr/bin/env bash
# Installs leaktrace under PREFIX (default /usr/local): bin/leaktrace and
# lib/libleaktrace.so, which the command finds in ../lib. Needs a Rust toolchain
# (rustup's stable; Debian's rustc is too old).
#   scripts/install.sh [PREFIX]
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${1:-/usr/local}
cargo build --release --workspace
install -d "$prefix/bin" "$prefix/lib"
install -m 0755 target/release/leaktrace "$prefix/bin/leaktrace"
install -m 0755 target/release/libleaktrace.so "$prefix/lib/libleaktrace.so"
echo "installed $prefix/bin/leaktrace and $prefix/lib/libleaktrace.so"
