//! The memory store as the request path calls it (`MemoryStore::acquire`, with the
//! system clock), from one thread and from one thread per available core at once:
//!
//! - `hot_key`: every request on the same key (one shard, one lock);
//! - `10k_keys`: 10,000 keys in rotation, each thread starting at its own place;
//! - `evicting`: 200,000 keys in rotation through a store that holds 100,000, so
//!   every request inserts a key and evicts another.
//!
//! The limit never refuses (like a gateway under normal load). One iteration is one
//! request on each thread; the throughput line counts requests on all threads.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use sluice::limit::{Algorithm, LimitDef, MemoryStore, Mode, Plan, SystemClock};

pub fn bench(c: &mut Criterion) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let plan = Plan {
        limits: vec![LimitDef::new(
            "per_key".into(),
            Algorithm::FixedWindow {
                limit: u64::MAX / 2,
                window_us: 60_000_000,
            },
            1,
        )],
        mode: Mode::Reject,
    };
    let keys = |n: usize| (0..n).map(|i| format!("client-{i:07}")).collect::<Vec<_>>();
    let cases = [
        ("hot_key", 100_000, keys(1)),
        ("10k_keys", 100_000, keys(10_000)),
        ("evicting", 100_000, keys(200_000)),
    ];

    let mut g = c.benchmark_group("store");
    for (name, max_keys, keys) in &cases {
        let mut threads = vec![1];
        if cores > 1 {
            threads.push(cores);
        }
        for n in threads {
            let store = MemoryStore::new(*max_keys, SystemClock::new());
            g.throughput(Throughput::Elements(n as u64));
            let label = if n == 1 {
                "1_thread".into()
            } else {
                format!("{n}_threads")
            };
            g.bench_function(BenchmarkId::new(*name, label), |b| {
                b.iter_custom(|iters| requests(&store, &plan, keys, n, iters))
            });
        }
    }
    g.finish();
}

/// `iters` requests on each of `threads` threads, started together; the time until
/// the last one is done.
fn requests(
    store: &MemoryStore,
    plan: &Plan,
    keys: &[String],
    threads: usize,
    iters: u64,
) -> Duration {
    let start = Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let start = &start;
                s.spawn(move || {
                    let mut i = t * keys.len() / threads;
                    start.wait();
                    for _ in 0..iters {
                        let key = &keys[i];
                        i = if i + 1 == keys.len() { 0 } else { i + 1 };
                        black_box(store.acquire("api", key, plan));
                    }
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        for w in workers {
            w.join().expect("benchmark thread panicked");
        }
        began.elapsed()
    })
}
