//! The configuration file: every rule `sluice check` reports, where it reports it,
//! and the JSON Schema the binary prints and the repository keeps.

#[path = "../common/mod.rs"]
mod common;

mod config_check;
mod schema;
