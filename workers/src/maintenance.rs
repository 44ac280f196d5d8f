//! Maintenance: rescues jobs whose lease expired (their dispatcher died or lost the
//! database), settling the reservations they held, and fails queued or admitted jobs
//! whose deadline passed. Safe to run in every process at
//! once: each statement locks with SKIP LOCKED and changes a row only once.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use tollgate::store::{self, Rescued, StoreError};

/// What one pass changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    pub rescued: Rescued,
    pub deadlines_expired: u64,
}

#[derive(Clone)]
pub struct Maintenance {
    pool: PgPool,
    interval: Duration,
}

impl Maintenance {
    pub fn new(pool: PgPool, interval: Duration) -> Self {
        Self { pool, interval }
    }

    /// One pass at time `now` (tests pass a future `now` instead of waiting for leases).
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Pass, StoreError> {
        let rescued = store::rescue_expired_leases(&self.pool, now).await?;
        let deadlines_expired = store::expire_deadlines(&self.pool, now).await?;
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
        })
    }

    pub async fn run(self, cancel: CancellationToken) {
        loop {
            if let Err(e) = self.run_once(Utc::now()).await {
                tracing::warn!(error = %e, "maintenance pass failed");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.interval) => {}
            }
        }
    }
}
