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
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Version};
use prometheus::IntCounter;
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

    /// The part of a line known when the answer's head is: taken from the request,
    /// and written at once in the line's form (`Entry::request`), so the entry owns
    /// one buffer and the end of the request only appends to it.
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
    ) -> Entry {
        let ip = crate::identity::canonical(ip);
        let (method, path, protocol) = (method.as_str(), cut(path, MAX_PATH), protocol(version));
        let mut request = Vec::with_capacity(LINE_CAPACITY);
        let ip_end = match self.format {
            Format::Json => {
                request.extend_from_slice(b"\"ip\":\"");
                push_ip(&mut request, ip);
                request.extend_from_slice(b"\",\"method\":");
                json_str(&mut request, method);
                request.extend_from_slice(b",\"path\":");
                json_str(&mut request, path);
                request.extend_from_slice(b",\"protocol\":\"");
                request.extend_from_slice(protocol.as_bytes());
                request.push(b'"');
                0
            }
            Format::Combined => {
                push_ip(&mut request, ip);
                let ip_end = request.len();
                escape_into(&mut request, method);
                request.push(b' ');
                escape_into(&mut request, path);
                request.push(b' ');
                request.extend_from_slice(protocol.as_bytes());
                ip_end
            }
        };
        Entry {
            format: self.format,
            request,
            ip_end: ip_end as u32,
            status,
            upstream_status: None,
            client,
            dropped,
        }
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
    /// JSON: `"ip":"…","method":"…","path":"…","protocol":"…"`, escaped; combined:
    /// the address, then (from `ip_end`) `METHOD path protocol` as nginx escapes it.
    request: Vec<u8>,
    ip_end: u32,
    /// The status the client got (a 502 instead of a head whose body failed at
    /// once: `OnFail`).
    pub status: u16,
    /// The upstream's status, when the answer is the upstream's.
    pub upstream_status: Option<u16>,
    client: Option<Box<ClientFields>>,
    dropped: u64,
}

/// Room for a whole line in the request's buffer, so that `line_into` rarely grows it.
const LINE_CAPACITY: usize = 320;

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

impl Entry {
    /// The line, without its newline.
    pub fn line(&self, end: &End<'_>) -> String {
        let mut out = Vec::new();
        self.line_into(end, &mut out);
        String::from_utf8(out).unwrap_or_default()
    }

    /// Appends the line, without its newline, to `out`. Written by hand rather
    /// than through serde or `format!`: it runs for every request, and the bytes are
    /// the same as `serde_json` writes (a test compares them).
    pub fn line_into(&self, end: &End<'_>, out: &mut Vec<u8>) {
        let micros = end.duration.as_micros();
        match self.format {
            Format::Json => {
                out.extend_from_slice(b"{\"time\":\"");
                crate::telemetry::push_rfc3339(out, end.at_ms);
                out.extend_from_slice(b"\",");
                out.extend_from_slice(&self.request);
                out.extend_from_slice(b",\"status\":");
                push_u64(out, u64::from(self.status));
                out.extend_from_slice(b",\"route\":");
                json_str(out, end.route);
                out.extend_from_slice(b",\"decision\":");
                json_str(out, end.decision);
                out.extend_from_slice(b",\"limit\":");
                json_opt_str(out, end.limit);
                out.extend_from_slice(b",\"upstream\":");
                json_opt_str(out, end.upstream);
                out.extend_from_slice(b",\"upstream_status\":");
                match self.upstream_status {
                    Some(s) => push_u64(out, u64::from(s)),
                    None => out.extend_from_slice(b"null"),
                }
                out.extend_from_slice(b",\"duration_ms\":");
                push_json_ms(out, micros);
                out.extend_from_slice(b",\"bytes\":");
                push_u64(out, end.bytes);
                out.extend_from_slice(b",\"dropped\":");
                push_u64(out, self.dropped);
                out.push(b'}');
            }
            Format::Combined => {
                // nginx: $remote_addr - $remote_user [$time_local] "$request" $status
                // $body_bytes_sent "$http_referer" "$http_user_agent"
                let (ip, request) = self.request.split_at(self.ip_end as usize);
                let c = Civil::from_ms(end.at_ms);
                out.extend_from_slice(ip);
                let _ = write!(
                    out,
                    " - - [{:02}/{}/{:04}:{:02}:{:02}:{:02} +0000] \"",
                    c.day,
                    MONTHS[(c.month as usize).clamp(1, 12) - 1],
                    c.year,
                    c.hour,
                    c.minute,
                    c.second
                );
                out.extend_from_slice(request);
                let _ = write!(out, "\" {} {} \"", self.status, end.bytes);
                let client = self.client.as_deref();
                let referer = client.and_then(|c| c.referer.as_deref());
                escape_into(out, referer.unwrap_or("-"));
                out.extend_from_slice(b"\" \"");
                let user_agent = client.and_then(|c| c.user_agent.as_deref());
                escape_into(out, user_agent.unwrap_or("-"));
                let _ = write!(
                    out,
                    "\" route={} decision={} limit={} upstream={} upstream_status=",
                    dash(end.route),
                    end.decision,
                    dash(end.limit.unwrap_or("")),
                    dash(end.upstream.unwrap_or("")),
                );
                match self.upstream_status {
                    Some(s) => push_u64(out, u64::from(s)),
                    None => out.push(b'-'),
                }
                let _ = write!(
                    out,
                    " duration_ms={}.{:03} dropped={}",
                    micros / 1000,
                    micros % 1000,
                    self.dropped
                );
            }
        }
    }
}

/// `n` in decimal.
fn push_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// An address as `Display` writes it (the common IPv4 by hand).
fn push_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, o) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                push_u64(out, u64::from(o));
            }
        }
        IpAddr::V6(v6) => {
            let _ = write!(out, "{v6}");
        }
    }
}

/// `s` as a JSON string, escaped as `serde_json` escapes it (the usual string,
/// with nothing to escape, copied as it is).
fn json_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        // Writing to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    } else {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    }
}

fn json_opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => json_str(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

/// Milliseconds with up to three decimals, from `micros`, as `serde_json` writes
/// the `f64` `micros / 1000` (`1.234`, `3.0`): shortest decimal first, so below a
/// billion milliseconds it is the exact quotient with its trailing zeros cut.
fn push_json_ms(out: &mut Vec<u8>, micros: u128) {
    if micros >= 1_000_000_000_000 {
        let _ = serde_json::to_writer(&mut *out, &(micros as f64 / 1000.0));
        return;
    }
    let micros = micros as u64;
    push_u64(out, micros / 1000);
    out.push(b'.');
    let mut frac = micros % 1000;
    if frac == 0 {
        out.push(b'0');
        return;
    }
    let mut digits = 3;
    while frac.is_multiple_of(10) {
        frac /= 10;
        digits -= 1;
    }
    let mut buf = [b'0'; 3];
    for d in buf[..digits].iter_mut().rev() {
        *d = b'0' + (frac % 10) as u8;
        frac /= 10;
    }
    out.extend_from_slice(&buf[..digits]);
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

/// As nginx writes variables in its log: `"`, `\\`, control bytes and bytes past
/// ASCII as `\\xHH`, so a client cannot forge a field or a line.
fn escape_into(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    for b in s.bytes() {
        if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) {
            out.extend_from_slice(&[
                b'\\',
                b'x',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 15)],
            ]);
        } else {
            out.push(b);
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

    fn entry(format: Format) -> Entry {
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

    /// The line as `serde_json` writes it, the reference for the one written by hand.
    #[derive(serde::Serialize)]
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

    #[test]
    fn a_json_line_is_what_serde_json_writes() {
        let log = AccessLog::new(Format::Json, 1.0, IntCounter::new("x", "x").unwrap(), None);
        let ips: [IpAddr; 3] = [
            "203.0.113.9".parse().unwrap(),
            "0.0.0.0".parse().unwrap(),
            "2001:db8::1".parse().unwrap(),
        ];
        let paths = ["/", "/a\"b\\c", "/tab\there\u{1}\u{7f}", "/José/✓", ""];
        let strings = [None, Some("api"), Some("q\"uote\n")];
        let micros = (0..2_000)
            .chain([
                9_999,
                10_000,
                123_456,
                999_999_999,
                1_000_000_000_000,
                u64::MAX as u128 / 7,
            ])
            .chain((0..40).map(|i| 1u128 << i));
        let times = [
            0,
            1_795_730_584_000,
            1_795_730_584_005,
            1_795_730_584_999,
            253_402_300_799_999,
            253_402_300_800_000,
        ];
        for (n, micros) in micros.enumerate() {
            let (ip, path) = (ips[n % ips.len()], paths[n % paths.len()]);
            let (limit, upstream) = (strings[n % 3], strings[(n / 3) % 3]);
            let at_ms = times[n % times.len()];
            let mut e = log.entry(
                &Method::POST,
                path,
                Version::HTTP_2,
                None,
                ip,
                429,
                n as u64,
            );
            e.upstream_status = (n % 2 == 0).then_some(503);
            let end = End {
                at_ms,
                route: "r\u{0}",
                decision: "limited",
                limit,
                upstream,
                duration: Duration::from_micros(micros as u64),
                bytes: n as u64 * 1000,
            };
            let want = serde_json::to_string(&JsonLine {
                time: &crate::telemetry::rfc3339(at_ms),
                ip,
                method: "POST",
                path,
                protocol: "HTTP/2.0",
                status: 429,
                route: end.route,
                decision: end.decision,
                limit,
                upstream,
                upstream_status: e.upstream_status,
                duration_ms: end.duration.as_micros() as f64 / 1000.0,
                bytes: end.bytes,
                dropped: n as u64,
            })
            .unwrap();
            assert_eq!(e.line(&end), want, "{micros} µs");
        }
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
