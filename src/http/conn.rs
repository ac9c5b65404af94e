//! A client connection's state that outlives one request: its requests in flight
//! and when the last ended (what the idle timeout and graceful shutdown watch),
//! whether it closes with a lingering close, and the slots it holds, which a tunnel
//! it upgrades to keeps.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
#[cfg(not(target_os = "linux"))]
use std::time::Instant;

/// Milliseconds on a coarse monotonic clock: the time of the kernel's last tick
/// (1 to 4 ms behind), read without reading the hardware clock (about a quarter of
/// the cost of `Instant::now`). For stamps compared against timeouts of seconds:
/// when a connection was last used, when its last request ended.
pub(crate) fn coarse_ms() -> u64 {
    #[cfg(target_os = "linux")]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC_COARSE exists
        // on every Linux since 2.6.32, and the call cannot fail otherwise.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
        let ms = u64::try_from(ts.tv_nsec).unwrap_or(0) / 1_000_000;
        secs * 1000 + ms
    }
    #[cfg(not(target_os = "linux"))]
    {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_millis() as u64
    }
}

/// When something last happened (a tunnel carried a byte, a connection's request
/// ended), on the coarse clock (`coarse_ms`, a few milliseconds behind, for
/// timeouts of seconds): one atomic store per event.
pub struct LastActive {
    at: std::sync::atomic::AtomicU64,
}

impl LastActive {
    pub(crate) fn new() -> LastActive {
        LastActive {
            at: std::sync::atomic::AtomicU64::new(coarse_ms()),
        }
    }

    pub(crate) fn touch(&self) {
        self.at.store(coarse_ms(), Ordering::Relaxed);
    }

    /// How long ago the last event was (since it was made, if none yet).
    pub(crate) fn since(&self) -> Duration {
        Duration::from_millis(coarse_ms().saturating_sub(self.at.load(Ordering::Relaxed)))
    }

    /// Resolves once nothing has crossed for `idle`.
    pub(crate) async fn idle(&self, idle: Duration) {
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        loop {
            let waited = u64::try_from(self.since().as_millis()).unwrap_or(u64::MAX);
            if waited >= idle_ms {
                return;
            }
            tokio::time::sleep(Duration::from_millis(idle_ms - waited)).await;
        }
    }
}

/// What the listener holds for a client connection (its `max_connections` and
/// per-IP slots), put on upgrade requests: a tunnel keeps it until it closes, so
/// tunnels count against the connection limits like any connection.
#[derive(Clone)]
pub struct ConnectionHeld(pub Arc<dyn std::any::Any + Send + Sync>);

/// Requests in flight on one connection, and when the last one ended: what the idle
/// timeout watches (hyper has none for HTTP/2). Plain atomics: a request costs two increments and a
/// clock read, and nothing is woken; the idle timer checks them when it fires.
pub(crate) struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended.
    last_end: LastActive,
    /// An answer went out before its request body was read (`body::Linger`): the
    /// connection closes with a lingering close (`Linger`).
    pub(crate) linger: AtomicBool,
    /// That lingering close is under way: the connection is busy with it (a close
    /// for idleness or stop must not drop it mid-read; `LINGER_TIME` bounds it).
    pub(crate) draining: AtomicBool,
}

/// One request in flight; ends when its response body has been sent (or dropped).
pub(crate) struct InFlight(Arc<Activity>);

impl Activity {
    pub(crate) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            in_flight: AtomicUsize::new(0),
            last_end: LastActive::new(),
            linger: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        })
    }

    /// An answer went out before its request body was read: the connection
    /// closes with a lingering close.
    pub(crate) fn linger(&self) {
        self.linger.store(true, Ordering::Relaxed);
    }

    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    pub(crate) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0 || self.draining.load(Ordering::Acquire)
    }

    /// Resolves once no request has been in flight for `timeout`.
    pub(crate) async fn idle(&self, timeout: Duration) {
        let mut wait = timeout;
        loop {
            tokio::time::sleep(wait).await;
            if self.busy() {
                // Whatever ends after this look ends at least `timeout` before the next.
                wait = timeout;
                continue;
            }
            let since = self.last_end.since();
            if since >= timeout {
                return;
            }
            wait = timeout - since;
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.last_end.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Release);
    }
}
