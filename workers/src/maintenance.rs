//! Maintenance: rescues jobs whose lease expired (their dispatcher died or lost the
//! database), settling the reservations they held, and fails queued or admitted jobs
//! whose deadline passed; then ends due batches (`batches`; also between passes, every
//! [`BATCH_STEPS_EVERY`]), announces spend budgets that
//! reached 80 % or all of their window (`budget.threshold` webhooks), and, when configured, prunes
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
    /// Budget thresholds announced (`budget.threshold` events queued).
    pub budgets_announced: u64,
}

/// The thresholds a spend budget is announced at (`budget.threshold`): 80 % and all of it.
pub const BUDGET_THRESHOLDS: [f64; 2] = [0.8, 1.0];

/// How often the batch steps ([`Maintenance::finish_batches`]) run between passes: a batch
/// completes about this soon after its last line.
pub const BATCH_STEPS_EVERY: Duration = Duration::from_millis(200);

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
        store::hold_paused_lines(&self.pool).await?;
        let deadlines_expired = store::expire_deadlines(&self.pool, now).await?;
        let calibrated = self.calibrate(now).await?;
        store::prune_pauses(&self.pool, now).await?;
        store::refresh_job_statistics(&self.pool, &self.analyzed_at).await?;
        let batches_finished = self.finish_batches(now).await?;
        let budgets_announced = self.announce_budgets(now).await?;
        let pruned = match &self.retention {
            Some(r) => r.run_once(now).await?,
            None => Pruned::default(),
        };
        if rescued.requeued + rescued.failed + rescued.callers_gone + deadlines_expired > 0 {
            tracing::info!(
                requeued = rescued.requeued,
                failed = rescued.failed,
                callers_gone = rescued.callers_gone,
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
            budgets_announced,
        })
    }

    /// The batch steps of a pass, which also run between passes (every [`BATCH_STEPS_EVERY`]):
    /// stops batches over their error cap (before a batch could be finalized whole), then
    /// ends the batches that are due. Returns how many batches ended.
    pub async fn finish_batches(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        store::stop_failing_batches(&mut *self.pool.acquire().await?, now).await?;
        self.batches.run_once(now).await
    }

    /// Queues a `budget.threshold` event for each spend budget whose spending just
    /// reached one of [`BUDGET_THRESHOLDS`] in its window, to its tenant's webhook
    /// endpoints: once per budget, window and threshold, however many processes run this.
    async fn announce_budgets(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        let crossed = store::budget_crossings(&mut tx, &BUDGET_THRESHOLDS, now).await?;
        for c in &crossed {
            let body = budget_event(c, now);
            store::enqueue_event(&mut *tx, &c.tenant, None, BUDGET_EVENT, &body, now).await?;
        }
        tx.commit().await?;
        Ok(crossed.len() as u64)
    }

    /// Passes every `interval` until `cancel`; between them, the batch steps every
    /// [`BATCH_STEPS_EVERY`], so a batch whose last line ended completes then, not at the
    /// next pass.
    pub async fn run(self, cancel: CancellationToken) {
        let mut next_pass = tokio::time::Instant::now();
        loop {
            let now = tokio::time::Instant::now();
            if now >= next_pass {
                next_pass = now + self.interval;
                if let Err(e) = self.run_once(self.clock.now()).await {
                    tracing::warn!(error = %e, "maintenance pass failed");
                }
            } else if let Err(e) = self.finish_batches(self.clock.now()).await {
                tracing::warn!(error = %e, "finishing batches failed");
            }
            let wake = next_pass.min(tokio::time::Instant::now() + BATCH_STEPS_EVERY);
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }
}

/// The event type of a budget reaching a threshold.
const BUDGET_EVENT: &str = "budget.threshold";

/// The `budget.threshold` event of `c`: whose budget (a tenant's, one of its
/// applications', or one of its API keys'), its window, the threshold reached, the budget
/// and what is spent of it in USD, and when the window resets.
fn budget_event(c: &store::BudgetCrossing, now: DateTime<Utc>) -> String {
    // `<holder>:<scope…>:<bucket name>`; names hold no `:`.
    let (holder, rest) = c.bucket.split_once(':').unwrap_or_default();
    let (scope, name) = rest.rsplit_once(':').unwrap_or_default();
    let window = match name {
        "weekly_spend" => "week",
        "monthly_spend" => "month",
        _ => "day",
    };
    let (holder, api_key, application) = match holder {
        "apikey" => ("api_key", Some(scope), None),
        "app" => ("application", None, scope.split_once(':').map(|(_, app)| app)),
        _ => ("tenant", None, None),
    };
    serde_json::json!({
        "type": BUDGET_EVENT,
        "timestamp": now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        "data": {
            "object": "budget",
            "tenant": c.tenant,
            "holder": holder,
            "api_key": api_key,
            "application": application,
            "window": window,
            "threshold": c.threshold,
            "budget_usd": c.capacity / 1e6,
            "spent_usd": c.spent / 1e6,
            "resets_at": c.resets_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        },
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_event_names_whose_budget_it_is() {
        let now = Utc::now();
        let event = |bucket: &str| {
            let c = store::BudgetCrossing {
                bucket: bucket.to_owned(),
                tenant: "shop".to_owned(),
                threshold: 0.8,
                capacity: 2e6,
                spent: 1.7e6,
                resets_at: now,
            };
            let body: serde_json::Value = serde_json::from_str(&budget_event(&c, now)).unwrap();
            let d = &body["data"];
            (
                d["holder"].clone(),
                d["application"].clone(),
                d["api_key"].clone(),
                d["window"].clone(),
            )
        };
        use serde_json::json;
        assert_eq!(
            event("tenant:shop:monthly_spend"),
            (json!("tenant"), json!(null), json!(null), json!("month"))
        );
        assert_eq!(
            event("app:shop:chatbot:daily_spend"),
            (json!("application"), json!("chatbot"), json!(null), json!("day"))
        );
        let id = "0190a000-0000-7000-8000-000000000012";
        assert_eq!(
            event(&format!("apikey:{id}:weekly_spend")),
            (json!("api_key"), json!(null), json!(id), json!("week"))
        );
    }
}
