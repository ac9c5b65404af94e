//! One `ShouldRateLimit` call decided: each descriptor's rule found as
//! envoyproxy/ratelimit finds it, the deny list asked, every limited descriptor
//! decided in one store call (all charged, or none when the call is refused), and
//! the answer built as envoyproxy/ratelimit builds it.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration;
use prometheus::IntCounter;

use super::files::{Domain, Domains, Rule, Unit};
use crate::limit::{Mode, OnError, Outcome, Plan, Share, Verdict};
use crate::pipeline::Shared;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::top::Top;

/// A descriptor's decision, as `sluice_rls_descriptors_total` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Ok,
    OverLimit,
    Shadow,
    Unlimited,
    Denied,
    None,
    StoreError,
}

pub const DECISIONS: [Decision; 7] = [
    Decision::Ok,
    Decision::OverLimit,
    Decision::Shadow,
    Decision::Unlimited,
    Decision::Denied,
    Decision::None,
    Decision::StoreError,
];

impl Decision {
    pub fn label(self) -> &'static str {
        match self {
            Decision::Ok => "ok",
            Decision::OverLimit => "over_limit",
            Decision::Shadow => "shadow",
            Decision::Unlimited => "unlimited",
            Decision::Denied => "denied",
            Decision::None => "none",
            Decision::StoreError => "store_error",
        }
    }
}

/// A call's answer as `sluice_rls_requests_total` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallCode {
    Ok,
    OverLimit,
    Error,
}

const CALL_CODES: [&str; 3] = ["ok", "over_limit", "error"];

/// A domain's metric children, resolved when its file is loaded.
pub struct Counters {
    calls: [IntCounter; 3],
    /// By rule path; `_none` for descriptors that reach no rule.
    descriptors: HashMap<String, [IntCounter; 7]>,
}

/// The label of descriptors that reach no rule, and of calls to no known domain.
const NONE: &str = "_none";
const UNKNOWN_DOMAIN: &str = "_unknown";

impl Counters {
    fn new(metrics: &Metrics, domain: &str, rules: &[Arc<Rule>]) -> Counters {
        let calls = CALL_CODES.map(|c| metrics.rls_requests.with_label_values(&[domain, c]));
        let paths = rules.iter().map(|r| r.path.as_str()).chain([NONE]);
        let descriptors = paths
            .map(|p| {
                let children = DECISIONS.map(|d| {
                    metrics
                        .rls_descriptors
                        .with_label_values(&[domain, p, d.label()])
                });
                (p.to_string(), children)
            })
            .collect();
        Counters { calls, descriptors }
    }

    fn call(&self, code: CallCode) {
        self.calls[code as usize].inc();
    }

    fn descriptor(&self, rule: Option<&Rule>, d: Decision) {
        let path = rule.map_or(NONE, |r| r.path.as_str());
        // A limit override is no rule of the file: counted with `_none`.
        let children = self
            .descriptors
            .get(path)
            .or_else(|| self.descriptors.get(NONE));
        if let Some(c) = children {
            c[DECISIONS.iter().position(|x| *x == d).unwrap_or(0)].inc();
        }
    }
}

/// The domains of `rls.config_dir` with their metric children: swapped whole on a
/// reload.
pub struct Compiled {
    pub domains: Domains,
    counters: HashMap<String, Counters>,
    unknown: Counters,
    /// Each domain's most refused callers, kept across reloads by name.
    pub tops: HashMap<String, Arc<Top>>,
}

impl Compiled {
    /// `domains` with their metric children; the sketches of `before`'s domains
    /// that are still there are kept.
    pub fn new(domains: Domains, metrics: &Metrics, before: Option<&Compiled>) -> Compiled {
        let counters = domains
            .by_name
            .values()
            .map(|d| (d.name.clone(), Counters::new(metrics, &d.name, &d.rules)))
            .collect();
        let tops = domains
            .by_name
            .keys()
            .map(|name| {
                let kept = before.and_then(|b| b.tops.get(name)).cloned();
                (name.clone(), kept.unwrap_or_default())
            })
            .collect();
        Compiled {
            domains,
            counters,
            unknown: Counters::new(metrics, UNKNOWN_DOMAIN, &[]),
            tops,
        }
    }
}

/// A malformed call: answered with gRPC's INVALID_ARGUMENT.
#[derive(Debug, thiserror::Error)]
pub enum Malformed {
    #[error("rate limit domain must not be empty")]
    NoDomain,
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
}

/// One descriptor of a call, as decided.
struct Item {
    rule: Option<Arc<Rule>>,
    /// Its entries with their values (`/admin/top` shows them).
    key: String,
    /// Where its count lives in the domain's namespace: `key`, or its digest.
    stored: String,
    cost: u64,
    denied: bool,
    /// The client address of a `remote_address` entry, for `/admin/top`.
    ip: Option<IpAddr>,
}

/// What the store said about the call's limited descriptors.
enum Said {
    /// Nothing was asked (no descriptor has a limit).
    Nothing,
    /// Each descriptor's outcome, and what its share was to be charged.
    Verdict(Verdict, Vec<u64>),
    /// The store failed and `on_error` is `allow` or `deny`.
    Failed(OnError),
}

/// Decides `req` against `compiled` in the gateway's store and deny list.
pub async fn decide(
    shared: &Shared,
    compiled: &Compiled,
    req: &RateLimitRequest,
    response_headers: bool,
) -> Result<RateLimitResponse, Malformed> {
    let domain = compiled.domains.by_name.get(&req.domain);
    let counters = domain
        .and_then(|d| compiled.counters.get(&d.name))
        .unwrap_or(&compiled.unknown);
    if req.domain.is_empty() || req.descriptors.is_empty() {
        counters.call(CallCode::Error);
        return Err(if req.domain.is_empty() {
            Malformed::NoDomain
        } else {
            Malformed::NoDescriptors
        });
    }
    let items = items(shared, domain, req);
    let ns = format!("rls:{}", req.domain);
    let said = ask(shared, &ns, &items).await;
    let (answer, decisions) = answer(&items, &said, response_headers);
    for (item, d) in items.iter().zip(decisions) {
        counters.descriptor(item.rule.as_deref(), d);
    }
    let code = match (&said, answer.overall_code == Code::OverLimit as i32) {
        (Said::Failed(_), _) => CallCode::Error,
        (_, true) => CallCode::OverLimit,
        (_, false) => CallCode::Ok,
    };
    counters.call(code);
    if let (Some(d), true) = (domain, answer.overall_code == Code::OverLimit as i32) {
        if let Some(top) = compiled.tops.get(&d.name) {
            let ip = items.iter().find_map(|i| i.ip);
            let ip = ip.unwrap_or(IpAddr::from([0, 0, 0, 0]));
            let refusing = answer
                .statuses
                .iter()
                .position(|s| s.code == Code::OverLimit as i32);
            if let Some(item) = refusing.and_then(|n| items.get(n)) {
                top.refused(&top_key(item), ip, crate::deny::now_ms());
            }
        }
    }
    Ok(answer)
}

/// A refused call's key in `/admin/top`: the values of its first refusing
/// descriptor, joined by `,` (one entry's value alone: the key `sluice deny`
/// takes, which then refuses every call with it).
fn top_key(item: &Item) -> String {
    let values: Vec<&str> = item
        .key
        .split('\u{1e}')
        .map(|entry| entry.split_once('\u{1f}').map_or(entry, |(_, v)| v))
        .collect();
    values.join(",")
}

/// Each descriptor's rule (a `limit` override, else the configured node), cost,
/// key and whether the deny list refuses it; then `replaces` applied.
fn items(shared: &Shared, domain: Option<&Arc<Domain>>, req: &RateLimitRequest) -> Vec<Item> {
    let rt = shared.runtime.load();
    let dynamic = shared.deny.load();
    let request_hits = u64::from(req.hits_addend.max(1));
    let mut items: Vec<Item> = req
        .descriptors
        .iter()
        .map(|d| {
            let entries: Vec<(&str, &str)> = d
                .entries
                .iter()
                .map(|e| (e.key.as_str(), e.value.as_str()))
                .collect();
            let ip = entries
                .iter()
                .find(|(k, _)| *k == "remote_address")
                .and_then(|(_, v)| v.parse::<IpAddr>().ok());
            let denied = ip.is_some_and(|ip| rt.deny.table.ip(ip) || dynamic.ip(ip))
                || entries
                    .iter()
                    .any(|(_, v)| rt.deny.table.key(v) || dynamic.key(v));
            // A descriptor's own hits_addend may be 0: checked, not counted.
            let cost = d.hits_addend.as_ref().map_or(request_hits, |h| h.value);
            let (rule, shared_values) = match domain {
                None => (None, Vec::new()),
                Some(domain) => match d.limit.as_ref().and_then(|l| {
                    Unit::from_proto(l.unit).map(|u| Rule::overriding(l.requests_per_unit, u))
                }) {
                    Some(r) => (Some(Arc::new(r)), Vec::new()),
                    None => {
                        let found = domain.find(&entries);
                        let shared: Vec<Option<String>> =
                            found.shared.iter().map(|s| s.map(str::to_string)).collect();
                        (found.rule.cloned(), shared)
                    }
                },
            };
            // `is_negative_hits` asks to give hits back: not supported, so the
            // descriptor is left unlimited by this call rather than charged.
            let rule = rule.filter(|_| !d.is_negative_hits);
            let mut key = String::new();
            for (i, (k, v)) in entries.iter().enumerate() {
                if i > 0 {
                    key.push('\u{1e}');
                }
                key.push_str(k);
                key.push('\u{1f}');
                key.push_str(shared_values.get(i).and_then(|s| s.as_deref()).unwrap_or(v));
            }
            // As the gateway stores client keys: a long one, or one with braces
            // (which would split a Redis Cluster's hash tag), by its digest.
            let stored = if crate::identity::kept_hashed(&key) {
                crate::identity::KeyDigest::of(&key).as_str().to_string()
            } else {
                key.clone()
            };
            Item {
                rule,
                key,
                stored,
                cost,
                denied,
                ip,
            }
        })
        .collect();
    // A rule named in another reached rule's `replaces` is not applied.
    let replaced: HashSet<&str> = items
        .iter()
        .filter_map(|i| i.rule.as_deref())
        .flat_map(|r| r.replaces.iter().map(String::as_str))
        .collect();
    if !replaced.is_empty() {
        let drop: Vec<bool> = items
            .iter()
            .map(|i| {
                i.rule
                    .as_deref()
                    .is_some_and(|r| !r.name.is_empty() && replaced.contains(r.name.as_str()))
            })
            .collect();
        for (i, d) in items.iter_mut().zip(drop) {
            if d {
                i.rule = None;
            }
        }
    }
    items
}

/// The limited descriptors decided in one store call. A denied descriptor
/// refuses the call, so a limit that refuses everything joins it: the others are
/// decided (their counts reported) and none is charged.
async fn ask(shared: &Shared, ns: &str, items: &[Item]) -> Said {
    let limited: Vec<(usize, &Item)> = items
        .iter()
        .enumerate()
        .filter(|(_, i)| i.rule.as_ref().is_some_and(|r| r.limit.is_some()))
        .collect();
    let denied = items.iter().any(|i| i.denied);
    if limited.is_empty() {
        return Said::Nothing;
    }
    // Descriptors that reach the same count (the same entries and limit twice in
    // a call) are one share, charged their costs together: decided apart, each
    // would be judged against the count before the other and both charged.
    let mut plans: Vec<Plan> = Vec::with_capacity(limited.len() + 1);
    let mut keys: Vec<&str> = Vec::with_capacity(limited.len() + 1);
    let mut share_of: Vec<usize> = Vec::with_capacity(limited.len());
    for (_, item) in &limited {
        let Some((rule, def)) = item
            .rule
            .as_ref()
            .and_then(|r| Some((r, r.limit.as_ref()?)))
        else {
            continue;
        };
        let same = keys
            .iter()
            .zip(&plans)
            .position(|(k, p)| *k == item.stored && p.limits[0].id == def.id);
        match same {
            Some(j) => {
                plans[j].limits[0].cost += item.cost;
                share_of.push(j);
            }
            None => {
                let mut limit = def.clone();
                limit.cost = item.cost;
                limit.shadow = rule.shadow;
                plans.push(Plan {
                    limits: vec![limit],
                    mode: Mode::Reject,
                });
                keys.push(item.stored.as_str());
                share_of.push(plans.len() - 1);
            }
        }
    }
    if denied {
        plans.push(Plan {
            limits: vec![super::refuse_all()],
            mode: Mode::Reject,
        });
        keys.push("\u{1f}denied");
    }
    let at: Vec<usize> = (0..plans.len()).collect();
    let shares: Vec<Share<'_>> = plans
        .iter()
        .zip(&keys)
        .zip(&at)
        .map(|((plan, key), at)| Share {
            ns,
            key,
            plan,
            at: std::slice::from_ref(at),
        })
        .collect();
    let trial = plans
        .iter()
        .take(64)
        .enumerate()
        .filter(|(_, p)| p.limits.iter().any(|l| l.shadow))
        .fold(0u64, |m, (i, _)| m | 1 << i);
    let checked = match shared.store.check_shares_asked(&shares, trial).await {
        Ok(c) => Some(c),
        Err(e) => {
            let on_error = shared.runtime.load().on_error;
            tracing::debug!(error = %e, "rls: the store failed; on_error {on_error:?}");
            match on_error {
                OnError::Local => shared.store.fallback_shares(&shares, trial),
                other => return Said::Failed(other),
            }
        }
    };
    match checked {
        Some(c) => {
            // Outcomes by descriptor, each that of its share (the refuse-all share,
            // if any, is dropped), with what the share would have been charged.
            let mut outcomes = vec![Outcome::default(); items.len()];
            let mut charged = vec![0; items.len()];
            for ((i, _), j) in limited.iter().zip(&share_of) {
                if let Some(o) = c.verdict.outcomes.get(*j) {
                    outcomes[*i] = *o;
                    charged[*i] = plans[*j].limits[0].cost;
                }
            }
            Said::Verdict(
                Verdict {
                    allowed: c.verdict.allowed,
                    delay_us: 0,
                    outcomes: outcomes.into(),
                    trial: 0,
                },
                charged,
            )
        }
        None => Said::Failed(OnError::Allow),
    }
}

/// The response: statuses in the call's order, the overall code, and the
/// headers of the descriptor closest to its limit.
fn answer(
    items: &[Item],
    said: &Said,
    response_headers: bool,
) -> (RateLimitResponse, Vec<Decision>) {
    let mut statuses = Vec::with_capacity(items.len());
    let mut decisions = Vec::with_capacity(items.len());
    for (n, item) in items.iter().enumerate() {
        let limit = item.rule.as_deref();
        let current = limit.filter(|r| !r.unlimited).map(|r| RateLimit {
            name: r.name.clone(),
            requests_per_unit: r.requests_per_unit,
            unit: r.unit.proto(),
        });
        let (status, decision) = match (limit, said) {
            _ if item.denied => (
                DescriptorStatus {
                    code: Code::OverLimit as i32,
                    current_limit: current,
                    ..Default::default()
                },
                Decision::Denied,
            ),
            (Some(r), _) if r.unlimited => (
                DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
                Decision::Unlimited,
            ),
            (Some(r), Said::Verdict(v, charged)) => {
                let o: Outcome = v.outcomes.get(n).copied().unwrap_or_default();
                let over = !o.allowed;
                // Admitted by its limit in a refused call: not charged, so its
                // count is reported without this call.
                let remaining = if over {
                    0
                } else if v.allowed {
                    o.remaining
                } else {
                    let charged = charged.get(n).copied().unwrap_or(item.cost);
                    o.remaining.saturating_add(charged).min(o.quota)
                };
                let decision = match (over, r.shadow) {
                    (false, _) => Decision::Ok,
                    (true, true) => Decision::Shadow,
                    (true, false) => Decision::OverLimit,
                };
                let status = DescriptorStatus {
                    code: if decision == Decision::OverLimit {
                        Code::OverLimit as i32
                    } else {
                        Code::Ok as i32
                    },
                    current_limit: current,
                    limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                    duration_until_reset: Some(Duration {
                        seconds: i64::try_from(o.reset_us.div_ceil(1_000_000)).unwrap_or(i64::MAX),
                        nanos: 0,
                    }),
                    ..Default::default()
                };
                (status, decision)
            }
            (Some(r), Said::Failed(on_error)) if r.limit.is_some() => (
                DescriptorStatus {
                    code: if *on_error == OnError::Deny {
                        Code::OverLimit as i32
                    } else {
                        Code::Ok as i32
                    },
                    current_limit: current.filter(|_| *on_error == OnError::Deny),
                    ..Default::default()
                },
                Decision::StoreError,
            ),
            _ => (
                DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
                Decision::None,
            ),
        };
        statuses.push(status);
        decisions.push(decision);
    }
    let over = statuses.iter().any(|s| s.code == Code::OverLimit as i32);
    let mut response = RateLimitResponse {
        overall_code: if over {
            Code::OverLimit as i32
        } else {
            Code::Ok as i32
        },
        ..Default::default()
    };
    if response_headers {
        response.response_headers_to_add = headers(&statuses);
    }
    response.statuses = statuses;
    (response, decisions)
}

/// envoyproxy/ratelimit's `LIMIT_RESPONSE_HEADERS_ENABLED`: the headers of the
/// descriptor with a limit and the fewest requests left, or of the last one over
/// its limit.
fn headers(statuses: &[DescriptorStatus]) -> Vec<HeaderValue> {
    let mut closest: Option<&DescriptorStatus> = None;
    let mut min = u32::MAX;
    for s in statuses {
        if s.current_limit.is_some() && s.limit_remaining < min {
            closest = Some(s);
            min = s.limit_remaining;
        }
        if s.code == Code::OverLimit as i32 && s.current_limit.is_some() {
            closest = Some(s);
            min = 0;
        }
    }
    let Some(s) = closest else { return Vec::new() };
    let Some(limit) = &s.current_limit else {
        return Vec::new();
    };
    let reset = s.duration_until_reset.as_ref().map_or(0, |d| d.seconds);
    let header = |key: &str, value: String| HeaderValue {
        key: key.into(),
        value,
        ..Default::default()
    };
    vec![
        header("RateLimit-Limit", limit.requests_per_unit.to_string()),
        header("RateLimit-Remaining", s.limit_remaining.to_string()),
        header("RateLimit-Reset", reset.to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, rpu: Option<u32>, remaining: u32, reset: i64) -> DescriptorStatus {
        DescriptorStatus {
            code: code as i32,
            current_limit: rpu.map(|requests_per_unit| RateLimit {
                name: String::new(),
                requests_per_unit,
                unit: Unit::Minute.proto(),
            }),
            limit_remaining: remaining,
            duration_until_reset: Some(Duration {
                seconds: reset,
                nanos: 0,
            }),
            ..Default::default()
        }
    }

    fn pairs(h: &[HeaderValue]) -> Vec<(&str, &str)> {
        h.iter()
            .map(|h| (h.key.as_str(), h.value.as_str()))
            .collect()
    }

    #[test]
    fn the_headers_are_those_of_the_fewest_left_or_of_the_last_over_its_limit() {
        let ok = [
            status(Code::Ok, Some(10), 7, 30),
            status(Code::Ok, Some(100), 3, 50),
            status(Code::Ok, None, 0, 0),
        ];
        assert_eq!(
            pairs(&headers(&ok)),
            [
                ("RateLimit-Limit", "100"),
                ("RateLimit-Remaining", "3"),
                ("RateLimit-Reset", "50")
            ]
        );
        let over = [
            status(Code::OverLimit, Some(5), 0, 10),
            status(Code::Ok, Some(100), 0, 50),
            status(Code::OverLimit, Some(8), 0, 20),
        ];
        assert_eq!(
            pairs(&headers(&over)),
            [
                ("RateLimit-Limit", "8"),
                ("RateLimit-Remaining", "0"),
                ("RateLimit-Reset", "20")
            ]
        );
        // No descriptor with a limit: no headers.
        assert!(headers(&[status(Code::Ok, None, u32::MAX, 0)]).is_empty());
    }

    #[test]
    fn the_top_key_is_the_refusing_descriptors_values() {
        let item = |key: &str| Item {
            rule: None,
            key: key.into(),
            stored: key.into(),
            cost: 1,
            denied: false,
            ip: None,
        };
        assert_eq!(
            top_key(&item("remote_address\u{1f}203.0.113.9")),
            "203.0.113.9"
        );
        assert_eq!(top_key(&item("path\u{1f}/a\u{1e}user\u{1f}bob")), "/a,bob");
    }
}
