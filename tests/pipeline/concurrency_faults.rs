//! `concurrency` on the Redis store when Redis misbehaves: a call that fails after its
//! script was sent, and a release that fails, must not leave a slot taken until its
//! lease expires. Against a real `redis-server`, through the store itself and through
//! the gateway.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice::limit::{
    Algorithm, LimitDef, Mode, Plan, RedisOptions, RedisStore, RedisTarget, StoreError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use crate::common;
use crate::common::redis::RedisServer;
use crate::common::{bounded, eventually};

/// One slot, with a lease (60 s) far longer than any test waits.
fn one_slot() -> Plan {
    Plan {
        limits: vec![LimitDef::new(
            "c".into(),
            Algorithm::Concurrency {
                limit: 1,
                lease_us: 60_000_000,
            },
            1,
        )],
        mode: Mode::Reject,
    }
}

async fn store(url: String) -> RedisStore {
    bounded(
        "connect",
        RedisStore::connect(RedisOptions {
            target: RedisTarget::Url(url),
            timeout: Duration::from_millis(100),
            key_prefix: "sluice:".into(),
            refusal_cache: 0,
        }),
    )
    .await
    .expect("store")
}

/// Leases held in Redis for `key`.
fn held(server: &RedisServer, store: &RedisStore, key: &str) -> i64 {
    let keys = store.keys("r", key, &one_slot());
    server.cmd(&["ZCARD", &keys[0]])
}

/// No lease of `k` is held in Redis, within 2 s; else fail with `why`.
async fn assert_freed(server: &RedisServer, store: &RedisStore, why: &str) {
    let freed = eventually(Duration::from_secs(2), || async {
        held(server, store, "k") == 0
    })
    .await;
    assert!(freed.is_some(), "{why}");
    assert_eq!(held(server, store, "k"), 0);
}

/// The store is ready again, within 2 s, and the next request of `k` is admitted
/// and takes the slot (given back at the end).
async fn the_next_request_is_admitted(server: &RedisServer, store: &RedisStore, plan: &Plan) {
    let ready = eventually(Duration::from_secs(2), || async { store.ready() }).await;
    assert!(ready.is_some(), "the store is ready again");
    let next = store.acquire("r", "k", plan).await.expect("next");
    assert!(next.verdict.allowed, "the next request is admitted");
    assert_eq!(held(server, store, "k"), 1);
    drop(next);
}

/// Redis stalls (a Lua busy loop of 3 s on another connection, as during a slow
/// fork; long enough that the request is surely sent within it, however loaded
/// the machine) while a request asks for a slot: the call times out on the client, the
/// script runs later and takes the lease. The store gives it back: once Redis
/// answers again the slot is free, and the next request of the key is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_timed_out_gives_its_lease_back() {
    let server = RedisServer::start();
    let store = store(server.url()).await;
    let plan = one_slot();
    // Warm the connection (and load the script).
    let warm = store.acquire("r", "warm", &plan).await.expect("warm");
    assert!(warm.verdict.allowed);
    drop(warm);
    let busy = tokio::task::block_in_place(|| server.stall(Duration::from_secs(3)));
    let first = store.acquire("r", "k", &plan).await;
    // Timed out by the store's bound or by the connection's response timeout (both
    // are `store.redis.timeout`), whichever fires first.
    let timed_out = match &first {
        Err(StoreError::Timeout) => true,
        Err(StoreError::Unavailable(e)) => e.contains("timed out"),
        _ => false,
    };
    assert!(
        timed_out,
        "expected a timeout, got {:?}",
        first.map(|c| c.verdict)
    );
    tokio::task::spawn_blocking(move || busy.join().unwrap())
        .await
        .unwrap();
    assert_freed(&server, &store, "the timed-out call's lease is still held").await;
    // The stall may have opened the breaker (the call and the background PINGs all
    // failed); the first probe that answers closes it.
    the_next_request_is_admitted(&server, &store, &plan).await;
}

/// A TCP proxy in front of Redis that, once armed, cuts the connection that carries
/// the next `ZREM` (the command is lost: Redis never sees it), then refuses
/// connections until `up()`: a short outage at the moment a lease is released.
struct Blip {
    port: u16,
    armed: Arc<AtomicBool>,
    down: Arc<AtomicBool>,
    cut: Arc<Notify>,
}

impl Blip {
    async fn start(redis_port: u16) -> Blip {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let down = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(Notify::new());
        let (a, d, n) = (armed.clone(), down.clone(), cut.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if d.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(("127.0.0.1", redis_port)).await else {
                    continue;
                };
                let (a, d, n) = (a.clone(), d.clone(), n.clone());
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut ur, mut uw) = upstream.into_split();
                    let to_redis = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n_read = match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => n,
                            };
                            let chunk = &buf[..n_read];
                            if a.load(Ordering::SeqCst)
                                && chunk.windows(4).any(|w| w.eq_ignore_ascii_case(b"ZREM"))
                            {
                                a.store(false, Ordering::SeqCst);
                                d.store(true, Ordering::SeqCst);
                                n.notify_one();
                                return;
                            }
                            if uw.write_all(chunk).await.is_err() {
                                return;
                            }
                        }
                    };
                    let to_client = tokio::io::copy(&mut ur, &mut cw);
                    tokio::select! {
                        _ = to_redis => {}
                        _ = to_client => {}
                    }
                    // Both halves of both sockets are dropped here: the connection ends.
                });
            }
        });
        Blip {
            port,
            armed,
            down,
            cut,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// The release of a lease is lost in a short outage (its connection cut with the
/// `ZREM` on it, then 300 ms without Redis). The store tries again once Redis is
/// back: the slot frees long before the lease (60 s) would expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_lost_in_an_outage_is_tried_again() {
    let server = RedisServer::start();
    let blip = Blip::start(server.port).await;
    let store = store(blip.url()).await;
    let plan = one_slot();
    let permit = store.acquire("r", "k", &plan).await.expect("acquire");
    assert!(permit.verdict.allowed);
    assert_eq!(held(&server, &store, "k"), 1);
    let refused = store.acquire("r", "k", &plan).await.expect("second");
    assert!(!refused.verdict.allowed);

    let cut = blip.cut.notified();
    blip.armed.store(true, Ordering::SeqCst);
    drop(permit);
    bounded("the release's ZREM at the proxy", cut).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held(&server, &store, "k"), 1, "the ZREM was lost");
    blip.down.store(false, Ordering::SeqCst);

    assert_freed(&server, &store, "the lost release was never tried again").await;
    the_next_request_is_admitted(&server, &store, &plan).await;
}

/// The same through the gateway: a response ends while its lease release is lost in
/// a short outage; once Redis is back the slot frees long before its lease (1m), and
/// the key's next request is answered 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_a_release_lost_in_an_outage_frees_the_slot() {
    let server = RedisServer::start();
    let blip = Blip::start(server.port).await;
    let up = common::upstream().await;
    let store = common::redis::redis_store(&common::redis::url_target(&blip.url()), "deny", 100);
    let yaml = format!(
        "{store}upstreams:\n  up: {{targets: [\"{}\"]}}\nroutes:\n  - name: r\n    match: {{path_prefix: /}}\n    upstream: up\n    key: header:x-key\n    limits: [{{name: inflight, algorithm: concurrency, limit: 1, lease: 1m}}]\n",
        up.url()
    );
    let gw = common::start_gateway(&yaml).await;
    let client = common::http1();
    let page = common::url(gw.addr, "/x");
    let readyz = common::url(gw.admin_addr, "/readyz");

    // Another key's request first, so that the one whose release is cut does not
    // also open the connection and load the script within the 100 ms timeout (a
    // loaded machine can take longer).
    let warm = eventually(Duration::from_secs(5), || async {
        client.get(&page, &[("x-key", "warm")]).await.status == 200
    })
    .await;
    assert!(warm.is_some(), "no request admitted before the outage");
    // (Its release, too, before the proxy is armed to cut the next.)
    let zcard = |key: &str| -> i64 {
        let keys: Vec<String> = server.cmd(&["KEYS", &format!("sluice:{{r:{key}}}:*")]);
        keys.first()
            .map_or(0, |k| server.cmd::<i64>(&["ZCARD", k.as_str()]))
    };
    let released = eventually(Duration::from_secs(2), || async { zcard("warm") == 0 }).await;
    let held = || zcard("k");
    assert!(
        released.is_some(),
        "the first request's slot was never released"
    );
    let cut = blip.cut.notified();
    blip.armed.store(true, Ordering::SeqCst);
    let first = client.get(&page, &[("x-key", "k")]).await;
    assert_eq!(first.status, 200);
    bounded("the release's ZREM at the proxy", cut).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(held(), 1, "the ZREM was lost");
    blip.down.store(false, Ordering::SeqCst);

    let freed = eventually(Duration::from_secs(2), || async { held() == 0 }).await;
    assert!(freed.is_some(), "the lost release was never tried again");
    assert_eq!(held(), 0);
    let ready = eventually(Duration::from_secs(2), || async {
        client.get(&readyz, &[]).await.status == 200
    })
    .await;
    assert!(ready.is_some(), "the gateway is ready again");
    let next = client.get(&page, &[("x-key", "k")]).await;
    assert_eq!(next.status, 200);
    assert_eq!(up.hits(), 3);
}
