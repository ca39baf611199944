//! The consumer side: the live set and per-stack aggregates, fed in ticket order.
pub mod address_table;
pub mod groups;
pub mod state;
pub mod transients;
