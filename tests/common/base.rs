//! What every end-to-end test uses: bounds on waiting, free ports, child
//! processes that never outlive the test, and the gateway starter. Loaded as
//! `redis::base` and re-exported by `common` and `redis`; examples/pgo_train.rs
//! includes this file alone, by path.
#![allow(dead_code)]

use std::future::Future;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use sluice::server::Running;

/// How long any single step of a test may take before the test fails instead of
/// hanging.
pub const BOUND: Duration = Duration::from_secs(20);

pub async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {BOUND:?}"))
}

/// Polls `f` every 50ms until it is true or `within` passes; how long it took.
pub async fn eventually<F, Fut>(within: Duration, mut f: F) -> Option<Duration>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if f().await {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

// === ports ===

/// A port free on 127.0.0.1 now, and its Redis cluster bus port p + 10000 too (a
/// cluster node on p binds both). Below 32768, the start of Linux' ephemeral range,
/// so no outgoing connection takes it meanwhile; spread by process id, so parallel
/// test binaries rarely probe the same ones.
pub fn free_port() -> u16 {
    const LOW: u32 = 20_000;
    const SPAN: u32 = 32_768 - LOW;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Per process, and per copy of this file in it (its own NEXT).
    let copy = (&NEXT as *const AtomicU32 as usize >> 4) as u32;
    let base = (std::process::id() ^ copy).wrapping_mul(7919) % SPAN;
    let free = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    for _ in 0..SPAN {
        let step = NEXT.fetch_add(1, Ordering::Relaxed).wrapping_mul(13);
        let p = (LOW + (base + step) % SPAN) as u16;
        if free(p) && free(p + 10_000) {
            return p;
        }
    }
    panic!("no free port");
}

// === child processes ===

/// A child process of the test, in a process group of its own (so a signal to the
/// group reaches whatever it started). Dropped, also when the test panics, it kills
/// the whole group; and if the test process dies without unwinding (killed, or an
/// abort), the kernel kills the child (its parent-death signal). No test run leaves
/// a process behind.
pub struct Spawned {
    child: Option<Child>,
}

/// Runs `cmd` as a `Spawned` child. (`cmd` is taken: what is left is an empty
/// command.)
pub fn spawn_grouped(cmd: &mut Command) -> std::io::Result<Spawned> {
    let mut cmd = std::mem::replace(cmd, Command::new("true"));
    let parent = std::process::id();
    cmd.process_group(0);
    // SAFETY: between fork and exec the closure calls only async-signal-safe
    // functions (prctl, getppid, _exit) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The test died between fork and prctl: no signal will come.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    // The parent-death signal fires when the thread that forked ends, not the
    // process: fork from one thread that lives as long as the process, not from
    // a test's thread (a shared server outlives the test that started it).
    let child = on_spawner_thread(move || cmd.spawn())?;
    Ok(Spawned { child: Some(child) })
}

/// Lines a child writes to stderr, collected as they come (`spawn_logged`).
pub type Lines = Arc<Mutex<Vec<String>>>;

/// `cmd` started as `spawn_grouped` does, with its stderr read line by line into
/// `Lines` by a thread, which ends when the pipe closes.
pub fn spawn_logged(cmd: &mut Command) -> (Spawned, Lines, std::thread::JoinHandle<()>) {
    use std::io::BufRead;
    let mut child = spawn_grouped(cmd.stderr(Stdio::piped())).expect("the child starts");
    let pipe = child.stderr.take().expect("stderr piped");
    let lines: Lines = Arc::default();
    let sink = lines.clone();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            sink.lock().unwrap().push(line);
        }
    });
    (child, lines, reader)
}

/// Runs `cmd` to its end as a `Spawned` child: its status and output (stdin empty,
/// stdout and stderr captured), like `Command::output`.
pub fn run_grouped(cmd: &mut Command) -> std::io::Result<Output> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut spawned = spawn_grouped(cmd)?;
    let child = spawned.child.take().expect("a child");
    child.wait_with_output()
}

fn on_spawner_thread<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    type Job = Box<dyn FnOnce() + Send>;
    static JOBS: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    let jobs = JOBS.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("test-children".into())
            .spawn(move || rx.into_iter().for_each(|job| job()))
            .expect("spawner thread");
        Mutex::new(tx)
    });
    let (tx, rx) = mpsc::sync_channel(1);
    let job: Job = Box::new(move || {
        let _ = tx.send(f());
    });
    jobs.lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job)
        .expect("spawner thread alive");
    rx.recv().expect("spawner thread answers")
}

impl Spawned {
    /// SIGKILL to the whole group, then reap the child (at once: nothing in the
    /// group can block it). Again, it does nothing.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The group id is the child's pid (`process_group(0)`); until it is
            // reaped below, that pid is not anyone else's.
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) on a process group; no memory involved.
                unsafe {
                    libc::kill(-pid, libc::SIGKILL);
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (e.g. `libc::SIGHUP`) to the child alone.
    pub fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.id()).expect("pid");
        // SAFETY: kill(2) on our own, not yet reaped, child.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill -{signal} {pid}");
    }
}

impl std::ops::Deref for Spawned {
    type Target = Child;

    fn deref(&self) -> &Child {
        self.child.as_ref().expect("the child was killed")
    }
}

impl std::ops::DerefMut for Spawned {
    fn deref_mut(&mut self) -> &mut Child {
        self.child.as_mut().expect("the child was killed")
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill();
    }
}

// === gateway ===

/// Start a gateway from YAML text. A `server:` or `admin:` section the text does not
/// have is added, listening on 127.0.0.1:0; a text that has one must say
/// `listen: 127.0.0.1:0` itself.
pub async fn start_gateway(yaml: &str) -> Running {
    let text = with_listeners(yaml);
    let loaded = sluice::config::parse(&text, Path::new("test.yaml"))
        .unwrap_or_else(|e| panic!("config does not parse: {e}\n{text}"));
    start(loaded).await
}

/// Like `start_gateway`, with the limiter's time driven by `clock` (on Redis, sent
/// with every call instead of Redis' own: `sluice::server::start_at`).
pub async fn start_gateway_at(yaml: &str, clock: Arc<dyn sluice::limit::Clock>) -> Running {
    let text = with_listeners(yaml);
    let loaded = sluice::config::parse(&text, Path::new("test.yaml"))
        .unwrap_or_else(|e| panic!("config does not parse: {e}\n{text}"));
    match sluice::server::start_at(loaded, clock).await {
        Ok(r) => r,
        Err(e) => panic!("gateway does not start: {e}"),
    }
}

/// Like `start_gateway`, but from a file (kept alive by the returned handle), for
/// tests that reload it.
pub async fn start_gateway_file(yaml: &str) -> (Running, tempfile::NamedTempFile) {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), with_listeners(yaml)).expect("write config");
    let loaded =
        sluice::config::load(file.path()).unwrap_or_else(|e| panic!("config does not load: {e}"));
    (start(loaded).await, file)
}

async fn start(loaded: sluice::config::Loaded) -> Running {
    match sluice::server::start(loaded).await {
        Ok(r) => r,
        Err(e) => panic!("gateway does not start: {e}"),
    }
}

pub fn with_listeners(yaml: &str) -> String {
    let has = |section: &str| yaml.lines().any(|l| l.starts_with(section));
    let mut text = String::new();
    if !has("server:") {
        text.push_str("server: {listen: \"127.0.0.1:0\"}\n");
    }
    if !has("admin:") {
        text.push_str("admin: {listen: \"127.0.0.1:0\"}\n");
    }
    text.push_str(yaml);
    text
}

/// A gateway from YAML that is parsed but not validated: for tests of the defences
/// behind `check` (what a file `check` refuses would do if it got past it).
pub async fn start_unchecked(yaml: &str) -> Running {
    let text = with_listeners(yaml);
    let file = serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    start(sluice::config::Loaded {
        path: "unchecked.yaml".into(),
        file,
        hash: sluice::config::hash(&text),
        warnings: Vec::new(),
    })
    .await
}
