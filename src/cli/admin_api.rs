//! The client side of the admin API's deny list, top offenders and fleet view, for
//! `sluice deny`, `sluice top` and `sluice fleet`: it finds the admin address and
//! token (flags, environment, configuration file), sends one bounded HTTP/1.1
//! request and turns the answer into what the operator reads.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Serialize;

use crate::config::{self, ConfigErrors};
use crate::deny::Target;
use crate::ops::admin::TopRow;
use crate::telemetry::metrics::Decision;

/// How long one call may take, from connecting to the last byte of the answer.
pub const CALL_BOUND: Duration = Duration::from_secs(10);

/// The environment variable that carries the admin token.
pub const TOKEN_ENV: &str = "SLUICE_ADMIN_TOKEN";

// === what is denied ===

/// `--ip`: an address or a CIDR block, in the form the admin API stores it (host
/// bits dropped: `10.1.2.3/16` is `10.1.0.0/16`).
pub fn parse_ip(s: &str) -> Result<Target, String> {
    Target::ip(s)
        .ok_or_else(|| "expected an IP address or a CIDR block like 10.0.0.0/8".to_string())
}

/// `--key`: any non-empty text.
pub fn parse_key(s: &str) -> Result<Target, String> {
    if s.is_empty() {
        return Err("a key cannot be empty".to_string());
    }
    Ok(Target::Key(s.to_string()))
}

/// A time to live as written (`10m`), checked with the configuration's parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ttl {
    pub text: String,
    pub duration: Duration,
}

pub fn parse_ttl(s: &str) -> Result<Ttl, String> {
    let text = s.trim();
    match config::value::parse_duration(text) {
        Some(d) if !d.is_zero() => Ok(Ttl {
            text: text.to_string(),
            duration: d,
        }),
        Some(_) => Err("a time to live must be longer than 0".to_string()),
        None => Err("expected a duration like 250ms, 10s, 1m, 1h or 1d".to_string()),
    }
}

// === the answers ===

/// One entry of `GET /admin/deny`: the server's own JSON form.
pub use crate::deny::EntryJson as Entry;

/// The body of `POST` and `DELETE /admin/deny`.
#[derive(Debug, Serialize)]
struct Body<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    ip: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'a str>,
    /// Only sent when given, so a server without it takes the body as before.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    force: bool,
}

impl<'a> Body<'a> {
    fn new(target: &'a Target) -> Body<'a> {
        let (ip, key) = match target {
            Target::Ip(_) => (Some(target.value()), None),
            Target::Key(k) => (None, Some(k.as_str())),
        };
        Body {
            ip,
            key,
            ttl: None,
            reason: None,
            force: false,
        }
    }
}

// === errors ===

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No `--admin`, and the configuration file that should name the listener
    /// cannot be read or is invalid.
    #[error("{0}\nhint: pass --admin URL (e.g. --admin http://127.0.0.1:9091) to reach the admin API without the configuration file")]
    Config(ConfigErrors),
    #[error("--admin {url:?}: {why}")]
    BadUrl { url: String, why: String },
    #[error("cannot reach the admin API at {url}: {why}")]
    Unreachable { url: String, why: String },
    /// The API answered with a status other than the one that means success.
    #[error("{}", refusal(*.status, .message))]
    Refused { status: StatusCode, message: String },
    #[error("the admin API at {url} answered {what}")]
    BadAnswer { url: String, what: String },
}

fn refusal(status: StatusCode, message: &str) -> String {
    let mut line = status.to_string();
    if !message.is_empty() {
        line.push_str(": ");
        line.push_str(message);
    }
    if status == StatusCode::UNAUTHORIZED {
        line.push_str(&format!(" (set {TOKEN_ENV} or admin.token)"));
    }
    line
}

/// An I/O error as a short lower-case phrase: `connection refused`, not
/// `Connection refused (os error 111)`.
fn io_phrase(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(i) => &text[..i],
        None => &text,
    };
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => format!("{:?}", e.kind()),
    }
}

// === finding the admin API ===

/// Where the admin API is and how to authenticate to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `http://HOST:PORT` plus any path prefix, without a trailing `/`.
    pub base: String,
    /// Host and port to connect to; the host as in the URL, without brackets.
    host: String,
    port: u16,
    /// `HOST:PORT` as the `Host` header says it.
    authority: String,
    pub token: Option<String>,
}

impl Endpoint {
    /// `--admin` wins over the configuration's `admin.listen`; `env_token` (from
    /// `SLUICE_ADMIN_TOKEN`) wins over `admin.token`. Only the file's `admin`
    /// section is read. With `--admin` the file is optional: one that is missing or
    /// whose admin section is invalid contributes nothing.
    pub fn resolve(
        admin: Option<&str>,
        config_path: &Path,
        env_token: Option<String>,
    ) -> Result<Endpoint, ClientError> {
        let env_token = env_token.filter(|t| !t.is_empty());
        // Only the admin section: the rest of the file is the gateway's business.
        let loaded = config::load_admin(config_path);
        let (base, file_token) = match (admin, loaded) {
            (Some(url), loaded) => {
                let token = loaded.ok().and_then(|a| a.token);
                (url.to_string(), token)
            }
            (None, Ok(a)) => (listen_url(a.listen.0), a.token),
            (None, Err(errors)) => return Err(ClientError::Config(errors)),
        };
        let token = env_token.or(file_token.map(|t| t.0).filter(|t| !t.is_empty()));
        Endpoint::new(&base, token)
    }

    /// For `sluice health`, which asks about the process, not the file: as
    /// `resolve`, but a file that no longer loads (saved with a mistake while the
    /// gateway runs the version before it) still gives its `admin.listen` when that
    /// one value can be read. No token: health needs none.
    pub fn resolve_listener(
        admin: Option<&str>,
        config_path: &Path,
    ) -> Result<Endpoint, ClientError> {
        if let Some(url) = admin {
            return Endpoint::new(url, None);
        }
        match config::load(config_path) {
            Ok(l) => Endpoint::new(&listen_url(l.file.admin.listen.0), None),
            Err(errors) => match raw_admin_listen(config_path) {
                Some(listen) => Endpoint::new(&listen_url(listen), None),
                None => Err(ClientError::Config(errors)),
            },
        }
    }

    pub fn new(url: &str, token: Option<String>) -> Result<Endpoint, ClientError> {
        let bad = |why: &str| ClientError::BadUrl {
            url: url.to_string(),
            why: why.to_string(),
        };
        let written = url.trim();
        // `127.0.0.1:9091` alone means plain HTTP, as the admin listener speaks.
        let full = if written.contains("://") {
            written.to_string()
        } else {
            format!("http://{written}")
        };
        let uri: Uri = full
            .parse()
            .map_err(|_| bad("expected a URL like http://127.0.0.1:9091"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(bad("the admin listener speaks plain HTTP: use http://")),
            _ => return Err(bad("expected a URL like http://127.0.0.1:9091")),
        }
        let host = uri
            .host()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| bad("the URL has no host"))?;
        if uri.query().is_some() {
            return Err(bad("the URL cannot have a query"));
        }
        let port = uri.port_u16().unwrap_or(80);
        let authority = match uri.port_u16() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_string(),
        };
        let prefix = uri.path().trim_end_matches('/');
        Ok(Endpoint {
            base: format!("http://{authority}{prefix}"),
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            authority,
            token,
        })
    }

    // === the three calls ===

    /// `GET /admin/deny`, every page: the entries, and the JSON list of them as the
    /// API sent them (the pages' lists joined into one, each entry exactly as sent).
    pub async fn list(&self) -> Result<(Vec<Entry>, String), ClientError> {
        let (mut entries, mut json) = (Vec::new(), String::from("["));
        let mut path = format!("/admin/deny?limit={PAGE}");
        // Bounded: a server that kept sending next pages would be a broken one.
        for _ in 0..MAX_PAGES {
            let (body, next) = self.call_at(Method::GET, &path, None).await?;
            let page: Vec<Entry> =
                serde_json::from_slice(&body).map_err(|e| self.bad_answer("list", e))?;
            let text = String::from_utf8_lossy(&body);
            let inner = text
                .trim()
                .strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .unwrap_or("")
                .trim();
            if !inner.is_empty() {
                if json.len() > 1 {
                    json.push(',');
                }
                json.push_str(inner);
            }
            entries.extend(page);
            match next {
                Some(p) => path = p,
                None => {
                    json.push(']');
                    return Ok((entries, json));
                }
            }
        }
        Err(ClientError::BadAnswer {
            url: self.base.clone(),
            what: format!("more than {MAX_PAGES} pages of deny-list entries"),
        })
    }

    /// `POST /admin/deny`: the entry as the API stored it.
    pub async fn add(
        &self,
        target: &Target,
        ttl: Option<&Ttl>,
        reason: Option<&str>,
        force: bool,
    ) -> Result<Entry, ClientError> {
        let mut body = Body::new(target);
        body.ttl = ttl.map(|t| t.text.as_str());
        body.reason = reason;
        body.force = force;
        let answer = self.call(Method::POST, Some(&body)).await?;
        serde_json::from_slice(&answer).map_err(|e| self.bad_answer("entry", e))
    }

    /// `DELETE /admin/deny`.
    pub async fn remove(&self, target: &Target) -> Result<(), ClientError> {
        let body = Body::new(target);
        self.call(Method::DELETE, Some(&body)).await.map(drop)
    }

    /// `GET /admin/top` (with `fleet`, `scope=fleet`): the rows, and the JSON the
    /// API sent.
    pub async fn top(
        &self,
        route: Option<&str>,
        n: Option<u64>,
        fleet: bool,
    ) -> Result<(Vec<TopRow>, String), ClientError> {
        let mut query = form_urlencoded::Serializer::new(String::new());
        if let Some(r) = route {
            query.append_pair("route", r);
        }
        if let Some(n) = n {
            query.append_pair("n", &n.to_string());
        }
        if fleet {
            query.append_pair("scope", "fleet");
        }
        let query = query.finish();
        let path = match query.is_empty() {
            true => "/admin/top".to_string(),
            false => format!("/admin/top?{query}"),
        };
        let (body, _) = self.call_at(Method::GET, &path, None).await?;
        let rows = serde_json::from_slice(&body).map_err(|e| ClientError::BadAnswer {
            url: self.base.clone(),
            what: format!("something that is not a list of top offenders: {e}"),
        })?;
        Ok((rows, String::from_utf8_lossy(&body).trim_end().to_string()))
    }

    fn bad_answer(&self, wanted: &str, e: serde_json::Error) -> ClientError {
        ClientError::BadAnswer {
            url: self.base.clone(),
            what: format!("something that is not a deny-list {wanted}: {e}"),
        }
    }

    /// One request to `/admin/deny` on a fresh connection, bounded by `CALL_BOUND`.
    /// Any 2xx is success (the API sends 200, 201 or 204); anything else is a
    /// `Refused` with the API's one-line message.
    async fn call(&self, method: Method, body: Option<&Body<'_>>) -> Result<Bytes, ClientError> {
        self.call_at(method, "/admin/deny", body)
            .await
            .map(|(answer, _)| answer)
    }

    /// `call` on `path` (`/admin/deny` and a query): the answer, and the path of the
    /// next page if its `Link` header names one.
    async fn call_at(
        &self,
        method: Method,
        path: &str,
        body: Option<&Body<'_>>,
    ) -> Result<(Bytes, Option<String>), ClientError> {
        let unreachable = |why: String| ClientError::Unreachable {
            url: self.base.clone(),
            why,
        };
        let exchange = self.exchange(method, path, body);
        let (status, answer, next) = tokio::time::timeout(CALL_BOUND, exchange)
            .await
            .map_err(|_| unreachable(format!("no answer within {}s", CALL_BOUND.as_secs())))?
            .map_err(unreachable)?;
        if status.is_success() {
            return Ok((answer, next));
        }
        let message = String::from_utf8_lossy(&answer);
        // The API's errors are one line; keep the first, whatever comes.
        let message = message.lines().next().unwrap_or("").trim().to_string();
        Err(ClientError::Refused { status, message })
    }

    /// `GET PATH` (such as `/healthz`) on a fresh connection, bounded by `bound`:
    /// whatever status the listener answers, and the first line of its body.
    pub async fn get(
        &self,
        path: &str,
        bound: Duration,
    ) -> Result<(StatusCode, String), ClientError> {
        let unreachable = |why: String| ClientError::Unreachable {
            url: self.base.clone(),
            why,
        };
        let (status, answer, _) =
            tokio::time::timeout(bound, self.exchange(Method::GET, path, None))
                .await
                .map_err(|_| unreachable(format!("no answer within {}s", bound.as_secs_f64())))?
                .map_err(unreachable)?;
        let text = String::from_utf8_lossy(&answer);
        let line = text.lines().next().unwrap_or("").trim().to_string();
        Ok((status, line))
    }

    async fn exchange(
        &self,
        method: Method,
        path: &str,
        body: Option<&Body<'_>>,
    ) -> Result<(StatusCode, Bytes, Option<String>), String> {
        let stream = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| io_phrase(&e))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        // The connection is driven on its own; it ends when `sender` is dropped.
        let driver = tokio::spawn(conn);

        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", uri_path(&self.base)))
            .header(HOST, &self.authority)
            .header(ACCEPT, "application/json");
        if let Some(token) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let payload = match body {
            Some(b) => {
                req = req.header(CONTENT_TYPE, "application/json");
                Bytes::from(serde_json::to_vec(b).map_err(|e| e.to_string())?)
            }
            None => Bytes::new(),
        };
        let req = req
            .body(Full::new(payload))
            .map_err(|e| format!("cannot build the request: {e}"))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("the connection failed: {e}"))?;
        let status = resp.status();
        let next = resp
            .headers()
            .get("link")
            .and_then(|v| v.to_str().ok())
            .and_then(next_page);
        let answer = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("the answer broke off: {e}"))?
            .to_bytes();
        drop(sender);
        driver.abort();
        Ok((status, answer, next))
    }
}

/// Entries asked for per page (the API's most), and the most pages read.
const PAGE: usize = 1000;
const MAX_PAGES: usize = 100_000;

/// The path of `Link: </admin/deny?…>; rel="next"`.
fn next_page(link: &str) -> Option<String> {
    let (target, params) = link.split_once(';')?;
    if params.trim() != "rel=\"next\"" {
        return None;
    }
    let path = target.trim().strip_prefix('<')?.strip_suffix('>')?;
    path.starts_with("/admin/deny?").then(|| path.to_string())
}

/// The path part of `http://authority/prefix`.
fn uri_path(base: &str) -> &str {
    let rest = base.strip_prefix("http://").unwrap_or(base);
    rest.find('/').map(|i| &rest[i..]).unwrap_or("")
}

/// `admin.listen` of a file that may not load as a whole: the YAML read loosely,
/// that one value interpolated and parsed; its default when the file has none.
fn raw_admin_listen(path: &Path) -> Option<SocketAddr> {
    let text = std::fs::read_to_string(path).ok()?;
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).ok()?;
    let listen = match doc.get("admin").and_then(|a| a.get("listen")) {
        None => return Some(config::schema::AdminSpec::default().listen.0),
        Some(v) => v.as_str()?,
    };
    config::value::interpolate(listen).ok()?.trim().parse().ok()
}

/// `http://ADDR` for a listen address; an unspecified one (`0.0.0.0`, `::`)
/// listens on loopback too, so that is where to connect.
pub fn listen_url(listen: SocketAddr) -> String {
    let ip = match listen.ip() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, listen.port()))
}

// === what the operator reads ===

/// `denied ip 203.0.113.7 for 10m (reason: scraping)`, `denied key k until removed`.
pub fn added_line(
    target: &Target,
    entry: Option<&Entry>,
    ttl: Option<&Ttl>,
    reason: Option<&str>,
) -> String {
    let value = printable(&entry.map(|e| e.value.clone()).unwrap_or(target.value()));
    let mut line = format!("denied {} {value}", target.kind());
    match ttl {
        Some(t) => line.push_str(&format!(" for {}", t.text)),
        None => line.push_str(" until removed"),
    }
    if let Some(r) = reason.filter(|r| !r.is_empty()) {
        line.push_str(&format!(" (reason: {})", printable(r)));
    }
    line
}

/// `removed ip 203.0.113.7`.
pub fn removed_line(target: &Target) -> String {
    format!("removed {target}")
}

/// A key or address as printable ASCII, anything else escaped (`\u{a0}`): a key
/// that a request can carry is printable ASCII, so anything else in one is an old
/// entry's, shown so that it cannot pass for another.
fn ascii(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c == ' ' || c.is_ascii_graphic() {
                c.to_string()
            } else {
                c.escape_default().to_string()
            }
        })
        .collect()
}

/// `s` with control, format and invisible characters escaped (`\n`, `\u{1b}`,
/// `\u{202e}`, `\u{3164}`).
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() || is_format(c) || is_invisible(c) {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Unicode's format characters (category Cf) that change how text around them is
/// shown without showing themselves: bidirectional overrides and isolates (a key
/// with U+202E prints backwards), zero-width characters, invisible operators, the
/// soft hyphen, and tag characters.
fn is_format(c: char) -> bool {
    matches!(c,
        '\u{00AD}' | '\u{061C}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{202A}'..='\u{202E}'
        | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{2069}' | '\u{FEFF}'
        | '\u{FFF9}'..='\u{FFFB}' | '\u{E0001}' | '\u{E0020}'..='\u{E007F}')
}

/// Characters that show as nothing or as blank space although they are no ASCII
/// space: separators other than U+0020 (U+00A0, U+1680, U+2000-U+200A, U+2028,
/// U+2029, U+202F, U+205F, U+3000), Hangul fillers (U+115F, U+1160, U+3164,
/// U+FFA0), the Khmer invisible vowels (U+17B4, U+17B5), the braille blank
/// (U+2800), the combining grapheme joiner (U+034F) and variation selectors.
fn is_invisible(c: char) -> bool {
    matches!(c,
        '\u{00A0}' | '\u{034F}' | '\u{115F}' | '\u{1160}' | '\u{1680}' | '\u{17B4}'
        | '\u{17B5}' | '\u{2800}' | '\u{2000}'..='\u{200A}'
        | '\u{2028}' | '\u{2029}' | '\u{202F}' | '\u{205F}' | '\u{3000}' | '\u{3164}'
        | '\u{FE00}'..='\u{FE0F}' | '\u{FFA0}' | '\u{E0100}'..='\u{E01EF}')
}

/// The entries as an aligned table under a header row.
pub fn table(entries: &[Entry]) -> String {
    let header = ["KIND", "VALUE", "SOURCE", "EXPIRES", "REASON"];
    // Keys and reasons come from clients: control and format characters are shown
    // escaped, so a key can never move the cursor, forge a line of the table or
    // reorder what is shown.
    let rows = entries
        .iter()
        .map(|e| {
            [
                printable(e.kind.as_str()),
                ascii(&e.value),
                printable(e.source.as_str()),
                printable(e.expires_at.as_deref().unwrap_or("never")),
                printable(e.reason.as_deref().filter(|r| !r.is_empty()).unwrap_or("-")),
            ]
        })
        .collect();
    aligned(header, rows)
}

/// `sluice top`'s table: a count the sketch may have overstated shows as the range
/// it lies in (`95..100`); rows summed over a fleet say over how many instances.
pub fn top_table(rows: &[TopRow]) -> String {
    let header = [
        "ROUTE",
        "KEY",
        "IP",
        "REFUSED",
        "ALLOWED",
        "LAST SEEN (UTC)",
        "INSTANCES",
    ];
    let cells = |r: &TopRow| {
        let refused = match r.error {
            0 => r.refused.to_string(),
            e => format!("{}..{}", r.refused.saturating_sub(e), r.refused),
        };
        [
            printable(&r.route),
            ascii(&r.key),
            ascii(&r.ip),
            refused,
            r.allowed.to_string(),
            printable(&r.last_seen),
            r.instances.map_or(String::new(), |n| n.to_string()),
        ]
    };
    if rows.iter().any(|r| r.instances.is_some()) {
        return aligned(header, rows.iter().map(cells).collect());
    }
    let rows = rows
        .iter()
        .map(|r| {
            let [a, b, c, d, e, f, _] = cells(r);
            [a, b, c, d, e, f]
        })
        .collect();
    let [a, b, c, d, e, f, _] = header;
    aligned([a, b, c, d, e, f], rows)
}

/// `rows` as columns aligned under `header`; every line ends in `\n`, and no line
/// in trailing spaces.
fn aligned<const N: usize>(header: [&str; N], rows: Vec<[String; N]>) -> String {
    let header = header.map(String::from);
    let mut widths = header.each_ref().map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            if i + 1 < row.len() {
                let pad = widths[i] - cell.chars().count();
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

// === the whole command ===

/// One `sluice deny` action.
#[derive(Debug, Clone)]
pub enum Action {
    Add {
        target: Target,
        ttl: Option<Ttl>,
        reason: Option<String>,
        /// Needed for a block wider than /8 (IPv4) or /32 (IPv6).
        force: bool,
    },
    Remove {
        target: Target,
    },
    List {
        json: bool,
    },
}

/// `sluice top`: what to print on stdout, a table or the API's JSON.
pub async fn top(
    endpoint: &Endpoint,
    route: Option<&str>,
    n: Option<u64>,
    fleet: bool,
    json: bool,
) -> Result<String, ClientError> {
    let (rows, text) = endpoint.top(route, n, fleet).await?;
    Ok(match json {
        true => text + "\n",
        false => top_table(&rows),
    })
}

/// Run `action` against `endpoint`; what to print on stdout.
pub async fn run(endpoint: &Endpoint, action: &Action) -> Result<String, ClientError> {
    match action {
        Action::Add {
            target,
            ttl,
            reason,
            force,
        } => {
            let entry = endpoint
                .add(target, ttl.as_ref(), reason.as_deref(), *force)
                .await?;
            Ok(added_line(target, Some(&entry), ttl.as_ref(), reason.as_deref()) + "\n")
        }
        Action::Remove { target } => {
            endpoint.remove(target).await?;
            Ok(removed_line(target) + "\n")
        }
        Action::List { json } => {
            let (entries, mut text) = endpoint.list().await?;
            if *json {
                text.push('\n');
                Ok(text)
            } else {
                Ok(table(&entries))
            }
        }
    }
}

// === sluice fleet ===

impl Endpoint {
    /// `GET /admin/fleet`: the view, and its JSON as the API sent it.
    pub async fn fleet(&self) -> Result<(serde_json::Value, String), ClientError> {
        let (body, _) = self.call_at(Method::GET, "/admin/fleet", None).await?;
        let v = serde_json::from_slice(&body).map_err(|e| ClientError::BadAnswer {
            url: self.base.clone(),
            what: format!("something that is not a fleet view: {e}"),
        })?;
        Ok((v, String::from_utf8_lossy(&body).trim_end().to_string()))
    }
}

/// `sluice fleet`: the instances, each route's sums, and a line when the
/// instances' config hashes differ or Redis could not be read.
pub fn fleet_text(v: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => printable(s),
        serde_json::Value::Null => "-".to_string(),
        other => printable(&other.to_string()),
    };
    let empty = Vec::new();
    let instances = v["instances"].as_array().unwrap_or(&empty);
    let rows: Vec<Vec<String>> = instances
        .iter()
        .map(|i| {
            let mut id = text(&i["id"]);
            if i["self"] == true {
                id.push_str(" (this)");
            }
            let hash = text(&i["config_hash"]);
            vec![
                id,
                text(&i["addr"]),
                text(&i["version"]),
                hash.chars().take(12).collect(),
                match (i["ready"] == true, i["stale"] == true) {
                    (_, true) => "stale",
                    (true, false) => "yes",
                    (false, false) => "no",
                }
                .to_string(),
                text(&i["last_seen"]),
            ]
        })
        .collect();
    let mut out = columns(
        &[
            "INSTANCE",
            "ADDRESS",
            "VERSION",
            "CONFIG",
            "READY",
            "LAST SEEN",
        ],
        &rows,
    );
    out.push('\n');
    let decisions: Vec<&str> = Decision::of_route().map(Decision::as_str).collect();
    let rows: Vec<Vec<String>> = v["routes"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(name, counts)| {
            std::iter::once(printable(name))
                .chain(decisions.iter().map(|d| text(&counts[*d])))
                .collect()
        })
        .collect();
    let header: Vec<String> = std::iter::once("ROUTE".to_string())
        .chain(decisions.iter().map(|d| d.to_ascii_uppercase()))
        .collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    out.push_str(&columns(&header, &rows));
    if v["consistent"] == false {
        out.push_str(&format!(
            "\nconfig hashes differ: {} hashes across {} instances (a reload not applied everywhere?)\n",
            text(&v["config_hashes"]),
            instances.len()
        ));
    }
    if v["store"] == "memory" {
        out.push_str("\nmemory store: every instance limits on its own; this one alone is shown\n");
    }
    if let Some(e) = v["error"].as_str() {
        out.push_str(&format!(
            "\nRedis not read ({}): this instance alone is shown\n",
            printable(e)
        ));
    }
    out
}

/// Left-aligned columns two spaces apart, the header first.
fn columns(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    let mut out = String::new();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            line.extend(std::iter::repeat_n(' ', pad));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_text_lists_instances_and_routes_and_flags_differing_hashes() {
        let v = serde_json::json!({
            "instances": [
                {"id": "a-1-000001", "addr": "a:8080", "version": "0.1.0",
                 "config_hash": "93f078b7bb41b8492b7c656dff6592c1de9f0866", "ready": true,
                 "last_seen": "2026-11-26T22:44:22.807Z", "last_seen_ms": 1, "self": true},
                {"id": "b-2-000002", "addr": "b:8080", "version": "0.1.0",
                 "config_hash": "c331faa035f05f808b4ccf2a8e031e544813e0e8", "ready": false,
                 "last_seen": "2026-11-26T22:44:21.5Z", "last_seen_ms": 1, "self": false}
            ],
            "routes": {"api": {"allowed": 5, "delayed": 0, "limited": 4, "denied": 0, "shadow": 0,
                "store_error_allowed": 0, "store_error_denied": 0, "bad_request": 0,
                "unauthorized": 0}},
            "config_hashes": 2, "consistent": false, "store": "redis"
        });
        assert_eq!(
            fleet_text(&v),
            "INSTANCE           ADDRESS  VERSION  CONFIG        READY  LAST SEEN\n\
             a-1-000001 (this)  a:8080   0.1.0    93f078b7bb41  yes    2026-11-26T22:44:22.807Z\n\
             b-2-000002         b:8080   0.1.0    c331faa035f0  no     2026-11-26T22:44:21.5Z\n\
             \n\
             ROUTE  ALLOWED  DELAYED  LIMITED  DENIED  SHADOW  STORE_ERROR_ALLOWED  STORE_ERROR_DENIED  BAD_REQUEST  UNAUTHORIZED\n\
             api    5        0        4        0       0       0                    0                   0            0\n\
             \n\
             config hashes differ: 2 hashes across 2 instances (a reload not applied everywhere?)\n"
        );
    }

    #[test]
    fn ip_values_as_the_api_takes_them() {
        let v = |s: &str| parse_ip(s).unwrap().value();
        assert_eq!(v("203.0.113.7"), "203.0.113.7");
        assert_eq!(v("203.0.113.7/32"), "203.0.113.7");
        assert_eq!(v("10.1.2.3/16"), "10.1.0.0/16");
        assert_eq!(v("2001:db8::1/32"), "2001:db8::/32");
        assert_eq!(v("::1"), "::1");
        assert_eq!(v("::ffff:192.0.2.1"), "192.0.2.1");
        assert!(parse_ip("10.0.0.0/33").is_err());
        assert!(parse_ip("example.com").is_err());
        assert!(parse_key("").is_err());
    }

    /// Keys (an old entry's, from a state file or Redis, may be anything) are shown
    /// as printable ASCII; reasons keep their text but not what hides or reorders it.
    #[test]
    fn keys_and_reasons_are_shown_so_that_they_cannot_pass_for_others() {
        assert_eq!(ascii("k-1 ~x"), "k-1 ~x");
        assert_eq!(
            ascii("bad\u{3164}\u{a0}\u{301}\u{e9}\t"),
            "bad\\u{3164}\\u{a0}\\u{301}\\u{e9}\\t"
        );
        assert_eq!(
            printable("\u{e9}t\u{e9} \u{202e}\u{2028}\u{fe0f}\u{3000}\u{2800}\u{17b5}\u{1680}\n"),
            "\u{e9}t\u{e9} \\u{202e}\\u{2028}\\u{fe0f}\\u{3000}\\u{2800}\\u{17b5}\\u{1680}\\n"
        );
    }

    #[test]
    fn ttl_uses_the_config_durations() {
        assert_eq!(parse_ttl("10m").unwrap().duration, Duration::from_secs(600));
        assert_eq!(parse_ttl("250ms").unwrap().text, "250ms");
        assert!(parse_ttl("0s").is_err());
        assert!(parse_ttl("10 minutes").is_err());
        assert!(parse_ttl("").is_err());
    }

    #[test]
    fn urls() {
        let e = Endpoint::new("http://127.0.0.1:9091/", None).unwrap();
        assert_eq!(
            (e.base.as_str(), e.host.as_str(), e.port),
            ("http://127.0.0.1:9091", "127.0.0.1", 9091)
        );
        let e = Endpoint::new("[::1]:9091", None).unwrap();
        assert_eq!(
            (e.base.as_str(), e.host.as_str(), e.authority.as_str()),
            ("http://[::1]:9091", "::1", "[::1]:9091")
        );
        let e = Endpoint::new("http://admin.internal/sluice/", None).unwrap();
        assert_eq!(
            (e.base.as_str(), e.port),
            ("http://admin.internal/sluice", 80)
        );
        assert_eq!(uri_path(&e.base), "/sluice");
        assert!(Endpoint::new("https://127.0.0.1:9091", None).is_err());
        assert!(Endpoint::new("ftp://x", None).is_err());
        assert!(Endpoint::new("http://", None).is_err());
    }

    #[test]
    fn unspecified_listen_addresses_mean_loopback() {
        let url = |s: &str| listen_url(s.parse().unwrap());
        assert_eq!(url("0.0.0.0:9091"), "http://127.0.0.1:9091");
        assert_eq!(url("[::]:9091"), "http://[::1]:9091");
        assert_eq!(url("10.0.0.5:9091"), "http://10.0.0.5:9091");
    }

    #[test]
    fn lines() {
        let ip = parse_ip("203.0.113.7").unwrap();
        let ttl = parse_ttl("10m").unwrap();
        assert_eq!(
            added_line(&ip, None, Some(&ttl), Some("scraping")),
            "denied ip 203.0.113.7 for 10m (reason: scraping)"
        );
        let key = Target::Key("leaked-key-123".into());
        assert_eq!(
            added_line(&key, None, None, None),
            "denied key leaked-key-123 until removed"
        );
        assert_eq!(removed_line(&ip), "removed ip 203.0.113.7");
        assert_eq!(
            refusal(
                StatusCode::UNAUTHORIZED,
                "missing or wrong bearer token"
            ),
            "401 Unauthorized: missing or wrong bearer token (set SLUICE_ADMIN_TOKEN or admin.token)"
        );
        assert_eq!(refusal(StatusCode::NOT_FOUND, ""), "404 Not Found");
    }

    #[test]
    fn control_characters_are_shown_escaped() {
        let entries: Vec<Entry> = serde_json::from_str(
            r#"[{"kind":"key","value":"evil\n2026 INFO forged\u001b[2J","reason":"a\rb","source":"ban"}]"#,
        )
        .unwrap();
        assert_eq!(
            table(&entries),
            "KIND  VALUE                            SOURCE  EXPIRES  REASON\n\
             key   evil\\n2026 INFO forged\\u{1b}[2J  ban     never    a\\rb\n"
        );
    }

    #[test]
    fn format_characters_are_shown_escaped() {
        for c in [
            '\u{202E}',
            '\u{200B}',
            '\u{2066}',
            '\u{FEFF}',
            '\u{00AD}',
            '\u{E0041}',
        ] {
            assert_eq!(
                printable(&format!("a{c}b")),
                format!("a{}b", c.escape_default())
            );
        }
        assert_eq!(printable("é ü 日本"), "é ü 日本");
    }

    #[test]
    fn next_pages() {
        assert_eq!(
            next_page("</admin/deny?limit=5&after=ab>; rel=\"next\""),
            Some("/admin/deny?limit=5&after=ab".to_string())
        );
        assert_eq!(next_page("</admin/deny?limit=5>; rel=\"prev\""), None);
        assert_eq!(next_page("<http://elsewhere/>; rel=\"next\""), None);
    }

    #[test]
    fn table_aligns_columns() {
        let entries: Vec<Entry> = serde_json::from_str(
            r#"[
            {"kind":"ip","value":"10.1.0.0/16","expires_at":"2026-11-21T22:10:00Z","reason":"scraping","source":"api"},
            {"kind":"key","value":"leaked-key-123","expires_at":null,"reason":null,"source":"static"},
            {"kind":"ip","value":"2001:db8::/32","expires_at":null,"reason":"","source":"ban","route":"login"}
            ]"#,
        )
        .unwrap();
        assert_eq!(
            table(&entries),
            "KIND  VALUE           SOURCE  EXPIRES               REASON\n\
             ip    10.1.0.0/16     api     2026-11-21T22:10:00Z  scraping\n\
             key   leaked-key-123  static  never                 -\n\
             ip    2001:db8::/32   ban     never                 -\n"
        );
        assert_eq!(table(&[]), "KIND  VALUE  SOURCE  EXPIRES  REASON\n");
    }

    #[test]
    fn top_table_shows_an_overstated_count_as_its_range() {
        let rows: Vec<TopRow> = serde_json::from_str(
            r#"[
            {"route":"api","key":"flood\n","ip":"198.51.100.7","refused":100,"error":5,"allowed":2,"last_seen":"2027-01-15T08:00:00.250Z","last_seen_ms":1799999999250},
            {"route":"login","key":"192.0.2.1","ip":"192.0.2.1","refused":3,"error":0,"allowed":0,"last_seen":"2027-01-15T08:00:00Z","last_seen_ms":1799999999000}
            ]"#,
        )
        .unwrap();
        assert_eq!(
            top_table(&rows),
            "ROUTE  KEY        IP            REFUSED  ALLOWED  LAST SEEN (UTC)\n\
             api    flood\\n    198.51.100.7  95..100  2        2027-01-15T08:00:00.250Z\n\
             login  192.0.2.1  192.0.2.1     3        0        2027-01-15T08:00:00Z\n"
        );
        assert_eq!(
            top_table(&[]),
            "ROUTE  KEY  IP  REFUSED  ALLOWED  LAST SEEN (UTC)\n"
        );
        // Summed over a fleet: over how many instances' lists.
        let rows: Vec<TopRow> = serde_json::from_str(
            r#"[{"route":"api","key":"k","ip":"192.0.2.1","refused":30,"error":0,"allowed":0,"last_seen":"2027-01-15T08:00:00Z","last_seen_ms":1799999999000,"instances":3}]"#,
        )
        .unwrap();
        assert_eq!(
            top_table(&rows),
            "ROUTE  KEY  IP         REFUSED  ALLOWED  LAST SEEN (UTC)       INSTANCES\n\
             api    k    192.0.2.1  30       0        2027-01-15T08:00:00Z  3\n"
        );
    }

    #[test]
    fn io_errors_read_as_phrases() {
        let e = std::io::Error::from_raw_os_error(111);
        assert_eq!(io_phrase(&e), "connection refused");
    }
}
