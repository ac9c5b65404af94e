//! The access log (`access_log:`, off by default): one line per request, as one JSON
//! object or as nginx's `combined` line with sluice's fields after it. With `path`
//! the lines go to that file, through a buffer (`access_file`); without, to stderr
//! under the target `sluice::access` (so `SLUICE_LOG` turns them off like any
//! other). The line is the whole output: no timestamp or level is put before it,
//! whatever `--log-format` says (`AccessLayer` writes it as it is).
//!
//! Forwarded requests (allowed, delayed, shadow, store_error_allowed, and those the
//! upstream then failed) are kept by `sample`, deterministically: with 0.1 exactly
//! one request in ten. Every other request (refused: limited, denied, store down,
//! unmatched, malformed) is always logged. On stderr, where the lines share the
//! application log, within a budget of `LINES_PER_SECOND` a second, as the refusal
//! log is: the rest are counted in `sluice_access_logs_dropped_total` and in the
//! `dropped` field of the next refusal's line. A file gets every one.
//!
//! Never written: the query string (only the path is), cookies, `Authorization`,
//! and the referer's query.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Version};
use prometheus::IntCounter;
use serde::Serialize;
use tracing_subscriber::layer::Context;

use super::access_file::AccessFile;
use super::refusal_log::{Budget, LINES_PER_SECOND};
use super::Civil;

/// The log target of the lines.
pub const TARGET: &str = "sluice::access";

/// Longest path written; a longer one is cut (at a character boundary).
const MAX_PATH: usize = 1024;
/// Longest `User-Agent` or `Referer` written (combined format).
const MAX_FIELD: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Json,
    Combined,
}

/// The access log of one configuration: its format, its sample, the budget of
/// refusal lines on stderr, or the file.
pub struct AccessLog {
    format: Format,
    /// Where the lines go; stderr when `None`.
    file: Option<Arc<AccessFile>>,
    /// Forwarded requests kept per million.
    per_million: u64,
    /// Forwarded requests seen, for the sample.
    seen: AtomicU64,
    refusals: Budget,
    dropped_total: IntCounter,
}

impl AccessLog {
    /// `sample` is clamped to 0..=1 (validation refuses anything else).
    pub fn new(
        format: Format,
        sample: f64,
        dropped_total: IntCounter,
        file: Option<Arc<AccessFile>>,
    ) -> AccessLog {
        AccessLog {
            format,
            file,
            per_million: (sample.clamp(0.0, 1.0) * 1e6).round() as u64,
            seen: AtomicU64::new(0),
            refusals: Budget::new(LINES_PER_SECOND),
            dropped_total,
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The file the lines go to, if not stderr.
    pub fn file(&self) -> Option<&Arc<AccessFile>> {
        self.file.as_ref()
    }

    /// Writes a finished line: to the file's buffer, or to stderr.
    pub fn write(&self, entry: &Entry, end: &End<'_>) {
        match &self.file {
            Some(file) => {
                thread_local! {
                    static LINE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
                }
                LINE.with(|line| {
                    let Ok(mut line) = line.try_borrow_mut() else {
                        return file.append(entry.line(end).as_bytes());
                    };
                    line.clear();
                    entry.line_into(end, &mut line);
                    file.append(&line);
                });
            }
            None => {
                let line = entry.line(end);
                tracing::info!(target: TARGET, line = line.as_str());
            }
        }
    }

    /// Whether this request gets a line: a forwarded one by the sample, a refused
    /// one within this second's budget (counted when not). `Some` holds the refusal
    /// lines dropped since the last one written (0 for forwarded requests).
    pub fn keep(&self, refused: bool, now_ms: u64) -> Option<u64> {
        // (No `tracing::enabled!` here: with the per-layer filter of `main`'s log, an
        // `enabled!` that no event follows leaves the next event of the formatted log
        // filtered out. `SLUICE_LOG` still drops the line when it is written.)
        if refused {
            if self.file.is_some() {
                return Some(0);
            }
            let kept = self.refusals.admit(now_ms / 1000);
            if kept.is_none() {
                self.dropped_total.inc();
            }
            return kept;
        }
        match self.per_million {
            1_000_000 => Some(0),
            0 => None,
            p => {
                // Request n is kept when n·p / 10⁶ reaches a new whole number.
                let n = self.seen.fetch_add(1, Relaxed);
                ((n + 1) * p / 1_000_000 > n * p / 1_000_000).then_some(0)
            }
        }
    }

    /// What the combined format writes of the request's fields (`Referer` without
    /// its query, `User-Agent`), read before the request is forwarded (which takes
    /// its fields); `None` for the JSON format, which writes neither.
    pub fn client_fields(&self, headers: &HeaderMap) -> Option<Box<ClientFields>> {
        if self.format != Format::Combined {
            return None;
        }
        let field = |name: http::header::HeaderName, cut_query: bool| {
            let v = headers.get(name)?.as_bytes();
            let v = if cut_query {
                v.split(|b| *b == b'?' || *b == b'#').next().unwrap_or(v)
            } else {
                v
            };
            Some(String::from_utf8_lossy(&v[..v.len().min(MAX_FIELD)]).into_owned())
        };
        Some(Box::new(ClientFields {
            referer: field(http::header::REFERER, true),
            user_agent: field(http::header::USER_AGENT, false),
        }))
    }

    /// The part of a line known when the answer's head is: taken from the request.
    #[allow(clippy::too_many_arguments)]
    pub fn entry(
        &self,
        method: &Method,
        path: &str,
        version: Version,
        client: Option<Box<ClientFields>>,
        ip: IpAddr,
        status: u16,
        dropped: u64,
    ) -> Box<Entry> {
        Box::new(Entry {
            format: self.format,
            method: method.clone(),
            path: cut(path, MAX_PATH).to_string(),
            version,
            ip: crate::identity::canonical(ip),
            status,
            upstream_status: None,
            client,
            dropped,
        })
    }
}

/// The request fields the combined format writes.
pub struct ClientFields {
    referer: Option<String>,
    user_agent: Option<String>,
}

/// A request's line, but for what is known only at its end.
pub struct Entry {
    format: Format,
    method: Method,
    path: String,
    version: Version,
    ip: IpAddr,
    /// The status the client got (a 502 instead of a head whose body failed at
    /// once: `OnFail`).
    pub status: u16,
    /// The upstream's status, when the answer is the upstream's.
    pub upstream_status: Option<u16>,
    client: Option<Box<ClientFields>>,
    dropped: u64,
}

/// What the end of a request adds to its line.
pub struct End<'a> {
    pub at_ms: u64,
    pub route: &'a str,
    pub decision: &'a str,
    /// The limit that refused.
    pub limit: Option<&'a str>,
    /// The upstream target's address (`host:port`) the request went to.
    pub upstream: Option<&'a str>,
    pub duration: Duration,
    /// Body bytes sent to the client.
    pub bytes: u64,
}

#[derive(Serialize)]
struct JsonLine<'a> {
    time: &'a str,
    ip: IpAddr,
    method: &'a str,
    path: &'a str,
    protocol: &'a str,
    status: u16,
    route: &'a str,
    decision: &'a str,
    limit: Option<&'a str>,
    upstream: Option<&'a str>,
    upstream_status: Option<u16>,
    duration_ms: f64,
    bytes: u64,
    dropped: u64,
}

impl Entry {
    /// The line, without its newline.
    pub fn line(&self, end: &End<'_>) -> String {
        let mut out = Vec::new();
        self.line_into(end, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Appends the line, without its newline, to `out`.
    pub fn line_into(&self, end: &End<'_>, out: &mut Vec<u8>) {
        let duration_ms = end.duration.as_micros() as f64 / 1000.0;
        let protocol = protocol(self.version);
        match self.format {
            Format::Json => {
                let time = crate::telemetry::rfc3339(end.at_ms);
                let line = JsonLine {
                    time: &time,
                    ip: self.ip,
                    method: self.method.as_str(),
                    path: &self.path,
                    protocol,
                    status: self.status,
                    route: end.route,
                    decision: end.decision,
                    limit: end.limit,
                    upstream: end.upstream,
                    upstream_status: self.upstream_status,
                    duration_ms,
                    bytes: end.bytes,
                    dropped: self.dropped,
                };
                // Writing to a Vec fails only for a value serde cannot write: none here.
                let _ = serde_json::to_writer(&mut *out, &line);
            }
            Format::Combined => {
                // nginx: $remote_addr - $remote_user [$time_local] "$request" $status
                // $body_bytes_sent "$http_referer" "$http_user_agent"
                let c = Civil::from_ms(end.at_ms);
                let mut s = String::with_capacity(256);
                let _ = write!(
                    s,
                    "{} - - [{:02}/{}/{:04}:{:02}:{:02}:{:02} +0000] \"",
                    self.ip,
                    c.day,
                    MONTHS[(c.month as usize).clamp(1, 12) - 1],
                    c.year,
                    c.hour,
                    c.minute,
                    c.second
                );
                escape_into(&mut s, self.method.as_str());
                s.push(' ');
                escape_into(&mut s, &self.path);
                let _ = write!(s, " {protocol}\" {} {} \"", self.status, end.bytes);
                let client = self.client.as_deref();
                let referer = client.and_then(|c| c.referer.as_deref());
                escape_into(&mut s, referer.unwrap_or("-"));
                s.push_str("\" \"");
                let user_agent = client.and_then(|c| c.user_agent.as_deref());
                escape_into(&mut s, user_agent.unwrap_or("-"));
                let _ = write!(
                    s,
                    "\" route={} decision={} limit={} upstream={} upstream_status={} duration_ms={:.3} dropped={}",
                    dash(end.route),
                    end.decision,
                    dash(end.limit.unwrap_or("")),
                    dash(end.upstream.unwrap_or("")),
                    self.upstream_status.map_or_else(|| "-".to_string(), |s| s.to_string()),
                    duration_ms,
                    self.dropped
                );
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
}

const MONTHS: [&str; 12] = [
    "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
];

fn protocol(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/1.1",
    }
}

/// A field of the combined format: `-` when empty.
fn dash(s: &str) -> &str {
    if s.is_empty() {
        "-"
    } else {
        s
    }
}

/// `s` cut to at most `max` bytes, at a character boundary.
fn cut(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// As nginx writes variables in its log: `"`, `\`, control bytes and bytes past
/// ASCII as `\xHH`, so a client cannot forge a field or a line.
fn escape_into(out: &mut String, s: &str) {
    for b in s.bytes() {
        if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) {
            let _ = write!(out, "\\x{b:02X}");
        } else {
            out.push(char::from(b));
        }
    }
}

/// The `tracing` layer that writes access lines as they are: the event's `line`
/// field and a newline, in one write to stderr. Other layers must leave the target
/// out (`main` filters it from the formatted log).
pub struct AccessLayer;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for AccessLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if event.metadata().target() != TARGET {
            return;
        }
        struct Line(Option<String>);
        impl tracing::field::Visit for Line {
            fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                if field.name() == "line" {
                    let mut s = String::with_capacity(value.len() + 1);
                    s.push_str(value);
                    s.push('\n');
                    self.0 = Some(s);
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut line = Line(None);
        event.record(&mut line);
        if let Some(s) = line.0 {
            use std::io::Write;
            let _ = std::io::stderr().lock().write_all(s.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(format: Format) -> Box<Entry> {
        let log = AccessLog::new(format, 1.0, IntCounter::new("x", "x").unwrap(), None);
        let mut h = HeaderMap::new();
        h.insert("referer", "https://ex.com/p?token=secret".parse().unwrap());
        h.insert("user-agent", "curl/8 \"evil\"".parse().unwrap());
        h.insert("authorization", "Bearer hunter2".parse().unwrap());
        h.insert("cookie", "sid=hunter3".parse().unwrap());
        let ip: IpAddr = "203.0.113.9".parse().unwrap();
        let client = log.client_fields(&h);
        let mut e = log.entry(
            &Method::GET,
            "/api/items",
            Version::HTTP_11,
            client,
            ip,
            200,
            0,
        );
        e.upstream_status = Some(200);
        e
    }

    fn end() -> End<'static> {
        End {
            // 2026-11-26T22:03:04.005Z
            at_ms: 1_795_730_584_005,
            route: "api",
            decision: "allowed",
            limit: None,
            upstream: Some("127.0.0.1:3000"),
            duration: Duration::from_micros(1234),
            bytes: 5,
        }
    }

    #[test]
    fn a_json_line_has_every_field_and_no_secret() {
        let line = entry(Format::Json).line(&end());
        assert_eq!(
            line,
            r#"{"time":"2026-11-26T22:03:04.005Z","ip":"203.0.113.9","method":"GET","path":"/api/items","protocol":"HTTP/1.1","status":200,"route":"api","decision":"allowed","limit":null,"upstream":"127.0.0.1:3000","upstream_status":200,"duration_ms":1.234,"bytes":5,"dropped":0}"#
        );
    }

    #[test]
    fn a_combined_line_is_nginx_s_with_sluice_s_fields_after_it() {
        let line = entry(Format::Combined).line(&end());
        assert_eq!(
            line,
            r#"203.0.113.9 - - [26/Nov/2026:22:03:04 +0000] "GET /api/items HTTP/1.1" 200 5 "https://ex.com/p" "curl/8 \x22evil\x22" route=api decision=allowed limit=- upstream=127.0.0.1:3000 upstream_status=200 duration_ms=1.234 dropped=0"#
        );
        assert!(!line.contains("secret") && !line.contains("hunter"));
    }

    #[test]
    fn a_sample_keeps_exactly_its_share_of_forwarded_requests() {
        let c = || IntCounter::new("x", "x").unwrap();
        for (sample, kept) in [(0.0, 0), (0.1, 100), (0.25, 250), (1.0, 1000)] {
            let log = AccessLog::new(Format::Json, sample, c(), None);
            let n = (0..1000).filter(|_| log.keep(false, 0).is_some()).count();
            assert_eq!(n, kept, "sample {sample}");
        }
        // Refusals: the second's budget, the rest counted and reported next.
        let dropped = c();
        let log = AccessLog::new(Format::Json, 0.0, dropped.clone(), None);
        let kept: Vec<_> = (0..LINES_PER_SECOND + 2)
            .map(|_| log.keep(true, 5_000))
            .collect();
        assert_eq!(
            kept.iter().filter(|k| k.is_some()).count() as u64,
            LINES_PER_SECOND
        );
        assert_eq!(dropped.get(), 2);
        assert_eq!(log.keep(true, 6_000), Some(2));
    }
}
