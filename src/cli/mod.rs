//! The command line's own machinery: the client of a running gateway's admin API.

pub mod admin_api;
