//! The breaker: counts consecutive failed calls, opens after `TRIP_AFTER` (the
//! limiter then applies `store.on_error` without calling), and a prober that closes
//! it when Redis answers again, and keeps idle connections alive meanwhile.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Weak;
use std::time::{Duration, Instant};

use super::conn::{Conn, Shared};
use super::scripts::Eval;
use super::Error;
use crate::telemetry::metrics::CallKind;

/// Consecutive failed calls that open the breaker.
pub const TRIP_AFTER: u32 = 3;
/// How often an open breaker probes Redis (the script, run for no limits).
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// Counts consecutive failures; open after `TRIP_AFTER`, closed by the first probe
/// that succeeds.
pub struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
    skipped: AtomicU64,
    /// When a call last succeeded, in µs since `epoch`.
    answered_us: AtomicU64,
    epoch: Instant,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            skipped: AtomicU64::new(0),
            answered_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl Breaker {
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    /// A call answered, or failed (`e`): counted, and a failure logged, once as the
    /// breaker opens.
    pub fn settle<T>(&self, result: &Result<T, Error>) {
        match result {
            Ok(_) => self.success(),
            Err(e) => {
                if self.failure() {
                    tracing::error!(error = %e, failures = TRIP_AFTER, "Redis keeps failing; breaker open, applying store.on_error while probing");
                } else {
                    tracing::warn!(error = %e, "Redis limiter call failed");
                }
            }
        }
    }

    /// The breaker is open: a request is answered without calling (counted).
    pub fn skip(&self) -> Error {
        self.skipped.fetch_add(1, Ordering::Relaxed);
        Error::Open
    }

    /// Requests answered by `on_error` without calling Redis because the breaker was
    /// open.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::Relaxed)
    }

    fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        let now = self.epoch.elapsed().as_micros() as u64;
        // One store per ~millisecond at most: the hot path rarely writes the line.
        if now.saturating_sub(self.answered_us.load(Ordering::Relaxed)) > 1_000 {
            self.answered_us.store(now, Ordering::Relaxed);
        }
    }

    /// Whether a call succeeded within the last `d`.
    fn answered_within(&self, d: Duration) -> bool {
        let last = self.answered_us.load(Ordering::Relaxed);
        last != 0 && self.epoch.elapsed().as_micros() as u64 - last < d.as_micros() as u64
    }

    /// A probe answered: the failures in a row start again from zero.
    fn probe_answered(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Counts a failure; true if it opened the breaker.
    fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= TRIP_AFTER && self.trip()
    }

    /// Opens the breaker; true if it was closed.
    pub fn trip(&self) -> bool {
        !self.open.swap(true, Ordering::Relaxed)
    }

    fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Relaxed);
    }
}

impl Shared {
    /// Probes Redis every `PROBE_EVERY` unless a call has just succeeded: while the
    /// breaker is open, the first answer to `probe` (a script call answering one
    /// integer, which also loads the script) closes it; while it is closed, a PING,
    /// and failed ones count like failed calls, so an idle instance notices a Redis
    /// that went away (and `/readyz` says so) within `TRIP_AFTER` probes. The PINGs
    /// are also the keepalive: no connection is ever idle for longer than
    /// `PROBE_EVERY`, far below the smallest server `timeout` (1 s), so Redis never
    /// closes one as idle. A connection that moved to another primary (Sentinel) is
    /// probed at once. Ends when the connection is dropped.
    pub fn watch(&self, probe: Eval<'static>) {
        spawn_prober(self.downgrade(), self.moved(), probe);
    }
}

fn spawn_prober(
    conn: Weak<Conn>,
    moved: Option<std::sync::Arc<tokio::sync::Notify>>,
    probe: Eval<'static>,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            match &moved {
                Some(moved) => tokio::select! {
                    _ = tick.tick() => {}
                    _ = moved.notified() => {}
                },
                None => {
                    tick.tick().await;
                }
            }
            let Some(conn) = conn.upgrade() else { return };
            let shared = Shared(conn);
            let breaker = shared.breaker();
            let open = breaker.is_open();
            // A call that just answered kept the one connection busy; on a cluster it
            // reached one node, and the PING (sent to every node) keeps the others'
            // connections from being closed as idle.
            if !open && !shared.is_cluster() && breaker.answered_within(PROBE_EVERY) {
                continue;
            }
            let within = shared.timeout();
            // An open breaker closes only once the script itself runs; an idle one
            // just checks that Redis answers.
            let answer = if open {
                match shared
                    .call::<super::Numbers, _>(CallKind::Probe, &probe, within)
                    .await
                {
                    Ok(reply) if reply.0.len() == 1 => Ok(()),
                    Ok(reply) => Err(Error::Unavailable(format!(
                        "limiter script answered {} numbers for 0 requests (1 expected)",
                        reply.0.len()
                    ))),
                    Err(e) => Err(e),
                }
            } else {
                let ping = ::redis::cmd("PING");
                shared
                    .call::<String, _>(CallKind::Probe, &ping, within)
                    .await
                    .map(drop)
            };
            match answer {
                Ok(()) if open => {
                    breaker.close();
                    tracing::info!("Redis answers again; limits are decided in Redis");
                }
                // Not `success()`: stamped as an answer, a probe would skip the next one,
                // and an idle instance would probe every 2 × PROBE_EVERY.
                Ok(()) => breaker.probe_answered(),
                Err(e) if open => tracing::debug!(error = %e, "Redis probe failed"),
                Err(e) => {
                    if breaker.failure() {
                        tracing::error!(error = %e, failures = TRIP_AFTER, "Redis does not answer; breaker open, applying store.on_error while probing");
                    } else {
                        tracing::warn!(error = %e, "Redis probe failed");
                    }
                }
            }
        }
    });
}
