//! The body of a response whose cost a limit reads from it (`cost: {response_json}`):
//! every chunk passes to the client as it comes, untouched and unbuffered, while
//! `limit::metered` reads it; the charge is settled once, when the body ends, fails
//! or is dropped (the client went away). Only routes with such a limit wrap their
//! bodies; every other response is left as it is.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http_body::Frame;
use prometheus::IntCounter;

use super::{Later, Shared, Tier};
use crate::http::body::{Body, BoxError};
use crate::limit::metered::{Kind, Reading};
use crate::limit::{
    BodyCost, Charge, CostFrom, Estimate, FromResponse, LimitDef, Mode, Plan, ResponseCost, Verdict,
};

/// `sluice_response_costs_total`'s children of one limit, by `CostFrom::index`:
/// those of the sources its cost can come from, created at 0 with the route.
#[derive(Clone, Default)]
pub struct CostCounters([Option<IntCounter>; CostFrom::ALL.len()]);

impl CostCounters {
    pub fn new(children: impl IntoIterator<Item = (CostFrom, IntCounter)>) -> CostCounters {
        let mut c = CostCounters::default();
        for (from, child) in children {
            c.0[from.index()] = Some(child);
        }
        c
    }

    pub fn inc(&self, from: CostFrom) {
        if let Some(c) = &self.0[from.index()] {
            c.inc();
        }
    }
}

/// A limit of the request whose cost the body says.
struct Metered {
    /// The tier's limit (its `cost` what admission charged).
    def: LimitDef,
    /// Its pointers, by index in the reading's.
    which: Vec<usize>,
    /// The estimate admission charged, if it charged one.
    held: Option<u64>,
    /// The key number it counts (`ShareDef::key`).
    key: usize,
    counters: Option<CostCounters>,
}

/// The reading of one response's body and what to charge when it ends.
struct Settle {
    shared: Arc<Shared>,
    /// The namespace and the stored key of each key number.
    keys: Vec<(String, String)>,
    /// Decided in this instance's fallback (`on_error: local`).
    fallback: bool,
    mode: Mode,
    limits: Vec<Metered>,
    reading: Reading,
}

/// The response, its body read on its way when the tier has limits whose cost the
/// body says (else as it is).
pub(super) fn meter(shared: &Shared, later: &Later<'_>, resp: Response<Body>) -> Response<Body> {
    let kind = Kind::of(
        resp.headers()
            .get(http::header::CONTENT_TYPE)
            .map(|v| v.as_bytes()),
    );
    let Some(settle) = settle_for(shared, later, kind) else {
        return resp;
    };
    let (parts, body) = resp.into_parts();
    let body = MeteredBody {
        body,
        settle: Some(settle),
    };
    Response::from_parts(parts, Body::new(body))
}

/// No upstream answer to read (it could not be reached, or timed out: sluice
/// answered): every estimate admission held is given back, as a response sluice
/// writes itself charges nothing.
pub(super) fn unanswered(shared: &Shared, later: &Later<'_>) {
    if let Some(s) = settle_for(shared, later, Kind::Other) {
        s.apply(&vec![0; s.limits.len()]);
    }
}

/// What the end of the response settles for the tier's limits whose cost the body
/// says; None when it has none.
fn settle_for(shared: &Shared, later: &Later<'_>, kind: Kind) -> Option<Settle> {
    let tier = later.tier;
    let mut pointers: Vec<String> = Vec::new();
    let mut limits = Vec::new();
    for l in tier.later.iter().filter(|l| l.reads_body) {
        let def = &tier.plan.limits[l.at];
        let Some(cost) = body_cost(def) else {
            continue;
        };
        let which = cost
            .pointers
            .iter()
            .map(|p| match pointers.iter().position(|q| q == p) {
                Some(i) => i,
                None => {
                    pointers.push(p.clone());
                    pointers.len() - 1
                }
            })
            .collect();
        limits.push(Metered {
            def: def.clone(),
            which,
            held: later.held.get(l.at).copied().filter(|&h| h > 0),
            key: tier
                .shares
                .iter()
                .find(|s| s.at.contains(&l.at))
                .map_or(0, |s| s.key),
            counters: l.costs.clone(),
        });
    }
    if limits.is_empty() {
        return None;
    }
    Some(Settle {
        shared: shared.me.upgrade()?,
        keys: later.keys.clone(),
        fallback: later.fallback,
        mode: tier.plan.mode,
        limits,
        reading: Reading::new(kind, pointers),
    })
}

/// A tier's plan priced for one request whose limits read their `estimate` from
/// its JSON body: what admission charges.
pub(super) struct Priced {
    pub plan: Plan,
    /// Each of the tier's shares, priced alike (`Tier::shares` order).
    pub shares: Vec<Plan>,
}

/// The estimate admission charged each limit of `plan` (priced, when the request's
/// body priced it) by index: its cost when it holds one and was charged (the
/// request admitted, and the limit too: one on trial that refused was not).
/// Empty when no limit of the plan reads its cost from the body.
pub(super) fn held(plan: &Plan, v: &Verdict) -> Vec<u64> {
    if !plan.limits.iter().any(|l| body_cost(l).is_some()) {
        return Vec::new();
    }
    plan.limits
        .iter()
        .zip(v.outcomes.iter())
        .map(|(l, o)| match v.allowed && o.allowed && l.gives_back() {
            true => l.cost,
            false => 0,
        })
        .collect()
}

/// Whether a limit of `plan` reads its `estimate` from the request's body.
pub fn reads_estimate(plan: &Plan) -> bool {
    plan.limits.iter().any(|l| read_estimate(l).is_some())
}

fn read_estimate(def: &LimitDef) -> Option<(&str, u64)> {
    match body_cost(def)?.estimate.as_ref()? {
        Estimate::Read { pointer, default } => Some((pointer, *default)),
        Estimate::Units(_) => None,
    }
}

/// The tier's plan priced with the estimates the request's body says (`default`
/// where it says none, at most the limit's quota); None when no limit of the tier
/// reads one. (Boxed: the request path's state stays one word larger.)
pub(super) fn priced(tier: &Tier, body: Option<&[u8]>) -> Option<Box<Priced>> {
    if !reads_estimate(&tier.plan) {
        return None;
    }
    let price = |def: &LimitDef| match read_estimate(def) {
        Some((pointer, default)) => body
            .and_then(|b| crate::identity::json_units(b, pointer))
            .unwrap_or(default)
            .min(def.algorithm.quota()),
        None => def.cost,
    };
    let priced = |plan: &Plan| Plan {
        limits: plan
            .limits
            .iter()
            .map(|l| {
                let mut l = l.clone();
                l.cost = price(&l);
                l
            })
            .collect(),
        mode: plan.mode,
    };
    let plan = priced(&tier.plan);
    Some(Box::new(Priced {
        shares: tier.shares.iter().map(|s| priced(&s.plan)).collect(),
        plan,
    }))
}

fn body_cost(def: &LimitDef) -> Option<&BodyCost> {
    match &def.charge {
        Charge::Response(r) => r.body(),
        _ => None,
    }
}

impl Settle {
    /// Charges each limit what the body said (or the difference to its estimate,
    /// either way), once: `cut` when the body did not end (the client went away,
    /// the upstream failed).
    fn settle(mut self, cut: bool) {
        self.reading.finish();
        let units: Vec<u64> = self
            .limits
            .iter()
            .map(|m| {
                let (units, from) = match body_cost(&m.def) {
                    Some(cost) => self.reading.charge(&m.which, cost, m.held, cut),
                    None => (0, CostFrom::Default),
                };
                if let Some(c) = &m.counters {
                    c.inc(from);
                }
                units
            })
            .collect();
        self.apply(&units);
    }

    /// Charges each limit its `units` (by index in `limits`), less the estimate
    /// admission held, or gives back the difference.
    fn apply(&self, units: &[u64]) {
        let mut charges: Vec<(usize, Plan)> = Vec::new();
        let mut back: Vec<(usize, Plan)> = Vec::new();
        for (m, &units) in self.limits.iter().zip(units) {
            let held = m.held.unwrap_or(0);
            let (into, n, charge) = if units >= held {
                let charge = Charge::Response(Box::new(FromResponse {
                    statuses: None,
                    cost: ResponseCost::Units(units - held),
                }));
                (&mut charges, units - held, charge)
            } else {
                (&mut back, held - units, Charge::GiveBack)
            };
            if n == 0 {
                continue;
            }
            let mut def = m.def.clone();
            def.cost = n;
            def.charge = charge;
            match into.iter_mut().find(|(k, _)| *k == m.key) {
                Some((_, plan)) => plan.limits.push(def),
                None => into.push((
                    m.key,
                    Plan {
                        limits: vec![def],
                        mode: self.mode,
                    },
                )),
            }
        }
        let keyed = |by_key: Vec<(usize, Plan)>| -> Vec<(String, String, Plan)> {
            by_key
                .into_iter()
                .filter_map(|(k, plan)| {
                    let (ns, key) = self.keys.get(k)?;
                    Some((ns.clone(), key.clone(), plan))
                })
                .collect()
        };
        let store = &self.shared.store;
        if !charges.is_empty() {
            store.charge_response(keyed(charges), self.fallback);
        }
        if !back.is_empty() {
            store.give_back(keyed(back), self.fallback);
        }
    }
}

/// A response body read on its way (`meter`).
struct MeteredBody {
    body: Body,
    /// Taken when settled.
    settle: Option<Settle>,
}

impl MeteredBody {
    fn settle(&mut self, cut: bool) {
        if let Some(s) = self.settle.take() {
            s.settle(cut);
        }
    }
}

impl http_body::Body for MeteredBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // Both fields are Unpin (a boxed body and an Option).
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(s), Some(data)) = (this.settle.as_mut(), frame.data_ref()) {
                    s.reading.feed(data);
                }
                // Settled before the last bytes go: the client's next request sees
                // the charge.
                if this.body.is_end_stream() {
                    this.settle(false);
                }
            }
            Poll::Ready(None) => this.settle(false),
            Poll::Ready(Some(Err(_))) => this.settle(true),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// Dropped before its end: the client went away (or the server gave up on it).
impl Drop for MeteredBody {
    fn drop(&mut self) {
        self.settle(true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Algorithm, Outcome, Rate};

    fn limit(name: &str, estimate: Option<u64>) -> LimitDef {
        let bucket = Algorithm::TokenBucket {
            rate: Rate {
                count: 1000,
                per_us: 1_000_000,
            },
            burst: 1000,
        };
        let cost = BodyCost {
            pointers: vec!["/usage/total_tokens".into()],
            estimate: estimate.map(Estimate::Units),
            default: 1,
            cap: 1000,
        };
        LimitDef::new(name.into(), bucket, estimate.unwrap_or(1)).from_response(FromResponse {
            statuses: None,
            cost: ResponseCost::Body(Box::new(cost)),
        })
    }

    /// What the end of a response settles against: the estimate of each limit that
    /// admission charged, none for a limit without one, and none where nothing was
    /// charged (a refused request on a shadow route, a limit on trial that refused).
    #[test]
    fn only_an_estimate_admission_charged_is_held() {
        let plan = Plan {
            limits: vec![limit("a", Some(500)), limit("b", None), limit("c", Some(7))],
            mode: Mode::Reject,
        };
        let outcome = |allowed| Outcome {
            allowed,
            ..Outcome::default()
        };
        let verdict = |allowed, each: [bool; 3]| crate::limit::Verdict {
            allowed,
            delay_us: 0,
            outcomes: each.map(outcome).to_vec().into(),
            trial: 0b100,
        };
        assert_eq!(held(&plan, &verdict(true, [true; 3])), [500, 0, 7]);
        assert_eq!(
            held(&plan, &verdict(true, [true, true, false])),
            [500, 0, 0]
        );
        assert_eq!(held(&plan, &verdict(false, [true, true, false])), [0, 0, 0]);
        let unmetered = Plan {
            limits: vec![LimitDef::new("x".into(), plan.limits[0].algorithm, 1)],
            mode: Mode::Reject,
        };
        assert!(held(&unmetered, &verdict(true, [true; 3])).is_empty());
    }
}
