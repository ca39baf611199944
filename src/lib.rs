//! leaktrace: an LD_PRELOAD memory-leak tracer.
//!
//! Layout (three stages kept apart, as in heaptrack):
//! - `interpose/` — the ABI boundary: exported hooks, real-function lookup, lifecycle.
//! - `hotpath/`   — what runs inside every allocation: thread guard, stack capture,
//!   stack interning, the per-thread event rings.
//! - `collector/` — the background consumer's model: live set and per-stack totals.
//! - `report/`    — symbolization, JSON and text rendering, atomic file writing.
//! - `scan/`      — the reachability scan (definite / indirect / reachable).
//! - `lifecycle.rs` — the process lifecycle, one object: phase, owner, collector
//!   thread, the exit under way; every exit path asks it for the final report's turn.
//! - `agent.rs`   — glue: starts the collector, drains, writes reports, handles fork.
//! - `os/`       — utilities of no stage: stack bounds, the library's own threads,
//!   the program's standard error.
//! - `config.rs`  — `LEAKTRACE_*` variables.
pub mod agent;
pub mod collector;
pub mod config;
pub mod hotpath;
pub mod interpose;
pub mod lifecycle;
pub mod os;
pub mod report;
pub mod scan;
#[cfg(test)]
mod test_rng;

#[cfg(not(test))]
#[global_allocator]
static ALLOCATOR: interpose::malloc::RealAllocator = interpose::malloc::RealAllocator;
