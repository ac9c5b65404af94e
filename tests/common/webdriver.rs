//! A real headless Chromium for the tests, driven over the W3C WebDriver protocol:
//! `chromedriver` on a free loopback port in a process group of its own, spoken to
//! with the tests' own HTTP client (JSON over HTTP, no WebDriver crate). Dropped,
//! also when the test panics, it ends the session, kills chromedriver's group, and
//! kills whatever process still runs with this browser's profile directory, so no
//! Chromium outlives the test.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use http::Method;
use serde_json::{json, Value};

use super::{eventually, free_port, http1, spawn_grouped, HttpClient, Spawned, BOUND};

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    base: String,
    session: Option<String>,
    client: HttpClient,
    driver: Spawned,
    port: u16,
    profile: tempfile::TempDir,
}

/// A reference to an element of the page.
#[derive(Clone, Debug)]
pub struct Element(String);

/// The Chromium binary itself: Debian's `/usr/bin/chromium` is a shell wrapper.
fn chromium() -> PathBuf {
    let real = Path::new("/usr/lib/chromium/chromium");
    if real.exists() {
        return real.to_path_buf();
    }
    PathBuf::from("chromium")
}

impl Browser {
    /// Starts chromedriver and one headless Chromium session.
    pub async fn start() -> Browser {
        let port = free_port();
        let mut cmd = Command::new("chromedriver");
        cmd.arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let driver = spawn_grouped(&mut cmd)
            .unwrap_or_else(|e| panic!("start chromedriver (tests/run.sh installs it): {e}"));
        let profile = tempfile::Builder::new()
            .prefix("sluice-chromium-")
            .tempdir()
            .expect("profile directory");
        let mut b = Browser {
            base: format!("http://127.0.0.1:{port}"),
            session: None,
            client: http1(),
            driver,
            port,
            profile,
        };
        let ready = eventually(BOUND, || async {
            match b
                .client
                .try_send(
                    Method::GET,
                    &format!("{}/status", b.base),
                    &[],
                    Default::default(),
                )
                .await
            {
                Ok(r) => serde_json::from_slice::<Value>(&r.body)
                    .map(|v| v["value"]["ready"] == json!(true))
                    .unwrap_or(false),
                Err(_) => false,
            }
        })
        .await;
        assert!(ready.is_some(), "chromedriver did not come up on {port}");
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium().display().to_string(),
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--disable-gpu",
                    "--no-first-run",
                    "--no-default-browser-check",
                    "--disable-extensions",
                    "--window-size=1280,900",
                    format!("--user-data-dir={}", b.profile.path().display()),
                ],
            },
        }}});
        let v = b.call(Method::POST, "/session", Some(caps)).await;
        let id = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session id in {v}"))
            .to_string();
        b.session = Some(id);
        b
    }

    /// One WebDriver command: its `value`; panics on an error answer.
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let r = self
            .client
            .send(
                method.clone(),
                &format!("{}{path}", self.base),
                &[("content-type", "application/json")],
                body,
            )
            .await;
        let v: Value = serde_json::from_slice(&r.body)
            .unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {}", r.text()));
        assert_eq!(r.status, 200, "{method} {path}: {v}");
        v["value"].clone()
    }

    fn session(&self, rest: &str) -> String {
        format!(
            "/session/{}{rest}",
            self.session.as_deref().expect("a session")
        )
    }

    pub async fn open(&self, url: &str) {
        self.call(
            Method::POST,
            &self.session("/url"),
            Some(json!({"url": url})),
        )
        .await;
    }

    /// The first element matching the CSS selector; panics when there is none.
    pub async fn find(&self, css: &str) -> Element {
        let v = self
            .call(
                Method::POST,
                &self.session("/element"),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        Element(
            v[ELEMENT]
                .as_str()
                .unwrap_or_else(|| panic!("{css}: {v}"))
                .to_string(),
        )
    }

    /// Types `text` into the element, as a user would.
    pub async fn type_into(&self, e: &Element, text: &str) {
        self.call(
            Method::POST,
            &self.session(&format!("/element/{}/value", e.0)),
            Some(json!({"text": text})),
        )
        .await;
    }

    pub async fn click(&self, e: &Element) {
        self.call(
            Method::POST,
            &self.session(&format!("/element/{}/click", e.0)),
            Some(json!({})),
        )
        .await;
    }

    /// The element's rendered text.
    pub async fn text(&self, e: &Element) -> String {
        let v = self
            .call(
                Method::GET,
                &self.session(&format!("/element/{}/text", e.0)),
                None,
            )
            .await;
        v.as_str().unwrap_or_default().to_string()
    }

    /// Runs `script` (a function body; `return` gives the value) in the page.
    pub async fn eval(&self, script: &str) -> Value {
        self.call(
            Method::POST,
            &self.session("/execute/sync"),
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Polls `script` until it returns `want` (every 100ms, up to `BOUND`); panics
    /// with the last value otherwise.
    pub async fn wait_for(&self, what: &str, script: &str, want: Value) {
        let t0 = std::time::Instant::now();
        let mut last;
        loop {
            last = self.eval(script).await;
            if last == want {
                return;
            }
            if t0.elapsed() > BOUND {
                panic!("{what}: wanted {want}, the page still says {last} after {BOUND:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A PNG of the whole page (the window grown to its height first).
    pub async fn screenshot(&self) -> Vec<u8> {
        let height = self
            .eval("return document.documentElement.scrollHeight")
            .await
            .as_u64()
            .unwrap_or(900)
            .clamp(600, 4000);
        self.call(
            Method::POST,
            &self.session("/window/rect"),
            Some(json!({"width": 1280, "height": height + 120})),
        )
        .await;
        self.eval("window.scrollTo(0, 0); document.activeElement && document.activeElement.blur()")
            .await;
        let v = self
            .call(Method::GET, &self.session("/screenshot"), None)
            .await;
        base64_decode(v.as_str().expect("base64 PNG"))
    }

    /// Ends the session (Chromium exits) and chromedriver; then every process of
    /// this browser is gone.
    pub async fn quit(mut self) {
        let ours = self.processes();
        if self.session.is_some() {
            self.call(Method::DELETE, &self.session(""), None).await;
            self.session = None;
        }
        self.driver.kill();
        // Gone, not just dead: a zombie is reaped too (by whoever became its parent).
        let left = || {
            let mut pids = self.processes();
            pids.extend(
                ours.iter()
                    .filter(|p| Path::new(&format!("/proc/{p}")).exists()),
            );
            pids
        };
        let gone = eventually(BOUND, || async { left().is_empty() }).await;
        assert!(gone.is_some(), "Chromium processes left: {:?}", left());
    }

    /// Processes (pids) whose command line names this browser's profile directory.
    pub fn processes(&self) -> Vec<i32> {
        let needle = self.profile.path().display().to_string();
        let mut pids = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return pids;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) {
                if String::from_utf8_lossy(&cmdline).contains(&needle) {
                    pids.push(pid);
                }
            }
        }
        pids
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // A panicking test: end the session with a plain blocking request (no runtime
        // to await on in drop), then kill whatever is left.
        if let Some(id) = self.session.take() {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = write!(
                    s,
                    "DELETE /session/{id} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
                );
                let _ = s.read_to_end(&mut Vec::new());
            }
        }
        self.driver.kill();
        for pid in self.processes() {
            // SAFETY: kill(2) on a process started for this browser (its command
            // line names our own temporary profile directory).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Standard base64 (with padding), as WebDriver sends screenshots.
pub fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for c in s.bytes().filter_map(val) {
        acc = (acc << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}
