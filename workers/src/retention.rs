//! Retention: a maintenance step that deletes what has been kept long enough — finished
//! jobs (with their attempts), finished batches, files past their expiry, and settled
//! webhook deliveries. A batch's jobs are kept while the batch is open, so its output
//! file is always complete. Runs at most every `retention.interval_secs`, in chunks of
//! `retention.chunk` rows so no transaction grows large.

use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tollgate::config::RetentionConfig;
use tollgate::store::{self, StoreError};

/// Most chunks one pass deletes per kind of row (the rest waits for the next pass).
const MAX_CHUNKS_PER_PASS: u32 = 20;

/// Rows one pass deleted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    pub jobs: u64,
    pub batches: u64,
    pub files: u64,
    pub deliveries: u64,
    /// Budget alerts of windows that have ended.
    pub budget_alerts: u64,
}

impl Pruned {
    pub fn total(&self) -> u64 {
        self.jobs + self.batches + self.files + self.deliveries + self.budget_alerts
    }
}

#[derive(Clone)]
pub struct Retention {
    pool: PgPool,
    config: RetentionConfig,
    last_run: Arc<Mutex<Option<DateTime<Utc>>>>,
}

impl Retention {
    pub fn new(pool: PgPool, config: RetentionConfig) -> Self {
        Self {
            pool,
            config,
            last_run: Arc::default(),
        }
    }

    fn due(&self, now: DateTime<Utc>) -> bool {
        let mut last = match self.last_run.lock() {
            Ok(l) => l,
            Err(poisoned) => poisoned.into_inner(),
        };
        let due = last.is_none_or(|at| (now - at).num_seconds() >= self.config.interval_secs as i64);
        if due {
            *last = Some(now);
        }
        due
    }

    /// One pass at `now`, if `retention.interval_secs` has passed since the last one.
    pub async fn run_once(&self, now: DateTime<Utc>) -> Result<Pruned, StoreError> {
        if !self.due(now) {
            return Ok(Pruned::default());
        }
        let before = now - chrono::Duration::seconds(self.config.finished_secs.min(i64::MAX as u64) as i64);
        let chunk = self.config.chunk;
        let mut pruned = Pruned::default();
        for _ in 0..MAX_CHUNKS_PER_PASS {
            let n = store::prune_finished_jobs(&self.pool, before, chunk).await?;
            pruned.jobs += n;
            if n < chunk as u64 {
                break;
            }
        }
        pruned.batches = store::prune_finished_batches(&self.pool, before, chunk).await?;
        pruned.files = store::prune_expired_files(&self.pool, now, chunk).await?;
        pruned.deliveries = store::prune_deliveries(&self.pool, before, chunk).await?;
        pruned.budget_alerts = store::prune_budget_alerts(&self.pool, now).await?;
        if pruned.total() > 0 {
            tracing::info!(?pruned, "retention pass");
        }
        Ok(pruned)
    }
}
