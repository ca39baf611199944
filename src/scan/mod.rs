//! Reachability of outstanding blocks (issue 6, in progress): a conservative mark phase
//! over root memory and the live heap, classifying each block as LeakSanitizer does —
//! reachable from a root, indirect (reachable only from other leaked blocks), or
//! definite. This module is the pure algorithm over an abstract memory reader; the root
//! collection (module data, thread stacks and registers with other threads held still)
//! and the report wiring are not built yet.
pub mod mark;
