//! Shared by the preload library and the `leaktrace` command, so both read the same
//! suppressions and print frames the same way.
pub mod frame_text;
pub mod suppressions;

pub use suppressions::Suppressions;
