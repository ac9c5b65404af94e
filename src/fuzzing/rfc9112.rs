//! RFC 9112's message rules that requests and responses share, written out plainly
//! for the oracles of the `response` and `request` targets: `Content-Length`, the
//! chunked coding (§7.1) and its trailer section. Nothing here is sluice's code.
//! Where sluice's limits or leniencies enter, the code says so (`EXCEPTION`).

/// Fields as they came, in order: names lowercased, values as bytes.
pub type Fields = Vec<(String, Vec<u8>)>;

/// The longest chunk-size line sluice takes (`http::h1::upstream`'s limit): size, extensions, CR.
pub const MAX_CHUNK_LINE: usize = 4096;
/// The most hex digits of a chunk size sluice takes (a `u64` holds any 16).
pub const MAX_SIZE_DIGITS: usize = 16;
/// The most digits of a `Content-Length` sluice takes (a `u64` holds any 19).
pub const MAX_LENGTH_DIGITS: usize = 19;

/// A message's `Content-Length`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Length {
    Absent,
    Valid(u64),
    Invalid,
}

/// The `Content-Length` of a message with these values (RFC 9112 §6.3 rule 5, RFC
/// 9110 §8.6): each is 1*DIGIT; a list of one number repeated, over one line or
/// several, may be taken as that number (the RFC's MAY, which sluice and hyper
/// take); anything else is invalid.
pub fn content_length<'a>(values: impl Iterator<Item = &'a [u8]>) -> Length {
    let mut length = Length::Absent;
    for value in values {
        for item in value.split(|&b| b == b',') {
            let item = item.trim_ascii();
            // EXCEPTION (a limit): more than 19 digits is invalid, leading zeros
            // included (no body is longer).
            let n = (!item.is_empty()
                && item.len() <= MAX_LENGTH_DIGITS
                && item.iter().all(u8::is_ascii_digit))
            .then(|| std::str::from_utf8(item).ok()?.parse::<u64>().ok())
            .flatten();
            length = match (n, length) {
                (Some(n), Length::Absent) => Length::Valid(n),
                (Some(n), Length::Valid(m)) if n == m => Length::Valid(n),
                _ => Length::Invalid,
            };
        }
    }
    length
}

/// The items of a list-valued field over all its lines, lowercased (RFC 9110
/// §5.6.1: items are separated by commas with optional white space around them;
/// empty items do not count).
pub fn items(fields: &Fields, name: &str) -> Vec<Vec<u8>> {
    fields
        .iter()
        .filter(|(n, _)| n == name)
        .flat_map(|(_, v)| v.split(|&b| b == b','))
        .map(|item| item.trim_ascii().to_ascii_lowercase())
        .filter(|item| !item.is_empty())
        .collect()
}

/// How strictly chunk extensions are read, and the trailer section's limits.
#[derive(Debug, Clone, Copy)]
pub struct ChunkRules {
    /// Extensions as RFC 9112 §7.1.1 writes them (`;name` or `;name=value`, the value
    /// a token or a quoted string, white space only around `;` and `=`); else
    /// anything but a CR or LF of their own, as hyper and nginx read them.
    pub strict_extensions: bool,
    /// The largest trailer section, and the most fields in it.
    pub max_trailers: usize,
    pub max_trailer_fields: usize,
}

/// How a chunked body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkedEnd {
    /// As framed: the trailer fields, and where the message ends in the input.
    Complete { trailers: Fields, end: usize },
    /// The input ends within it.
    Unfinished,
    /// The chunked framing is malformed: at this index of the input, or in the
    /// trailer section (`None`).
    Malformed(Option<usize>),
}

/// A chunked body starting at `input[at]` (RFC 9112 §7.1): its data, and how it
/// ended.
///
/// ```text
/// chunked-body    = *chunk last-chunk trailer-section CRLF
/// chunk           = chunk-size [ chunk-ext ] CRLF chunk-data CRLF
/// chunk-size      = 1*HEXDIG
/// last-chunk      = 1*("0") [ chunk-ext ] CRLF
/// chunk-ext       = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )
/// chunk-ext-name  = token
/// chunk-ext-val   = token / quoted-string
/// trailer-section = *( field-line CRLF )
/// ```
pub fn chunked(input: &[u8], mut at: usize, rules: &ChunkRules) -> (Vec<u8>, ChunkedEnd) {
    let mut body = Vec::new();
    loop {
        let (size, after) = match size_line(input, at, rules.strict_extensions) {
            Line::Whole { size, next } => (size, next),
            Line::Unfinished => return (body, ChunkedEnd::Unfinished),
            Line::Malformed(at) => return (body, ChunkedEnd::Malformed(Some(at))),
        };
        at = after;
        if size == 0 {
            break;
        }
        let rest = &input[at..];
        let have = usize::try_from(size).map_or(rest.len(), |n| n.min(rest.len()));
        body.extend_from_slice(&rest[..have]);
        if (have as u64) < size {
            return (body, ChunkedEnd::Unfinished);
        }
        at += have;
        for want in *b"\r\n" {
            match input.get(at) {
                None => return (body, ChunkedEnd::Unfinished),
                Some(&b) if b != want => return (body, ChunkedEnd::Malformed(Some(at))),
                Some(_) => at += 1,
            }
        }
    }
    // The trailer section: field lines, as in a head (RFC 9112 §2.2 lets a bare LF
    // end a line), then an empty line.
    let mut slots = vec![httparse::EMPTY_HEADER; 4 * rules.max_trailer_fields.max(25)];
    match httparse::parse_headers(&input[at..], &mut slots) {
        // EXCEPTION (a limit): as a head, a largest size and most fields.
        Ok(httparse::Status::Complete((len, fields)))
            if len <= rules.max_trailers && fields.len() <= rules.max_trailer_fields =>
        {
            let trailers = fields
                .iter()
                .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
                .collect();
            let end = at + len;
            (body, ChunkedEnd::Complete { trailers, end })
        }
        Ok(httparse::Status::Partial) if input.len() - at <= rules.max_trailers => {
            (body, ChunkedEnd::Unfinished)
        }
        _ => (body, ChunkedEnd::Malformed(None)),
    }
}

pub enum Line {
    /// The chunk's size, and where the line after it starts.
    Whole { size: u64, next: usize },
    /// The input ends within the line.
    Unfinished,
    /// The byte at this index cannot be part of a chunk-size line.
    Malformed(usize),
}

/// The chunk-size line at `input[start]`, read byte by byte, so that a malformed
/// line is known at the first byte that makes it so.
pub fn size_line(input: &[u8], start: usize, strict: bool) -> Line {
    #[derive(Clone, Copy, PartialEq)]
    enum At {
        Size,
        /// BWS after the size or an extension, before `;` (or the CRLF).
        Space,
        /// After `;`, BWS before a name.
        Semi,
        Name,
        /// BWS after a name, before `=`, `;` or the CRLF.
        NameSpace,
        /// After `=`, BWS before the value.
        Equals,
        Token,
        Quoted,
        /// After `\` in a quoted string.
        Escape,
        /// Anything up to the CRLF (not strict).
        Anything,
        Cr,
    }
    let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    let ws = |b: u8| b == b' ' || b == b'\t';
    let mut state = At::Size;
    let mut digits = 0;
    let mut size = 0u64;
    for (i, &b) in input[start..].iter().enumerate() {
        // EXCEPTION (a limit): the line, its CR included, is at most 4096 bytes.
        if i == MAX_CHUNK_LINE && b != b'\n' {
            return Line::Malformed(start + i);
        }
        use At::*;
        state = match state {
            Size if b.is_ascii_hexdigit() => {
                digits += 1;
                // EXCEPTION (a limit): at most 16 hex digits, leading zeros included.
                if digits > MAX_SIZE_DIGITS {
                    return Line::Malformed(start + i);
                }
                size = size << 4 | u64::from((b as char).to_digit(16).unwrap_or(0));
                Size
            }
            Size if digits == 0 => return Line::Malformed(start + i),
            // EXCEPTION: white space after the size before the CRLF, as hyper and
            // nginx read it (the grammar has BWS only before `;`).
            Size | Space if ws(b) => Space,
            Size | Space if b == b';' => {
                if strict {
                    Semi
                } else {
                    Anything
                }
            }
            Size | Space => match b {
                b'\r' => Cr,
                _ => return Line::Malformed(start + i),
            },
            // EXCEPTION (unless strict): an extension is anything up to the CRLF but
            // a CR or LF of its own (as hyper and nginx read it: extensions are
            // dropped, so what is in them cannot change the framing). RFC 9112
            // §2.2: a bare CR is invalid.
            Anything => match b {
                b'\r' => Cr,
                b'\n' => return Line::Malformed(start + i),
                _ => Anything,
            },
            Semi if ws(b) => Semi,
            Semi | Name if tchar(b) => Name,
            Semi => return Line::Malformed(start + i),
            Name | NameSpace if ws(b) => NameSpace,
            Name | NameSpace if b == b'=' => Equals,
            Equals if ws(b) => Equals,
            Equals | Token if tchar(b) => Token,
            Equals if b == b'"' => Quoted,
            Equals => return Line::Malformed(start + i),
            // qdtext = HTAB / SP / %x21 / %x23-5B / %x5D-7E / obs-text
            Quoted => match b {
                b'"' => Space,
                b'\\' => Escape,
                b'\t' | b' ' | 0x21 | 0x23..=0x5b | 0x5d..=0x7e | 0x80..=0xff => Quoted,
                _ => return Line::Malformed(start + i),
            },
            // quoted-pair = "\" ( HTAB / SP / VCHAR / obs-text )
            Escape => match b {
                b'\t' | b' ' | 0x21..=0x7e | 0x80..=0xff => Quoted,
                _ => return Line::Malformed(start + i),
            },
            Name | NameSpace | Token if ws(b) => Space,
            Name | NameSpace | Token if b == b';' => Semi,
            Name | NameSpace | Token if b == b'\r' => Cr,
            Name | NameSpace | Token => return Line::Malformed(start + i),
            Cr if b == b'\n' => {
                return Line::Whole {
                    size,
                    next: start + i + 1,
                }
            }
            Cr => return Line::Malformed(start + i),
        };
    }
    Line::Unfinished
}

#[cfg(test)]
mod tests {
    use super::*;

    fn malformed_at(line: &str, strict: bool) -> Option<usize> {
        match size_line(line.as_bytes(), 0, strict) {
            Line::Malformed(at) => Some(at),
            _ => None,
        }
    }

    #[test]
    fn chunk_size_lines() {
        for (line, lenient, strict) in [
            ("5\r\n", None, None),
            ("5 \r\n", None, None),
            ("5\r\r\n", Some(2), Some(2)),
            ("5;a\rb\r\n", Some(4), Some(4)),
            ("5;a=\"x;\\\"y\" ; b\r\n", None, None),
            ("5 ; a = b\r\n", None, None),
            ("5;\r\n", None, Some(2)),
            ("5;a=\r\n", None, Some(4)),
            ("5;a=\"x\r\n", None, Some(6)),
            ("5;a b\r\n", None, Some(4)),
            ("5;a=b c\r\n", None, Some(6)),
            ("5;\x01\r\n", None, Some(2)),
            ("5\n", Some(1), Some(1)),
            ("x\r\n", Some(0), Some(0)),
            ("\r\n", Some(0), Some(0)),
            ("00000000000000001\r\n", Some(16), Some(16)),
        ] {
            assert_eq!(malformed_at(line, false), lenient, "{line:?}");
            assert_eq!(malformed_at(line, true), strict, "{line:?} (strict)");
        }
        assert!(matches!(size_line(b"5;a", 0, true), Line::Unfinished));
        let long = format!("5;{}\r\n", "a".repeat(MAX_CHUNK_LINE));
        assert_eq!(malformed_at(&long, false), Some(MAX_CHUNK_LINE));
    }

    #[test]
    fn lengths() {
        let cl = |vs: &[&str]| content_length(vs.iter().map(|v| v.as_bytes()));
        assert_eq!(cl(&[]), Length::Absent);
        assert_eq!(cl(&["5"]), Length::Valid(5));
        assert_eq!(cl(&["5, 5", "5"]), Length::Valid(5));
        for bad in [
            &["+5"][..],
            &["5, 6"],
            &["5,"],
            &["5", "6"],
            &["-1"],
            &[""],
            &["0x5"],
        ] {
            assert_eq!(cl(bad), Length::Invalid, "{bad:?}");
        }
    }
}
