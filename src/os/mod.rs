//! Operating-system utilities that belong to no stage: the calling thread's stack, the
//! library's own threads (started with every signal blocked), signal dispositions, the
//! loader's module list, a spin lock, and the files the program may move under us
//! (standard error, `/proc` and the report directory across `chroot`). Nothing here
//! imports from the stages.
pub mod anchor;
pub mod fds;
pub mod loader;
pub mod lock;
pub mod signals;
pub mod stack;
pub mod threads;
