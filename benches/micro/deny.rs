//! The deny list with 100,000 entries: 50,000 IPv4 addresses, 10,000 IPv6 addresses,
//! 10,000 CIDR blocks (/16 to /28, IPv4 and IPv6) and 30,000 client keys; a fifth of
//! them bans with an expiry (an hour away), the rest without. Lookups rotate through
//! 1,024 addresses or keys, so they do not all hit the same cache lines:
//!
//! - `deny/ip/hit_address`, `hit_block`: a listed address, an address inside a block;
//! - `deny/ip/miss_v4`, `miss_v6`: addresses no entry covers (what almost every
//!   request asks);
//! - `deny/key/hit`, `miss`.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use criterion::Criterion;
use ipnet::IpNet;
use sluice::deny::{now_ms, DenyTable, Entry, Meta, Source, Target};

/// xorshift64: the same entries on every run, without a random-number crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Entries stay outside these, which the misses are drawn from.
fn reserved_v4(a: Ipv4Addr) -> bool {
    a.octets()[0] == 203
}
fn reserved_v6(a: Ipv6Addr) -> bool {
    a.segments()[0] == 0x2001 && a.segments()[1] == 0x0db8
}

fn v4(rng: &mut Rng) -> Ipv4Addr {
    loop {
        let a = Ipv4Addr::from(rng.next() as u32);
        if !reserved_v4(a) {
            return a;
        }
    }
}
fn v6(rng: &mut Rng) -> Ipv6Addr {
    loop {
        let a = Ipv6Addr::from((u128::from(rng.next()) << 64) | u128::from(rng.next()));
        if !reserved_v6(a) {
            return a;
        }
    }
}

fn key(rng: &mut Rng) -> String {
    format!("key-{:016x}{:08x}", rng.next(), rng.next() as u32)
}

/// The table, and samples of what it holds: listed addresses, addresses inside its
/// blocks, listed keys.
struct Listed {
    table: DenyTable,
    addresses: Vec<IpAddr>,
    in_blocks: Vec<IpAddr>,
    keys: Vec<String>,
}

fn listed() -> Listed {
    let mut rng = Rng(0x5eed_cafe_f00d_d00d);
    let mut table = DenyTable::new();
    let mut n = 0u64;
    // Adds an entry for a target not listed yet; false for one drawn twice.
    let mut add = |table: &mut DenyTable, target: Target| {
        if table.get(&target).is_some() {
            return false;
        }
        n += 1;
        let ban = n.is_multiple_of(5);
        let meta = Meta {
            expires_at_ms: ban.then(|| now_ms() + 3_600_000),
            reason: None,
            source: if ban { Source::Ban } else { Source::Static },
            route: ban.then(|| Arc::from("api")),
        };
        table.insert(Entry { target, meta });
        true
    };
    let (mut addresses, mut in_blocks, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..50_000 {
        let a = loop {
            let a = IpAddr::V4(v4(&mut rng));
            if add(&mut table, Target::Ip(IpNet::from(a))) {
                break a;
            }
        };
        if i % 40 == 0 {
            addresses.push(a);
        }
    }
    for _ in 0..10_000 {
        while !add(
            &mut table,
            Target::Ip(IpNet::from(IpAddr::V6(v6(&mut rng)))),
        ) {}
    }
    for i in 0..10_000 {
        let net = loop {
            let (a, len) = if i % 4 == 3 {
                (IpAddr::V6(v6(&mut rng)), 32 + (rng.next() % 33) as u8)
            } else {
                (IpAddr::V4(v4(&mut rng)), 16 + (rng.next() % 13) as u8)
            };
            let net = IpNet::new(a, len)
                .expect("a prefix length in range")
                .trunc();
            if add(&mut table, Target::Ip(net)) {
                break net;
            }
        };
        // An address of the block other than its first.
        if i % 4 != 3 && in_blocks.len() < 1024 {
            if let IpNet::V4(n) = net {
                let last = u32::from(n.broadcast());
                in_blocks.push(IpAddr::V4(Ipv4Addr::from(last - 1)));
            }
        }
    }
    for i in 0..30_000 {
        let k = loop {
            let k = key(&mut rng);
            if add(&mut table, Target::Key(k.clone())) {
                break k;
            }
        };
        if i % 29 == 0 {
            keys.push(k);
        }
    }
    assert_eq!(table.len(), 100_000);
    Listed {
        table,
        addresses,
        in_blocks,
        keys,
    }
}

/// Rotates through `items` with each call of the benchmark.
fn rotating<'a, T>(items: &'a [T]) -> impl FnMut() -> &'a T {
    let mut i = 0;
    move || {
        i = if i + 1 == items.len() { 0 } else { i + 1 };
        &items[i]
    }
}

pub fn bench(c: &mut Criterion) {
    let l = listed();
    let mut rng = Rng(0x0bad_5eed_1234_5678);
    let miss_v4: Vec<IpAddr> = (0..1024)
        .map(|_| {
            IpAddr::V4(Ipv4Addr::new(
                203,
                rng.next() as u8,
                rng.next() as u8,
                rng.next() as u8,
            ))
        })
        .collect();
    let miss_v6: Vec<IpAddr> = (0..1024)
        .map(|_| {
            let low = u128::from(rng.next()) << 32;
            IpAddr::V6(Ipv6Addr::from((0x2001_0db8u128 << 96) | low))
        })
        .collect();
    let miss_keys: Vec<String> = (0..1024).map(|_| key(&mut rng)).collect();
    // What each benchmark looks up must be what it says.
    let t = &l.table;
    assert!(l.addresses.iter().chain(&l.in_blocks).all(|a| t.ip(*a)));
    assert!(miss_v4.iter().chain(&miss_v6).all(|a| !t.ip(*a)));
    assert!(l.keys.iter().all(|k| t.key(k)) && !miss_keys.iter().any(|k| t.key(k)));

    let mut g = c.benchmark_group("deny");
    for (name, ips) in [
        ("ip/hit_address", &l.addresses),
        ("ip/hit_block", &l.in_blocks),
        ("ip/miss_v4", &miss_v4),
        ("ip/miss_v6", &miss_v6),
    ] {
        g.bench_function(name, |b| {
            let mut next = rotating(ips);
            b.iter(|| t.ip(black_box(*next())))
        });
    }
    for (name, keys) in [("key/hit", &l.keys), ("key/miss", &miss_keys)] {
        g.bench_function(name, |b| {
            let mut next = rotating(keys);
            b.iter(|| t.key(black_box(next())))
        });
    }
    g.finish();
}
