//! Request paths in one canonical form, so that no spelling of a path can step
//! around the route meant for it: what routes match and what the upstream receives
//! is the same string. Pure functions of the path (a fuzz target can call them).

use std::borrow::Cow;

/// Why a path cannot be normalised safely: the request gets 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("the path must start with \"/\"")]
    NotAbsolute,
    #[error("a bad percent-escape in the path")]
    BadEscape,
    #[error("an encoded \"/\" (%2F) in the path")]
    EncodedSlash,
    #[error("an encoded NUL (%00) in the path")]
    EncodedNul,
    #[error("a backslash in the path")]
    Backslash,
    #[error("the path climbs above the root")]
    AboveRoot,
    #[error("a dot segment with parameters (\"..;\") in the path")]
    DotWithParams,
}

/// The path routes match when it differs from the forwarded one (it had `;params`);
/// kept in the request's extensions by `admit::admit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutePath(pub String);

/// The normal form of an origin-form path (no query):
/// - percent-escapes of unreserved characters (`A-Z a-z 0-9 - . _ ~`) decoded, the
///   hex of every other escape upper-cased (RFC 3986 §6.2.2);
/// - `.` and `..` segments resolved, `%2e` ones included; a trailing `.` or `..`
///   leaves no trailing slash (`/login/.` is `/login`);
/// - repeated slashes merged (nginx's `merge_slashes`).
///
/// Refused: an encoded `/` or NUL, a backslash (raw or `%5C`: some servers take it
/// for a slash), a bad escape, a `..` above the root, and `.`/`..` segments with
/// `;parameters` (Java servers resolve `..;x` as `..`, others do not).
pub fn normalize(raw: &str) -> Result<Cow<'_, str>, PathError> {
    let rest = raw.strip_prefix('/').ok_or(PathError::NotAbsolute)?;
    if is_normal(rest) {
        return Ok(Cow::Borrowed(raw));
    }
    let mut out = String::with_capacity(raw.len());
    // Where each kept segment starts in `out` (just after its slash).
    let mut starts: Vec<usize> = Vec::new();
    let mut seg = String::new();
    let mut trailing_slash = false;
    let mut segments = rest.split('/').peekable();
    while let Some(s) = segments.next() {
        let last = segments.peek().is_none();
        seg.clear();
        decode(s, &mut seg)?;
        match seg.as_str() {
            "" => trailing_slash = last,
            "." => {}
            ".." => {
                let start = starts.pop().ok_or(PathError::AboveRoot)?;
                out.truncate(start - 1);
            }
            _ if matches!(bare(&seg), "." | "..") => return Err(PathError::DotWithParams),
            _ => {
                out.push('/');
                starts.push(out.len());
                out.push_str(&seg);
            }
        }
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

/// The path as routes see it: a normalised path with each segment's `;parameters`
/// removed (Java servers ignore them, so `/login;x` is their `/login`) and the
/// slashes that leaves merged.
pub fn route_view(normalised: &str) -> Cow<'_, str> {
    if !normalised.contains(';') {
        return Cow::Borrowed(normalised);
    }
    let rest = normalised.strip_prefix('/').unwrap_or(normalised);
    let mut out = String::with_capacity(normalised.len());
    let mut trailing_slash = false;
    let mut segments = rest.split('/').peekable();
    while let Some(s) = segments.next() {
        let last = segments.peek().is_none();
        match bare(s) {
            "" => trailing_slash = last,
            b => {
                out.push('/');
                out.push_str(b);
            }
        }
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Cow::Owned(out)
}

/// A segment without its `;parameters`.
fn bare(segment: &str) -> &str {
    segment.split(';').next().unwrap_or(segment)
}

/// Whether the path after its first slash is in normal form already (the common
/// case: no allocation), in one pass: no backslash, every escape upper-case hex of
/// a byte that stays escaped, no empty segment but the last, no `.` or `..`
/// segment (with or without `;parameters`).
fn is_normal(rest: &str) -> bool {
    let b = rest.as_bytes();
    // The current segment: where it starts, and where its first `;` is.
    let mut start = 0;
    let mut params = None;
    let mut i = 0;
    loop {
        match b.get(i) {
            None | Some(b'/') => {
                let last = i == b.len();
                if i == start && !last {
                    return false;
                }
                if matches!(&b[start..params.unwrap_or(i)], b"." | b"..") {
                    return false;
                }
                if last {
                    return true;
                }
                start = i + 1;
                params = None;
            }
            Some(b';') => {
                params.get_or_insert(i);
            }
            Some(b'\\') => return false,
            Some(b'%') => match (b.get(i + 1), b.get(i + 2)) {
                (Some(hi), Some(lo)) if is_upper_hex(*hi) && is_upper_hex(*lo) => {
                    let v = (hex_value(*hi) << 4) | hex_value(*lo);
                    if unreserved(v) || matches!(v, b'/' | b'\\' | 0) {
                        return false;
                    }
                }
                _ => return false,
            },
            Some(_) => {}
        }
        i += 1;
    }
}

fn unreserved(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_' | b'~')
}

fn is_upper_hex(c: u8) -> bool {
    c.is_ascii_digit() || (b'A'..=b'F').contains(&c)
}

fn hex_value(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        _ => c - b'A' + 10,
    }
}

/// Append `segment` to `out` with its escapes decoded or upper-cased.
fn decode(segment: &str, out: &mut String) -> Result<(), PathError> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let b = segment.as_bytes();
    let mut run = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => return Err(PathError::Backslash),
            b'%' => {
                out.push_str(&segment[run..i]);
                let hex = |j: usize| {
                    b.get(j)
                        .and_then(|c| (*c as char).to_digit(16))
                        .ok_or(PathError::BadEscape)
                };
                let (hi, lo) = (hex(i + 1)?, hex(i + 2)?);
                let c = (hi * 16 + lo) as u8;
                match c {
                    b'/' => return Err(PathError::EncodedSlash),
                    0 => return Err(PathError::EncodedNul),
                    b'\\' => return Err(PathError::Backslash),
                    c if unreserved(c) => out.push(c as char),
                    _ => {
                        out.push('%');
                        out.push(HEX[hi as usize] as char);
                        out.push(HEX[lo as usize] as char);
                    }
                }
                i += 3;
                run = i;
            }
            _ => i += 1,
        }
    }
    out.push_str(&segment[run..]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use PathError::*;

    #[test]
    fn one_pass_is_normal_agrees_with_two_passes() {
        let alphabet = [
            "a", "/", ".", ";", "%", "2", "e", "E", "F", "4", "1", "\\", "~",
        ];
        let mut last = vec![String::new()];
        let mut n = 0;
        for _ in 0..5 {
            let next: Vec<String> = last
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            for p in &next {
                assert_eq!(is_normal(p), is_normal_reference(p), "{p:?}");
                n += 1;
            }
            last = next;
        }
        assert!(is_normal(""));
        assert!(n > 300_000);
    }

    /// The two-pass `is_normal` this one replaced.
    fn is_normal_reference(rest: &str) -> bool {
        let b = rest.as_bytes();
        for (i, c) in b.iter().enumerate() {
            match c {
                b'\\' => return false,
                // Normal: upper-case hex of a byte that stays escaped.
                b'%' => match (b.get(i + 1), b.get(i + 2)) {
                    (Some(hi), Some(lo)) if is_upper_hex(*hi) && is_upper_hex(*lo) => {
                        let v = (hex_value(*hi) << 4) | hex_value(*lo);
                        if unreserved(v) || matches!(v, b'/' | b'\\' | 0) {
                            return false;
                        }
                    }
                    _ => return false,
                },
                _ => {}
            }
        }
        let mut segments = rest.split('/').peekable();
        while let Some(s) = segments.next() {
            let last = segments.peek().is_none();
            if (s.is_empty() && !last) || matches!(bare(s), "." | "..") {
                return false;
            }
        }
        true
    }

    #[test]
    fn normal_forms() {
        let cases: &[(&str, &str)] = &[
            ("/", "/"),
            ("/login", "/login"),
            ("/login/", "/login/"),
            ("/%6Cogin", "/login"),
            ("/%6cogin", "/login"),
            ("/./login", "/login"),
            ("//login", "/login"),
            ("///login//", "/login/"),
            ("/x/../login", "/login"),
            ("/login/.", "/login"),
            ("/login/./", "/login/"),
            ("/login/x/..", "/login"),
            ("/login/x/../", "/login/"),
            ("/%2e/login", "/login"),
            ("/a/%2E%2e/x", "/x"),
            ("/x/%2e%2e/login", "/login"),
            ("/.", "/"),
            ("/x/..", "/"),
            ("//", "/"),
            ("/a//..", "/"),
            ("/%7Euser", "/~user"),
            ("/%41%5a%30%2D%5F", "/AZ0-_"),
            ("/caf%c3%a9", "/caf%C3%A9"),
            ("/a%3bb", "/a%3Bb"),
            ("/a%20b", "/a%20b"),
            ("/%252e", "/%252e"),
            ("/login;foo", "/login;foo"),
            ("/a;b/../c", "/c"),
            ("/...", "/..."),
            ("/..x/.x", "/..x/.x"),
            ("/é", "/é"),
            ("/%C3%A9/é%2e", "/%C3%A9/é."),
        ];
        for (raw, want) in cases {
            assert_eq!(normalize(raw).as_deref(), Ok(*want), "{raw}");
            // Idempotent: a normal form stays as it is, without copying.
            assert!(matches!(normalize(want), Ok(Cow::Borrowed(_))), "{want}");
        }
    }

    #[test]
    fn refused() {
        let cases: &[(&str, PathError)] = &[
            ("", NotAbsolute),
            ("*", NotAbsolute),
            ("login", NotAbsolute),
            ("/login%2f", EncodedSlash),
            ("/login%2F", EncodedSlash),
            ("/lo%00gin", EncodedNul),
            ("/a\\b", Backslash),
            ("/a%5cb", Backslash),
            ("/a%5Cb", Backslash),
            ("/..", AboveRoot),
            ("/../login", AboveRoot),
            ("/x/../../login", AboveRoot),
            ("/%2e%2e/login", AboveRoot),
            ("/..;/login", DotWithParams),
            ("/x/.;a", DotWithParams),
            ("/x/%2e%2e;a/y", DotWithParams),
            ("/%", BadEscape),
            ("/%2", BadEscape),
            ("/%zz", BadEscape),
            ("/%+1", BadEscape),
            ("/%é", BadEscape),
        ];
        for (raw, want) in cases {
            assert_eq!(normalize(raw), Err(*want), "{raw}");
        }
    }

    /// Every path of up to five characters over an alphabet that makes dot
    /// segments, escapes, slashes and parameters: a normal form is its own normal
    /// form (found without copying), has no dot segment and no empty segment but a
    /// trailing one, and the route view of it is stable too.
    #[test]
    fn normal_forms_are_fixed_points() {
        const ALPHABET: &[u8] = b"/.%2eEfF;a5c";
        let mut raw = Vec::new();
        let mut checked = 0;
        for len in 0..=5u32 {
            for mut n in 0..ALPHABET.len().pow(len) {
                raw.clear();
                raw.push(b'/');
                for _ in 0..len {
                    raw.push(ALPHABET[n % ALPHABET.len()]);
                    n /= ALPHABET.len();
                }
                let raw = std::str::from_utf8(&raw).unwrap();
                let Ok(normal) = normalize(raw) else { continue };
                checked += 1;
                assert!(
                    matches!(normalize(&normal), Ok(Cow::Borrowed(n)) if n == normal),
                    "{raw} -> {normal}"
                );
                let segments: Vec<&str> = normal[1..].split('/').collect();
                for (i, s) in segments.iter().enumerate() {
                    assert!(!matches!(bare(s), "." | ".."), "{raw} -> {normal}");
                    assert!(
                        !s.is_empty() || i + 1 == segments.len(),
                        "{raw} -> {normal}"
                    );
                }
                let view = route_view(&normal);
                assert_eq!(route_view(&view), view, "{raw} -> {normal} -> {view}");
                assert!(view.starts_with('/'));
            }
        }
        assert!(checked > 10_000, "{checked}");
    }

    #[test]
    fn routes_see_paths_without_parameters() {
        for (path, want) in [
            ("/login", "/login"),
            ("/login;foo", "/login"),
            ("/login;a=1;b=2/x;y", "/login/x"),
            ("/;x/login", "/login"),
            ("/login/;x", "/login/"),
            ("/;x", "/"),
            ("/a%3Bb", "/a%3Bb"),
        ] {
            assert_eq!(route_view(path), want, "{path}");
        }
    }
}
