//! Who is asking: the client's IP (the TCP peer, or what a trusted proxy in front of
//! us says it saw) and the client key a route's limits are counted against.

use std::borrow::Cow;
use std::net::IpAddr;

use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_TYPE, COOKIE};
use http::request::Parts;
use ipnet::IpNet;

mod multipart;
mod text;

pub use text::{can_be_a_key, casefold, is_text_key, nfc, normalize_joined, Normalize};

// === client IP ===

/// The proxies whose `X-Forwarded-For` (or `Forwarded`) we believe.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    pub fn new(nets: Vec<IpNet>) -> TrustedProxies {
        TrustedProxies(nets.into_iter().map(canonical_net).collect())
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        self.0.iter().any(|n| n.contains(&ip))
    }

    /// The client's address: the TCP peer; when the peer is a trusted proxy, the
    /// right-most address of `X-Forwarded-For` that is not itself trusted. A client
    /// that is not a trusted proxy can never choose its address. When every hop is
    /// trusted, the left-most one; an entry that is not an address ends the walk at
    /// the last trusted hop. `Forwarded` is not read: a proxy that writes only that
    /// header must not let a client's own `X-Forwarded-For` through.
    pub fn client_ip(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if self.0.is_empty() || !self.contains(peer) {
            return peer;
        }
        let mut last = peer;
        for value in headers.get_all("x-forwarded-for").iter().rev() {
            let Ok(value) = value.to_str() else {
                return last;
            };
            for hop in value.rsplit(',') {
                match parse_hop(hop) {
                    Some(ip) if self.contains(ip) => last = ip,
                    Some(ip) => return ip,
                    None => return last,
                }
            }
        }
        last
    }
}

/// IPv4-mapped IPv6 peers (`::ffff:1.2.3.4`, from a dual-stack socket) as IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// A block in the form lookups use: IPv4-mapped IPv6 blocks (`::ffff:10.9.0.0/112`)
/// as IPv4 (`10.9.0.0/16`), like `canonical` does for addresses; host bits cleared.
pub fn canonical_net(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net {
        if let (Some(v4), true) = (v6.addr().to_ipv4_mapped(), v6.prefix_len() >= 96) {
            if let Ok(n) = ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96) {
                return IpNet::V4(n.trunc());
            }
        }
    }
    net.trunc()
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`,
/// `[2001:db8::1]:5678`.
pub(crate) fn parse_hop(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Some(rest) = hop.strip_prefix('[') {
        return rest
            .split_once(']')
            .and_then(|(a, _)| a.parse().ok())
            .map(canonical);
    }
    hop.rsplit_once(':')
        .and_then(|(a, _)| a.parse::<std::net::Ipv4Addr>().ok())
        .map(IpAddr::V4)
}

// === client key ===

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    Ip,
    Global,
    Header(HeaderName),
    Query(String),
    Cookie(String),
    /// A field of an `application/x-www-form-urlencoded` body.
    Form(String),
    /// A value in a JSON body, at this RFC 6901 pointer (as written, `/user/name`).
    Json(String),
    /// A claim of the request's verified JWT (`VerifiedClaims`).
    Jwt(Claim),
}

/// A claim a key reads: as written (`sub`, or a pointer `/org/id`), and the RFC
/// 6901 pointer it is found at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub written: String,
    pub pointer: String,
}

impl Claim {
    /// `NAME` (a top-level claim, any characters) or `/POINTER` (RFC 6901).
    pub fn parse(s: &str) -> Option<Claim> {
        if s.is_empty() {
            return None;
        }
        let pointer = if s.starts_with('/') {
            is_json_pointer(s).then(|| s.to_string())?
        } else {
            format!("/{}", s.replace('~', "~0").replace('/', "~1"))
        };
        Some(Claim {
            written: s.to_string(),
            pointer,
        })
    }

    /// The claim's value as a key: a string as it is, a number as JSON writes it;
    /// absent, null, a boolean, an array or an object is no key.
    pub fn value<'a>(&self, claims: &'a serde_json::Value) -> Option<Cow<'a, str>> {
        match claims.pointer(&self.pointer)? {
            serde_json::Value::String(s) => Some(Cow::Borrowed(s.as_str())),
            serde_json::Value::Number(n) => Some(Cow::Owned(n.to_string())),
            _ => None,
        }
    }
}

/// The claims of a request's JWT, verified (signature, times, issuer, audience) by
/// its route's provider: put in the request's extensions by the pipeline, read by
/// `jwt:` key parts. Nothing else puts it there, so no unverified token is a key.
#[derive(Debug, Clone)]
pub struct VerifiedClaims(pub std::sync::Arc<serde_json::Value>);

impl KeyPart {
    /// `ip`, `global`, `header:NAME`, `query:NAME`, `cookie:NAME`, `form:NAME`,
    /// `json:/POINTER`.
    pub fn parse(s: &str) -> Option<KeyPart> {
        match s.split_once(':') {
            None if s == "ip" => Some(KeyPart::Ip),
            None if s == "global" => Some(KeyPart::Global),
            Some(("header", n)) if !n.is_empty() => HeaderName::from_bytes(n.as_bytes())
                .ok()
                .map(KeyPart::Header),
            Some(("query", n)) if !n.is_empty() => Some(KeyPart::Query(n.to_string())),
            Some(("cookie", n)) if !n.is_empty() => Some(KeyPart::Cookie(n.to_string())),
            Some(("form", n)) if !n.is_empty() => Some(KeyPart::Form(n.to_string())),
            Some(("json", p)) if is_json_pointer(p) => Some(KeyPart::Json(p.to_string())),
            Some(("jwt", c)) => Claim::parse(c).map(KeyPart::Jwt),
            _ => None,
        }
    }

    /// What is missing, for the 400 answer.
    pub fn describe(&self) -> String {
        match self {
            KeyPart::Ip => "client address".into(),
            KeyPart::Global => "nothing".into(),
            KeyPart::Header(h) => format!("header {h}"),
            KeyPart::Query(q) => format!("query parameter {q}"),
            KeyPart::Cookie(c) => format!("cookie {c}"),
            KeyPart::Form(f) => format!("form field {f}"),
            KeyPart::Json(p) => format!("JSON value {p}"),
            KeyPart::Jwt(c) => format!("JWT claim {}", c.written),
        }
    }

    /// Whether the part is read from the request body.
    pub fn reads_body(&self) -> bool {
        matches!(self, KeyPart::Form(_) | KeyPart::Json(_))
    }
}

/// Whether `p` is an RFC 6901 pointer a key can use: it starts with `/` (the empty
/// pointer, the whole document, is never a key), and every `~` is `~0` or `~1`.
pub fn is_json_pointer(p: &str) -> bool {
    p.starts_with('/')
        && p.match_indices('~')
            .all(|(i, _)| matches!(p.as_bytes().get(i + 1), Some(b'0' | b'1')))
}

/// The part as the configuration writes it.
impl std::fmt::Display for KeyPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyPart::Ip => f.write_str("ip"),
            KeyPart::Global => f.write_str("global"),
            KeyPart::Header(h) => write!(f, "header:{h}"),
            KeyPart::Query(q) => write!(f, "query:{q}"),
            KeyPart::Cookie(c) => write!(f, "cookie:{c}"),
            KeyPart::Form(n) => write!(f, "form:{n}"),
            KeyPart::Json(p) => write!(f, "json:{p}"),
            KeyPart::Jwt(c) => write!(f, "jwt:{}", c.written),
        }
    }
}

/// What a route does when a request lacks its key: 400, or count it by client IP.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
    Default,
)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    #[default]
    Reject,
    Ip,
}

/// How a route finds the key of a request: one part, or several joined, each
/// part's value compared in the form `normalize` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    pub parts: Vec<KeyPart>,
    pub normalize: Normalize,
}

/// Why a request has no key for a `KeySpec`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoKey<'a> {
    /// The part is absent, empty, sent more than once, or not readable.
    Missing(&'a KeyPart),
    /// The part's value holds a character no key of its kind may hold (`unprintable`).
    Unprintable(&'a KeyPart),
}

impl<'a> NoKey<'a> {
    pub fn part(self) -> &'a KeyPart {
        match self {
            NoKey::Missing(p) | NoKey::Unprintable(p) => p,
        }
    }
}

/// The key a request is counted against, as the client sent it (borrowed from the
/// request where it can be: a single header or cookie, no allocation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientKey<'a> {
    pub value: Cow<'a, str>,
    /// For a composite key, each part's value, so that a denied key is denied inside
    /// a list too; empty for a single-part key.
    pub parts: Vec<String>,
}

/// Keys longer than this are hashed before they are stored.
pub const MAX_STORED_KEY: usize = 256;

impl<'a> ClientKey<'a> {
    pub fn new(value: impl Into<Cow<'a, str>>) -> ClientKey<'a> {
        ClientKey {
            value: value.into(),
            parts: Vec::new(),
        }
    }

    /// The whole key, and each part of a composite one.
    pub fn values(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.value.as_ref()).chain(self.parts.iter().map(String::as_str))
    }

    /// The key as stored: itself, or `#` and its SHA-1 when it is long or holds
    /// characters that would break a Redis hash tag (`{`, `}`) or start with `#`
    /// (so a raw key can never equal a hashed one).
    pub fn stored(&self) -> Cow<'_, str> {
        let k: &str = &self.value;
        if kept_hashed(k) {
            Cow::Owned(KeyDigest::of(k).as_str().to_string())
        } else {
            Cow::Borrowed(k)
        }
    }
}

/// Whether a key the client sent is stored as its hash (`KeyDigest`): it is long,
/// holds characters that would break a Redis hash tag (`{`, `}`), or starts with `#`
/// (so no client can send a key that spells another key's hash). The one rule for
/// the limiter, the strikes and the deny list's lookups.
pub fn kept_hashed(k: &str) -> bool {
    k.len() > MAX_STORED_KEY || k.starts_with('#') || k.contains(['{', '}'])
}

/// Whether `k` is the form `KeyDigest` writes: `#` and 40 lower-case hex digits.
pub fn is_digest(k: &str) -> bool {
    k.len() == 41
        && k.starts_with('#')
        && k[1..]
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `#` and a key's SHA-1 in lower-case hex: the form a key is stored in when it
/// cannot be stored as it is. Kept on the stack, so that the deny list's lookup of a
/// long key on the request path allocates nothing.
pub struct KeyDigest([u8; 41]);

impl KeyDigest {
    pub fn of(key: &str) -> KeyDigest {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [b'#'; 41];
        let bytes = sha1_smol::Sha1::from(key.as_bytes()).digest().bytes();
        for (i, b) in bytes.iter().enumerate() {
            out[1 + 2 * i] = HEX[usize::from(b >> 4)];
            out[2 + 2 * i] = HEX[usize::from(b & 0xf)];
        }
        KeyDigest(out)
    }

    pub fn as_str(&self) -> &str {
        // ASCII by construction.
        std::str::from_utf8(&self.0).unwrap_or("#")
    }
}

impl KeySpec {
    /// A key of these parts, compared as sent.
    pub fn new(parts: Vec<KeyPart>) -> KeySpec {
        KeySpec {
            parts,
            normalize: Normalize::None,
        }
    }

    /// The request's key, or why it has none, for a request whose body is not read:
    /// a body part (`form:`, `json:`) is then missing.
    pub fn extract<'a>(&'a self, req: &'a Parts, ip: IpAddr) -> Result<ClientKey<'a>, NoKey<'a>> {
        self.extract_with_body(req, ip, None)
    }

    /// The request's key, or why it has none. `body` is the request body when it was
    /// read whole (`pipeline::body_key`); None (not read, or larger than
    /// `server.max_key_body`) makes a body part missing. Each part's value is checked
    /// (`unprintable`), put in its canonical form (`canonical`) and normalised.
    pub fn extract_with_body<'a>(
        &'a self,
        req: &'a Parts,
        ip: IpAddr,
        body: Option<&'a [u8]>,
    ) -> Result<ClientKey<'a>, NoKey<'a>> {
        let value = |part: &'a KeyPart| {
            let v = part_value(part, req, ip, body).ok_or(NoKey::Missing(part))?;
            if !part.holds(&v) {
                return Err(NoKey::Unprintable(part));
            }
            Ok(self.canonical(part, v))
        };
        if let [one] = self.parts.as_slice() {
            return value(one).map(ClientKey::new);
        }
        let mut key = String::new();
        let mut parts = Vec::with_capacity(self.parts.len());
        for (i, part) in self.parts.iter().enumerate() {
            let v = value(part)?;
            if i > 0 {
                key.push('|');
            }
            // Escape the separator so two different lists never join to one key.
            for c in v.chars() {
                if c == '|' || c == '\\' {
                    key.push('\\');
                }
                key.push(c);
            }
            parts.push(v.into_owned());
        }
        Ok(ClientKey {
            value: Cow::Owned(key),
            parts,
        })
    }
}

impl KeySpec {
    /// The key as the configuration writes it, a composite one's parts joined by `+`.
    pub fn describe_grammar(&self) -> String {
        let parts: Vec<String> = self.parts.iter().map(|p| p.to_string()).collect();
        parts.join("+")
    }

    /// A part's value as it is counted and looked up in the deny list: a body value
    /// in NFC, then in the key's `normalize` form. Addresses are kept as they are.
    pub fn canonical<'v>(&self, part: &KeyPart, v: Cow<'v, str>) -> Cow<'v, str> {
        let v = if part.reads_body() || matches!(part, KeyPart::Jwt(_)) {
            nfc(v)
        } else {
            v
        };
        match part {
            KeyPart::Ip => v,
            _ => self.normalize.apply(v),
        }
    }

    /// Whether the key is the client IP alone.
    pub fn is_ip(&self) -> bool {
        self.parts == [KeyPart::Ip]
    }

    /// Whether a part of the key is read from the request body (`form:`, `json:`):
    /// only then is the body read before the decision.
    pub fn reads_body(&self) -> bool {
        self.parts.iter().any(KeyPart::reads_body)
    }

    /// Whether the body of this request is worth reading for the key: a part reads
    /// the body, and a `Content-Type` of the request names the type that part reads
    /// (any copy of the field: the deny list looks at every reading of the body). A
    /// body of another type is never read, as nothing in it could be the key.
    pub fn body_wanted(&self, headers: &HeaderMap) -> bool {
        self.parts.iter().any(|part| match part {
            KeyPart::Form(_) => {
                any_body_type(headers, BodyType::Form)
                    || any_body_type(headers, BodyType::Multipart)
            }
            KeyPart::Json(_) => any_body_type(headers, BodyType::Json),
            _ => false,
        })
    }

    /// `any_value` for a request whose body is not read: its body parts see nothing.
    pub fn any_value(&self, req: &Parts, ip: IpAddr, f: impl FnMut(&str) -> bool) -> bool {
        self.any_value_with_body(req, ip, None, f)
    }

    /// Whether `f` holds for any value of any part as sent, every copy of a repeated
    /// header, parameter, cookie, form field or JSON member included: the deny list
    /// must catch a denied key however it is sent, even where `extract` calls it
    /// missing. A body part is looked for under every `Content-Type` the request
    /// names, since an upstream given two may read either. Each value is given in
    /// its canonical form (`canonical`), as the key would hold it; the address of an
    /// `ip` part and `global` too, so the key `/admin/top` shows can be denied.
    pub fn any_value_with_body(
        &self,
        req: &Parts,
        ip: IpAddr,
        body: Option<&[u8]>,
        mut f: impl FnMut(&str) -> bool,
    ) -> bool {
        self.parts.iter().any(|part| {
            // In the key's form, and as sent: an entry kept hashed (long, or with
            // `{`, `}`) is matched only as the client sent it.
            let mut f = |v: &str| {
                let c = self.canonical(part, Cow::Borrowed(v));
                f(&c) || (c != v && f(v))
            };
            match part {
                KeyPart::Ip => f(IpText::of(ip).as_str()),
                KeyPart::Global => f("global"),
                // A comma list is the same as several header lines (RFC 9110 §5.3),
                // which an upstream may read either way: each element is checked as
                // well.
                KeyPart::Header(h) => req.headers.get_all(h).iter().any(|v| {
                    let text = header_text(v);
                    f(&text) || (text.contains(',') && text.split(',').any(|e| f(e.trim())))
                }),
                KeyPart::Query(name) => req
                    .uri
                    .query()
                    .is_some_and(|q| query_pairs(q).any(|(k, v)| same_name(&k, name) && f(&v))),
                KeyPart::Cookie(name) => cookies(&req.headers, name).any(|v| f(&v)),
                KeyPart::Form(_) | KeyPart::Json(_) => {
                    any_body_value(part, req, body, true, &mut f)
                }
                KeyPart::Jwt(c) => claims(req).and_then(|v| c.value(v)).is_some_and(|v| f(&v)),
            }
        })
    }

    /// `unprintable` for a request whose body is not read.
    pub fn unprintable(&self, req: &Parts) -> Option<&KeyPart> {
        self.unprintable_with_body(req, None)
    }

    /// The first part with a value, any copy of it, holding a character its kind of
    /// key may not (`KeyPart::holds`), as the upstream would read it (a header
    /// without the spaces and tabs around it, a parameter or cookie decoded, a body
    /// value trimmed of white space): Node trims an NBSP off a header, PHP and
    /// others trim Unicode white space, so `k` followed by one would be `k` to the
    /// upstream, yet another key here. Body values are the ones `any_value` sees.
    pub fn unprintable_with_body(&self, req: &Parts, body: Option<&[u8]>) -> Option<&KeyPart> {
        let bad = |v: &[u8]| !printable_bytes(v);
        self.parts.iter().find(|part| match part {
            KeyPart::Ip | KeyPart::Global => false,
            KeyPart::Header(h) => req
                .headers
                .get_all(h)
                .iter()
                .any(|v| bad(trim_ows(v.as_bytes()))),
            KeyPart::Query(name) => req.uri.query().is_some_and(|q| {
                query_pairs(q).any(|(k, v)| same_name(&k, name) && bad(v.as_bytes()))
            }),
            KeyPart::Cookie(name) => cookies(&req.headers, name).any(|v| bad(v.as_bytes())),
            KeyPart::Form(_) | KeyPart::Json(_) => {
                any_body_value(part, req, body, false, &mut |v: &str| !is_text_key(v))
            }
            KeyPart::Jwt(c) => claims(req)
                .and_then(|v| c.value(v))
                .is_some_and(|v| !is_text_key(&v)),
        })
    }
}

impl KeyPart {
    /// Whether `v` is a value this kind of part may hold: printable ASCII for a
    /// header, parameter or cookie (0x20-0x7E: the NBSP tricks), text of any script
    /// for a body value (`is_text_key`).
    pub fn holds(&self, v: &str) -> bool {
        match self {
            KeyPart::Ip | KeyPart::Global => true,
            KeyPart::Form(_) | KeyPart::Json(_) | KeyPart::Jwt(_) => is_text_key(v),
            _ => printable_key(v),
        }
    }
}

/// An address as text, on the stack: the deny list looks up an `ip` key with no
/// allocation.
struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl IpText {
    fn of(ip: IpAddr) -> IpText {
        use std::io::Write;
        let mut buf = [0u8; 48];
        let mut w = &mut buf[..];
        // An IPv6 address is at most 45 characters.
        let _ = write!(w, "{ip}");
        let len = 48 - w.len();
        IpText { buf, len }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

/// Whether `key` is one the request path can carry: printable ASCII (0x20-0x7E)
/// only; a key value with any other byte is refused with 400 (`unprintable`).
pub fn printable_key(key: &str) -> bool {
    printable_bytes(key.as_bytes())
}

fn printable_bytes(v: &[u8]) -> bool {
    v.iter().all(|b| (0x20..=0x7e).contains(b))
}

/// Whether a parameter or cookie sent as `sent` is the one named `name` to PHP,
/// which reads a name up to its first NUL byte (`api_key%00x` is `api_key`), drops
/// leading spaces from it, reads `.`, ` ` and a `[` that no `]` follows as `_`
/// (`api.key` is `api_key`, and the last value wins), and reads `api_key[]` or
/// `api_key[0]` as the array `api_key` (whose `['bad']` equals `'bad'` to loose
/// comparisons): a key must not be one parameter here and another to the upstream.
fn same_name(sent: &str, name: &str) -> bool {
    let sent = sent.split('\0').next().unwrap_or(sent);
    let fold = |b: u8| match b {
        b'.' | b' ' | b'[' => b'_',
        b => b,
    };
    fn base(n: &str) -> &str {
        match n.find('[') {
            Some(i) if n[i..].contains(']') => &n[..i],
            _ => n,
        }
    }
    let (sent, name) = (
        base(sent.trim_start_matches(' ')),
        base(name.trim_start_matches(' ')),
    );
    sent.len() == name.len()
        && sent
            .bytes()
            .zip(name.bytes())
            .all(|(a, b)| fold(a) == fold(b))
}

/// A header value without the spaces and tabs around it (RFC 9110 §5.5 OWS).
fn trim_ows(b: &[u8]) -> &[u8] {
    let ows = |c: &u8| *c == b' ' || *c == b'\t';
    let start = b.iter().position(|c| !ows(c)).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !ows(c)).map_or(start, |i| i + 1);
    &b[start..end]
}

/// The value of one key part. A part that is absent, empty, or sent more than once
/// (`?k=a&k=b`, two headers, two cookies) is missing: upstreams disagree on which of
/// several values counts, so a client must not be able to pick one for its key and
/// let the upstream see another.
///
/// A body part is read only from a body of its type, named by one `Content-Type`
/// (a second one, which an upstream may read instead, makes it missing), and a
/// JSON member sent twice on the pointer's way is missing too: serde_json keeps the
/// last, other parsers the first. A member whose name equals the pointer's token
/// when case is ignored (`USER` for `user`) is a copy of it, as Go reads it; in
/// forms, a name is read up to a NUL byte (`same_name`), as PHP reads it.
fn part_value<'a>(
    part: &'a KeyPart,
    req: &'a Parts,
    ip: IpAddr,
    body: Option<&'a [u8]>,
) -> Option<Cow<'a, str>> {
    let v: Cow<'a, str> = match part {
        KeyPart::Form(_) | KeyPart::Json(_) => body_part_value(part, req, body?)?,
        KeyPart::Ip => Cow::Owned(ip.to_string()),
        KeyPart::Global => Cow::Borrowed("global"),
        KeyPart::Header(h) => header_text(single(req.headers.get_all(h).iter())?),
        KeyPart::Query(name) => single(
            query_pairs(req.uri.query()?)
                .filter(|(k, _)| same_name(k, name))
                .map(|(_, v)| v),
        )?,
        KeyPart::Cookie(name) => single(cookies(&req.headers, name))?,
        KeyPart::Jwt(c) => c.value(claims(req)?)?,
    };
    if v.is_empty() {
        None
    } else {
        Some(v)
    }
}

/// The verified claims of the request's JWT, if its route verified one.
fn claims(req: &Parts) -> Option<&serde_json::Value> {
    req.extensions.get::<VerifiedClaims>().map(|c| c.0.as_ref())
}

/// The value of a body part (`form:`, `json:`) in a body read whole, as
/// `part_value` says; the request's `Content-Type` is looked at only here, so a
/// route whose key is not in the body never reads it.
fn body_part_value<'a>(part: &'a KeyPart, req: &'a Parts, body: &'a [u8]) -> Option<Cow<'a, str>> {
    Some(match (part, key_body(&req.headers)) {
        // Go's `FormValue` reads the query's parameter first: one there is a copy.
        (KeyPart::Form(name), _) if in_query(req, name) => return None,
        (KeyPart::Form(name), Some((BodyType::Form, _))) => single(form_fields(body, name))?,
        (KeyPart::Form(name), Some((BodyType::Multipart, ct))) => {
            // The strict reading's field, when every reading finds just what it
            // finds, with the one boundary every upstream reads.
            let same = |n: &str| same_name(n, name);
            let boundary = multipart::boundary(ct.as_bytes())?;
            if multipart_boundaries(&req.headers).len() != 1 {
                return None;
            }
            let strict = multipart::strict(body, boundary, same)?;
            if multipart::every_field(body, boundary, same) != strict {
                return None;
            }
            let field = single(strict.into_iter())?;
            if !field.plain {
                return None;
            }
            trim_white(field.value)
        }
        (KeyPart::Json(pointer), Some((BodyType::Json, _))) => {
            let found = json_values(body, pointer)?;
            if found.repeated {
                return None;
            }
            Cow::Owned(json_text(single(found.values.iter())?)?)
        }
        _ => return None,
    })
}

/// Whether the query has a parameter named `name` (`same_name`).
fn in_query(req: &Parts, name: &str) -> bool {
    req.uri
        .query()
        .is_some_and(|q| query_pairs(q).any(|(k, _)| same_name(&k, name)))
}

// === body keys ===

/// The body types a key part reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyType {
    Form,
    /// `multipart/form-data`, read by `form:` keys too.
    Multipart,
    Json,
}

/// The body type a `Content-Type` value names, if a key part reads it: its media
/// type (cut at `;`, `,` or white space, as PHP cuts it; case-insensitive) is
/// `application/x-www-form-urlencoded`, or `*/json` or `*/*+json` (Flask, Spring
/// and Laravel read `application/vnd.api+json` as JSON, and Laravel `text/json`:
/// a key that an upstream reads must not be missing here).
fn body_type(v: &HeaderValue) -> Option<BodyType> {
    let v = v.as_bytes().trim_ascii_start();
    let end = v
        .iter()
        .position(|b| matches!(b, b';' | b',') || b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let media = std::str::from_utf8(&v[..end]).ok()?.to_ascii_lowercase();
    if media == "application/x-www-form-urlencoded" {
        return Some(BodyType::Form);
    }
    if media == "multipart/form-data" {
        return Some(BodyType::Multipart);
    }
    let (_, subtype) = media.split_once('/')?;
    (subtype == "json" || subtype.ends_with("+json")).then_some(BodyType::Json)
}

/// The body's type as a key reads it: one `Content-Type`, of a type a part reads,
/// and that field.
fn key_body(headers: &HeaderMap) -> Option<(BodyType, &HeaderValue)> {
    let ct = single(headers.get_all(CONTENT_TYPE).iter())?;
    Some((body_type(ct)?, ct))
}

/// Whether the request says its body is JSON (`application/json`, or a `+json`
/// type): a body a limit's `estimate` may be read from.
pub fn json_body(headers: &HeaderMap) -> bool {
    any_body_type(headers, BodyType::Json)
}

/// The whole number of units at `pointer` in a JSON body (a limit's `estimate:
/// "json:/max_tokens"`); None when the body is not JSON, the pointer reaches
/// nothing or something else, or a member on its way is sent twice.
pub fn json_units(body: &[u8], pointer: &str) -> Option<u64> {
    let found = json_values(body, pointer)?;
    match (&found.values[..], found.repeated) {
        ([v], false) => v.as_u64(),
        _ => None,
    }
}

/// Whether any `Content-Type` of the request names `t`.
fn any_body_type(headers: &HeaderMap, t: BodyType) -> bool {
    headers
        .get_all(CONTENT_TYPE)
        .iter()
        .any(|v| body_type(v) == Some(t))
}

/// Whether `f` holds for any value of a body part, every copy of it, under any
/// `Content-Type` the request names (`any_value`). `wide`: also the values only
/// a lenient reader finds (a JSON body that is not valid UTF-8 or not valid JSON,
/// scanned for members of the pointer's last name), for the deny list.
fn any_body_value(
    part: &KeyPart,
    req: &Parts,
    body: Option<&[u8]>,
    wide: bool,
    f: &mut impl FnMut(&str) -> bool,
) -> bool {
    match part {
        KeyPart::Form(name) => {
            // Go's `FormValue` reads the query's parameter before the body's field.
            let query = req
                .uri
                .query()
                .is_some_and(|q| query_pairs(q).any(|(k, v)| same_name(&k, name) && f(&v)));
            let Some(body) = body else {
                return query;
            };
            if query {
                return true;
            }
            if any_body_type(&req.headers, BodyType::Form) && form_fields(body, name).any(|v| f(&v))
            {
                return true;
            }
            // Every part of that name, file or field, that any reader finds, with
            // every boundary the request's `Content-Type` fields name.
            multipart_boundaries(&req.headers).iter().any(|b| {
                multipart::every_field(body, b, |n| same_name(n, name))
                    .into_iter()
                    .any(|p| f(&trim_white(p.value)))
            })
        }
        // Every member on the pointer's way, each copy of a repeated one, and the
        // items of an array at its end: `["bad"] == "bad"` in JavaScript, as
        // `k[]=bad` is `bad` to PHP's loose comparisons.
        KeyPart::Json(pointer) if any_body_type(&req.headers, BodyType::Json) => {
            let Some(body) = body else {
                return false;
            };
            let mut structural = || {
                json_values(body, pointer).is_some_and(|found| {
                    found.values.iter().any(|v| match v {
                        serde_json::Value::Array(items) => {
                            items.iter().filter_map(json_text).any(|t| f(&t))
                        }
                        v => json_text(v).is_some_and(|t| f(&t)),
                    })
                })
            };
            structural() || (wide && json_lexical(body, pointer, &mut *f))
        }
        _ => false,
    }
}

/// The distinct boundaries of every `multipart/form-data` `Content-Type` of the
/// request, as any upstream may read them (`multipart::boundaries`), at most
/// `multipart::MAX_BOUNDARIES`.
fn multipart_boundaries(headers: &HeaderMap) -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for ct in headers.get_all(CONTENT_TYPE) {
        if body_type(ct) == Some(BodyType::Multipart) {
            multipart::boundaries(ct.as_bytes(), &mut all);
        }
    }
    all.truncate(multipart::MAX_BOUNDARIES);
    all
}

/// A JSON body as text for a lenient reader: UTF-16 or UTF-32 by their byte order
/// marks, or by the zero bytes of an ASCII start, as Python's `json.loads`
/// detects them; else UTF-8 without its byte order mark, bad bytes replaced as Go
/// reads strings.
fn lenient_json_text(body: &[u8]) -> Cow<'_, str> {
    let units32 = |be: bool| -> String {
        body.chunks_exact(4)
            .map(|c| {
                let w = [c[0], c[1], c[2], c[3]];
                let u = if be {
                    u32::from_be_bytes(w)
                } else {
                    u32::from_le_bytes(w)
                };
                char::from_u32(u).unwrap_or('\u{FFFD}')
            })
            .collect()
    };
    let units16 = |be: bool| -> String {
        let units = body.chunks_exact(2).map(|c| {
            let w = [c[0], c[1]];
            if be {
                u16::from_be_bytes(w)
            } else {
                u16::from_le_bytes(w)
            }
        });
        char::decode_utf16(units)
            .map(|c| c.unwrap_or('\u{FFFD}'))
            .collect()
    };
    let text = match body {
        [0xFF, 0xFE, 0, 0, ..] => units32(false),
        [0, 0, 0xFE, 0xFF, ..] => units32(true),
        [0xFF, 0xFE, ..] => units16(false),
        [0xFE, 0xFF, ..] => units16(true),
        [0, 0, _, _, ..] => units32(true),
        [0, _, ..] => units16(true),
        [_, 0, 0, 0, ..] => units32(false),
        [_, 0, ..] => units16(false),
        _ => {
            return match std::str::from_utf8(body) {
                Ok(t) => Cow::Borrowed(t.strip_prefix('\u{FEFF}').unwrap_or(t)),
                Err(_) => String::from_utf8_lossy(body),
            }
        }
    };
    Cow::Owned(text.trim_start_matches('\u{FEFF}').to_string())
}

/// Whether `f` holds for the value of any member, at any depth, whose name is the
/// pointer's last name (as Go compares names), found by scanning the body's text
/// as a lenient reader would read it (`lenient_json_text`), valid JSON or not
/// (`NaN`, a stray byte): the deny list's reading of what a parser may accept.
/// A pointer ending in an array index has no name to look for.
fn json_lexical(body: &[u8], pointer: &str, f: &mut impl FnMut(&str) -> bool) -> bool {
    let Some(last) = pointer.rsplit('/').next() else {
        return false;
    };
    if last.is_empty() || last.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    let token = last.replace("~1", "/").replace("~0", "~");
    let text = lenient_json_text(body);
    let b = text.as_bytes();
    let skip_ws = |mut i: usize| {
        while b.get(i).is_some_and(|c| c.is_ascii_whitespace()) {
            i += 1;
        }
        i
    };
    // The end (past the closing quote) of the string starting at `i`, and its text.
    let string_at = |i: usize| -> (usize, Cow<'_, str>) {
        let mut j = i + 1;
        while j < b.len() && b[j] != b'"' {
            j += if b[j] == b'\\' { 2 } else { 1 };
        }
        let end = (j + 1).min(b.len());
        let raw = text.get(i..end).unwrap_or("");
        match serde_json::from_str::<String>(raw) {
            Ok(s) => (end, Cow::Owned(s)),
            Err(_) => (end, Cow::Borrowed(raw.trim_matches('"'))),
        }
    };
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'"' {
            i += 1;
            continue;
        }
        let (end, name) = string_at(i);
        i = end;
        let colon = skip_ws(end);
        if b.get(colon) != Some(&b':') || !text::same_member(&name, &token) {
            continue;
        }
        let at = skip_ws(colon + 1);
        let value = match b.get(at) {
            Some(b'"') => string_at(at).1.trim().to_string(),
            // An array or object: the structural reading's, when there is one.
            Some(b'[' | b'{') | None => continue,
            Some(_) => {
                let stop = b[at..]
                    .iter()
                    .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace())
                    .map_or(b.len(), |n| at + n);
                let scalar = text.get(at..stop).unwrap_or("");
                match serde_json::from_str::<serde_json::Value>(scalar) {
                    Ok(v) => json_text(&v).unwrap_or_default(),
                    Err(_) => scalar.to_string(),
                }
            }
        };
        if !value.is_empty() && f(&value) {
            return true;
        }
    }
    false
}

/// The values of form field `name` in a form body, every copy: split and decoded as
/// a query is (`query_pairs`: `+` is a space, `;` splits too, names read as PHP
/// reads them), each trimmed of Unicode white space; bytes that are not UTF-8
/// replaced (so refused as unprintable).
fn form_fields<'a>(body: &'a [u8], name: &'a str) -> impl Iterator<Item = Cow<'a, str>> + 'a {
    body.split(|b| matches!(b, b'&' | b';'))
        .flat_map(form_urlencoded::parse)
        .filter(move |(k, _)| same_name(k, name))
        .map(|(_, v)| trim_white(v))
}

/// A text without the Unicode white space around it, as body keys are read (PHP's
/// frameworks trim it: Laravel's `TrimStrings`).
fn trim_white(v: Cow<'_, str>) -> Cow<'_, str> {
    match v {
        Cow::Borrowed(b) => Cow::Borrowed(b.trim()),
        Cow::Owned(o) if o.trim().len() == o.len() => Cow::Owned(o),
        Cow::Owned(o) => Cow::Owned(o.trim().to_owned()),
    }
}

/// What a JSON pointer reaches in a body.
struct JsonFound {
    /// Every value at the pointer: more than one when a member on its way is sent
    /// twice.
    values: Vec<serde_json::Value>,
    /// A member on the pointer's way is sent more than once.
    repeated: bool,
}

/// The values at `pointer` in a JSON body; None when the body is not one JSON
/// document in UTF-8 (RFC 8259 §8.1), or nests deeper than serde_json's 128 levels.
/// Members off the pointer's way are checked and skipped, never kept.
fn json_values(body: &[u8], pointer: &str) -> Option<JsonFound> {
    use serde::de::DeserializeSeed;
    // serde_json skips the text of strings it ignores without looking at their
    // bytes: the body is checked whole first.
    let text = std::str::from_utf8(body).ok()?;
    // A byte order mark before the document, as Python and .NET read it.
    let text = text.strip_prefix('\u{FEFF}').unwrap_or(text);
    let mut found = JsonFound {
        values: Vec::new(),
        repeated: false,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    JsonAt {
        pointer,
        found: &mut found,
    }
    .deserialize(&mut de)
    .ok()?;
    de.end().ok()?;
    Some(found)
}

/// A key's text of a JSON value: a string trimmed of Unicode white space, a number
/// in one spelling for every way of writing it (`1`, `1.0`, `1e0` and `"1"` are one
/// key: JavaScript and PHP's loose comparisons take them for one), `true` or
/// `false`. Null, an array or an object is no key.
fn json_text(v: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match v {
        Value::String(s) => Some(s.trim().to_owned()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                return Some(i.to_string());
            }
            if let Some(u) = n.as_u64() {
                return Some(u.to_string());
            }
            let f = n.as_f64()?;
            // Whole numbers within i64 are written as integers (and -0 as 0).
            if f.fract() == 0.0 && f.abs() < 9.2e18 {
                Some((f as i64).to_string())
            } else {
                Some(f.to_string())
            }
        }
        Value::Null | Value::Array(_) | Value::Object(_) => None,
    }
}

/// The first reference token of a pointer (`/a~1b/c` gives `a/b` and `/c`),
/// borrowed when it has no escape; None at the pointer's end.
fn pointer_token(pointer: &str) -> Option<(Cow<'_, str>, &str)> {
    let rest = pointer.strip_prefix('/')?;
    let end = rest.find('/').unwrap_or(rest.len());
    let (token, rest) = rest.split_at(end);
    let token = if token.contains('~') {
        Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
    } else {
        Cow::Borrowed(token)
    };
    Some((token, rest))
}

/// Deserializes a JSON document, keeping what is at `pointer` (what is left of it)
/// in `found` and skipping the rest.
struct JsonAt<'p, 'f> {
    pointer: &'p str,
    found: &'f mut JsonFound,
}

impl<'de> serde::de::DeserializeSeed<'de> for JsonAt<'_, '_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.pointer.is_empty() {
            let v = <serde_json::Value as serde::Deserialize>::deserialize(d)?;
            self.found.values.push(v);
            Ok(())
        } else {
            d.deserialize_any(self)
        }
    }
}

impl<'de> serde::de::Visitor<'de> for JsonAt<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        use serde::de::IgnoredAny;
        let Some((token, rest)) = pointer_token(self.pointer) else {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            return Ok(());
        };
        let mut seen = 0;
        while let Some(name) = map.next_key::<Cow<'de, str>>()? {
            if text::same_member(&name, &token) {
                seen += 1;
                map.next_value_seed(JsonAt {
                    pointer: rest,
                    found: &mut *self.found,
                })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        if seen > 1 {
            self.found.repeated = true;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        use serde::de::IgnoredAny;
        // An index is `0` or digits without a leading zero (RFC 6901 §4).
        let index = pointer_token(self.pointer).and_then(|(token, rest)| {
            let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
            let canonical = token == "0" || !token.starts_with('0');
            (digits && canonical)
                .then(|| token.parse::<usize>().ok())
                .flatten()
                .map(|i| (i, rest))
        });
        let mut i = 0;
        loop {
            let more = match index {
                Some((at, rest)) if at == i => seq
                    .next_element_seed(JsonAt {
                        pointer: rest,
                        found: &mut *self.found,
                    })?
                    .is_some(),
                _ => seq.next_element::<IgnoredAny>()?.is_some(),
            };
            if !more {
                return Ok(());
            }
            i += 1;
        }
    }

    // A scalar where the pointer goes on: nothing there.
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
}

/// The parameters of a query, decoded, split on `&` and on `;` as well: Rack 2, Go
/// before 1.17 and Python before 3.9.2 split on both, so `k=bad;x` is `k=bad` to
/// them, and must be to the key and the deny list. Values without the spaces
/// around them, as Laravel's `TrimStrings` reads them (`bad%20` is `bad`).
fn query_pairs(q: &str) -> impl Iterator<Item = (Cow<'_, str>, Cow<'_, str>)> {
    q.split(['&', ';'])
        .flat_map(|seg| form_urlencoded::parse(seg.as_bytes()))
        .map(|(k, v)| (k, trim_spaces(v)))
}

/// A decoded value without the spaces around it.
fn trim_spaces(v: Cow<'_, str>) -> Cow<'_, str> {
    if !v.starts_with(' ') && !v.ends_with(' ') {
        return v;
    }
    match v {
        Cow::Borrowed(b) => Cow::Borrowed(b.trim_matches(' ')),
        Cow::Owned(o) => Cow::Owned(o.trim_matches(' ').to_owned()),
    }
}

/// A cookie's name or value decoded as PHP reads it (`urldecode`: `%XX` escapes,
/// and `+` as a space), and as Express and most cookie parsers read the escapes:
/// `%73id=bad` is the cookie `sid` to PHP, and `sid=%62ad` is `bad` to all of them.
/// Bytes that are not UTF-8 are replaced.
fn cookie_text(b: &[u8]) -> Cow<'_, str> {
    if !b.iter().any(|c| matches!(c, b'%' | b'+')) {
        return String::from_utf8_lossy(b);
    }
    let plus: Vec<u8> = b
        .iter()
        .map(|c| if *c == b'+' { b' ' } else { *c })
        .collect();
    let decoded: Vec<u8> = percent_encoding::percent_decode(&plus).collect();
    Cow::Owned(String::from_utf8_lossy(&decoded).into_owned())
}

/// The only item, or None when there is none or more than one.
fn single<T>(mut it: impl Iterator<Item = T>) -> Option<T> {
    let first = it.next()?;
    it.next().is_none().then_some(first)
}

/// A header value as an HTTP/1 upstream will read it: without the spaces and tabs
/// around it (hyper strips them from HTTP/1 requests, but not from HTTP/2 ones), any
/// bytes that are not UTF-8 replaced.
fn header_text(v: &HeaderValue) -> Cow<'_, str> {
    let text = trim_ows(v.as_bytes());
    // The same as `from_utf8_lossy`, which costs more on the usual (short, ASCII)
    // value than looking at its words once.
    if text.is_ascii() {
        // SAFETY: ASCII is valid UTF-8.
        Cow::Borrowed(unsafe { std::str::from_utf8_unchecked(text) })
    } else {
        String::from_utf8_lossy(text)
    }
}

/// The values of cookie `name` in every `Cookie` header, as lenient servers read them:
/// pairs split on `;`, spaces around names and values trimmed, names and values
/// decoded (`cookie_text`), names compared as PHP reads them (`same_name`), a
/// value's quotes removed and the spaces inside them trimmed too (one odd byte
/// elsewhere in the header must not hide a cookie from the deny list).
pub fn cookies<'a>(
    headers: &'a HeaderMap,
    name: &'a str,
) -> impl Iterator<Item = Cow<'a, str>> + 'a {
    headers
        .get_all(COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b';'))
        .filter_map(|pair| {
            let eq = pair.iter().position(|b| *b == b'=')?;
            let (k, v) = (&pair[..eq], &pair[eq + 1..]);
            same_name(&cookie_text(k.trim_ascii()), name).then_some(v.trim_ascii())
        })
        .map(|v| {
            let v = v
                .strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(v);
            trim_spaces(cookie_text(v))
        })
}

/// The first 16 hex digits of the SHA-1 of the key as written (`Display`):
/// `printf %s KEY | sha1sum | cut -c1-16`. An address is hashed as its text, with no
/// string made for it.
pub struct KeyHash<T>(pub T);

impl<T: std::fmt::Display> std::fmt::Display for KeyHash<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        /// Feeds what is formatted into the hash.
        struct Sha1Writer(sha1_smol::Sha1);
        impl std::fmt::Write for Sha1Writer {
            fn write_str(&mut self, s: &str) -> std::fmt::Result {
                self.0.update(s.as_bytes());
                Ok(())
            }
        }
        let mut h = Sha1Writer(sha1_smol::Sha1::new());
        std::fmt::Write::write_fmt(&mut h, format_args!("{}", self.0))?;
        let digest = h.0.digest().bytes();
        for b in &digest[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    /// A key header's text: trimmed of spaces and tabs, and what `from_utf8_lossy`
    /// makes of the rest, for every byte a value may hold in the middle, UTF-8
    /// sequences whole and cut, and spaces around.
    #[test]
    fn header_text_is_the_lossy_text_of_the_trimmed_value() {
        let mut values: Vec<Vec<u8>> = (0..=255u8)
            .filter(|b| HeaderValue::from_bytes(&[b'a', *b, b'z']).is_ok())
            .map(|b| vec![b'a', b, b'z'])
            .collect();
        for v in ["ключ", "k\u{1F600}y", " \tpadded \t", "", "  "] {
            values.push(v.as_bytes().to_vec());
        }
        values.push(b"cut \xd0".to_vec());
        values.push(b"\xe2\x82 x".to_vec());
        for v in values {
            let value = HeaderValue::from_bytes(&v).unwrap();
            let ows = |c: &u8| *c == b' ' || *c == b'\t';
            let start = v.iter().position(|c| !ows(c)).unwrap_or(v.len());
            let end = v.iter().rposition(|c| !ows(c)).map_or(start, |i| i + 1);
            let trimmed = &v[start..end];
            assert_eq!(
                header_text(&value),
                String::from_utf8_lossy(trimmed),
                "{v:?}"
            );
        }
    }

    fn trusted() -> TrustedProxies {
        TrustedProxies::new(vec![
            "10.0.0.0/8".parse().unwrap(),
            "192.168.1.1/32".parse().unwrap(),
        ])
    }

    fn xff(v: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in v {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_cannot_choose_its_address() {
        let t = trusted();
        assert_eq!(
            t.client_ip(ip("203.0.113.9"), &xff(&["1.1.1.1"])),
            ip("203.0.113.9")
        );
        assert_eq!(
            TrustedProxies::default().client_ip(ip("10.0.0.1"), &xff(&["1.1.1.1"])),
            ip("10.0.0.1")
        );
    }

    #[test]
    fn trusted_peer_rightmost_untrusted_hop() {
        let t = trusted();
        // The client spoofs 6.6.6.6 on the left; the first untrusted from the right wins.
        let h = xff(&["6.6.6.6, 203.0.113.7", "10.1.1.1"]);
        assert_eq!(t.client_ip(ip("10.0.0.2"), &h), ip("203.0.113.7"));
        // All hops trusted: the left-most.
        assert_eq!(
            t.client_ip(ip("10.0.0.2"), &xff(&["10.9.9.9, 192.168.1.1"])),
            ip("10.9.9.9")
        );
        // No header: the peer.
        assert_eq!(
            t.client_ip(ip("10.0.0.2"), &HeaderMap::new()),
            ip("10.0.0.2")
        );
        // Garbage stops the walk at the last trusted hop.
        assert_eq!(
            t.client_ip(ip("10.0.0.2"), &xff(&["1.1.1.1, nonsense, 10.3.3.3"])),
            ip("10.3.3.3")
        );
        // Ports and brackets.
        assert_eq!(
            t.client_ip(ip("10.0.0.2"), &xff(&["[2001:db8::1]:443"])),
            ip("2001:db8::1")
        );
        assert_eq!(
            t.client_ip(ip("10.0.0.2"), &xff(&["203.0.113.1:8080"])),
            ip("203.0.113.1")
        );
        // Mapped peers are IPv4.
        assert_eq!(
            t.client_ip(ip("::ffff:10.0.0.2"), &xff(&["203.0.113.1"])),
            ip("203.0.113.1")
        );
    }

    #[test]
    fn forwarded_is_not_read() {
        let mut h = HeaderMap::new();
        h.insert("forwarded", "for=198.51.100.17".parse().unwrap());
        assert_eq!(trusted().client_ip(ip("10.0.0.2"), &h), ip("10.0.0.2"));
        assert!(trusted().contains(ip("::ffff:10.1.2.3")));
    }

    fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn spec(parts: &[&str]) -> KeySpec {
        KeySpec::new(parts.iter().map(|p| KeyPart::parse(p).unwrap()).collect())
    }

    #[test]
    fn keys() {
        let p = parts(
            "/x?api_key=q%20k&other=1",
            &[("x-api-key", "abc"), ("cookie", "a=1; session=s3; b=2")],
        );
        let a = ip("1.2.3.4");
        assert_eq!(spec(&["ip"]).extract(&p, a).unwrap().value, "1.2.3.4");
        assert_eq!(
            spec(&["header:x-api-key"]).extract(&p, a).unwrap().value,
            "abc"
        );
        assert_eq!(
            spec(&["query:api_key"]).extract(&p, a).unwrap().value,
            "q k"
        );
        assert_eq!(
            spec(&["cookie:session"]).extract(&p, a).unwrap().value,
            "s3"
        );
        assert_eq!(spec(&["global"]).extract(&p, a).unwrap().value, "global");
        assert_eq!(
            spec(&["header:x-api-key", "ip"])
                .extract(&p, a)
                .unwrap()
                .value,
            "abc|1.2.3.4"
        );
        let missing = spec(&["ip", "header:x-tenant"]);
        assert_eq!(
            missing.extract(&p, a).unwrap_err().part().describe(),
            "header x-tenant"
        );
        assert_eq!(
            spec(&["cookie:nope"])
                .extract(&p, a)
                .unwrap_err()
                .part()
                .describe(),
            "cookie nope"
        );
        // Separators are escaped: these two must not share a key.
        let p1 = parts("/", &[("a", "x|y"), ("b", "z")]);
        let p2 = parts("/", &[("a", "x"), ("b", "y|z")]);
        let s = spec(&["header:a", "header:b"]);
        assert_ne!(s.extract(&p1, a).unwrap(), s.extract(&p2, a).unwrap());
        assert!(KeyPart::parse("header:").is_none());
        assert!(KeyPart::parse("bogus").is_none());
    }

    #[test]
    fn padded_headers_and_lenient_cookies() {
        let p = parts(
            "/",
            &[
                ("x-api-key", " k1\t"),
                ("cookie", "theme=caf\u{e9}; session =k2"),
                ("cookie", "a=\"q\""),
            ],
        );
        let a = ip("1.2.3.4");
        assert_eq!(
            spec(&["header:x-api-key"]).extract(&p, a).unwrap().value,
            "k1"
        );
        assert_eq!(
            spec(&["cookie:session"]).extract(&p, a).unwrap().value,
            "k2"
        );
        assert_eq!(spec(&["cookie:a"]).extract(&p, a).unwrap().value, "q");
        assert!(spec(&["cookie:session"]).any_value(&p, ip("1.2.3.4"), |v| v == "k2"));
        assert!(spec(&["header:x-api-key"]).any_value(&p, ip("1.2.3.4"), |v| v == "k1"));
    }

    #[test]
    fn one_key_however_it_is_spelled() {
        let a = ip("1.2.3.4");
        let key = |spec_: &[&str], uri: &str, headers: &[(&str, &str)]| {
            spec(spec_)
                .extract(&parts(uri, headers), a)
                .map(|k| k.value.into_owned())
                .map_err(|p| p.part().describe())
        };
        // Cookie values are read with their escapes decoded, as PHP and Express do.
        for cookie in [
            "sid=victim",
            "sid=%76ictim",
            "sid=v%69ctim",
            "sid=\"%76ictim\"",
        ] {
            assert_eq!(
                key(&["cookie:sid"], "/", &[("cookie", cookie)]),
                Ok("victim".into()),
                "{cookie}"
            );
        }
        assert_eq!(
            key(&["cookie:sid"], "/", &[("cookie", "sid=a%zz%4")]),
            Ok("a%zz%4".into())
        );
        // Queries are split on ';' as well as '&', as Rack 2 and older Go and Python do.
        assert_eq!(key(&["query:k"], "/?k=victim;1", &[]), Ok("victim".into()));
        assert_eq!(key(&["query:k"], "/?x=1;k=v&y=2", &[]), Ok("v".into()));
        assert_eq!(
            key(&["query:k"], "/?k=a;k=b", &[]),
            Err("query parameter k".into()),
            "sent twice"
        );
        // The deny list sees the decoded values, and each element of a comma list.
        let seen = |spec_: &[&str], uri: &str, headers: &[(&str, &str)]| {
            let mut v = Vec::new();
            spec(spec_).any_value(&parts(uri, headers), ip("1.2.3.4"), |x| {
                v.push(x.to_string());
                false
            });
            v
        };
        assert_eq!(
            seen(&["cookie:sid"], "/", &[("cookie", "sid=%62ad")]),
            ["bad"]
        );
        assert_eq!(seen(&["query:k"], "/?k=bad;x", &[]), ["bad"]);
        assert_eq!(
            seen(&["header:x-api-key"], "/", &[("x-api-key", "bad, good")]),
            ["bad, good", "bad", "good"]
        );
    }

    /// PHP's reading of parameter and cookie names: `.`, ` ` and `[` are `_`, and
    /// leading spaces are dropped; nothing else is folded.
    #[test]
    fn names_as_php_reads_them() {
        for sent in ["api_key", "api.key", "api key", "api[key", " api.key"] {
            assert!(same_name(sent, "api_key"), "{sent}");
            assert!(same_name("api_key", sent), "{sent}");
        }
        // PHP arrays: `api_key[]=bad` is `['bad']`, which loose comparisons take
        // for `'bad'`.
        for sent in ["api_key[]", "api_key[0]", "api.key[x]", "api_key[a][b]"] {
            assert!(same_name(sent, "api_key"), "{sent}");
        }
        for sent in ["api-key", "apikey", "api[key]", "API_KEY", "api_key_"] {
            assert!(!same_name(sent, "api_key"), "{sent}");
        }
        let a = ip("1.2.3.4");
        let p = parts("/", &[("cookie", "s.id=v")]);
        assert_eq!(spec(&["cookie:s_id"]).extract(&p, a).unwrap().value, "v");
        // Cookie names and values are url-decoded as PHP reads them (`+` a space),
        // and values trimmed of spaces, as Laravel's TrimStrings reads parameters.
        let key = |h: &str| {
            let p = parts("/", &[("cookie", h)]);
            let spec = spec(&["cookie:sid"]);
            let key = spec.extract(&p, a).map(|k| k.value.to_string());
            key.map_err(|_| ())
        };
        assert_eq!(key("%73id=bad"), Ok("bad".into()));
        assert!(key("%73id=bad; sid=fresh").is_err(), "sent twice");
        assert_eq!(key("sid=a+b"), Ok("a b".into()));
        assert_eq!(key("sid=a%20b"), Ok("a b".into()));
        assert_eq!(key("sid=%20bad%20"), Ok("bad".into()));
        let p = parts("/?api_key=bad%20&x=1", &[]);
        assert_eq!(
            spec(&["query:api_key"]).extract(&p, a).unwrap().value,
            "bad"
        );
        let p = parts("/?api_key[]=bad", &[]);
        assert_eq!(
            spec(&["query:api_key"]).extract(&p, a).unwrap().value,
            "bad"
        );
    }

    /// PHP reads a field name up to a NUL byte: `username%00` is `username`, so a
    /// second copy of the key (a repeat: missing), and the deny list sees it.
    #[test]
    fn names_end_at_a_nul_byte() {
        for sent in ["api_key\0", "api_key\0x", "api.key\0[", " api_key\0\0"] {
            assert!(same_name(sent, "api_key"), "{sent:?}");
        }
        assert!(!same_name("api\0_key", "api_key"));
        let u = ["form:username"];
        for body in [
            "username=fresh1&username%00=victim",
            "username%00=victim&username=fresh1",
            "username=fresh1&username%00x=victim",
        ] {
            assert_eq!(
                body_key(&u, FORM, body),
                Err("form field username".into()),
                "{body}"
            );
            assert!(
                body_seen(&u, FORM, body).contains(&"victim".to_string()),
                "{body}"
            );
        }
        assert_eq!(
            body_key(&u, FORM, "username%00=victim"),
            Ok("victim".into())
        );
        let a = ip("1.2.3.4");
        let p = parts("/?api_key=fresh&api_key%00=victim", &[]);
        let q = spec(&["query:api_key"]);
        assert!(q.extract(&p, a).is_err(), "a repeat");
        assert!(q.any_value(&p, a, |v| v == "victim"));
        let p = parts("/", &[("cookie", "sid=fresh; sid%00=victim")]);
        assert!(spec(&["cookie:sid"]).extract(&p, a).is_err(), "a repeat");
    }

    /// Go's `encoding/json` and ASP.NET match member names ignoring case: a member
    /// whose name folds to the pointer's token is a copy of it.
    #[test]
    fn json_members_as_case_blind_upstreams_read_them() {
        let u = ["json:/user"];
        for body in [
            r#"{"user":"fresh","USER":"victim"}"#,
            r#"{"USER":"victim","user":"fresh"}"#,
            r#"{"user":"f9","u\u017fer":"victim"}"#,
            r#"{"user":"f9","uſer":"victim"}"#,
            r#"{"User":"a","uSER":"victim"}"#,
        ] {
            assert_eq!(
                body_key(&u, JSON, body),
                Err("JSON value /user".into()),
                "{body}"
            );
            assert!(
                body_seen(&u, JSON, body).contains(&"victim".to_string()),
                "{body}"
            );
        }
        // One copy, however it is spelled, is the key.
        assert_eq!(
            body_key(&u, JSON, r#"{"USER":"victim"}"#),
            Ok("victim".into())
        );
        assert_eq!(
            body_key(&u, JSON, r#"{"uſer":"victim"}"#),
            Ok("victim".into())
        );
        // On the way too.
        let n = ["json:/user/name"];
        assert_eq!(
            body_key(&n, JSON, r#"{"user":{"name":"a"},"USER":{"NAME":"b"}}"#),
            Err("JSON value /user/name".into())
        );
        assert_eq!(
            body_key(&n, JSON, r#"{"User":{"Name":"b"}}"#),
            Ok("b".into())
        );
        // Other names stay other members.
        assert_eq!(
            body_key(&u, JSON, r#"{"user":"a","users":"b","ｕｓｅｒ":"c"}"#),
            Ok("a".into())
        );
    }

    /// Body keys are text of any script, in NFC; a JSON body may start with a byte
    /// order mark.
    #[test]
    fn international_body_keys() {
        let u = ["json:/username"];
        assert_eq!(
            body_key(&u, JSON, r#"{"username":"José"}"#),
            Ok("José".into())
        );
        assert_eq!(
            body_key(&u, JSON, r#"{"username":"Jose\u0301"}"#),
            Ok("José".into()),
            "decomposed is composed"
        );
        assert_eq!(
            body_key(&u, JSON, r#"{"username":"李小龍"}"#),
            Ok("李小龍".into())
        );
        for bad in [
            r#""car\u200bl""#,
            r#""\u202elrac""#,
            r#""carl\ue000""#,
            r#""carl\u0000""#,
        ] {
            assert_eq!(
                body_key(&u, JSON, &format!(r#"{{"username":{bad}}}"#)),
                Err("unprintable JSON value /username".into()),
                "{bad}"
            );
        }
        let f = ["form:username"];
        assert_eq!(body_key(&f, FORM, "username=Jos%C3%A9"), Ok("José".into()));
        assert_eq!(body_key(&f, FORM, "username=Jose%CC%81"), Ok("José".into()));
        assert_eq!(
            body_key(&f, FORM, "username=%FF"),
            Err("unprintable form field username".into())
        );
        // A byte order mark before the document.
        assert_eq!(
            body_key(&u, JSON, "\u{FEFF}{\"username\":\"carl\"}"),
            Ok("carl".into())
        );
        assert_eq!(
            body_key(&u, JSON, "\u{FEFF}\u{FEFF}{\"username\":\"carl\"}"),
            Err("JSON value /username".into())
        );
        // Header keys keep printable ASCII.
        let p = parts("/", &[("x-user", "José")]);
        assert!(matches!(
            spec(&["header:x-user"]).extract(&p, ip("1.2.3.4")),
            Err(NoKey::Unprintable(_))
        ));
    }

    /// `form:` keys from `multipart/form-data`: a part of that name with no file
    /// name; two, a file, or a part only a lenient reader finds make it missing, and
    /// the deny list sees every one.
    #[test]
    fn multipart_form_keys() {
        let ct = "multipart/form-data; boundary=b0undary";
        let f = ["form:user"];
        let part = |name: &str, v: &str| {
            format!("--b0undary\r\nContent-Disposition: form-data; {name}\r\n\r\n{v}\r\n")
        };
        let body = |parts: &[String]| format!("{}--b0undary--\r\n", parts.concat());
        let one = body(&[part("name=\"pass\"", "x"), part("name=\"user\"", "victim")]);
        assert_eq!(body_key(&f, ct, &one), Ok("victim".into()));
        assert_eq!(body_seen(&f, ct, &one), ["victim"]);
        let two = body(&[
            part("name=\"user\"", "fresh"),
            part("name=\"user\x00\"", "victim"),
        ]);
        assert_eq!(body_key(&f, ct, &two), Err("form field user".into()));
        assert!(body_seen(&f, ct, &two).contains(&"victim".to_string()));
        let file = body(&[part("name=\"user\"; filename=\"a\"", "victim")]);
        assert_eq!(body_key(&f, ct, &file), Err("form field user".into()));
        assert!(body_seen(&f, ct, &file).contains(&"victim".to_string()));
        // A part framed with bare LFs, which Go and PHP read and the strict reading
        // does not.
        let lf = format!(
            "{}--b0undary\nContent-Disposition: form-data; name=user\n\nvictim\n--b0undary--\r\n",
            part("name=\"user\"", "fresh")
        );
        assert_eq!(body_key(&f, ct, &lf), Err("form field user".into()));
        assert!(body_seen(&f, ct, &lf).contains(&"victim".to_string()));
        // Names as PHP reads them; values trimmed and in NFC.
        let php = body(&[part("name=\"user[]\"", " Jose\u{301} ")]);
        assert_eq!(body_key(&f, ct, &php), Ok("José".into()));
        // A body read only under its type.
        assert!(spec(&f).body_wanted(&parts("/", &[("content-type", ct)]).headers));
        assert_eq!(
            body_key(&f, "multipart/form-data", &one),
            Err("form field user".into()),
            "no boundary"
        );
    }

    /// Go's `FormValue` reads a query parameter before the body's field: on a
    /// `form:` key, one in the query is a copy (the key is missing) and the deny
    /// list sees it, body or none.
    #[test]
    fn a_form_key_in_the_query_is_a_copy() {
        let f = ["form:user"];
        let with = |uri: &str, body: Option<&[u8]>| {
            let p = parts(uri, &[("content-type", FORM)]);
            let s = spec(&f);
            let key = s
                .extract_with_body(&p, ip("1.2.3.4"), body)
                .ok()
                .map(|k| k.value.into_owned());
            let mut seen = Vec::new();
            s.any_value_with_body(&p, ip("1.2.3.4"), body, |v| {
                seen.push(v.to_string());
                false
            });
            (key, seen)
        };
        assert_eq!(
            with("/", Some(b"user=carl")),
            (Some("carl".into()), vec!["carl".into()])
        );
        assert_eq!(
            with("/?user=victim", Some(b"user=carl")),
            (None, vec!["victim".into(), "carl".into()])
        );
        assert_eq!(
            with("/?user%00=victim", None),
            (None, vec!["victim".into()])
        );
        assert_eq!(with("/?other=x", Some(b"user=carl")).0, Some("carl".into()));
    }

    /// The deny list reads a JSON body as lenient parsers do: UTF-16 and UTF-32
    /// (Python), `NaN` (Python), a stray byte elsewhere (Go), never a key.
    #[test]
    fn the_deny_list_reads_json_as_lenient_parsers_do() {
        let u = ["json:/user"];
        let seen = |body: &[u8]| {
            let p = parts("/", &[("content-type", JSON)]);
            let mut v = Vec::new();
            spec(&u).any_value_with_body(&p, ip("1.2.3.4"), Some(body), |x| {
                v.push(x.to_string());
                false
            });
            let key = spec(&u)
                .extract_with_body(&p, ip("1.2.3.4"), Some(body))
                .is_ok();
            (v, key)
        };
        let json = r#"{"user": "victim-denied"}"#;
        let utf16le: Vec<u8> = json.encode_utf16().flat_map(u16::to_le_bytes).collect();
        let utf16be_bom: Vec<u8> = "\u{FEFF}{\"USER\":\"victim-denied\"}"
            .encode_utf16()
            .flat_map(u16::to_be_bytes)
            .collect();
        let utf32le: Vec<u8> = json
            .chars()
            .flat_map(|c| (c as u32).to_le_bytes())
            .collect();
        for (what, body) in [
            ("UTF-16LE", utf16le),
            ("UTF-16BE with a BOM", utf16be_bom),
            ("UTF-32LE", utf32le),
            ("NaN", br#"{"user":"victim-denied","x":NaN}"#.to_vec()),
            (
                "a stray byte",
                b"{\"x\":\"\xff\",\"user\":\"victim-denied\"}".to_vec(),
            ),
            ("cut short", br#"{"user": "victim-denied", "x": ["#.to_vec()),
        ] {
            let (v, key) = seen(&body);
            assert!(v.contains(&"victim-denied".to_string()), "{what}: {v:?}");
            assert!(!key, "{what}: no key");
        }
        // Numbers in one spelling; other names and arrays are not the member.
        assert_eq!(seen(br#"{"user": 1.0, "x": NaN}"#).0, ["1"]);
        assert_eq!(
            seen(br#"{"users": "a", "user": ["b"], x}"#).0,
            Vec::<String>::new()
        );
    }

    /// More than `MAX_BOUNDARIES` boundaries are not all read: such a request has
    /// no key, and duplicates are read once.
    #[test]
    fn boundaries_are_read_once_and_bounded() {
        let mut h = HeaderMap::new();
        for _ in 0..90 {
            h.append(
                CONTENT_TYPE,
                HeaderValue::from_static("multipart/form-data; boundary=a"),
            );
        }
        assert_eq!(multipart_boundaries(&h), [b"a".to_vec()]);
        for i in 0..9 {
            h.append(
                CONTENT_TYPE,
                HeaderValue::from_str(&format!("multipart/form-data; boundary=b{i}")).unwrap(),
            );
        }
        assert_eq!(multipart_boundaries(&h).len(), multipart::MAX_BOUNDARIES);
    }

    /// A key in its `normalize_key` form: the key counted and the values the deny
    /// list sees.
    #[test]
    fn normalized_keys() {
        let mut s = spec(&["json:/username"]);
        s.normalize = Normalize::Casefold;
        let key = |body: &str| {
            let p = parts("/", &[("content-type", JSON)]);
            s.extract_with_body(&p, ip("1.2.3.4"), Some(body.as_bytes()))
                .map(|k| k.value.into_owned())
                .ok()
        };
        for sent in ["carl", "Carl", "CARL", "cArl", "ｃａｒｌ", " CARL "] {
            assert_eq!(
                key(&format!(r#"{{"username":"{sent}"}}"#)),
                Some("carl".into())
            );
        }
        let p = parts("/", &[("content-type", JSON)]);
        let mut seen = Vec::new();
        s.any_value_with_body(&p, ip("1.2.3.4"), Some(br#"{"username":"CARL"}"#), |v| {
            if !seen.iter().any(|s| s == v) {
                seen.push(v.to_string());
            }
            false
        });
        // In the key's form, and as sent (for entries kept hashed).
        assert_eq!(seen, ["carl", "CARL"]);
        // Composite keys: each part in its form.
        let mut c = spec(&["header:x-tenant", "query:user"]);
        c.normalize = Normalize::Email;
        let p = parts("/?user=Carl%2Bnews@Example.com", &[("x-tenant", "ACME")]);
        let k = c.extract(&p, ip("1.2.3.4")).unwrap();
        assert_eq!(k.value, "acme|carl@example.com");
        assert_eq!(k.parts, ["acme", "carl@example.com"]);
        // The address is never folded.
        let mut a = spec(&["ip"]);
        a.normalize = Normalize::Casefold;
        let p = parts("/", &[]);
        let v6: IpAddr = "2001:DB8::1".parse().unwrap();
        assert_eq!(a.extract(&p, v6).unwrap().value, "2001:db8::1");
    }

    /// Which part holds a byte outside printable ASCII, any copy of it, as the
    /// upstream reads it (spaces and tabs around a header value are not in it).
    #[test]
    fn unprintable_key_values() {
        let which = |spec_: &[&str], uri: &str, headers: &[(&str, &str)]| {
            spec(spec_)
                .unprintable(&parts(uri, headers))
                .map(KeyPart::describe)
        };
        let h = ["header:x-api-key"];
        assert_eq!(which(&h, "/", &[("x-api-key", " \tk \t")]), None);
        assert_eq!(
            which(&h, "/", &[("x-api-key", "k\u{a0}")]),
            Some("header x-api-key".into())
        );
        assert_eq!(
            which(&h, "/", &[("x-api-key", "k"), ("x-api-key", "k\tk")]),
            Some("header x-api-key".into())
        );
        let q = ["ip", "query:k"];
        assert_eq!(which(&q, "/?k=a+b&x=%A0", &[]), None);
        assert_eq!(
            which(&q, "/?k.=1&k=%C2%A0", &[]),
            Some("query parameter k".into())
        );
        assert_eq!(which(&q, "/?k=%7F", &[]), Some("query parameter k".into()));
        let c = ["cookie:s"];
        assert_eq!(which(&c, "/", &[("cookie", "t=caf\u{e9}; s=v")]), None);
        assert_eq!(
            which(&c, "/", &[("cookie", "s=%00")]),
            Some("cookie s".into())
        );
    }

    /// A key read from `body`, sent with `content_type`: its value, or what is
    /// missing.
    fn body_key(spec_: &[&str], content_type: &str, body: &str) -> Result<String, String> {
        body_key_with(
            spec_,
            &[("content-type", content_type)],
            Some(body.as_bytes()),
        )
    }

    fn body_key_with(
        spec_: &[&str],
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<String, String> {
        let p = parts("/login", headers);
        let s = spec(spec_);
        let key = s.extract_with_body(&p, ip("1.2.3.4"), body);
        key.map(|k| k.value.into_owned()).map_err(|p| match p {
            NoKey::Missing(p) => p.describe(),
            NoKey::Unprintable(p) => format!("unprintable {}", p.describe()),
        })
    }

    /// Every value of the body parts the deny list sees.
    fn body_seen(spec_: &[&str], content_type: &str, body: &str) -> Vec<String> {
        let p = parts("/login", &[("content-type", content_type)]);
        let mut v = Vec::new();
        spec(spec_).any_value_with_body(&p, ip("1.2.3.4"), Some(body.as_bytes()), |x| {
            if !v.iter().any(|s| s == x) {
                v.push(x.to_string());
            }
            false
        });
        v
    }

    const FORM: &str = "application/x-www-form-urlencoded";
    const JSON: &str = "application/json";

    #[test]
    fn body_parts_parse_and_describe() {
        assert_eq!(
            KeyPart::parse("form:username"),
            Some(KeyPart::Form("username".into()))
        );
        assert_eq!(
            KeyPart::parse("json:/user/name"),
            Some(KeyPart::Json("/user/name".into()))
        );
        assert_eq!(KeyPart::parse("json:/"), Some(KeyPart::Json("/".into())));
        assert_eq!(
            KeyPart::parse("json:/a~0b/c~1d"),
            Some(KeyPart::Json("/a~0b/c~1d".into()))
        );
        for bad in [
            "form:",
            "json:",
            "json:user",
            "json:/a~2",
            "json:/a~",
            "json:~0",
        ] {
            assert_eq!(KeyPart::parse(bad), None, "{bad}");
        }
        assert_eq!(
            KeyPart::parse("form:username").unwrap().describe(),
            "form field username"
        );
        assert_eq!(
            KeyPart::parse("json:/user/name").unwrap().describe(),
            "JSON value /user/name"
        );
        assert!(spec(&["ip", "form:u"]).reads_body());
        assert!(spec(&["json:/u"]).reads_body());
        assert!(!spec(&["ip", "header:x", "query:u", "cookie:u", "global"]).reads_body());
    }

    #[test]
    fn form_fields_as_upstreams_read_them() {
        let u = ["form:username"];
        assert_eq!(
            body_key(&u, FORM, "username=alice&password=x"),
            Ok("alice".into())
        );
        // `+` is a space, escapes decoded, Unicode white space trimmed.
        assert_eq!(body_key(&u, FORM, "username=a+b%21"), Ok("a b!".into()));
        assert_eq!(
            body_key(&u, FORM, "username=%C2%A0%09alice+%0A"),
            Ok("alice".into())
        );
        // Names read as PHP reads them, and `;` splits as in a query.
        assert_eq!(
            body_key(&["form:user_name"], FORM, "user.name=bob"),
            Ok("bob".into())
        );
        assert_eq!(body_key(&u, FORM, "username[]=bob"), Ok("bob".into()));
        assert_eq!(body_key(&u, FORM, "username=bob;x=1"), Ok("bob".into()));
        // Parameters and case of the type do not matter.
        for ct in [
            "application/x-www-form-urlencoded; charset=UTF-8",
            "Application/X-WWW-Form-Urlencoded",
            " application/x-www-form-urlencoded ;charset=utf-8",
        ] {
            assert_eq!(body_key(&u, ct, "username=c"), Ok("c".into()), "{ct}");
        }
        let missing = Err("form field username".to_string());
        assert_eq!(
            body_key(&u, FORM, "username=a&username=b"),
            missing,
            "twice"
        );
        assert_eq!(
            body_key(&u, FORM, "username=a&username[]=b"),
            missing,
            "twice"
        );
        assert_eq!(body_key(&u, FORM, "username=+%20"), missing, "blank");
        assert_eq!(body_key(&u, FORM, "user=a"), missing, "absent");
        assert_eq!(body_key(&u, FORM, ""), missing, "empty body");
        assert_eq!(body_key(&u, "text/plain", "username=a"), missing);
        assert_eq!(body_key(&u, "multipart/form-data", "username=a"), missing);
        assert_eq!(body_key_with(&u, &[], Some(b"username=a")), missing);
        // Not read (larger than `max_key_body`).
        assert_eq!(body_key_with(&u, &[("content-type", FORM)], None), missing);
        // Two types: an upstream may read the body as either.
        let two = [("content-type", FORM), ("content-type", "text/plain")];
        assert_eq!(body_key_with(&u, &two, Some(b"username=a")), missing);
        // A composite key with a body part.
        assert_eq!(
            body_key(&["form:username", "ip"], FORM, "username=a%7Cb"),
            Ok("a\\|b|1.2.3.4".into())
        );
        assert_eq!(
            body_key(&["ip", "form:tenant", "form:username"], FORM, "username=a"),
            Err("form field tenant".into())
        );
    }

    #[test]
    fn json_values_as_upstreams_read_them() {
        let name = ["json:/user/name"];
        assert_eq!(
            body_key(
                &name,
                JSON,
                r#"{"user": {"name": " alice\u00a0"}, "x": [1, {}]}"#
            ),
            Ok("alice".into())
        );
        // Escapes in names are read as any parser reads them.
        assert_eq!(
            body_key(&name, JSON, r#"{"us\u0065r": {"name": "bob"}}"#),
            Ok("bob".into())
        );
        for ct in [
            "application/json; charset=utf-8",
            "APPLICATION/JSON",
            "application/vnd.api+json",
            "application/problem+JSON",
            "text/json",
            "application/json, text/plain",
        ] {
            assert_eq!(
                body_key(&name, ct, r#"{"user":{"name":"c"}}"#),
                Ok("c".into()),
                "{ct}"
            );
        }
        // Numbers: one spelling for every way of writing one; booleans as written.
        let id = ["json:/id"];
        for (body, key) in [
            (r#"{"id": 42}"#, "42"),
            (r#"{"id": "42"}"#, "42"),
            (r#"{"id": 42.0}"#, "42"),
            (r#"{"id": 4.2e1}"#, "42"),
            (r#"{"id": -0}"#, "0"),
            (r#"{"id": -7}"#, "-7"),
            (r#"{"id": 18446744073709551615}"#, "18446744073709551615"),
            (r#"{"id": 0.5}"#, "0.5"),
            (r#"{"id": true}"#, "true"),
        ] {
            assert_eq!(body_key(&id, JSON, body), Ok(key.into()), "{body}");
        }
        // Pointers: array indices, escaped names, the empty name.
        assert_eq!(
            body_key(&["json:/u/1"], JSON, r#"{"u": ["a", "b"]}"#),
            Ok("b".into())
        );
        assert_eq!(
            body_key(&["json:/a~1b/c~0d"], JSON, r#"{"a/b": {"c~d": "e"}}"#),
            Ok("e".into())
        );
        assert_eq!(body_key(&["json:/"], JSON, r#"{"": "e"}"#), Ok("e".into()));
        let missing = Err("JSON value /user/name".to_string());
        for body in [
            r#"{"user": {"name": null}}"#,
            r#"{"user": {"name": ["alice"]}}"#,
            r#"{"user": {"name": {"first": "a"}}}"#,
            r#"{"user": {"name": "  "}}"#,
            r#"{"user": "name"}"#,
            r#"{"user": {}}"#,
            r#"[{"user": {"name": "a"}}]"#,
            // Malformed, trailing bytes, a lone surrogate, not UTF-8 inside a string.
            r#"{"user": {"name": "a"}"#,
            r#"{"user": {"name": "a"}} x"#,
            r#"{"user": {"name": "\ud800"}}"#,
            "",
        ] {
            assert_eq!(body_key(&name, JSON, body), missing, "{body}");
        }
        let bad_utf8 = b"{\"user\": {\"name\": \"a\", \"x\": \"\xff\"}}";
        assert_eq!(
            body_key_with(&name, &[("content-type", JSON)], Some(bad_utf8)),
            missing
        );
        // Indices are digits without a leading zero.
        for p in ["json:/u/01", "json:/u/-", "json:/u/+1", "json:/u/x"] {
            assert_eq!(
                body_key(&[p], JSON, r#"{"u": ["a", "b"]}"#),
                Err(format!("JSON value {}", &p[5..])),
                "{p}"
            );
        }
        assert_eq!(body_key(&name, FORM, r#"{"user":{"name":"a"}}"#), missing);
        assert_eq!(
            body_key(&name, "application/jsonx", r#"{"user":{"name":"a"}}"#),
            missing
        );
    }

    /// serde_json keeps the last of two members of one name, other parsers (and
    /// upstreams) the first: a member sent twice on the pointer's way is missing,
    /// and the deny list sees both.
    #[test]
    fn a_json_member_sent_twice_is_missing_and_both_are_denied() {
        let u = ["json:/username"];
        let missing = Err("JSON value /username".to_string());
        let twice = r#"{"username": "victim", "username": "me"}"#;
        assert_eq!(body_key(&u, JSON, twice), missing);
        assert_eq!(body_seen(&u, JSON, twice), ["victim", "me"]);
        // On the way, not only at its end.
        let name = ["json:/user/name"];
        let twice = r#"{"user": {"name": "victim"}, "user": {"x": 1}}"#;
        assert_eq!(
            body_key(&name, JSON, twice),
            Err("JSON value /user/name".into())
        );
        assert_eq!(body_seen(&name, JSON, twice), ["victim"]);
        // A name sent twice off the way does not matter.
        assert_eq!(
            body_key(&name, JSON, r#"{"x": 1, "x": 2, "user": {"name": "a"}}"#),
            Ok("a".into())
        );
        // The items of an array at the pointer: `["bad"] == "bad"` in JavaScript.
        assert_eq!(
            body_seen(&u, JSON, r#"{"username": ["bad", 7, {"x": "no"}]}"#),
            ["bad", "7"]
        );
        assert_eq!(body_seen(&u, JSON, r#"{"username": 1.0}"#), ["1"]);
    }

    #[test]
    fn the_deny_list_sees_every_copy_of_a_body_part() {
        let u = ["form:username"];
        assert_eq!(
            body_seen(&u, FORM, "username=victim&username[0]=%20me&x=1"),
            ["victim", "me"]
        );
        // Under any `Content-Type` the request names.
        let p = parts(
            "/",
            &[("content-type", "text/plain"), ("content-type", FORM)],
        );
        assert!(
            spec(&u).any_value_with_body(&p, ip("1.2.3.4"), Some(b"username=bad"), |v| v == "bad")
        );
        // Not under another type, and not when the body was not read.
        assert_eq!(
            body_seen(&u, "text/plain", "username=bad"),
            Vec::<String>::new()
        );
        let p = parts("/", &[("content-type", FORM)]);
        assert!(!spec(&u).any_value_with_body(&p, ip("1.2.3.4"), None, |_| true));
        assert!(!spec(&u).any_value(&p, ip("1.2.3.4"), |_| true));
        // Next to other parts.
        let p = parts("/?k=q", &[("content-type", JSON)]);
        let mut seen = Vec::new();
        spec(&["query:k", "json:/u"]).any_value_with_body(
            &p,
            ip("1.2.3.4"),
            Some(br#"{"u": "b"}"#),
            |v| {
                if !seen.iter().any(|s| s == v) {
                    seen.push(v.to_string());
                }
                false
            },
        );
        assert_eq!(seen, ["q", "b"]);
    }

    #[test]
    fn body_wanted_only_for_a_type_a_part_reads() {
        let wanted = |spec_: &[&str], types: &[&str]| {
            let h: Vec<_> = types.iter().map(|t| ("content-type", *t)).collect();
            spec(spec_).body_wanted(&parts("/", &h).headers)
        };
        assert!(wanted(&["form:u"], &[FORM]));
        assert!(wanted(&["ip", "json:/u"], &["application/ld+json"]));
        assert!(wanted(&["form:u", "json:/u"], &[JSON]));
        assert!(wanted(&["form:u"], &["text/plain", FORM]));
        assert!(!wanted(&["form:u"], &[JSON]));
        assert!(!wanted(&["form:u"], &[]));
        assert!(!wanted(&["json:/u"], &["multipart/form-data; boundary=x"]));
        assert!(!wanted(&["header:x", "query:u"], &[FORM]));
    }

    /// Body values with a control, format, private-use or unassigned character (or
    /// bytes that are not UTF-8), any copy, after trimming; text of any script is a
    /// key.
    #[test]
    fn unprintable_body_values() {
        let which = |spec_: &[&str], ct: &str, body: &[u8]| {
            spec(spec_)
                .unprintable_with_body(&parts("/", &[("content-type", ct)]), Some(body))
                .map(KeyPart::describe)
        };
        let f = ["ip", "form:u"];
        assert_eq!(which(&f, FORM, b"u=%C2%A0k%09&x=%00"), None);
        assert_eq!(which(&f, FORM, b"u=k%C2%A0k"), None);
        assert_eq!(which(&f, FORM, b"u=caf%C3%A9"), None);
        assert_eq!(which(&f, FORM, b"u=k&u=k%00"), Some("form field u".into()));
        assert_eq!(
            which(&f, FORM, b"u=k%E2%80%8Bk"),
            Some("form field u".into())
        );
        assert_eq!(which(&f, FORM, b"u=%EE%80%80"), Some("form field u".into()));
        // Bytes that are not UTF-8 are replaced, so refused.
        assert_eq!(which(&f, FORM, b"u=%FF"), Some("form field u".into()));
        let j = ["json:/u"];
        assert_eq!(which(&j, JSON, br#"{"u": " k\n", "x": "\u0000"}"#), None);
        assert_eq!(
            which(&j, JSON, br#"{"u": "k", "u": "k\u200b"}"#),
            Some("JSON value /u".into())
        );
        assert_eq!(
            which(&j, JSON, br#"{"u": ["k\u0007"]}"#),
            Some("JSON value /u".into())
        );
        assert_eq!(which(&j, FORM, br#"{"u": "k\u0007"}"#), None);
    }

    #[test]
    fn mapped_blocks_are_ipv4() {
        let n = |s: &str| canonical_net(s.parse().unwrap()).to_string();
        assert_eq!(n("::ffff:10.9.0.0/112"), "10.9.0.0/16");
        assert_eq!(n("::ffff:1.2.3.4/128"), "1.2.3.4/32");
        assert_eq!(n("2001:db8::1/32"), "2001:db8::/32");
        assert!(
            TrustedProxies::new(vec!["::ffff:10.0.0.0/104".parse().unwrap()])
                .contains(ip("10.1.2.3"))
        );
    }

    #[test]
    fn every_value_of_every_part() {
        let p = parts(
            "/x?k=a&k=b",
            &[
                ("x-api-key", "one"),
                ("x-api-key", "two"),
                ("cookie", "s=c1; s=c2"),
            ],
        );
        let seen = |spec: &KeySpec| {
            let mut v = Vec::new();
            spec.any_value(&p, ip("1.2.3.4"), |x| {
                v.push(x.to_string());
                false
            });
            v
        };
        assert_eq!(seen(&spec(&["header:x-api-key"])), ["one", "two"]);
        assert_eq!(seen(&spec(&["query:k"])), ["a", "b"]);
        // The address too: a key entry denies what `/admin/top` shows of an ip key.
        assert_eq!(seen(&spec(&["cookie:s", "ip"])), ["c1", "c2", "1.2.3.4"]);
        assert_eq!(seen(&spec(&["global"])), ["global"]);
        assert!(spec(&["header:x-api-key"]).any_value(&p, ip("1.2.3.4"), |x| x == "two"));
        assert!(spec(&["ip"]).is_ip());
        assert!(!spec(&["ip", "global"]).is_ip());
    }

    #[test]
    fn stored_keys() {
        assert_eq!(ClientKey::new("abc").stored(), "abc");
        let long = ClientKey::new("k".repeat(300));
        let s = long.stored();
        assert_eq!(s.len(), 41);
        assert!(s.starts_with('#'));
        assert_eq!(s, ClientKey::new("k".repeat(300)).stored());
        assert!(ClientKey::new("a{b}").stored().starts_with('#'));
        assert_ne!(ClientKey::new("#x").stored(), "#x");
        let digest = format!("#{}", sha1_smol::Sha1::from("k".repeat(300)).digest());
        assert_eq!(s, digest.as_str());
    }
}
