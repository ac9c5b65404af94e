//! What sluice tells operators: Prometheus metrics, the refusal log, the access
//! log, the heaviest refused clients of each route (`top`), and the UTC times and
//! durations they write.

pub mod access_file;
pub mod access_log;
pub mod metrics;
pub mod refusal_log;
pub mod top;

/// A moment in UTC, from milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Civil {
    pub year: i64,
    /// 1 to 12.
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub milli: u32,
}

impl Civil {
    pub fn from_ms(ms: u64) -> Civil {
        let secs = ms / 1000;
        let (days, rem) = (secs / 86_400, secs % 86_400);
        // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        Civil {
            year,
            month: month as u32,
            day: day as u32,
            hour: (rem / 3600) as u32,
            minute: (rem % 3600 / 60) as u32,
            second: (rem % 60) as u32,
            milli: (ms % 1000) as u32,
        }
    }
}

/// `2026-11-21T22:10:00Z` (`.123` added when the milliseconds are not zero).
pub fn rfc3339(ms: u64) -> String {
    let mut out = Vec::with_capacity(24);
    push_rfc3339(&mut out, ms);
    String::from_utf8(out).unwrap_or_default()
}

/// Appends `rfc3339(ms)` to `out`. The date and time of the second are kept per
/// thread, so a busy access log formats each second once.
pub fn push_rfc3339(out: &mut Vec<u8>, ms: u64) {
    use std::io::Write as _;
    thread_local! {
        static SECOND: std::cell::Cell<(u64, [u8; 19])> =
            const { std::cell::Cell::new((u64::MAX, [0; 19])) };
    }
    let second = ms / 1000;
    let (cached, text) = SECOND.get();
    if cached == second {
        out.extend_from_slice(&text);
    } else {
        let start = out.len();
        let c = Civil::from_ms(ms);
        let _ = write!(
            out,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}",
            c.year, c.month, c.day, c.hour, c.minute, c.second
        );
        // Kept when it fits: every year up to 9999.
        if let Ok(text) = <[u8; 19]>::try_from(&out[start..]) {
            SECOND.set((second, text));
        }
    }
    match ms % 1000 {
        0 => {}
        milli => {
            out.push(b'.');
            out.push(b'0' + (milli / 100) as u8);
            out.push(b'0' + (milli / 10 % 10) as u8);
            out.push(b'0' + (milli % 10) as u8);
        }
    }
    out.push(b'Z');
}

/// A duration in the largest unit that divides it: `1d`, `90s`, `250ms`.
pub fn fmt_dur(d: std::time::Duration) -> String {
    let us = d.as_micros();
    if us == 0 {
        return "0s".to_string();
    }
    const UNITS: [(u128, &str); 6] = [
        (86_400_000_000, "d"),
        (3_600_000_000, "h"),
        (60_000_000, "m"),
        (1_000_000, "s"),
        (1_000, "ms"),
        (1, "us"),
    ];
    UNITS
        .iter()
        .find(|(n, _)| us.is_multiple_of(*n))
        .map(|(n, unit)| format!("{}{unit}", us / n))
        .unwrap_or_else(|| format!("{us}us"))
}
