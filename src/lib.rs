//! leaktrace: an LD_PRELOAD memory-leak tracer.
//!
//! Stages, top to bottom; a module imports only from those below it (heaptrack keeps
//! track, interpret and analyze apart the same way):
//! - `interpose/` — hooks: the ABI entry points (malloc, CUDA, pthread, signals, the
//!   library's constructor and exit paths), real-function lookup.
//! - `agent/`     — what the hooks call: `record` (capture and publish on the caller's
//!   thread), `fork`, `collector_thread`, `checkpoint`, `reports` (report assembly),
//!   `verdicts` (the scan's verdicts by group), `consumer` (the collector's state).
//! - `lifecycle.rs` — the process lifecycle, one object: phase, owner, collector
//!   thread, the exit under way; every exit path asks it for the final report's turn.
//! - `report/`    — symbolization, JSON and text rendering, atomic file writing.
//! - `collector/` — the background consumer's model: live set and per-stack totals.
//! - `scan/`      — the reachability scan (definite / indirect / reachable), its roots
//!   and the live pymalloc arenas.
//! - `hotpath/`   — what runs inside every allocation: thread guard, stack capture,
//!   stack interning, the per-thread event rings (capture and publish).
//! - `os/`, `util.rs` — utilities of no stage: stack bounds, the library's own threads,
//!   the loader's module list, the program's standard error, a fast hash map.
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
pub mod spans;
#[cfg(test)]
mod test_rng;
#[cfg(test)]
mod test_skip;
pub mod util;

#[cfg(not(test))]
#[global_allocator]
static ALLOCATOR: interpose::malloc::RealAllocator = interpose::malloc::RealAllocator;
