//! Shared by the preload library and the `leaktrace` command, so both read the same
//! suppressions, print frames the same way and agree on the report schema's versions.
pub mod frame_text;
pub mod growth;
pub mod held;
pub mod launch;
pub mod memory;
pub mod private_dir;
pub mod report_schema;
pub mod suppressions;

pub use suppressions::Suppressions;
