//! Off the hot path: symbolization, report rendering and atomic writing.
pub mod build;
pub mod cached;
pub mod checks;
pub mod dwarf_units;
pub mod held;
pub mod memory;
pub mod process;
pub mod python;
pub mod symbolize;
pub mod timeline;
pub mod writer;
