//! The wire and the connections, end to end: the gateway's own HTTP/1.1 server and
//! hyper's, hostile and faulty clients, stalls, connection caps, and HTTP/1.1 to
//! upstreams (their heads, fields, retries, the pool) with sluice invisible between.

#[path = "../common/mod.rs"]
mod common;

mod client_faults;
mod connections;
mod failover;
mod grpc;
mod h1_fast_path;
mod h1_fast_path_limits;
mod h1_hostile;
mod h2_hostile;
mod h2_upstream;
mod hostile_requests;
mod pool;
mod read_ahead;
mod stalls;
mod transparency;
mod upstream_retry;
mod upstream_wire;
