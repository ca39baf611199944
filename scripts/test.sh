#!/usr/bin/env bash
# Runs every test: unit tests, then the integration tests that run real C, C++ and
# Python programs under the freshly built preload library.
# cargo test alone never rebuilds a cdylib that no test links, hence the build first.
set -euo pipefail
cd "$(dirname "$0")/.."
# The preload library, the leaktrace command and the shared crates.
cargo build --release --workspace
cargo test --release --workspace "$@"
