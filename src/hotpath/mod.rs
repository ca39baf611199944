//! Code that runs inside every allocation call. Nothing here symbolizes, locks
//! globally, or allocates on the common path.
pub mod channel;
pub mod event;
pub mod hit_tree;
pub mod mapping;
pub mod python;
pub mod stacks;
pub mod thread;
pub mod unwind;
