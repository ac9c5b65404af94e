//! `multipart/form-data` bodies (RFC 7578), read for a `form:` key: the parts
//! between `--BOUNDARY` lines, each with its head (`Content-Disposition:
//! form-data; name="user"`) and its content.
//!
//! Two readings. The strict one (`strict`: RFC 2046's framing, CRLF line ends, one
//! `boundary` parameter, nothing after the closing delimiter) gives the key. The
//! wide one (`every_field`) finds every part any upstream may read: PHP and Go end
//! a head at any empty line, fold continued header lines, take single-quoted and
//! white-space-cut names, join RFC 2231 `name*0`/`name*1` pieces, read parts after
//! the closing delimiter or without one, and PHP takes the first `boundary`
//! substring of the `Content-Type`. The deny list looks at every field the wide
//! reading finds, and the key is read only when both readings find the same
//! fields, so a body framed for one upstream's reader never hides a value from
//! sluice or buys it a second key.

use std::borrow::Cow;

use memchr::memmem;

/// A part whose name is the field's: its content as text (bytes that are not UTF-8
/// replaced, so refused as a key), and whether the key can be read from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field<'a> {
    pub value: Cow<'a, str>,
    /// A plain field: no file name (an empty one is none: Go reads such a part as
    /// a field), and no transfer encoding upstreams read differently.
    pub plain: bool,
}

/// At most this many boundaries of one request are read (every `Content-Type`
/// field, each `boundary` in it): a request naming more has no key, and only the
/// first ones are looked at by the deny list.
pub const MAX_BOUNDARIES: usize = 4;

/// The boundary of a `multipart/form-data` `Content-Type` value as RFC 2046 reads
/// it: its one `boundary` parameter (any case, quoted or not); None when there is
/// none, more than one, or it is empty or longer than 70.
pub fn boundary(content_type: &[u8]) -> Option<&[u8]> {
    let mut found = params(content_type).filter(|(k, _)| k.eq_ignore_ascii_case(b"boundary"));
    let (_, value) = found.next()?;
    if found.next().is_some() {
        return None;
    }
    let value = unquoted(value)?;
    (!value.is_empty() && value.len() <= 70).then_some(value)
}

/// Every boundary an upstream may take from a `Content-Type` value: each
/// `boundary` parameter (any case), and what follows the first `boundary=`
/// anywhere in it, as PHP reads it (`xboundary=A` is `A` to PHP).
pub fn boundaries(content_type: &[u8], into: &mut Vec<Vec<u8>>) {
    let mut add = |b: &[u8]| {
        if !b.is_empty() && b.len() <= 200 && !into.iter().any(|x| x == b) {
            into.push(b.to_vec());
        }
    };
    for (k, v) in params(content_type) {
        if k.eq_ignore_ascii_case(b"boundary") {
            add(unquoted(v).unwrap_or(v));
        }
    }
    if let Some(at) = memmem::find(content_type, b"boundary") {
        let rest = &content_type[at + 8..];
        if let Some(v) = rest.strip_prefix(b"=") {
            let end = v
                .iter()
                .position(|b| *b == b',' || *b == b';')
                .unwrap_or(v.len());
            let v = v[..end].trim_ascii();
            add(unquoted(v).unwrap_or(v));
        }
    }
}

/// The `name=value` parameters after a media type, names and values trimmed.
fn params(content_type: &[u8]) -> impl Iterator<Item = (&[u8], &[u8])> {
    content_type.split(|b| *b == b';').skip(1).filter_map(|p| {
        let eq = p.iter().position(|b| *b == b'=')?;
        Some((p[..eq].trim_ascii(), p[eq + 1..].trim_ascii()))
    })
}

fn unquoted(v: &[u8]) -> Option<&[u8]> {
    match v.strip_prefix(b"\"") {
        Some(q) => q.strip_suffix(b"\""),
        None => Some(v),
    }
}

/// The parts of `body` named `name` (`same_name`), in order, under RFC 2046's
/// framing: None when the body is not such a multipart body (no delimiter line, a
/// part without its CRLF CRLF, no closing delimiter, or anything but white space
/// after it).
pub fn strict<'a>(
    body: &'a [u8],
    boundary: &[u8],
    same_name: impl Fn(&str) -> bool,
) -> Option<Vec<Field<'a>>> {
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    let dashes = &delimiter[2..];
    let finder = memmem::Finder::new(&delimiter);
    // The first delimiter may start the body, without the line break before it.
    let mut at = if body.starts_with(dashes) {
        0
    } else {
        finder.find(body)? + 2
    };
    let mut found = Vec::new();
    loop {
        // `at` is the start of `--BOUNDARY`; past it, `--` closes the body, or
        // transport padding (spaces and tabs) and CRLF start a part.
        let rest = &body[at + dashes.len()..];
        if let Some(after) = rest.strip_prefix(b"--") {
            return after.trim_ascii().is_empty().then_some(found);
        }
        let rest = without_padding(rest).strip_prefix(b"\r\n")?;
        let start = body.len() - rest.len();
        let end = start + finder.find(rest)?;
        let part = &body[start..end];
        let (head, content) = if let Some(c) = part.strip_prefix(b"\r\n") {
            (&part[..0], c)
        } else {
            let i = memmem::find(part, b"\r\n\r\n")?;
            (&part[..i], &part[i + 4..])
        };
        if let Some(f) = field(head, content, &same_name, false) {
            found.push(f.field);
        }
        at = end + 2;
    }
}

/// Every part of `body` named `name` that an upstream may read with this
/// boundary (see the module's comment): a superset of `strict`'s, in order, with
/// a quoted-printable part given as sent and decoded.
pub fn every_field<'a>(
    body: &'a [u8],
    boundary: &[u8],
    same_name: impl Fn(&str) -> bool,
) -> Vec<Field<'a>> {
    let mut dashes = Vec::with_capacity(boundary.len() + 2);
    dashes.extend_from_slice(b"--");
    dashes.extend_from_slice(boundary);
    let starts: Vec<usize> = memmem::find_iter(body, &dashes).collect();
    let mut found = Vec::new();
    for (i, &at) in starts.iter().enumerate() {
        let mut end = starts.get(i + 1).copied().unwrap_or(body.len());
        // The line break before the next delimiter is the delimiter's.
        if body[..end].ends_with(b"\r\n") {
            end -= 2;
        } else if body[..end].ends_with(b"\n") {
            end -= 1;
        }
        let Some(seg) = body.get(at + dashes.len()..end) else {
            continue;
        };
        // A closing delimiter's `--`, transport padding, the line break.
        let seg = seg.strip_prefix(b"--").unwrap_or(seg);
        let seg = without_padding(seg);
        let seg = seg
            .strip_prefix(b"\r\n")
            .or_else(|| seg.strip_prefix(b"\n"))
            .unwrap_or(seg);
        let (head, content) = split_head(seg);
        if let Some(f) = field(head, content, &same_name, true) {
            if let Some(decoded) = f.decoded.clone() {
                found.push(Field {
                    value: String::from_utf8_lossy(content),
                    plain: false,
                });
                found.push(Field {
                    value: decoded,
                    plain: false,
                });
            } else {
                found.push(f.field);
            }
        }
    }
    found
}

/// A part's head and content, the head ending at its first empty line (`\n\n`
/// or `\n\r\n`, or the part starting with one); all head when there is none.
fn split_head(seg: &[u8]) -> (&[u8], &[u8]) {
    if let Some(c) = seg
        .strip_prefix(b"\r\n")
        .or_else(|| seg.strip_prefix(b"\n"))
    {
        return (&seg[..0], c);
    }
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &seg[from..]) {
        let nl = from + i;
        let rest = &seg[nl + 1..];
        if let Some(c) = rest
            .strip_prefix(b"\n")
            .or_else(|| rest.strip_prefix(b"\r\n"))
        {
            return (&seg[..nl], c);
        }
        from = nl + 1;
    }
    (seg, &seg[seg.len()..])
}

/// Without the spaces and tabs RFC 2046 allows after a delimiter.
fn without_padding(b: &[u8]) -> &[u8] {
    let n = b
        .iter()
        .position(|c| *c != b' ' && *c != b'\t')
        .unwrap_or(b.len());
    &b[n..]
}

/// A part found, and its quoted-printable content decoded when it is encoded.
struct Found<'a> {
    field: Field<'a>,
    decoded: Option<Cow<'a, str>>,
}

impl<'a> std::ops::Deref for Found<'a> {
    type Target = Field<'a>;
    fn deref(&self) -> &Field<'a> {
        &self.field
    }
}

/// The field a part is, when a name in its head is the one looked for. `wide`:
/// the names and file names any upstream may read, anywhere in the head (folded
/// lines, any quoting, RFC 2231 pieces); else those of its `Content-Disposition`
/// lines as RFC 7578 writes them.
fn field<'a>(
    head: &[u8],
    content: &'a [u8],
    same_name: &impl Fn(&str) -> bool,
    wide: bool,
) -> Option<Found<'a>> {
    let text = String::from_utf8_lossy(head);
    let (mut named, mut file, mut encoded) = (false, false, false);
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if name.eq_ignore_ascii_case("content-transfer-encoding") {
            let v = value.trim();
            encoded |= !["7bit", "8bit", "binary"]
                .iter()
                .any(|e| v.eq_ignore_ascii_case(e));
        } else if !wide && name.eq_ignore_ascii_case("content-disposition") {
            named |= param_values(value, "name").iter().any(|n| same_name(n));
            file |= param_values(value, "filename")
                .iter()
                .any(|f| !f.is_empty());
        }
    }
    if wide {
        // The whole head as one line: a folded or colon-less line is part of the
        // header before it to PHP and Go.
        named = param_values(&text, "name").iter().any(|n| same_name(n));
        file = param_values(&text, "filename")
            .iter()
            .any(|f| !f.is_empty());
    }
    if !named {
        return None;
    }
    let decoded: Option<Cow<'a, str>> = encoded.then(|| {
        // Go decodes quoted-printable parts; PHP reads them as sent. Never a key.
        Cow::Owned(String::from_utf8_lossy(&quoted_printable(content)).into_owned())
    });
    let value = match (&decoded, wide) {
        (Some(d), false) => d.clone(),
        _ => String::from_utf8_lossy(content),
    };
    Some(Found {
        field: Field {
            value,
            plain: !file && !encoded,
        },
        decoded,
    })
}

/// Every value a reader may take for parameter `param` in `text`: each `param=`
/// (any case) that starts the text or follows `;`, white space or a line break,
/// its value double-quoted (with and without backslash escapes, and up to the
/// first quote as PHP reads it), single-quoted, or bare (cut at `;`, and at white
/// space); `param*=` decoded (RFC 5987); and the RFC 2231 pieces `param*0`,
/// `param*1`, … joined.
fn param_values(text: &str, param: &str) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut pieces: Vec<(u32, String)> = Vec::new();
    let mut from = 0;
    while let Some(i) = lower[from..].find(param) {
        let at = from + i;
        from = at + param.len();
        let before = lower[..at].chars().next_back();
        if !before.is_none_or(|c| c == ';' || c.is_whitespace()) {
            continue;
        }
        let mut rest = &text[at + param.len()..];
        // `*`, `*N` or `*N*`.
        let mut piece = None;
        let mut extended = false;
        if let Some(r) = rest.strip_prefix('*') {
            rest = r;
            let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
            if digits > 0 {
                piece = rest[..digits].parse::<u32>().ok();
                rest = &rest[digits..];
                if let Some(r) = rest.strip_prefix('*') {
                    rest = r;
                    extended = true;
                }
            } else {
                extended = true;
            }
        }
        let Some(r) = rest.trim_start().strip_prefix('=') else {
            continue;
        };
        let rest = r.trim_start();
        let mut values = Vec::new();
        if let Some(q) = rest.strip_prefix('"') {
            let mut unescaped = String::new();
            let mut end = q.len();
            let mut chars = q.char_indices();
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => {
                        if let Some((_, n)) = chars.next() {
                            unescaped.push(n);
                        }
                    }
                    '"' => {
                        end = i;
                        break;
                    }
                    c => unescaped.push(c),
                }
            }
            values.push(unescaped);
            let raw = &q[..end];
            values.push(raw.to_string());
            values.push(q.split('"').next().unwrap_or(q).to_string());
        } else if let Some(q) = rest.strip_prefix('\'') {
            values.push(q.split('\'').next().unwrap_or(q).to_string());
        } else {
            let to_semi = rest.split([';', '\r', '\n']).next().unwrap_or(rest).trim();
            values.push(to_semi.to_string());
            values.push(
                to_semi
                    .split(char::is_whitespace)
                    .next()
                    .unwrap_or(to_semi)
                    .to_string(),
            );
        }
        if extended {
            let decoded: Vec<String> = values
                .iter()
                .map(|v| {
                    let encoded = v.splitn(3, '\'').nth(2).unwrap_or(v);
                    percent_encoding::percent_decode_str(encoded)
                        .decode_utf8_lossy()
                        .into_owned()
                })
                .collect();
            values.extend(decoded);
        }
        match piece {
            Some(n) => pieces.push((n, values.last().cloned().unwrap_or_default())),
            None => out.extend(values),
        }
    }
    if !pieces.is_empty() {
        pieces.sort_by_key(|(n, _)| *n);
        out.push(pieces.into_iter().map(|(_, v)| v).collect());
    }
    out
}

/// Quoted-printable content decoded (RFC 2045 §6.7): `=XX` escapes and soft line
/// breaks; anything malformed left as it is.
fn quoted_printable(content: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(content.len());
    let mut i = 0;
    while i < content.len() {
        if content[i] == b'=' {
            if content[i + 1..].starts_with(b"\r\n") {
                i += 3;
                continue;
            }
            if content[i + 1..].starts_with(b"\n") {
                i += 2;
                continue;
            }
            if let (Some(h), Some(l)) = (
                content.get(i + 1).copied().and_then(hex),
                content.get(i + 2).copied().and_then(hex),
            ) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(content[i]);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(n: &str) -> bool {
        n == "user"
    }

    fn values(fields: &[Field<'_>]) -> Vec<(String, bool)> {
        fields
            .iter()
            .map(|f| (f.value.to_string(), f.plain))
            .collect()
    }

    fn strict_of(body: &str) -> Option<Vec<(String, bool)>> {
        strict(body.as_bytes(), b"XyZ", user).map(|f| values(&f))
    }

    fn every(body: &str) -> Vec<(String, bool)> {
        values(&every_field(body.as_bytes(), b"XyZ", user))
    }

    fn crlf(s: &str) -> String {
        s.replace('\n', "\r\n")
    }

    #[test]
    fn boundaries_as_rfc_2046_and_php_read_them() {
        assert_eq!(
            boundary(b"multipart/form-data; boundary=XyZ"),
            Some(&b"XyZ"[..])
        );
        assert_eq!(
            boundary(b"multipart/form-data;charset=utf-8; Boundary=\"a b\""),
            Some(&b"a b"[..])
        );
        for none in [
            &b"multipart/form-data"[..],
            b"multipart/form-data; boundary=",
            b"multipart/form-data; boundary=\"\"",
            b"multipart/form-data; boundary=a; boundary=b",
        ] {
            assert_eq!(boundary(none), None, "{:?}", String::from_utf8_lossy(none));
        }
        let all = |ct: &[u8]| {
            let mut v = Vec::new();
            boundaries(ct, &mut v);
            v.into_iter()
                .map(|b| String::from_utf8(b).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(all(b"multipart/form-data; boundary=A"), ["A"]);
        assert_eq!(
            all(b"multipart/form-data; xboundary=A; boundary=B"),
            ["B", "A"]
        );
        assert_eq!(
            all(b"multipart/form-data; BOUNDARY=B; boundary=A"),
            ["B", "A"]
        );
    }

    #[test]
    fn the_strict_reading() {
        let body = crlf(
            "preamble\n--XyZ\nContent-Disposition: form-data; name=\"pass\"\n\nsecret\n\
             --XyZ\nContent-Disposition: form-data; name=\"user\"\n\ncarl\n--XyZ--\n",
        );
        assert_eq!(strict_of(&body), Some(vec![("carl".into(), true)]));
        assert_eq!(every(&body), [("carl".to_string(), true)]);
        // At the very start, padding after the delimiter, an unquoted name.
        let body = crlf("--XyZ \t\nContent-Disposition: form-data; name=user\n\nJosé\n--XyZ--");
        assert_eq!(strict_of(&body), Some(vec![("José".into(), true)]));
        // A file is not a plain field; an empty file name is none.
        let body = crlf(
            "--XyZ\nContent-Disposition: form-data; name=\"user\"; filename=\"a.txt\"\n\
             Content-Type: text/plain\n\nfile\n\
             --XyZ\ncontent-disposition: form-data; filename=\"\"; name=\"user\"\n\nvictim\n--XyZ--",
        );
        let both = vec![("file".into(), false), ("victim".into(), true)];
        assert_eq!(strict_of(&body), Some(both.clone()));
        assert_eq!(every(&body), both);
        // Not such a body: no closing delimiter, bare LF lines, something after it.
        for not in [
            crlf("--XyZ\nContent-Disposition: form-data; name=user\n\nx"),
            "--XyZ\nContent-Disposition: form-data; name=user\n\nx\n--XyZ--\n".into(),
            crlf("--XyZ\nContent-Disposition: form-data; name=user\n\nx\n--XyZ--\nmore"),
            "user=carl".into(),
        ] {
            assert_eq!(strict_of(&not), None, "{not:?}");
        }
        // A boundary inside a value does not end it unless it starts a line.
        let body = crlf("--XyZ\nContent-Disposition: form-data; name=user\n\na--XyZb\n--XyZ--");
        assert_eq!(strict_of(&body), Some(vec![("a--XyZb".into(), true)]));
    }

    /// Every part an upstream's reader finds, which the strict reading does not.
    #[test]
    fn the_wide_reading_finds_what_any_reader_reads() {
        let decoy = "--XyZ\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n";
        for (what, tail) in [
            (
                "after the closing delimiter (PHP)",
                "--XyZ--\r\n--XyZ\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "single quotes (PHP)",
                "--XyZ\r\nContent-Disposition: form-data; name='user'\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "a bare name cut at white space (PHP)",
                "--XyZ\r\nContent-Disposition: form-data; name=user x\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "a head ending in LF CRLF (PHP, Go)",
                "--XyZ\r\nContent-Disposition: form-data; name=\"user\"\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "bare LF lines (PHP, Go)",
                "--XyZ\nContent-Disposition: form-data; name=user\n\nvictim\n--XyZ--",
            ),
            (
                "a folded header line (PHP, Go)",
                "--XyZ\r\nContent-Disposition: form-data; name=\"x\"\r\n ; name=\"user\"\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "a line without a colon (PHP)",
                "--XyZ\r\nContent-Disposition: form-data;\r\nname=\"user\"\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "RFC 2231 pieces (Go)",
                "--XyZ\r\nContent-Disposition: form-data; name*0=\"us\"; name*1=\"er\"\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "RFC 2231 encoded pieces (Go)",
                "--XyZ\r\nContent-Disposition: form-data; name*0*=UTF-8''us; name*1*=%65r\r\n\r\nvictim\r\n--XyZ--",
            ),
            (
                "no closing delimiter (PHP)",
                "--XyZ\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\nvictim",
            ),
        ] {
            let body = format!("{decoy}{tail}");
            let found = every(&body);
            assert!(
                found.iter().any(|(v, _)| v == "victim"),
                "{what}: {found:?}"
            );
            // No key: the readings differ, or they agree on two parts.
            let key = strict_of(&body).filter(|s| *s == found && s.len() == 1);
            assert_eq!(key, None, "{what}");
        }
        // Quoted-printable: as sent and decoded, never plain.
        let body = crlf(
            "--XyZ\nContent-Disposition: form-data; name=user\n\
             Content-Transfer-Encoding: quoted-printable\n\nvictim=2Ddenied\n--XyZ--",
        );
        assert_eq!(
            every(&body),
            [
                ("victim=2Ddenied".to_string(), false),
                ("victim-denied".to_string(), false)
            ]
        );
        assert_eq!(
            strict_of(&body),
            Some(vec![("victim-denied".into(), false)])
        );
        // `filename` is not `name`.
        let body = crlf("--XyZ\nContent-Disposition: form-data; filename=\"user\"\n\nx\n--XyZ--");
        assert_eq!(every(&body), []);
    }
}
