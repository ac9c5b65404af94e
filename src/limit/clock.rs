//! Time for the memory store: microseconds since the UNIX epoch, monotonic within a
//! process (wall time read once at start, then advanced by `Instant`), so windows
//! align with the epoch like Redis' `TIME` but never run backwards. Tests drive a
//! `ManualClock` instead.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub trait Clock: Send + Sync + 'static {
    /// Microseconds since the UNIX epoch.
    fn now_us(&self) -> u64;
}

pub struct SystemClock {
    start: Instant,
    start_us: u64,
}

impl SystemClock {
    pub fn new() -> Arc<SystemClock> {
        let start_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        Arc::new(SystemClock {
            start: Instant::now(),
            start_us,
        })
    }
}

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        self.start_us + self.start.elapsed().as_micros() as u64
    }
}

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

/// A clock that moves only when told to.
#[derive(Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn new(start_us: u64) -> Arc<ManualClock> {
        Arc::new(ManualClock(AtomicU64::new(start_us)))
    }
    pub fn set(&self, us: u64) {
        self.0.store(us, Ordering::SeqCst);
    }
    pub fn advance(&self, us: u64) {
        self.0.fetch_add(us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
