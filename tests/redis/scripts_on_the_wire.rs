//! Every script goes by EVALSHA: watched with `MONITOR` while a gateway decides
//! limits, adds and removes deny entries and renews a concurrency lease, each
//! script's whole body is sent (EVAL) at most once, to load it; every later call
//! names it by its hash.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::redis::*;
use crate::common::{upstream_with, UpstreamOpts};
use serde_json::json;

/// The commands Redis ran, as `MONITOR` prints them, gathered by a thread of its own
/// until the server goes away.
fn monitor(redis: &RedisServer) -> Arc<Mutex<Vec<String>>> {
    let mut s = TcpStream::connect(("127.0.0.1", redis.port)).expect("connect for MONITOR");
    s.write_all(b"MONITOR\r\n").expect("MONITOR");
    let mut lines = BufReader::new(s);
    let mut ok = String::new();
    lines.read_line(&mut ok).expect("MONITOR answers");
    assert_eq!(ok.trim_end(), "+OK");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let into = seen.clone();
    std::thread::spawn(move || {
        for line in lines.lines() {
            let Ok(line) = line else { return };
            into.lock().expect("monitor log").push(line);
        }
    });
    seen
}

/// A `MONITOR` line's command name (upper case) and its first argument.
fn command(line: &str) -> Option<(String, &str)> {
    let rest = &line[line.find("] \"")? + 3..];
    let (name, rest) = rest.split_once('"')?;
    let first = rest.strip_prefix(" \"").unwrap_or("");
    Some((name.to_ascii_uppercase(), first))
}

redis_and_valkey! {
    async fn every_script_is_sent_whole_at_most_once_then_by_its_hash() {
        let redis = RedisServer::start();
        let seen = monitor(&redis);
        let up = upstream_with(UpstreamOpts {
            status: None,
            delay: Duration::from_millis(500),
        })
        .await;
        let yaml = format!(
            "{}upstreams:\n  slow: {{targets: [\"{}\"]}}\nroutes:\n  - name: slow\n    match: {{path_prefix: /}}\n    upstream: slow\n    key: header:x-key\n    limits: [{{name: inflight, algorithm: concurrency, limit: 4, lease: 150ms}}, {{name: hourly, algorithm: fixed_window, limit: 100, window: 1h}}]\n",
            redis_store(&url_target(&redis.url()), "deny", 500),
            up.url()
        );
        let gw = start_gateway(&yaml).await;
        for round in 0..2 {
            // Limits decided, a lease taken and renewed (every 50 ms for 500 ms).
            let a = get(gw.addr, "/", &[("x-key", "k")]).await;
            assert_eq!(a.status, 200, "round {round}: {}", a.body);
            // The shared deny list: an entry added, then removed.
            let body = json!({"key": format!("k{round}"), "ttl": "10m"}).to_string();
            let a = request(gw.admin_addr, "POST", "/admin/deny", &[], &body).await;
            assert_eq!(a.status, 201, "round {round}: {}", a.body);
            let body = json!({"key": format!("k{round}")}).to_string();
            let a = request(gw.admin_addr, "DELETE", "/admin/deny", &[], &body).await;
            assert_eq!(a.status, 204, "round {round}: {}", a.body);
        }
        // The last renewals and releases land.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen = seen.lock().expect("monitor log").clone();
        let mut whole: HashMap<String, usize> = HashMap::new();
        let mut by_hash = 0;
        for line in &seen {
            match command(line) {
                Some((name, body)) if name == "EVAL" => {
                    let start: String = body.chars().take(80).collect();
                    *whole.entry(start).or_default() += 1;
                }
                Some((name, _)) if name == "EVALSHA" => by_hash += 1,
                _ => {}
            }
        }
        let again: Vec<_> = whole.iter().filter(|(_, n)| **n > 1).collect();
        assert!(
            again.is_empty(),
            "scripts sent whole more than once (body start, times): {again:?}"
        );
        // The limiter script twice, a lease renewed, the deny writes: all by hash.
        assert!(
            by_hash >= 6,
            "{by_hash} EVALSHA calls:\n{}",
            seen.join("\n")
        );
    }
}
