//! `multipart/form-data` bodies (RFC 7578), read for a `form:` key as PHP, Go and
//! Python read them: the parts between `--BOUNDARY` lines, each with its head
//! (`Content-Disposition: form-data; name="user"`) and its content.
//!
//! Two readings: the strict one (lines end in CRLF, as RFC 2046 writes them) gives
//! the key; the lenient one (a bare LF ends a line too, as Go's and PHP's readers
//! accept) is looked at as well by the deny list, so a body framed for a lenient
//! upstream never hides a denied value.

use std::borrow::Cow;

/// One part whose name is the field's: its content as text (bytes that are not
/// UTF-8 replaced, so refused as a key), and whether the key can be read from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field<'a> {
    pub value: Cow<'a, str>,
    /// A plain field: no file name (or an empty one, which Go reads as a field),
    /// and no transfer encoding sluice does not read as the upstream would.
    pub plain: bool,
}

/// The `boundary` parameter of a `multipart/form-data` `Content-Type` value
/// (quoted or not); None when it is missing, empty or longer than RFC 2046's 70.
pub fn boundary(content_type: &[u8]) -> Option<&[u8]> {
    let mut params = content_type.split(|b| *b == b';').skip(1);
    let value = params.find_map(|p| {
        let p = p.trim_ascii();
        let (k, v) = p.split_at(p.iter().position(|b| *b == b'=')?);
        k.trim_ascii()
            .eq_ignore_ascii_case(b"boundary")
            .then(|| v[1..].trim_ascii())
    })?;
    let value = match value.strip_prefix(b"\"") {
        Some(q) => q.strip_suffix(b"\"")?,
        None => value,
    };
    (!value.is_empty() && value.len() <= 70).then_some(value)
}

/// The parts of `body` named `name` (compared with `same_name`), in order, under
/// one reading; None when the body is not a multipart body with this boundary (no
/// delimiter line, or no closing one).
pub fn fields<'a>(
    body: &'a [u8],
    boundary: &[u8],
    lenient: bool,
    same_name: impl Fn(&str) -> bool,
) -> Option<Vec<Field<'a>>> {
    let mut delimiter = Vec::with_capacity(boundary.len() + 4);
    delimiter.extend_from_slice(b"\r\n--");
    delimiter.extend_from_slice(boundary);
    // The first delimiter may start the body, without the line break before it.
    let mut at = if body.starts_with(&delimiter[2..]) {
        0
    } else {
        let (end, skip) = find_delimiter(body, &delimiter, lenient)?;
        end + skip
    };
    let mut found = Vec::new();
    loop {
        // `at` is the start of `--BOUNDARY`; past it, `--` closes the body, or
        // transport padding (spaces and tabs) and a line break start a part.
        let rest = &body[at + delimiter.len() - 2..];
        if rest.starts_with(b"--") {
            return Some(found);
        }
        let rest = without_padding(rest);
        let line_end = if rest.starts_with(b"\r\n") {
            2
        } else if lenient && rest.starts_with(b"\n") {
            1
        } else {
            return None;
        };
        let part_start = body.len() - rest.len() + line_end;
        let (next, skip) = find_delimiter(&body[part_start..], &delimiter, lenient)?;
        let part = &body[part_start..part_start + next];
        if let Some(f) = field(part, lenient, &same_name) {
            found.push(f);
        }
        at = part_start + next + skip;
    }
}

/// Without the spaces and tabs RFC 2046 allows after a delimiter.
fn without_padding(b: &[u8]) -> &[u8] {
    let n = b
        .iter()
        .position(|c| *c != b' ' && *c != b'\t')
        .unwrap_or(b.len());
    &b[n..]
}

/// Where the next `CRLF--BOUNDARY` starts in `body` (the part's end), and how far
/// past that its `--BOUNDARY` starts; a bare `LF--BOUNDARY` too when lenient.
fn find_delimiter(body: &[u8], delimiter: &[u8], lenient: bool) -> Option<(usize, usize)> {
    let dashes = &delimiter[2..];
    let mut from = 0;
    while let Some(i) = find(&body[from..], dashes) {
        let i = from + i;
        if i >= 2 && &body[i - 2..i] == b"\r\n" {
            return Some((i - 2, 2));
        }
        if lenient && i >= 1 && body[i - 1] == b'\n' {
            return Some((i - 1, 1));
        }
        from = i + 1;
    }
    None
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A part's head and content; the field when its name is the one looked for.
fn field<'a>(
    part: &'a [u8],
    lenient: bool,
    same_name: &impl Fn(&str) -> bool,
) -> Option<Field<'a>> {
    let (head, content) = match find(part, b"\r\n\r\n") {
        Some(i) => (&part[..i], &part[i + 4..]),
        None if lenient => {
            let i = find(part, b"\n\n")?;
            (&part[..i], &part[i + 2..])
        }
        // A part with no fields at all starts with its blank line.
        None if part.starts_with(b"\r\n") => (&part[..0], &part[2..]),
        None => return None,
    };
    let mut named = false;
    let mut file = false;
    let mut encoded = false;
    for line in head.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let (name, value) = (line[..colon].trim_ascii(), &line[colon + 1..]);
        if name.eq_ignore_ascii_case(b"content-disposition") {
            for (k, v) in disposition_params(value) {
                match k.as_str() {
                    // Any spelling an upstream may read as the name makes it the field.
                    "name" | "name*" => named |= v.iter().any(|n| same_name(n)),
                    "filename" | "filename*" => file |= v.iter().any(|f| !f.is_empty()),
                    _ => {}
                }
            }
        } else if name.eq_ignore_ascii_case(b"content-transfer-encoding") {
            let v = value.trim_ascii();
            encoded |= !(v.eq_ignore_ascii_case(b"7bit")
                || v.eq_ignore_ascii_case(b"8bit")
                || v.eq_ignore_ascii_case(b"binary"));
        }
    }
    if !named {
        return None;
    }
    let value = if encoded {
        // Go decodes quoted-printable parts; PHP reads them as sent. The key is
        // missing (`plain: false`), and the deny list sees the decoded text.
        Cow::Owned(String::from_utf8_lossy(&quoted_printable(content)).into_owned())
    } else {
        String::from_utf8_lossy(content)
    };
    Some(Field {
        value,
        plain: !file && !encoded,
    })
}

/// The parameters of a `Content-Disposition` value, names lower-cased, each with
/// the values an upstream may read: a quoted value with and without its
/// backslash escapes undone, an RFC 5987 `name*=UTF-8''…` decoded.
fn disposition_params(value: &[u8]) -> Vec<(String, Vec<String>)> {
    let text = String::from_utf8_lossy(value);
    let mut out = Vec::new();
    let mut rest = text.as_ref();
    // Skip the disposition type (`form-data`).
    match rest.find(';') {
        Some(i) => rest = &rest[i + 1..],
        None => return out,
    }
    loop {
        rest = rest.trim_start();
        let Some(eq) = rest.find('=') else {
            return out;
        };
        let name = rest[..eq].trim().to_ascii_lowercase();
        rest = rest[eq + 1..].trim_start();
        let mut values = Vec::new();
        if let Some(q) = rest.strip_prefix('"') {
            // A quoted string: up to the first unescaped quote.
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
            let raw = &q[..end];
            values.push(unescaped);
            // PHP keeps the backslashes, and ends the value at the first quote.
            values.push(raw.split('"').next().unwrap_or(raw).to_string());
            values.push(raw.to_string());
            rest = q.get(end + 1..).unwrap_or("");
        } else {
            let end = rest.find(';').unwrap_or(rest.len());
            let raw = rest[..end].trim();
            if name.ends_with('*') {
                // charset'language'percent-encoded
                let encoded = raw.splitn(3, '\'').nth(2).unwrap_or(raw);
                values.push(
                    percent_encoding::percent_decode_str(encoded)
                        .decode_utf8_lossy()
                        .into_owned(),
                );
            }
            values.push(raw.to_string());
            rest = &rest[end..];
        }
        out.push((name, values));
        match rest.find(';') {
            Some(i) => rest = &rest[i + 1..],
            None => return out,
        }
    }
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

    fn read(body: &str, lenient: bool) -> Option<Vec<(String, bool)>> {
        fields(body.as_bytes(), b"XyZ", lenient, user).map(|fs| {
            fs.into_iter()
                .map(|f| (f.value.into_owned(), f.plain))
                .collect()
        })
    }

    #[test]
    fn boundaries() {
        assert_eq!(
            boundary(b"multipart/form-data; boundary=XyZ"),
            Some(&b"XyZ"[..])
        );
        assert_eq!(
            boundary(b"multipart/form-data;charset=utf-8; Boundary=\"a b\""),
            Some(&b"a b"[..])
        );
        assert_eq!(boundary(b"multipart/form-data"), None);
        assert_eq!(boundary(b"multipart/form-data; boundary="), None);
        assert_eq!(boundary(b"multipart/form-data; boundary=\"\""), None);
    }

    #[test]
    fn fields_as_upstreams_read_them() {
        let crlf = |s: &str| s.replace('\n', "\r\n");
        let body = crlf(
            "preamble\n--XyZ\nContent-Disposition: form-data; name=\"pass\"\n\nsecret\n\
             --XyZ\nContent-Disposition: form-data; name=\"user\"\n\ncarl\n--XyZ--\n",
        );
        assert_eq!(read(&body, false), Some(vec![("carl".into(), true)]));
        assert_eq!(read(&body, true), Some(vec![("carl".into(), true)]));
        // At the very start, with padding after the delimiter, a name unquoted.
        let body = crlf("--XyZ \t\nContent-Disposition: form-data; name=user\n\nJosé\n--XyZ--");
        assert_eq!(read(&body, false), Some(vec![("José".into(), true)]));
        // Two parts: a repeat. A file is not a plain field, an empty file name is.
        let body = crlf(
            "--XyZ\nContent-Disposition: form-data; name=\"user\"; filename=\"a.txt\"\n\
             Content-Type: text/plain\n\nfile\n\
             --XyZ\ncontent-disposition: form-data; filename=\"\"; name=\"user\"\n\nvictim\n--XyZ--",
        );
        assert_eq!(
            read(&body, false),
            Some(vec![("file".into(), false), ("victim".into(), true)])
        );
        // RFC 5987 names, escapes, and PHP's reading of them.
        let body = crlf(
            "--XyZ\nContent-Disposition: form-data; name*=UTF-8''us%65r\n\na\n\
             --XyZ\nContent-Disposition: form-data; name=\"us\\er\"\n\nb\n--XyZ--",
        );
        assert_eq!(
            read(&body, false),
            Some(vec![("a".into(), true), ("b".into(), true)])
        );
        // Quoted-printable: decoded for the deny list, never a key.
        let body = crlf(
            "--XyZ\nContent-Disposition: form-data; name=user\n\
             Content-Transfer-Encoding: quoted-printable\n\nvictim=2Ddenied\n--XyZ--",
        );
        assert_eq!(
            read(&body, false),
            Some(vec![("victim-denied".into(), false)])
        );
        // Bare LF lines: only the lenient reading finds the part.
        let body = "--XyZ\nContent-Disposition: form-data; name=user\n\nvictim\n--XyZ--\n";
        assert_eq!(read(body, false), None);
        assert_eq!(read(body, true), Some(vec![("victim".into(), true)]));
        // No closing delimiter, or another boundary: not such a body.
        assert_eq!(
            read(
                &crlf("--XyZ\nContent-Disposition: form-data; name=user\n\nx"),
                true
            ),
            None
        );
        assert_eq!(read("user=carl", true), None);
        // A boundary inside a value does not end it unless it starts a line.
        let body = crlf("--XyZ\nContent-Disposition: form-data; name=user\n\na--XyZb\n--XyZ--");
        assert_eq!(read(&body, false), Some(vec![("a--XyZb".into(), true)]));
    }
}
