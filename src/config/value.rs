//! Scalar values of the configuration file. Each one interpolates `${VAR}` and
//! `${VAR:-default}` from the environment and then parses its own form, so a bad
//! value or an unset variable is reported at its own line and column.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;

/// Replace `${VAR}` and `${VAR:-default}`; `$${` stands for a literal `${`.
pub fn interpolate(s: &str) -> Result<String, String> {
    interpolate_with(s, |name| std::env::var(name).ok())
}

pub fn interpolate_with(
    s: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String, String> {
    if !s.contains("${") {
        return Ok(s.to_string());
    }
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        if let Some(after) = tail.strip_prefix("$${") {
            out.push_str("${");
            rest = after;
        } else if let Some(body) = tail.strip_prefix("${") {
            let end = body
                .find('}')
                .ok_or_else(|| format!("unclosed `${{` in {s:?}"))?;
            let expr = &body[..end];
            let (name, default) = match expr.split_once(":-") {
                Some((n, d)) => (n, Some(d)),
                None => (expr, None),
            };
            let valid =
                !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !valid {
                return Err(format!("`${{{expr}}}` is not a valid variable reference"));
            }
            match (lookup(name), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(format!(
                        "environment variable {name} is not set (write ${{{name}:-default}} for a fallback)"
                    ))
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Any scalar as text, interpolated, then parsed by `parse`. The parse runs inside
/// the visitor so that serde_yaml reports a bad value at its own line and column.
struct Scalar<'a, T> {
    what: &'a str,
    parse: &'a dyn Fn(&str) -> Option<T>,
}

impl<T> Scalar<'_, T> {
    fn finish<E: de::Error>(&self, raw: String) -> Result<T, E> {
        (self.parse)(&raw)
            .ok_or_else(|| E::custom(format!("expected {}, found {raw:?}", self.what)))
    }
}

impl<T> Visitor<'_> for Scalar<'_, T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        let s = interpolate(v).map_err(E::custom)?;
        self.finish(s)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        self.finish(v.to_string())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        self.finish(v.to_string())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        self.finish(v.to_string())
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<T, E> {
        self.finish(v.to_string())
    }
}

/// Deserialize a scalar as text and parse it with `parse`, reporting `what` was expected.
fn parsed<'de, D, T>(d: D, what: &str, parse: impl Fn(&str) -> Option<T>) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    d.deserialize_any(Scalar {
        what,
        parse: &|s: &str| parse(s.trim()),
    })
}

// === Text ===

/// A string, after interpolation.
#[derive(Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Text(pub String);

impl Text {
    pub fn literal(s: &str) -> Text {
        Text(s.to_string())
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for Text {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Text keeps surrounding spaces: it is taken as written.
        d.deserialize_any(Scalar {
            what: "a string",
            parse: &|s: &str| Some(s.to_string()),
        })
        .map(Text)
    }
}

// === Num ===

/// A whole number, written as a number or as a string (so `${VAR}` works).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Num<T>(pub T);

impl<T: Copy> Num<T> {
    pub fn get(self) -> T {
        self.0
    }
}

impl<'de, T: FromStr> Deserialize<'de> for Num<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(d, "a whole number", |s| s.parse::<T>().ok()).map(Num)
    }
}

// === Dur ===

/// A duration: `250ms`, `10s`, `1m`, `1h`, `1d` (also `us`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dur(pub Duration);

impl Dur {
    pub const fn secs(s: u64) -> Dur {
        Dur(Duration::from_secs(s))
    }
    pub const fn millis(ms: u64) -> Dur {
        Dur(Duration::from_millis(ms))
    }
    pub fn get(self) -> Duration {
        self.0
    }
}

/// Parse `N<unit>` with unit `us`, `ms`, `s`, `m`, `h` or `d`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let micros_per = match unit.trim() {
        "us" | "µs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" => 60_000_000,
        "h" => 3_600_000_000,
        "d" => 86_400_000_000,
        _ => return None,
    };
    n.checked_mul(micros_per).map(Duration::from_micros)
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(
            d,
            "a duration like 250ms, 10s, 1m, 1h or 1d",
            parse_duration,
        )
        .map(Dur)
    }
}

// === Window ===

/// A limit's window: a duration, or `month` (calendar months, UTC; fixed_window only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSpec {
    Length(Duration),
    Month,
}

pub fn parse_window(s: &str) -> Option<WindowSpec> {
    if s == "month" {
        return Some(WindowSpec::Month);
    }
    parse_duration(s).map(WindowSpec::Length)
}

impl<'de> Deserialize<'de> for WindowSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(
            d,
            "a duration like 10s, 1m, 1h or 1d, or month",
            parse_window,
        )
    }
}

/// A window as written: `1d`, `90s`, `month`.
pub fn fmt_window(w: WindowSpec) -> String {
    match w {
        WindowSpec::Length(d) => fmt_dur(d),
        WindowSpec::Month => "month".to_string(),
    }
}

// === RateSpec ===

/// A rate: `N/s`, `N/m`, `N/h`, `N/d`, or `N/<duration>` such as `5/10s`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateSpec {
    pub count: u64,
    pub per: Duration,
}

pub fn parse_rate(s: &str) -> Option<RateSpec> {
    let (n, per) = s.split_once('/')?;
    let count: u64 = n.trim().parse().ok()?;
    let per = per.trim();
    let per = if per.starts_with(|c: char| c.is_ascii_digit()) {
        parse_duration(per)?
    } else {
        parse_duration(&format!("1{per}"))?
    };
    Some(RateSpec { count, per })
}

impl<'de> Deserialize<'de> for RateSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(d, "a rate like 10/s, 100/m, 1000/h or 5/10s", parse_rate)
    }
}

// === Size ===

/// A byte size: `512`, `64KiB`, `10MiB`, `1GiB` (also KB, MB, GB as powers of ten).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Size(pub u64);

pub fn parse_size(s: &str) -> Option<u64> {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" | "kB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(d, "a size like 512, 64KiB or 10MiB", parse_size).map(Size)
    }
}

// === Net, Addr ===

/// An address or a CIDR block; a bare address is a /32 (or /128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net(pub IpNet);

pub fn parse_net(s: &str) -> Option<IpNet> {
    if let Ok(n) = s.parse::<IpNet>() {
        return Some(n.trunc());
    }
    s.parse::<IpAddr>().ok().map(IpNet::from)
}

impl<'de> Deserialize<'de> for Net {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(d, "an IP address or CIDR block like 10.0.0.0/8", parse_net).map(Net)
    }
}

/// A socket address to listen on, `IP:PORT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr(pub SocketAddr);

impl Addr {
    pub fn literal(s: &str) -> Addr {
        Addr(
            s.parse()
                .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0))),
        )
    }
}

impl<'de> Deserialize<'de> for Addr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        parsed(d, "a listen address like 0.0.0.0:8080 or [::1]:9091", |s| {
            s.parse::<SocketAddr>().ok()
        })
        .map(Addr)
    }
}

// === serialization, for /admin/config: each value as it would be written ===

macro_rules! serialize_as {
    ($t:ty, |$v:ident, $s:ident| $body:expr) => {
        impl serde::Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, $s: S) -> Result<S::Ok, S::Error> {
                let $v = self;
                $body
            }
        }
    };
}

// A literal `${` is written `$${`, or it would be interpolated when read back.
serialize_as!(Text, |v, s| s.serialize_str(&v.0.replace("${", "$${")));
serialize_as!(Dur, |v, s| s.serialize_str(&fmt_dur(v.0)));
serialize_as!(RateSpec, |v, s| s.serialize_str(&fmt_rate(*v)));
serialize_as!(WindowSpec, |v, s| s.serialize_str(&fmt_window(*v)));
serialize_as!(Size, |v, s| s.serialize_u64(v.0));
serialize_as!(Addr, |v, s| s.collect_str(&v.0));
serialize_as!(Net, |v, s| {
    let n = v.0;
    if n.prefix_len() == n.max_prefix_len() {
        s.collect_str(&n.addr())
    } else {
        s.collect_str(&n)
    }
});

impl<T: serde::Serialize> serde::Serialize for Num<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

// === JSON Schema (`sluice schema`): each value's written forms ===

/// The forms a value may be written in, as JSON Schema regular expressions (ECMA
/// 262, which `regex` also reads). Each accepts whatever its parser accepts (the unit
/// tests below hold them to that); `${VAR}` anywhere makes any value acceptable,
/// since only the environment at startup decides it.
pub mod forms {
    pub const DURATION: &str = r"[0-9]+\s*(?:us|µs|ms|s|m|h|d)";
    pub const WINDOW: &str = r"month|[0-9]+\s*(?:us|µs|ms|s|m|h|d)";
    pub const RATE: &str = r"\+?[0-9]+\s*/\s*(?:[0-9]+\s*)?(?:us|µs|ms|s|m|h|d)";
    pub const SIZE: &str = r"[0-9]+\s*(?:B|KB|kB|KiB|MB|MiB|GB|GiB)?";
    pub const NUMBER: &str = r"\+?[0-9]+";
    pub const NET: &str = r"[0-9A-Fa-f:.]+(?:/[0-9]{1,3})?";
    pub const ADDR: &str = r"(?:[0-9.]+|\[[0-9A-Fa-f:.]+(?:%[0-9]+)?\]):[0-9]{1,5}";

    /// The `pattern` of a value written as a string: the whole string in `form`
    /// (spaces around it allowed), or one with a `${` in it.
    pub fn pattern(form: &str) -> String {
        format!(r"^\s*(?:{form})\s*$|\$\{{")
    }
}

fn string_schema(description: &str, form: &str) -> schemars::Schema {
    schemars::json_schema!({
        "description": description,
        "type": "string",
        "pattern": forms::pattern(form),
    })
}

/// A count written as a number, or as a string (`"${LIMIT}"`).
fn count_schema(description: &str, maximum: u64) -> schemars::Schema {
    schemars::json_schema!({
        "description": description,
        "type": ["integer", "string"],
        "minimum": 0,
        "maximum": maximum,
        "pattern": forms::pattern(forms::NUMBER),
    })
}

macro_rules! json_schema_as {
    ($t:ty, $name:literal, $schema:expr) => {
        impl schemars::JsonSchema for $t {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                $name.into()
            }
            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                $schema
            }
        }
    };
}

json_schema_as!(
    Text,
    "Text",
    schemars::json_schema!({
        "description": "A string; `${VAR}` and `${VAR:-default}` are read from the environment. A number or boolean is taken as its text.",
        "type": ["string", "number", "boolean"],
    })
);
json_schema_as!(
    Dur,
    "Duration",
    string_schema(
        "A duration: 250ms, 10s, 1m, 1h, 1d (also us).",
        forms::DURATION
    )
);
json_schema_as!(
    WindowSpec,
    "Window",
    string_schema(
        "A duration: 10s, 1m, 1h, 1d (also ms, us); or month: calendar months, UTC (fixed_window only).",
        forms::WINDOW
    )
);
json_schema_as!(
    RateSpec,
    "Rate",
    string_schema(
        "A rate: N/s, N/m, N/h, N/d, or N per a duration such as 5/10s.",
        forms::RATE
    )
);
json_schema_as!(
    Size,
    "Size",
    schemars::json_schema!({
        "description": "A size in bytes: 512, 64KiB, 10MiB, 1GiB (KB, MB, GB are powers of ten).",
        "type": ["integer", "string"],
        "minimum": 0,
        "pattern": forms::pattern(forms::SIZE),
    })
);
json_schema_as!(
    Net,
    "Network",
    string_schema(
        "An IP address, or a CIDR block like 10.0.0.0/8 or 2001:db8::/32.",
        forms::NET
    )
);
json_schema_as!(
    Addr,
    "ListenAddress",
    string_schema(
        "A listen address IP:PORT, like 0.0.0.0:8080 or [::1]:9091.",
        forms::ADDR
    )
);

macro_rules! count_schema_for {
    ($t:ty, $name:literal) => {
        json_schema_as!(
            Num<$t>,
            $name,
            count_schema(
                "A whole number (or a string with `${VAR}`).",
                <$t>::MAX as u64
            )
        );
    };
}
count_schema_for!(u16, "Count16");
count_schema_for!(u32, "Count32");
count_schema_for!(u64, "Count");
count_schema_for!(usize, "CountSize");

// === formatting, for summaries, messages and /admin/config ===

pub use crate::telemetry::fmt_dur;

/// A byte size in the largest binary unit that divides it: `64KiB`, `1MiB`, `100`.
pub fn fmt_size(n: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    UNITS
        .iter()
        .find(|(u, _)| n > 0 && n.is_multiple_of(*u))
        .map(|(u, unit)| format!("{}{unit}", n / u))
        .unwrap_or_else(|| n.to_string())
}

/// A rate as written: `10/s`, `100/m`, `5/10s`.
pub fn fmt_rate(r: RateSpec) -> String {
    let per = fmt_dur(r.per);
    match per.strip_prefix('1') {
        Some(unit @ ("s" | "m" | "h" | "d")) => format!("{}/{unit}", r.count),
        _ => format!("{}/{per}", r.count),
    }
}

/// `url` with the password (or a bare user info, which Redis takes as a password
/// in some clients) replaced by `***`, for messages and summaries.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        None => url.to_string(),
        Some((userinfo, host)) => {
            let user = match userinfo.split_once(':') {
                Some((user, _)) if !user.is_empty() => format!("{user}:***"),
                _ => "***".to_string(),
            };
            format!("{scheme}://{user}@{host}{tail}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "TOKEN" => Some("s3cret".into()),
            "EMPTY" => Some(String::new()),
            _ => None,
        }
    }

    #[test]
    fn interpolation() {
        assert_eq!(interpolate_with("a${TOKEN}b", env).unwrap(), "as3cretb");
        assert_eq!(interpolate_with("${MISSING:-dflt}", env).unwrap(), "dflt");
        assert_eq!(interpolate_with("${EMPTY:-dflt}", env).unwrap(), "");
        assert_eq!(
            interpolate_with("$${TOKEN} $5", env).unwrap(),
            "${TOKEN} $5"
        );
        let e = interpolate_with("${MISSING}", env).unwrap_err();
        assert!(e.contains("MISSING is not set"), "{e}");
        assert!(interpolate_with("${A B}", env).is_err());
        assert!(interpolate_with("${OPEN", env).is_err());
    }

    #[test]
    fn durations_rates_sizes() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("1d"), Some(Duration::from_secs(86_400)));
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("1w"), None);
        let r = parse_rate("10/s").unwrap();
        assert_eq!((r.count, r.per), (10, Duration::from_secs(1)));
        let r = parse_rate("5/10s").unwrap();
        assert_eq!((r.count, r.per), (5, Duration::from_secs(10)));
        assert_eq!(parse_rate("10/fortnight"), None);
        assert_eq!(parse_size("10MiB"), Some(10 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("1.5MiB"), None);
        assert_eq!(
            parse_net("10.1.2.3/8").map(|n| n.to_string()),
            Some("10.0.0.0/8".into())
        );
        assert_eq!(
            parse_net("::1").map(|n| n.to_string()),
            Some("::1/128".into())
        );
    }

    #[test]
    fn durations_and_rates() {
        assert_eq!(fmt_dur(Duration::from_secs(86_400)), "1d");
        assert_eq!(fmt_dur(Duration::from_secs(90)), "90s");
        assert_eq!(fmt_dur(Duration::from_millis(250)), "250ms");
        assert_eq!(fmt_dur(Duration::ZERO), "0s");
        let rate = |count, secs| RateSpec {
            count,
            per: Duration::from_secs(secs),
        };
        assert_eq!(fmt_rate(rate(10, 1)), "10/s");
        assert_eq!(fmt_rate(rate(100, 60)), "100/m");
        assert_eq!(fmt_rate(rate(5, 10)), "5/10s");
        assert_eq!(fmt_rate(rate(5, 86_400)), "5/d");
    }

    #[test]
    fn text_is_shown_as_written() {
        // `$${` is how a file writes a literal `${`; shown unescaped, the value would
        // be interpolated when copied back into a file.
        let shown = serde_json::to_string(&Text::literal("a ${HOME} $5")).unwrap();
        assert_eq!(shown, r#""a $${HOME} $5""#);
        let back: Text = serde_yaml::from_str(&shown).unwrap();
        assert_eq!(back.as_str(), "a ${HOME} $5");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact_url("redis://:s3cret@h:6379/0"),
            "redis://***@h:6379/0"
        );
        assert_eq!(
            redact_url("rediss://user:s3cret@h:6380"),
            "rediss://user:***@h:6380"
        );
        assert_eq!(redact_url("redis://h:6379/0"), "redis://h:6379/0");
        assert_eq!(redact_url("nonsense"), "nonsense");
    }

    /// Does the schema's pattern for `form` accept `s`?
    fn schema_accepts(form: &str, s: &str) -> bool {
        regex::Regex::new(&forms::pattern(form))
            .unwrap()
            .is_match(s)
    }

    /// The schema accepts every form its parser accepts, and refuses the usual
    /// mistakes the parser refuses, so an editor never flags a file sluice reads.
    #[test]
    fn schema_forms_agree_with_the_parsers() {
        type Parser = fn(&str) -> bool;
        let cases: [(&str, Parser, &[&str], &[&str]); 7] = [
            (
                forms::DURATION,
                |s| parse_duration(s.trim()).is_some(),
                &["250ms", "10s", " 1m ", "1h", "1d", "5us", "5µs", "10 s"],
                &["10", "1w", "1.5s", "s", "-1s", "10s5"],
            ),
            (
                forms::WINDOW,
                |s| parse_window(s.trim()).is_some(),
                &["month", " month ", "30d", "10s", "1m", "250ms"],
                &["Month", "months", "1month", "month1", "monthly", "10", "1w"],
            ),
            (
                forms::RATE,
                |s| parse_rate(s.trim()).is_some(),
                &[
                    "10/s", "100/m", "1000/h", "5/d", "5/10s", "5 / 10 s", "7/250ms", "+5/s",
                ],
                &[
                    "10",
                    "10/fortnight",
                    "1.5/s",
                    "/s",
                    "10/",
                    "10 per s",
                    "-5/s",
                ],
            ),
            (
                forms::SIZE,
                |s| parse_size(s.trim()).is_some(),
                &[
                    "512", "512B", "64KiB", "64KB", "64kB", "10MiB", "10 MB", "1GiB", "1GB",
                ],
                &["1.5MiB", "10mb", "MiB", "-1", "1TiB"],
            ),
            (
                forms::NUMBER,
                |s| s.trim().parse::<u64>().is_ok(),
                &["0", "20", " 7 ", "+5"],
                &["-1", "1.5", "ten", "", "++5"],
            ),
            (
                forms::NET,
                |s| parse_net(s.trim()).is_some(),
                &[
                    "10.0.0.0/8",
                    "198.51.100.7",
                    "2001:db8::/32",
                    "::1",
                    "::ffff:1.2.3.4",
                ],
                &["example.com", "10.0.0.0/", "10.0.0.0/8/8", ""],
            ),
            (
                forms::ADDR,
                |s| s.trim().parse::<SocketAddr>().is_ok(),
                &["0.0.0.0:8080", "127.0.0.1:9091", "[::1]:9091", "[::]:80"],
                &["localhost:8080", "8080", ":8080", "0.0.0.0", "[::1]"],
            ),
        ];
        for (form, parses, good, bad) in cases {
            for s in good {
                assert!(parses(s), "{form}: the parser refuses {s:?}");
                assert!(schema_accepts(form, s), "{form}: the schema refuses {s:?}");
            }
            for s in bad {
                assert!(!parses(s), "{form}: the parser accepts {s:?}");
                assert!(!schema_accepts(form, s), "{form}: the schema accepts {s:?}");
            }
            // An interpolated value is left to the environment at startup.
            assert!(schema_accepts(form, "${LIMIT}"), "{form}");
            assert!(schema_accepts(form, "x${LIMIT:-1}"), "{form}");
        }
    }
}
