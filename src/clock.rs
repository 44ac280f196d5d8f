//! The time every process reckons in: the database's.
//!
//! Hosts' clocks disagree — by milliseconds with NTP, by many seconds without — and a
//! lease, a deadline, a hold or a retry time written by one process is read by all the
//! others. So a process does not read its own wall clock for them: [`Clock::database`]
//! samples the PostgreSQL server's `clock_timestamp()` and advances that sample with the
//! process's monotonic clock ([`Instant`]), sampling again every [`RESAMPLE`]
//! ([`Clock::keep_sampling`]). Every process then agrees on the time to within a round
//! trip to the database, whatever its host's clock says, and a host clock stepped by NTP
//! meanwhile changes nothing.
//!
//! Statements that only write or compare a lease take the server's `now()` themselves
//! (`store::claim_jobs`, `extend_leases`, `rescue_expired_leases`): those need no clock in
//! the process at all.
//!
//! [`Clock::offset_by`] sets a clock a fixed offset off the database's time. It is for
//! tests: a process started with it stands for one whose clock is wrong.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::store::{self, StoreError};

/// How often a database clock samples the server's time again.
pub const RESAMPLE: Duration = Duration::from_secs(10);

/// A process's time. Cheap to clone; clones share the sample.
#[derive(Clone)]
pub struct Clock {
    inner: Arc<Inner>,
    offset: chrono::Duration,
}

struct Inner {
    /// Where samples come from; `None`: the process's wall clock.
    pool: Option<PgPool>,
    sample: Mutex<Sample>,
}

/// The server's time as read at one moment of the process's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sample {
    time: DateTime<Utc>,
    at: Instant,
}

impl Sample {
    /// The server's time at `instant`: the sample advanced by the monotonic time since.
    fn time_at(&self, instant: Instant) -> DateTime<Utc> {
        let elapsed = instant.saturating_duration_since(self.at);
        self.time + chrono::Duration::from_std(elapsed).unwrap_or(chrono::Duration::MAX)
    }

    /// A sample from a reading of the server's time taken between `before` and `after`:
    /// the reading is taken to be from the middle of the round trip.
    fn read(time: DateTime<Utc>, before: Instant, after: Instant) -> Self {
        let half = after.saturating_duration_since(before) / 2;
        Self {
            time: time + chrono::Duration::from_std(half).unwrap_or_default(),
            at: after,
        }
    }
}

impl Clock {
    /// The database's time, sampled now. Keep it current with [`Clock::keep_sampling`].
    pub async fn database(pool: &PgPool) -> Result<Self, StoreError> {
        let sample = sample(pool).await?;
        Ok(Self {
            inner: Arc::new(Inner {
                pool: Some(pool.clone()),
                sample: Mutex::new(sample),
            }),
            offset: chrono::Duration::zero(),
        })
    }

    /// The process's own wall clock: for roles built without a broker (tests that drive
    /// `run_once` with their own `now`, tools). A broker gives its roles
    /// [`Clock::database`].
    pub fn system() -> Self {
        Self {
            inner: Arc::new(Inner {
                pool: None,
                sample: Mutex::new(Sample {
                    time: Utc::now(),
                    at: Instant::now(),
                }),
            }),
            offset: chrono::Duration::zero(),
        }
    }

    /// This clock, `offset` ahead (or behind, when negative). For tests: a process whose
    /// clock is wrong.
    pub fn offset_by(mut self, offset: chrono::Duration) -> Self {
        self.offset = offset;
        self
    }

    /// The time now.
    pub fn now(&self) -> DateTime<Utc> {
        let time = match self.inner.pool {
            Some(_) => self.sample().time_at(Instant::now()),
            None => Utc::now(),
        };
        time + self.offset
    }

    fn sample(&self) -> Sample {
        *self.inner.sample.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Samples the database's time again.
    pub async fn resample(&self) -> Result<(), StoreError> {
        if let Some(pool) = &self.inner.pool {
            let fresh = sample(pool).await?;
            *self.inner.sample.lock().unwrap_or_else(PoisonError::into_inner) = fresh;
        }
        Ok(())
    }

    /// Samples the database's time every [`RESAMPLE`] until `stop`. A failed sample keeps
    /// the last one, which the monotonic clock goes on advancing.
    pub async fn keep_sampling(self, stop: tokio_util::sync::CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RESAMPLE) => {}
            }
            if let Err(e) = self.resample().await {
                tracing::warn!(error = %e, "could not sample the database's time; keeping the last sample");
            }
        }
    }
}

/// Readings of the server's time a sample is the best of.
const READINGS: usize = 3;

/// A sample of the server's time: of [`READINGS`] readings, the one with the shortest
/// round trip (its error is at most half of it). The connection is taken first, so the
/// round trips timed are the queries' alone (a pool's first connection takes tens of
/// milliseconds to open).
async fn sample(pool: &PgPool) -> Result<Sample, StoreError> {
    let mut conn = pool.acquire().await.map_err(StoreError::from)?;
    let mut best: Option<(Duration, Sample)> = None;
    for _ in 0..READINGS {
        let before = Instant::now();
        let time = store::database_time(&mut *conn).await?;
        let after = Instant::now();
        let trip = after.saturating_duration_since(before);
        if best.is_none_or(|(shortest, _)| trip < shortest) {
            best = Some((trip, Sample::read(time, before, after)));
        }
    }
    best.map(|(_, s)| s)
        .ok_or_else(|| StoreError::from(sqlx::Error::RowNotFound))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap_or_default()
    }

    #[test]
    fn a_sample_advances_with_the_monotonic_clock_only() {
        let start = Instant::now();
        let sample = Sample {
            time: at(0),
            at: start,
        };
        assert_eq!(sample.time_at(start), at(0));
        assert_eq!(sample.time_at(start + Duration::from_secs(7)), at(7));
        // An instant from before the sample reads the sample, never earlier.
        let earlier = start.checked_sub(Duration::from_secs(3)).unwrap_or(start);
        assert_eq!(sample.time_at(earlier), at(0));
    }

    #[test]
    fn a_reading_is_placed_in_the_middle_of_its_round_trip() {
        let before = Instant::now();
        let after = before + Duration::from_millis(40);
        let sample = Sample::read(at(0), before, after);
        assert_eq!(sample.at, after);
        assert_eq!(sample.time, at(0) + chrono::Duration::milliseconds(20));
    }

    #[test]
    fn an_offset_clock_reads_its_offset_off() {
        let clock = Clock::system();
        let skewed = clock.clone().offset_by(chrono::Duration::seconds(20));
        let (plain, ahead) = (clock.now(), skewed.now());
        // The skewed clock was read after the plain one: at least 20 s ahead of it.
        assert!(ahead - plain >= chrono::Duration::seconds(20), "{plain} {ahead}");
    }
}
