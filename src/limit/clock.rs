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
