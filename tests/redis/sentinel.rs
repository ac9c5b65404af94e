//! Redis Sentinel end to end: two `sluice run` processes find their Redis through
//! three sentinels, and when the primary is killed under traffic they follow the
//! failover by themselves: `on_error` answers during the gap, then limits are
//! decided in the new primary, the shared deny list is followed there and the fleet
//! heartbeats are written there, with no restart and no configuration change.

use std::time::{Duration, Instant};

use crate::common::redis::*;

/// A route answered by sluice itself, keyed by `x-key`, three requests per key and
/// hour; `on_error: deny` (503) while the store is down.
fn gateway(set: &SentinelSet) -> String {
    format!(
        "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{name: per_key, algorithm: fixed_window, limit: 3, window: 1h}}]\n",
        redis_store(&sentinel_target(set), "deny", 200)
    )
}

async fn ask(p: &SluiceProcess, key: &str) -> u16 {
    get(p.addr, "/", &[("x-key", key)]).await.status
}

/// Subscribers of the deny list's channel on `server`.
fn deny_subscribers(server: &RedisServer) -> i64 {
    let (_, n): (String, i64) = server.cmd(&["PUBSUB", "NUMSUB", "sluice:deny"]);
    n
}

redis_and_valkey! {
    async fn a_failover_moves_limits_and_the_deny_list_to_the_new_primary() {
        let mut set = SentinelSet::start();
        let yaml = gateway(&set);
        let mut a = SluiceProcess::start(&[], &[], &yaml).await;
        let mut b = SluiceProcess::start(&[], &[], &yaml).await;

        // Before: one count for both instances, kept in the primary.
        let mut before = Vec::new();
        for p in [&a, &b, &a, &b] {
            before.push(ask(p, "before").await);
        }
        assert_eq!(before, [200, 200, 200, 429]);
        assert_eq!(set.primary.keys("sluice:{api:before}:*").len(), 1);
        let both = eventually(BOUND, || async { deny_subscribers(&set.primary) == 2 }).await;
        assert!(
            both.is_some(),
            "{} subscribers",
            deny_subscribers(&set.primary)
        );

        // Traffic from both instances, each request on a key of its own (so each is
        // admitted whenever the store answers); the primary is killed after the 20th.
        let (old, new) = (set.primary.port, set.replica.port);
        let mut answers: Vec<(usize, Duration, u16)> = Vec::new();
        let mut killed: Option<Instant> = None;
        let mut switched = None;
        let mut since_ok = 0;
        let deadline = Instant::now() + BOUND;
        for i in 0.. {
            if i == 20 {
                set.primary.kill();
                killed = Some(Instant::now());
            }
            let p = if i % 2 == 0 { &a } else { &b };
            let status = ask(p, &format!("t{i}")).await;
            let at = killed.map_or(Duration::ZERO, |k| k.elapsed());
            answers.push((i, at, status));
            // When the sentinels named the new primary (asked between requests).
            if let (Some(k), None) = (killed, switched) {
                if set.named() == new {
                    switched = Some(k.elapsed());
                }
            }
            if killed.is_some() && answers.iter().any(|&(_, _, s)| s == 503) {
                since_ok = if status == 200 { since_ok + 1 } else { 0 };
                if since_ok == 20 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no recovery within {BOUND:?}: {answers:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Every request was answered: admitted by Redis, or refused by `on_error: deny`.
        let odd: Vec<_> = answers
            .iter()
            .filter(|a| ![200, 503].contains(&a.2))
            .collect();
        assert!(odd.is_empty(), "{odd:?}");
        assert!(answers[..20].iter().all(|a| a.2 == 200), "{answers:?}");
        let failed: Vec<_> = answers.iter().filter(|a| a.2 == 503).collect();
        let (first, last) = (failed[0], failed[failed.len() - 1]);
        let back = answers
            .iter()
            .find(|a| a.0 > last.0)
            .expect("answered again");
        println!(
            "store down for requests: first 503 {:?} after the kill, sentinels named the new primary by {:?}, first 200 from it {:?} after the kill ({} requests answered 503)",
            first.1,
            switched.expect("the sentinels switched"),
            back.1,
            failed.len()
        );
        // The sentinels moved the primary; so did both instances, with no restart.
        assert_eq!(set.named(), new);
        assert_ne!(new, old);
        assert!(a.child.try_wait().unwrap().is_none() && b.child.try_wait().unwrap().is_none());

        // Every request admitted after the kill was counted in the new primary.
        for &(i, _, _) in answers.iter().filter(|a| a.0 > last.0) {
            assert_eq!(
                set.replica.keys(&format!("sluice:{{api:t{i}}}:*")).len(),
                1,
                "t{i}"
            );
        }
        // The limiter works there, one count for both instances.
        let mut after = Vec::new();
        for p in [&b, &a, &b, &a] {
            after.push(ask(p, "after").await);
        }
        assert_eq!(after, [200, 200, 200, 429]);
        assert_eq!(set.replica.keys("sluice:{api:after}:*").len(), 1);

        // The fleet heartbeats: both instances' are written to the new primary. A key
        // copied from the old one has at most the heartbeat's TTL (5 s) less the time
        // since the kill (more than a second: the failover) left; one written there
        // again within the last half second has more than 4.5 s.
        // (Each instance beats on its own schedule: seen fresh one at a time.)
        let fresh_ms = sluice::ops::fleet::HEARTBEAT_TTL.as_millis() as i64 - 500;
        let mut fresh = std::collections::BTreeSet::new();
        let deadline = Instant::now() + BOUND;
        while fresh.len() < 2 {
            for k in set
                .replica
                .cmd::<Vec<String>>(&["KEYS", "sluice:{fleet}:i:*"])
            {
                if set.replica.cmd::<i64>(&["PTTL", &k]) > fresh_ms {
                    fresh.insert(k);
                }
            }
            assert!(
                Instant::now() < deadline,
                "heartbeats written there: {fresh:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }

        // The deny list: both instances subscribed on the new primary; an entry added
        // on a is enforced by b.
        let both = eventually(BOUND, || async { deny_subscribers(&set.replica) == 2 }).await;
        assert!(
            both.is_some(),
            "{} subscribers",
            deny_subscribers(&set.replica)
        );
        let added = request(
            a.admin,
            "POST",
            "/admin/deny",
            &[],
            r#"{"key":"bad","ttl":"1h","reason":"after the failover"}"#,
        )
        .await;
        assert_eq!(added.status, 201, "{}", added.body);
        let denied = eventually(BOUND, || async { ask(&b, "bad").await == 403 }).await;
        assert!(denied.is_some(), "b never enforced the entry");
        let kept: i64 = set
            .replica
            .cmd(&["HEXISTS", "sluice:{deny}:entries", "key:bad"]);
        assert_eq!(kept, 1);
    }
}

redis_and_valkey! {
    /// Credentials: the sentinels' own in their URLs, the servers' in `password`; the
    /// new primary after a failover takes the same. The first sentinel listed is not
    /// there: the others are asked.
    async fn credentials_reach_the_sentinels_and_each_primary() {
        let mut set = SentinelSet::start_auth(Some(("s3cret-pw", "sentinel-pw")));
        assert!(set.urls().iter().all(|u| u.contains(":sentinel-pw@")));
        let gone = format!("redis://:sentinel-pw@127.0.0.1:{}", free_port());
        let nodes: Vec<String> = std::iter::once(gone)
            .chain(set.urls())
            .map(|u| format!("\"{u}\""))
            .collect();
        let target = format!(
            "sentinel: {{master: {MASTER}, nodes: [{}], password: s3cret-pw}}",
            nodes.join(", ")
        );
        let yaml = format!(
            "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{name: per_key, algorithm: fixed_window, limit: 3, window: 1h}}]\n",
            redis_store(&target, "deny", 200)
        );
        let p = SluiceProcess::start(&[], &[], &yaml).await;
        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(ask(&p, "k").await);
        }
        assert_eq!(seen, [200, 200, 200, 429]);
        assert_eq!(set.primary.keys("sluice:{api:k}:*").len(), 1);

        set.primary.kill();
        let moved = eventually(BOUND, || async { ask(&p, "later").await == 200 }).await;
        assert!(moved.is_some(), "never decided in the new primary");
        assert_eq!(set.named(), set.replica.port);
        assert_eq!(set.replica.keys("sluice:{api:later}:*").len(), 1);
    }
}

/// TLS: `rediss://` sentinels, and the primary they name reached over TLS too (its
/// certificate checked against the address they announce), before and after a
/// failover. sluice trusts the self-signed certificate through `SSL_CERT_FILE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_reaches_the_sentinels_and_each_primary() {
    let mut set = TlsSentinelSet::start();
    let nodes: Vec<String> = set.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let target = format!(
        "sentinel: {{master: {MASTER}, nodes: [{}]}}",
        nodes.join(", ")
    );
    let yaml = format!(
        "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{name: per_key, algorithm: fixed_window, limit: 3, window: 1h}}]\n",
        redis_store(&target, "deny", 500)
    );
    let cert = set.cert.display().to_string();
    let p = SluiceProcess::start(&[], &[("SSL_CERT_FILE", &cert)], &yaml).await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(ask(&p, "k").await);
    }
    assert_eq!(seen, [200, 200, 200, 429]);
    assert_eq!(set.keys(set.primary.0, "sluice:{api:k}:*").len(), 1);

    set.primary.1.kill();
    let moved = eventually(BOUND, || async { ask(&p, "later").await == 200 }).await;
    assert!(moved.is_some(), "never decided in the new primary");
    let named = set.cli(
        set.sentinels[0].0,
        &["SENTINEL", "get-master-addr-by-name", MASTER],
    );
    assert_eq!(named, format!("127.0.0.1\n{}\n", set.replica.0));
    assert_eq!(set.keys(set.replica.0, "sluice:{api:later}:*").len(), 1);
}
