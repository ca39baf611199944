//! Operating-system utilities that belong to no stage: the calling thread's stack, the
//! library's own threads (started with every signal blocked), file descriptors the
//! program may move under us. Nothing here imports from the stages.
pub mod anchor;
pub mod fds;
pub mod stack;
pub mod threads;
