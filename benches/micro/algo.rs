//! The six algorithms as pure functions: one request decided and, when admitted,
//! charged (`Algorithm::charge`, what the memory store calls once every limit of a
//! request has admitted).
//!
//! - `algo/admit/*`: a busy key that stays under its limit; time moves on between
//!   requests, so the state is a live one (a sliding log holds about 50 entries).
//! - `algo/refuse/*`: a key at its limit; the refusal computes when to retry.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion};
use sluice::limit::{Algorithm, Rate, State};

/// Some time in 2023, in µs since the epoch (windows align with the epoch).
const T0: u64 = 1_700_000_000_000_000;
const MS: u64 = 1_000;
const S: u64 = 1_000_000;

fn rate(count: u64, per_us: u64) -> Rate {
    Rate { count, per_us }
}

pub fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("algo");

    // (name, limit, µs between requests): requests come slower than the limit allows.
    let admitting = [
        (
            "fixed_window",
            Algorithm::FixedWindow {
                limit: 1_000_000,
                window_us: S,
            },
            2,
        ),
        (
            "sliding_window",
            Algorithm::SlidingWindow {
                limit: 1_000_000,
                window_us: S,
            },
            2,
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 100,
                window_us: S,
            },
            20 * MS,
        ),
        (
            "token_bucket",
            Algorithm::TokenBucket {
                rate: rate(1_000, S),
                burst: 100,
            },
            2 * MS,
        ),
        (
            "gcra",
            Algorithm::Gcra {
                rate: rate(1_000, S),
                burst: 100,
            },
            2 * MS,
        ),
    ];
    for (name, algo, step) in admitting {
        g.bench_function(BenchmarkId::new("admit", name), |b| {
            let mut state = State::Empty;
            let mut now = T0;
            b.iter(|| {
                now += step;
                algo.charge(&mut state, black_box(now), 1, 0)
            })
        });
    }
    // A concurrency slot is given back when the response ends, outside the algorithm:
    // each request takes one from the same count of requests in flight.
    let concurrency = Algorithm::Concurrency {
        limit: 100,
        lease_us: 60 * S,
    };
    g.bench_function(BenchmarkId::new("admit", "concurrency"), |b| {
        b.iter(|| {
            let mut state = State::InFlight(50);
            concurrency.charge(black_box(&mut state), T0, 1, 0)
        })
    });

    let refusing = [
        (
            "fixed_window",
            Algorithm::FixedWindow {
                limit: 100,
                window_us: S,
            },
        ),
        (
            "sliding_window",
            Algorithm::SlidingWindow {
                limit: 100,
                window_us: S,
            },
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 100,
                window_us: S,
            },
        ),
        (
            "token_bucket",
            Algorithm::TokenBucket {
                rate: rate(10, S),
                burst: 100,
            },
        ),
        (
            "gcra",
            Algorithm::Gcra {
                rate: rate(10, S),
                burst: 100,
            },
        ),
        (
            "concurrency",
            Algorithm::Concurrency {
                limit: 100,
                lease_us: 60 * S,
            },
        ),
    ];
    for (name, algo) in refusing {
        // Filled to the limit over the first 100 ms (a sliding log of 100 entries).
        let mut state = State::Empty;
        let mut now = T0;
        while algo.charge(&mut state, now, 1, 0).allowed {
            now += MS;
        }
        g.bench_function(BenchmarkId::new("refuse", name), |b| {
            b.iter(|| algo.charge(&mut state, black_box(now), 1, 0))
        });
    }
    g.finish();
}
