//! The watched configuration file with the `sluice` binary, in folders where other
//! files change all the time: a log written beside `rules.yaml` every few
//! milliseconds must not delay an edit, saved in place or by rename, and a
//! Kubernetes ConfigMap's `..data` swap is seen, twice in a row, in such a folder too.
//! Waits are bounded polls; each edit must be served within `APPLIED`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use http::Method;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// The promise is "within a second"; the bound leaves room for a busy machine.
const APPLIED: Duration = Duration::from_secs(2);

/// A `sluice run -c PATH`, its stderr collected.
struct Gateway {
    process: Spawned,
    lines: Lines,
    port: u16,
    admin: u16,
}

/// The configuration: a route that answers `body` itself.
fn config(port: u16, admin: u16, body: &str) -> String {
    format!(
        r#"server: {{listen: "127.0.0.1:{port}"}}
admin: {{listen: "127.0.0.1:{admin}"}}
routes:
  - {{name: main, match: {{path_prefix: /}}, key: ip, respond: {{body: {body}}}}}
"#
    )
}

impl Gateway {
    async fn start(path: &Path, port: u16, admin: u16) -> Gateway {
        let (process, lines, _reader) = spawn_logged(
            Command::new(SLUICE)
                .arg("run")
                .arg("-c")
                .arg(path)
                .env_remove("SLUICE_CONFIG")
                .env("SLUICE_LOG", "info,sluice::config::watch=debug")
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        let g = Gateway {
            process,
            lines,
            port,
            admin,
        };
        let c = http1();
        let health = format!("http://127.0.0.1:{admin}/healthz");
        let up = eventually(BOUND, || async {
            c.try_send(Method::GET, &health, &[], Default::default())
                .await
                .is_ok()
        })
        .await;
        assert!(up.is_some(), "sluice not up: {:?}", g.lines.lock().unwrap());
        g
    }

    async fn body(&self) -> String {
        let r = http1()
            .get(&format!("http://127.0.0.1:{}/", self.port), &[])
            .await;
        assert_eq!(r.status, 200, "{}", r.text());
        r.text().to_string()
    }

    /// Waits until the gateway serves `body`; fails after `APPLIED`.
    async fn serves(&self, body: &str) -> Duration {
        let started = Instant::now();
        loop {
            if self.body().await == body {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < APPLIED,
                "{body} not served within {APPLIED:?}; log: {:#?}",
                self.lines.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn reloads(&self, result: &str) -> f64 {
        let m = metrics(format!("127.0.0.1:{}", self.admin).parse().unwrap()).await;
        metric(
            &m,
            &format!("sluice_config_reloads_total{{result=\"{result}\"}}"),
        )
        .unwrap_or_else(|| panic!("no reload counter in\n{m}"))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.process.kill();
    }
}

/// A thread appending a line to `path` every 3 ms until dropped: a busy access log
/// beside the configuration.
struct Busy {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Busy {
    fn writing(path: PathBuf) -> Busy {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .expect("open the busy file");
            let mut n = 0;
            while !flag.load(Ordering::Relaxed) {
                writeln!(f, "GET /busy {n}").expect("append");
                n += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
            n
        });
        Busy {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops the writer; how many lines it wrote.
    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().expect("writer")
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[tokio::test]
async fn an_edit_applies_within_a_second_while_a_file_beside_it_is_written_continuously() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.yaml");
    let (port, admin) = (free_port(), free_port());
    std::fs::write(&path, config(port, admin, "v1")).unwrap();
    let gw = Gateway::start(&path, port, admin).await;
    assert_eq!(gw.body().await, "v1");

    let busy = Busy::writing(dir.path().join("access.log"));
    // Let the writer run on its own first: it alone must reload nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(gw.body().await, "v1");

    // Written in place.
    std::fs::write(&path, config(port, admin, "v2")).unwrap();
    let took = gw.serves("v2").await;
    eprintln!("in place: applied after {took:?}");

    // Saved as editors do: a temporary file beside it, renamed over it.
    let tmp = dir.path().join(".rules.yaml.swp");
    std::fs::write(&tmp, config(port, admin, "v3")).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let took = gw.serves("v3").await;
    eprintln!("renamed: applied after {took:?}");

    let written = busy.stop();
    assert!(written > 100, "the busy file got only {written} lines");
    // Why the busy file's events changed nothing is at debug level.
    let ignored = gw
        .lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("event ignored") && l.contains("access.log"))
        .count();
    assert!(ignored > 0, "no debug line about access.log's events");
    assert_eq!(
        (gw.reloads("success").await, gw.reloads("failure").await),
        (2.0, 0.0)
    );
}

#[tokio::test]
async fn a_configmap_swap_done_twice_applies_while_the_folder_is_busy() {
    // The layout kubelet makes: `..data` points at a versioned directory, and the
    // file the gateway reads is a symlink through `..data`.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (port, admin) = (free_port(), free_port());
    let version = |name: &str, body: &str| {
        std::fs::create_dir(d.join(name)).unwrap();
        std::fs::write(d.join(name).join("rules.yaml"), config(port, admin, body)).unwrap();
    };
    let swap = |to: &str, old: &str| {
        std::os::unix::fs::symlink(to, d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        std::fs::remove_dir_all(d.join(old)).unwrap();
    };
    version("..v1", "v1");
    std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", d.join("rules.yaml")).unwrap();
    let gw = Gateway::start(&d.join("rules.yaml"), port, admin).await;
    assert_eq!(gw.body().await, "v1");

    // Something else keeps writing in the folder (not kubelet's way, but it must
    // not hide the swaps).
    let busy = Busy::writing(d.join("sidecar.log"));
    tokio::time::sleep(Duration::from_millis(300)).await;

    version("..v2", "v2");
    swap("..v2", "..v1");
    let took = gw.serves("v2").await;
    eprintln!("first swap: applied after {took:?}");

    // And again, now that the directory first resolved to is gone.
    version("..v3", "v3");
    swap("..v3", "..v2");
    let took = gw.serves("v3").await;
    eprintln!("second swap: applied after {took:?}");

    busy.stop();
    assert_eq!(
        (gw.reloads("success").await, gw.reloads("failure").await),
        (2.0, 0.0)
    );
}
