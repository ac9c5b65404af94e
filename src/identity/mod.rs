//! Who is asking: the client's IP (the TCP peer, or what a trusted proxy in front of
//! us says it saw) and the client key a route's limits are counted against.

use std::borrow::Cow;
use std::net::IpAddr;

use http::header::{HeaderMap, HeaderName, HeaderValue, COOKIE};
use http::request::Parts;
use ipnet::IpNet;

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
}

impl KeyPart {
    /// `ip`, `global`, `header:NAME`, `query:NAME`, `cookie:NAME`.
    pub fn parse(s: &str) -> Option<KeyPart> {
        match s.split_once(':') {
            None if s == "ip" => Some(KeyPart::Ip),
            None if s == "global" => Some(KeyPart::Global),
            Some(("header", n)) if !n.is_empty() => HeaderName::from_bytes(n.as_bytes())
                .ok()
                .map(KeyPart::Header),
            Some(("query", n)) if !n.is_empty() => Some(KeyPart::Query(n.to_string())),
            Some(("cookie", n)) if !n.is_empty() => Some(KeyPart::Cookie(n.to_string())),
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
        }
    }
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

/// How a route finds the key of a request: one part, or several joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec {
    pub parts: Vec<KeyPart>,
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
    /// The request's key, or the part that is missing.
    pub fn extract<'a>(&'a self, req: &'a Parts, ip: IpAddr) -> Result<ClientKey<'a>, &'a KeyPart> {
        if let [one] = self.parts.as_slice() {
            return part_value(one, req, ip).map(ClientKey::new).ok_or(one);
        }
        let mut key = String::new();
        let mut parts = Vec::with_capacity(self.parts.len());
        for (i, part) in self.parts.iter().enumerate() {
            let v = part_value(part, req, ip).ok_or(part)?;
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

    /// Whether the key is the client IP alone.
    pub fn is_ip(&self) -> bool {
        self.parts == [KeyPart::Ip]
    }

    /// Whether `f` holds for any value of any part as sent, every copy of a repeated
    /// header, parameter or cookie included: the deny list must catch a denied key
    /// however it is sent, even where `extract` calls it missing.
    pub fn any_value(&self, req: &Parts, mut f: impl FnMut(&str) -> bool) -> bool {
        self.parts.iter().any(|part| match part {
            // The address is checked against the deny list's IP entries already.
            KeyPart::Ip | KeyPart::Global => false,
            // A comma list is the same as several header lines (RFC 9110 §5.3), which
            // an upstream may read either way: each element is checked as well.
            KeyPart::Header(h) => req.headers.get_all(h).iter().any(|v| {
                let text = header_text(v);
                f(&text) || (text.contains(',') && text.split(',').any(|e| f(e.trim())))
            }),
            KeyPart::Query(name) => req
                .uri
                .query()
                .is_some_and(|q| query_pairs(q).any(|(k, v)| same_name(&k, name) && f(&v))),
            KeyPart::Cookie(name) => cookies(&req.headers, name).any(|v| f(&v)),
        })
    }

    /// The first part with a value, any copy of it, holding a byte outside
    /// printable ASCII (0x20-0x7E), as the upstream would read it (a header
    /// without the spaces and tabs around it, a parameter or cookie decoded):
    /// Node trims an NBSP off a header, PHP and others trim Unicode white space, so
    /// `k` followed by one would be `k` to the upstream, yet another key here.
    pub fn unprintable(&self, req: &Parts) -> Option<&KeyPart> {
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
        })
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
/// which drops leading spaces from a name, reads `.`, ` ` and a `[` that no `]`
/// follows as `_` (`api.key` is `api_key`, and the last value wins), and reads
/// `api_key[]` or `api_key[0]` as the array `api_key` (whose `['bad']` equals
/// `'bad'` to loose comparisons): a key must not be one parameter here and
/// another to the upstream.
fn same_name(sent: &str, name: &str) -> bool {
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
fn part_value<'a>(part: &'a KeyPart, req: &'a Parts, ip: IpAddr) -> Option<Cow<'a, str>> {
    let v: Cow<'a, str> = match part {
        KeyPart::Ip => Cow::Owned(ip.to_string()),
        KeyPart::Global => Cow::Borrowed("global"),
        KeyPart::Header(h) => header_text(single(req.headers.get_all(h).iter())?),
        KeyPart::Query(name) => single(
            query_pairs(req.uri.query()?)
                .filter(|(k, _)| same_name(k, name))
                .map(|(_, v)| v),
        )?,
        KeyPart::Cookie(name) => single(cookies(&req.headers, name))?,
    };
    if v.is_empty() {
        None
    } else {
        Some(v)
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
fn cookies<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = Cow<'a, str>> + 'a {
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
        KeySpec {
            parts: parts.iter().map(|p| KeyPart::parse(p).unwrap()).collect(),
        }
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
            missing.extract(&p, a).unwrap_err().describe(),
            "header x-tenant"
        );
        assert_eq!(
            spec(&["cookie:nope"])
                .extract(&p, a)
                .unwrap_err()
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
        assert!(spec(&["cookie:session"]).any_value(&p, |v| v == "k2"));
        assert!(spec(&["header:x-api-key"]).any_value(&p, |v| v == "k1"));
    }

    #[test]
    fn one_key_however_it_is_spelled() {
        let a = ip("1.2.3.4");
        let key = |spec_: &[&str], uri: &str, headers: &[(&str, &str)]| {
            spec(spec_)
                .extract(&parts(uri, headers), a)
                .map(|k| k.value.into_owned())
                .map_err(|p| p.describe())
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
            spec(spec_).any_value(&parts(uri, headers), |x| {
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
            spec.any_value(&p, |x| {
                v.push(x.to_string());
                false
            });
            v
        };
        assert_eq!(seen(&spec(&["header:x-api-key"])), ["one", "two"]);
        assert_eq!(seen(&spec(&["query:k"])), ["a", "b"]);
        assert_eq!(seen(&spec(&["cookie:s", "ip"])), ["c1", "c2"]);
        assert!(spec(&["header:x-api-key"]).any_value(&p, |x| x == "two"));
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
