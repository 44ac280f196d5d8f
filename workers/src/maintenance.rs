//! Maintenance: rescues jobs whose lease expired (their dispatcher died or lost the
//! database), settling the reservations they held, and fails queued or admitted jobs
//! whose deadline passed; then ends due batches (`batches`) and, when configured, prunes
//! what retention no longer keeps (`retention`), and analyzes the queue table when its
//! planner statistics went stale (`store::statistics`). Safe to run in every process at
//! once: each statement locks with SKIP LOCKED and changes a row only once. A lease has
//! expired when the database's `now()` says so (`store::rescue_expired_leases`), never by
//! this process's clock; the rest of a pass runs at its [`Clock`]'s `now`.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::clock::Clock;
use tollgate::config::RetentionConfig;
use tollgate::store::{self, Rescued, StoreError};

use crate::batches::BatchFinalizer;
use crate::retention::{Pruned, Retention};

/// What one pass changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub rescued: Rescued,
    pub deadlines_expired: u64,
    /// Models whose estimates were recalibrated (every [`CALIBRATE_EVERY`]).
    pub calibrated: u64,
    /// Batches that ended (their output and error files written).
    pub batches_finished: u64,
    pub pruned: Pruned,
}

/// How often estimates are recalibrated from recent attempts.
pub const CALIBRATE_EVERY: Duration = Duration::from_secs(30);
/// The attempts one calibration looks at.
const CALIBRATION_WINDOW: Duration = Duration::from_secs(300);
/// Most a model's input ratio moves in one calibration.
const CALIBRATION_STEP: f64 = 0.1;
/// Fewest attempts in the window for a model to be recalibrated.
const CALIBRATION_MIN_SAMPLES: i64 = 20;

#[derive(Clone)]
pub struct Maintenance {
    pool: PgPool,
    interval: Duration,
    clock: Clock,
    last_calibrated: std::sync::Arc<std::sync::Mutex<Option<DateTime<Utc>>>>,
    batches: BatchFinalizer,
    retention: Option<Retention>,
    /// `jobs`' count of changes since analyze when this process last analyzed it.
    analyzed_at: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl Maintenance {
    pub fn new(pool: PgPool, interval: Duration) -> Self {
        Self {
            batches: BatchFinalizer::new(pool.clone()),
            pool,
            interval,
            clock: Clock::system(),
            last_calibrated: Default::default(),
            retention: None,
            analyzed_at: Default::default(),
        }
    }

    /// Reckons time by `clock` (a broker's: the database's).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Also prune finished work older than `config` keeps it.
    pub fn with_retention(mut self, config: RetentionConfig) -> Self {
        self.retention = Some(Retention::new(self.pool.clone(), config));
        self
    }

    /// Recalibrates estimates if [`CALIBRATE_EVERY`] has passed since the last time.
    async fn calibrate(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let due = {
            let last = match self.last_calibrated.lock() {
                Ok(l) => *l,
                Err(poisoned) => *poisoned.into_inner(),
            };
            last.is_none_or(|at| (now - at).to_std().is_ok_and(|d| d >= CALIBRATE_EVERY))
        };
        if !due {
            return Ok(0);
        }
        let n = store::calibrate(
            &self.pool,
            now,
            CALIBRATION_WINDOW,
            CALIBRATION_STEP,
            CALIBRATION_MIN_SAMPLES,
        )
        .await?;
        match self.last_calibrated.lock() {
            Ok(mut l) => *l = Some(now),
            Err(poisoned) => *poisoned.into_inner() = Some(now),
        }
        Ok(n)
    }

    /// One pass at time `now` (tests pass a future `now` instead of waiting for deadlines;
    /// a lease is expired by the database's time, which a test moves by writing the lease).
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Pass, StoreError> {
        let rescued = store::rescue_expired_leases(&self.pool, now).await?;
        let deadlines_expired = store::expire_deadlines(&self.pool, now).await?;
        let calibrated = self.calibrate(now).await?;
        store::prune_pauses(&self.pool, now).await?;
        store::refresh_job_statistics(&self.pool, &self.analyzed_at).await?;
        let batches_finished = self.batches.run_once(now).await?;
        let pruned = match &self.retention {
            Some(r) => r.run_once(now).await?,
            None => Pruned::default(),
        };
        if rescued.requeued + rescued.failed + deadlines_expired > 0 {
            tracing::info!(
                requeued = rescued.requeued,
                failed = rescued.failed,
                deadlines_expired,
                "maintenance pass"
            );
        }
        Ok(Pass {
            rescued,
            deadlines_expired,
            calibrated,
            batches_finished,
            pruned,
        })
    }

    pub async fn run(self, cancel: CancellationToken) {
        loop {
            if let Err(e) = self.run_once(self.clock.now()).await {
                tracing::warn!(error = %e, "maintenance pass failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
