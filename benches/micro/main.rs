//! Micro-benchmarks of the request path's parts, through the library's public API:
//! the limit algorithms, the memory store under contention, route matching and
//! client keys, the deny list, and JWT verification. `cargo bench --bench micro` runs them all (under
//! two minutes once built); `cargo bench --bench micro -- store/` runs one group. They
//! report times and compare them with the previous run; nothing here asserts on a time.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};

mod algo;
mod deny;
mod jwt;
mod request;
mod store;

/// Short runs by default, so that the whole set takes under two minutes; criterion's
/// own options (`--measurement-time`, `--warm-up-time`, `--sample-size`) override them.
fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(1))
        .sample_size(50)
}

criterion_group! {
    name = micro;
    config = config();
    targets = algo::bench, store::bench, request::bench, deny::bench, jwt::bench
}
criterion_main!(micro);
