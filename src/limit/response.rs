//! Limits charged from the upstream's response instead of at admission: `count:
//! {status: [...]}` (only responses with a listed status count) and `cost:
//! {response_header: NAME, default: N}` (the response says what the request cost)
//! and `cost: {response_json: ...}` (its body says: `limit::metered` reads it).
//! Before forwarding such a limit is only checked, for one unit (or its fixed cost):
//! it refuses once nothing is left, and charges nothing. When the response head
//! arrives, what it says is charged whatever is left (`Algorithm::charge_anyway`),
//! off the response path.

use http::{HeaderMap, HeaderName};

/// When a limit is charged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Charge {
    /// When the request is admitted (every limit, unless configured otherwise).
    #[default]
    Admission,
    /// When the upstream's response head arrives (or, for a cost read from the
    /// body, when the body ends).
    Response(Box<FromResponse>),
    /// Not a limit's own: what a response charged less than its `estimate`, given
    /// back (`Algorithm::refund`) when the body ends.
    GiveBack,
}

/// What a response charges a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FromResponse {
    /// `count: {status: [...]}`: only responses with one of these statuses charge;
    /// None: every response.
    pub statuses: Option<StatusSet>,
    pub cost: ResponseCost,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResponseCost {
    /// The limit's `cost`.
    Units(u64),
    /// `cost: {response_header, default}`: the header's value, at most `cap` (the
    /// limit's quota: no response can owe more than a whole window or bucket).
    Header {
        name: HeaderName,
        default: u64,
        cap: u64,
    },
    /// `cost: {response_json, estimate, default}`: read from the body when it ends.
    Body(Box<BodyCost>),
}

/// A cost read from the response body (`limit::metered`), at most `cap` (the
/// limit's quota).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyCost {
    /// RFC 6901 pointers, as written; their values are summed.
    pub pointers: Vec<String>,
    /// Charged at admission (the limit's `cost` then) and settled at the end.
    pub estimate: Option<Estimate>,
    /// Charged when the body does not say.
    pub default: u64,
    pub cap: u64,
}

/// `estimate`: a fixed number of units, or read from the request's JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Estimate {
    Units(u64),
    /// A pointer into the request body (`json:/max_tokens`); `default` when the
    /// body has no whole number there.
    Read {
        pointer: String,
        default: u64,
    },
}

impl Estimate {
    /// What is held when nothing else says: the units, or the default of a read.
    pub fn fallback(&self) -> u64 {
        match self {
            Estimate::Units(n) | Estimate::Read { default: n, .. } => *n,
        }
    }
}

/// Where the charge of a limit charged from what the response says came from,
/// counted in `sluice_response_costs_total{source}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostFrom {
    /// The header, as sent.
    Header,
    /// A JSON body's pointers.
    Json,
    /// The last values of the pointers in an event stream's events.
    Sse,
    /// Nothing read (the client went away, the upstream failed): the estimate held.
    Estimate,
    /// The response did not say (no such header, no pointer in the body):
    /// `default`.
    Default,
    /// What it said is not a whole number of units (negative, a fraction, text,
    /// a header sent twice, a body that is not JSON or larger than what is kept):
    /// `default` (or the estimate held).
    Invalid,
    /// Above the limit's quota: the quota.
    Capped,
}

impl CostFrom {
    pub const ALL: [CostFrom; 7] = [
        CostFrom::Header,
        CostFrom::Json,
        CostFrom::Sse,
        CostFrom::Estimate,
        CostFrom::Default,
        CostFrom::Invalid,
        CostFrom::Capped,
    ];

    /// What a cost read from a header can come from.
    pub const OF_HEADER: [CostFrom; 4] = [
        CostFrom::Header,
        CostFrom::Default,
        CostFrom::Invalid,
        CostFrom::Capped,
    ];

    /// What a cost read from a body can come from.
    pub const OF_BODY: [CostFrom; 6] = [
        CostFrom::Json,
        CostFrom::Sse,
        CostFrom::Estimate,
        CostFrom::Default,
        CostFrom::Invalid,
        CostFrom::Capped,
    ];

    /// Its place in `ALL`.
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn label(self) -> &'static str {
        match self {
            CostFrom::Header => "header",
            CostFrom::Json => "json",
            CostFrom::Sse => "sse",
            CostFrom::Estimate => "estimate",
            CostFrom::Default => "default",
            CostFrom::Invalid => "invalid",
            CostFrom::Capped => "capped",
        }
    }
}

impl FromResponse {
    /// What a response with `status` and `headers` charges: the units, and for a
    /// cost read from a header how it was found. Zero: nothing to charge.
    pub fn units(&self, status: u16, headers: &HeaderMap) -> (u64, Option<CostFrom>) {
        if self.statuses.as_ref().is_some_and(|s| !s.contains(status)) {
            return (0, None);
        }
        match &self.cost {
            ResponseCost::Units(n) => (*n, None),
            ResponseCost::Header { name, default, cap } => {
                let mut values = headers.get_all(name).iter();
                let (first, second) = (values.next(), values.next());
                let (units, from) = match (first, second) {
                    (None, _) => (*default, CostFrom::Default),
                    (Some(v), None) => match whole_number(v.as_bytes()) {
                        Some(n) if n > *cap => (*cap, CostFrom::Capped),
                        Some(n) => (n, CostFrom::Header),
                        None => (*default, CostFrom::Invalid),
                    },
                    // Two values: which one the upstream meant is not ours to pick.
                    (Some(_), Some(_)) => (*default, CostFrom::Invalid),
                };
                (units, Some(from))
            }
            // Charged when the body ends (`limit::metered`), not from the head.
            ResponseCost::Body(_) => (0, None),
        }
    }

    /// The body's cost, when the limit's cost is read from the body.
    pub fn body(&self) -> Option<&BodyCost> {
        match &self.cost {
            ResponseCost::Body(b) => Some(b),
            _ => None,
        }
    }
}

/// A header value that is a whole number: ASCII digits with optional spaces or tabs
/// around them; saturating, so a huge one is capped, not refused.
fn whole_number(v: &[u8]) -> Option<u64> {
    let v = v.trim_ascii();
    if v.is_empty() || !v.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(v.iter().fold(0u64, |n, d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

/// A set of HTTP status codes, 100 to 599, a bit each.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    pub fn insert(&mut self, status: u16) {
        if status < 640 {
            self.0[usize::from(status / 64)] |= 1 << (status % 64);
        }
    }

    /// Every code of a class: `5` for 500 to 599.
    pub fn insert_class(&mut self, class: u16) {
        for s in class * 100..class * 100 + 100 {
            self.insert(s);
        }
    }

    pub fn contains(&self, status: u16) -> bool {
        status < 640 && self.0[usize::from(status / 64)] & (1 << (status % 64)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-usage-tokens", HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn a_status_list_charges_only_its_codes_and_classes() {
        let mut set = StatusSet::default();
        set.insert(401);
        set.insert(403);
        set.insert_class(5);
        let r = FromResponse {
            statuses: Some(set),
            cost: ResponseCost::Units(2),
        };
        let h = HeaderMap::new();
        let charged: Vec<u16> = [200, 400, 401, 402, 403, 499, 500, 503, 599, 600]
            .into_iter()
            .filter(|&s| r.units(s, &h).0 > 0)
            .collect();
        assert_eq!(charged, [401, 403, 500, 503, 599]);
        assert_eq!(r.units(401, &h), (2, None));
    }

    #[test]
    fn a_cost_from_a_header_is_capped_and_falls_back_to_its_default() {
        let r = FromResponse {
            statuses: None,
            cost: ResponseCost::Header {
                name: HeaderName::from_static("x-usage-tokens"),
                default: 7,
                cap: 1000,
            },
        };
        type Case<'a> = (&'a [&'a str], (u64, Option<CostFrom>));
        let cases: [Case; 12] = [
            (&["250"], (250, Some(CostFrom::Header))),
            (&[" 250\t"], (250, Some(CostFrom::Header))),
            (&["0"], (0, Some(CostFrom::Header))),
            (&["1000"], (1000, Some(CostFrom::Header))),
            (&["1001"], (1000, Some(CostFrom::Capped))),
            (&["99999999999999999999999"], (1000, Some(CostFrom::Capped))),
            (&[], (7, Some(CostFrom::Default))),
            (&["-5"], (7, Some(CostFrom::Invalid))),
            (&["2.5"], (7, Some(CostFrom::Invalid))),
            (&["ten"], (7, Some(CostFrom::Invalid))),
            (&[""], (7, Some(CostFrom::Invalid))),
            (&["5", "6"], (7, Some(CostFrom::Invalid))),
        ];
        for (values, expected) in cases {
            assert_eq!(r.units(200, &headers(values)), expected, "{values:?}");
        }
    }
}
