//! The limiter script and its calls: one request's part of a call (its keys and
//! arguments, as `lua/request.lua` reads them), the keys' names, and the reply read
//! back as a verdict.

use std::sync::LazyLock;

use crate::limit::{Algorithm, LimitDef, Outcome, Outcomes, Plan, StoreError, Verdict};
use crate::redis::{Eval, Script};

/// The whole script: the algorithms, then the runner that calls them. Loaded once
/// (`SCRIPT LOAD`) and run with `EVALSHA`; sent whole (`EVAL`) only after `NOSCRIPT`.
const SCRIPT: &str = concat!(
    include_str!("../../../lua/arith.lua"),
    "\n",
    include_str!("../../../lua/fixed_window.lua"),
    "\n",
    include_str!("../../../lua/sliding_window.lua"),
    "\n",
    include_str!("../../../lua/sliding_log.lua"),
    "\n",
    include_str!("../../../lua/token_bucket.lua"),
    "\n",
    include_str!("../../../lua/gcra.lua"),
    "\n",
    include_str!("../../../lua/concurrency.lua"),
    "\n",
    include_str!("../../../lua/refund.lua"),
    "\n",
    include_str!("../../../lua/request.lua"),
);

/// The limiter script, by EVALSHA (`crate::redis::scripts`).
pub(super) static LIMITER: LazyLock<Script> = LazyLock::new(|| Script::new(SCRIPT));

/// Integers the script answers per limit (`verdict`).
pub(super) const REPLY_PER_LIMIT: usize = 3;

// === shared script calls ===

/// One request's part of a script call: its keys and its two arguments, as
/// `lua/request.lua` reads them, built in one buffer.
pub(super) struct Part {
    buf: String,
    /// Where each key ends in `buf`, then where its two arguments end.
    ends: Vec<usize>,
    /// Its limits take units in advance (`reserve`): the script answers one more
    /// integer per limit, the units taken.
    pub(super) taking: bool,
}

impl Part {
    pub(super) fn new(tag: &str, plan: &Plan, uid: &str) -> Part {
        Part::of(
            plan.limits.iter().map(|l| (tag, l)),
            plan.max_delay_us(),
            uid,
            None,
        )
    }

    /// `new`, taking `wants[i]` units beyond the cost for limit i (`reserve`).
    pub(super) fn taking(tag: &str, plan: &Plan, uid: &str, wants: &[u64]) -> Part {
        Part::of(
            plan.limits.iter().map(|l| (tag, l)),
            plan.max_delay_us(),
            uid,
            Some(wants),
        )
    }

    /// The request of `limits`, each with the tag of the key it counts.
    pub(super) fn of<'a>(
        limits: impl Iterator<Item = (&'a str, &'a LimitDef)> + Clone,
        max_delay_us: u64,
        uid: &str,
        wants: Option<&[u64]>,
    ) -> Part {
        let n = limits.clone().count();
        let tags: usize = limits.clone().map(|(t, _)| t.len()).sum();
        let mut buf = String::with_capacity(tags + n * 60 + uid.len() + 24);
        let mut ends = Vec::with_capacity(n + 2);
        for (tag, l) in limits.clone() {
            buf.push_str(tag);
            buf.push(':');
            push_id(&mut buf, l.id);
            ends.push(buf.len());
        }
        // The limits: max_delay, then each limit's letter, cost and parameters. The
        // same for every request of a route, so the script parses it once per call.
        let mut num = itoa::Buffer::new();
        buf.push_str(num.format(max_delay_us));
        for (i, (_, l)) in limits.enumerate() {
            let (code, a, b, c) = params(&l.algorithm);
            buf.push(' ');
            // A limit charged from the response after a `~`, one on trial by its
            // letter in upper case (`lua/request.lua`).
            if !l.at_admission() {
                buf.push('~');
            }
            buf.push(if l.shadow {
                code.to_ascii_uppercase()
            } else {
                code
            });
            buf.push(' ');
            buf.push_str(num.format(l.cost));
            // The units to take beyond the cost (`reserve`).
            if let Some(wants) = wants {
                buf.push('+');
                buf.push_str(num.format(wants.get(i).copied().unwrap_or(0)));
            }
            for v in [a, b, c] {
                buf.push(' ');
                buf.push_str(num.format(v));
            }
        }
        ends.push(buf.len());
        buf.push_str(uid);
        ends.push(buf.len());
        Part {
            buf,
            ends,
            taking: wants.is_some(),
        }
    }

    /// The keys, then the arguments.
    fn pieces(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let piece = &self.buf[start..end];
            start = end;
            piece
        })
    }

    /// How many keys (limits) the request has.
    fn keys(&self) -> usize {
        self.ends.len() - 2
    }

    /// How many integers the script answers for this request.
    pub(super) fn reply_len(&self) -> usize {
        (REPLY_PER_LIMIT + usize::from(self.taking)) * self.keys()
    }
}

/// `<prefix>{<ns>:<key>}`: the part every key of the request shares, braces included,
/// so Redis Cluster puts them in one slot. `ns` is escaped so that it never contains
/// `:` or braces: no route name and key can make the tag of another pair. `key` is the
/// stored client key, which never contains braces.
pub(super) fn tag(prefix: &str, ns: &str, key: &str) -> String {
    let mut s = String::with_capacity(prefix.len() + ns.len() + key.len() + 3);
    s.push_str(prefix);
    s.push('{');
    for c in ns.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            ':' => s.push_str("\\;"),
            '{' => s.push_str("\\("),
            '}' => s.push_str("\\)"),
            c => s.push(c),
        }
    }
    s.push(':');
    s.push_str(key);
    s.push('}');
    s
}

/// `<tag>:<limit id>`, the id in 11 base64url digits. The id already names the
/// limit, its algorithm and window (`LimitDef::id`); the limit's name is not repeated.
pub(super) fn limit_key(tag: &str, id: u64) -> String {
    let mut s = String::with_capacity(tag.len() + 12);
    s.push_str(tag);
    s.push(':');
    push_id(&mut s, id);
    s
}

/// The base64url digits (RFC 4648 §5): no `:`, no braces.
const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// `n` in base64url digits, least significant first: 11 for any u64, fewer for a
/// small one (no leading zero digits).
pub(super) fn push_id(s: &mut String, mut n: u64) {
    loop {
        s.push(DIGITS[(n & 63) as usize] as char);
        n >>= 6;
        if n == 0 {
            break;
        }
    }
}

/// Whether a limit of the plan needs the request's id (`uid`): sliding_log members
/// and concurrency leases are named by it.
pub(super) fn needs_uid(plan: &Plan) -> bool {
    plan.limits.iter().any(|l| {
        matches!(
            l.algorithm,
            Algorithm::SlidingLog { .. } | Algorithm::Concurrency { .. }
        )
    })
}

/// The script's first argument: the time it decides at, or refunds a charge of.
#[derive(Clone, Copy)]
pub(super) enum Time {
    /// The server's clock (production).
    Server,
    /// A driven clock (the table of cases).
    At(u64),
    /// Refund the charges made at this time.
    Refund(u64),
    /// Charge whatever is left, at the server's time or a driven one.
    Anyway(Option<u64>),
}

/// The call of `script` (the limiter's) deciding `parts` in order: every part's
/// keys, then now (empty: Redis' clock), after a `*` when a key repeats, and every
/// part's arguments (`lua/request.lua`).
pub(super) fn script_call<'s>(script: &'s Script, parts: &[&Part], at: Time) -> Eval<'s> {
    let keys: usize = parts.iter().map(|p| p.keys()).sum();
    let args: usize = parts.iter().map(|p| p.ends.len()).sum();
    let bytes: usize = parts.iter().map(|p| p.buf.len()).sum();
    let mut cmd = script.call_sized(keys, 1 + args, 10 + bytes);
    for p in parts {
        for key in p.pieces().take(p.keys()) {
            cmd.arg(key);
        }
    }
    let repeats = if repeat_a_key(parts) { "*" } else { "" };
    match at {
        Time::Server => cmd.arg(repeats),
        Time::At(now) => cmd.arg(format!("{repeats}{now}")),
        Time::Refund(charged) => cmd.arg(format!("r{charged}")),
        Time::Anyway(None) => cmd.arg(format!("{repeats}c")),
        Time::Anyway(Some(now)) => cmd.arg(format!("{repeats}c{now}")),
    };
    for p in parts {
        for arg in p.pieces().skip(p.keys()) {
            cmd.arg(arg);
        }
    }
    cmd
}

/// Whether a key appears more than once among `parts` (requests of one client that
/// waited for the same call): the script then reads each state the call sets from
/// its own memory and writes it once more at the end, rather than reading and writing
/// Redis for every request (`repeats` in `lua/arith.lua`). Without the mark it
/// reads and writes Redis each time, which decides the same, at a cost per request;
/// so keys are compared by a 64-bit hash (FNV-1a), and the rare collision only
/// marks a call that did not need it.
fn repeat_a_key(parts: &[&Part]) -> bool {
    if parts.len() < 2 {
        return false;
    }
    let mut hashes: Vec<u64> = parts
        .iter()
        .flat_map(|p| p.pieces().take(p.keys()))
        .map(|key| {
            key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        })
        .collect();
    hashes.sort_unstable();
    hashes.windows(2).any(|w| w[0] == w[1])
}

/// The script's letter for an algorithm (`algorithms` in `lua/request.lua`) and its
/// three parameters.
fn params(a: &Algorithm) -> (char, u64, u64, u64) {
    match *a {
        Algorithm::FixedWindow { limit, window_us } => ('f', limit, window_us, 0),
        Algorithm::CalendarMonth { limit } => ('m', limit, 0, 0),
        Algorithm::SlidingWindow { limit, window_us } => ('w', limit, window_us, 0),
        Algorithm::SlidingLog { limit, window_us } => ('l', limit, window_us, 0),
        Algorithm::TokenBucket { rate, burst } => ('t', rate.count, rate.per_us, burst),
        Algorithm::Gcra { rate, burst } => ('g', rate.count, rate.per_us, burst),
        Algorithm::Concurrency { limit, lease_us } => ('c', limit, lease_us, 0),
    }
}

/// Reads the script's reply for one request, three integers per limit: remaining,
/// reset_us, and the limit's decision, `wait_us` (>= 0) if it admits, else
/// `-(retry_after_us + 1)`. The request is admitted if every limit admits, after the
/// longest wait.
/// The script's reply for a request that took units (`Part::taking`): four integers
/// per limit, `verdict`'s three and the units taken beyond the cost. Nothing is taken
/// when the request is refused (the script writes nothing then).
pub(super) fn verdict_taking(
    plan: &Plan,
    reply: &[i64],
) -> Result<(Verdict, Vec<u64>), StoreError> {
    const PER: usize = REPLY_PER_LIMIT + 1;
    if reply.len() != PER * plan.limits.len() {
        return Err(StoreError::Unavailable(format!(
            "limiter script answered {} numbers for {} limits taking units",
            reply.len(),
            plan.limits.len()
        )));
    }
    let mut three = Vec::with_capacity(REPLY_PER_LIMIT * plan.limits.len());
    let mut taken = Vec::with_capacity(plan.limits.len());
    for o in reply.chunks_exact(PER) {
        three.extend_from_slice(&o[..REPLY_PER_LIMIT]);
        taken.push(u64::try_from(o[REPLY_PER_LIMIT]).unwrap_or(0));
    }
    let v = verdict(plan, &three)?;
    if !v.allowed {
        taken.iter_mut().for_each(|t| *t = 0);
    }
    Ok((v, taken))
}

pub(super) fn verdict(plan: &Plan, reply: &[i64]) -> Result<Verdict, StoreError> {
    if reply.len() != REPLY_PER_LIMIT * plan.limits.len() {
        return Err(StoreError::Unavailable(format!(
            "limiter script answered {} numbers for {} limits",
            reply.len(),
            plan.limits.len()
        )));
    }
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    let outcomes: Outcomes = plan
        .limits
        .iter()
        .zip(reply.chunks_exact(REPLY_PER_LIMIT))
        .map(|(l, o)| {
            let allowed = o[2] >= 0;
            Outcome {
                allowed,
                quota: l.algorithm.quota(),
                remaining: u(o[0]),
                reset_us: u(o[1]),
                retry_after_us: if allowed { 0 } else { u(-1 - o[2]) },
                delay_us: if allowed { u(o[2]) } else { 0 },
            }
        })
        .collect();
    Ok(Verdict::on_trial(outcomes, plan.on_trial()))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::limit::{Mode, Rate};
    use crate::redis::Request;

    pub(in crate::limit::redis) fn plan(mode: Mode) -> Plan {
        Plan {
            limits: vec![
                LimitDef::new(
                    "a".into(),
                    Algorithm::FixedWindow {
                        limit: 3,
                        window_us: 1_000_000,
                    },
                    1,
                ),
                LimitDef::new(
                    "b".into(),
                    Algorithm::Gcra {
                        rate: Rate {
                            count: 10,
                            per_us: 1_000_000,
                        },
                        burst: 5,
                    },
                    1,
                ),
            ],
            mode,
        }
    }

    #[test]
    fn script_holds_every_algorithm_and_the_runner_last() {
        for name in [
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
            "gcra",
            "concurrency",
        ] {
            assert!(
                SCRIPT.contains(&format!("local function {name}(")),
                "{name}"
            );
        }
        let runner = SCRIPT.find("local parsed = {}").unwrap();
        assert!(SCRIPT.rfind("local function").unwrap() < runner);
    }

    #[test]
    fn keys_share_one_hash_tag() {
        assert_eq!(tag("sluice:", "api", "1.2.3.4"), "sluice:{api:1.2.3.4}");
        assert_eq!(tag("sluice:", "api/ip", "::1"), "sluice:{api/ip:::1}");
        // A route name can not pose as another route with a longer key.
        assert_ne!(tag("", "a:b", "c"), tag("", "a", "b:c"));
        assert_eq!(tag("", "a:b{c}\\", "k"), "{a\\;b\\(c\\)\\\\:k}");
        // The limit id in base64url digits, least significant first.
        assert_eq!(limit_key("sluice:{api:k}", 0xab), "sluice:{api:k}:rC");
        assert_eq!(limit_key("sluice:{api:k}", 0), "sluice:{api:k}:A");
        assert_eq!(limit_key("", u64::MAX), ":__________P");
        let id = LimitDef::new(
            "burst".into(),
            Algorithm::FixedWindow {
                limit: 3,
                window_us: 1_000_000,
            },
            1,
        )
        .id;
        let key = limit_key("sluice:{api:203.0.113.7}", id);
        assert_eq!(key.len(), "sluice:{api:203.0.113.7}:".len() + 11, "{key}");
        // Distinct ids, distinct keys; no digit is a separator or a brace.
        let mut seen = std::collections::HashSet::new();
        for id in (0..5_000u64).chain((13..64).map(|b| 1 << b)) {
            let k = limit_key("t", id);
            assert!(!k[2..].contains([':', '{', '}']), "{k}");
            assert!(seen.insert(k));
        }
    }

    /// What one call sends: every request's keys, then now, then per request its
    /// limits (max_delay, then each limit's letter, cost and parameters) and its id.
    #[test]
    fn one_call_sends_one_argument_per_key_and_per_limit() {
        let p = plan(Mode::Delay { max_delay_us: 250 });
        let one = Part::new("sluice:{r:k}", &p, "");
        let mut single = p.clone();
        single.limits.truncate(1);
        single.mode = Mode::Reject;
        let two = Part::new("sluice:{r:j}", &single, "id.7");
        let call = script_call(&LIMITER, &[&one, &two], Time::Server);
        let args: Vec<String> = call
            .cmd()
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8(b.to_vec()).unwrap(),
                _ => unreachable!("no cursor"),
            })
            .collect();
        let key = |tag: &str, i: usize| limit_key(tag, p.limits[i].id);
        assert_eq!(
            args,
            [
                "EVALSHA",
                LIMITER.hash(),
                "3",
                &key("sluice:{r:k}", 0),
                &key("sluice:{r:k}", 1),
                &key("sluice:{r:j}", 0),
                "",
                "250 f 1 3 1000000 0 g 1 10 1000000 5",
                "",
                "0 f 1 3 1000000 0",
                "id.7",
            ]
        );
        assert_eq!((one.reply_len(), two.reply_len()), (6, 3));
        assert!(!needs_uid(&p));
        let at = script_call(&LIMITER, &[&two], Time::At(17));
        assert_eq!(at.cmd().args_iter().count(), 3 + 1 + 1 + 2);
        // A key that repeats in the call: the time after a `*` (`repeats`).
        let again = Part::new("sluice:{r:k}", &single, "");
        let arg = |parts: &[&Part], at| match script_call(&LIMITER, parts, at)
            .cmd()
            .args_iter()
            .nth(3 + 3)
        {
            Some(redis::Arg::Simple(b)) => String::from_utf8(b.to_vec()).unwrap(),
            _ => unreachable!("no cursor"),
        };
        assert_eq!(arg(&[&one, &again], Time::Server), "*");
        assert_eq!(arg(&[&one, &again], Time::At(17)), "*17");
        assert_eq!(arg(&[&one, &again], Time::Anyway(Some(17))), "*c17");
        assert_eq!(arg(&[&one, &again], Time::Refund(17)), "r17");
        assert_eq!(arg(&[&one, &two], Time::At(17)), "17");
    }

    #[test]
    fn reply_becomes_a_verdict() {
        let p = plan(Mode::Reject);
        // The first limit admits (2 left), the second refuses (retry in 40 µs).
        let v = verdict(&p, &[2, 30, 0, 0, 50, -41]).unwrap();
        assert!(!v.allowed);
        assert_eq!(v.delay_us, 0);
        let seen: Vec<_> = v
            .outcomes
            .iter()
            .map(|o| {
                (
                    o.allowed,
                    o.remaining,
                    o.reset_us,
                    o.retry_after_us,
                    o.delay_us,
                )
            })
            .collect();
        assert_eq!(seen, [(true, 2, 30, 0, 0), (false, 0, 50, 40, 0)]);
        // Both admit, one after a wait: the request waits the longest.
        let v = verdict(&p, &[2, 30, 0, 4, 50, 700]).unwrap();
        assert_eq!(
            (v.allowed, v.delay_us, v.outcomes[1].delay_us),
            (true, 700, 700)
        );
        // A refusal with no time to wait still refuses.
        let v = verdict(&p, &[2, 30, 0, 0, 0, -1]).unwrap();
        assert_eq!((v.allowed, v.outcomes[1].retry_after_us), (false, 0));
        assert!(verdict(&p, &[1, 0, 17]).is_err());
    }
}
