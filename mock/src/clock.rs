//! The mock's notion of time: nanoseconds since the provider was created (monotonic,
//! drives buckets and fault windows) plus the wall-clock instant of creation (drives
//! UTC-midnight day windows, `created` and Anthropic's absolute reset stamps). Tests swap
//! in a manual clock so limits can be exercised without sleeping.

use std::time::Instant;

use chrono::{DateTime, Utc};

/// Source of "now" for the mock.
#[derive(Debug, Clone)]
pub(crate) enum Clock {
    /// Real time.
    System {
        /// Monotonic start.
        start: Instant,
        /// Wall clock at `start`.
        start_wall: DateTime<Utc>,
    },
    /// Time that only moves when a test advances it.
    #[cfg(test)]
    Manual(std::sync::Arc<ManualClock>),
}

impl Clock {
    pub(crate) fn system() -> Self {
        Clock::System {
            start: Instant::now(),
            start_wall: Utc::now(),
        }
    }

    /// Nanoseconds since the provider was created.
    pub(crate) fn now_ns(&self) -> u64 {
        match self {
            Clock::System { start, .. } => u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX),
            #[cfg(test)]
            Clock::Manual(m) => m.elapsed_ns.load(std::sync::atomic::Ordering::SeqCst),
        }
    }

    /// Nanoseconds since the Unix epoch at `at_ns`.
    pub(crate) fn unix_ns_at(&self, at_ns: u64) -> i128 {
        let start_wall = match self {
            Clock::System { start_wall, .. } => *start_wall,
            #[cfg(test)]
            Clock::Manual(m) => m.start_wall,
        };
        i128::from(start_wall.timestamp()) * 1_000_000_000
            + i128::from(start_wall.timestamp_subsec_nanos())
            + i128::from(at_ns)
    }
}

/// A clock pinned by tests.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct ManualClock {
    pub(crate) start_wall: DateTime<Utc>,
    pub(crate) elapsed_ns: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
impl ManualClock {
    pub(crate) fn new(start_wall: DateTime<Utc>) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            start_wall,
            elapsed_ns: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub(crate) fn advance(&self, d: std::time::Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.elapsed_ns.fetch_add(ns, std::sync::atomic::Ordering::SeqCst);
    }
}
