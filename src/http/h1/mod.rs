//! HTTP/1.1: the server codec (`server`) and the upstream client codec (`client`).

pub mod client;
pub mod server;
