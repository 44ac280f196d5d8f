//! What operators act on and look back at: pauses (theirs, and those providers caused),
//! retrying a finished job, a job's provider calls, and the dashboard's history.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, PgPool};

use super::Result;
use crate::holds;
use crate::model::{JobId, JobState};

/// A pause in force: an operator's (`reason` [`holds::OPERATOR`], no end) or a provider's
/// (`rate_limited`, `key_unusable`, until its Retry-After).
#[derive(Debug, Clone, PartialEq)]
pub struct PauseRecord {
    pub scope: String,
    pub until: DateTime<Utc>,
    pub reason: String,
    pub created_at: DateTime<Utc>,
}

/// Every pause in force at `now`, newest first.
pub async fn list_pauses(ex: impl PgExecutor<'_>, now: DateTime<Utc>) -> Result<Vec<PauseRecord>> {
    Ok(sqlx::query_as!(
        PauseRecord,
        "SELECT scope, until, reason, created_at FROM pauses WHERE until > $1 ORDER BY created_at DESC, scope",
        now,
    )
    .fetch_all(ex)
    .await?)
}

/// Pauses `scope` for the operator until they resume it (a provider's pause of the same
/// scope becomes the operator's).
pub async fn hold(ex: impl PgExecutor<'_>, scope: &str, now: DateTime<Utc>) -> Result<PauseRecord> {
    Ok(sqlx::query_as!(
        PauseRecord,
        "INSERT INTO pauses (scope, until, reason, created_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT ON CONSTRAINT pauses_pkey DO UPDATE
             SET until = excluded.until, reason = excluded.reason,
                 created_at = CASE WHEN pauses.reason = excluded.reason THEN pauses.created_at
                                   ELSE excluded.created_at END
         RETURNING scope, until, reason, created_at",
        scope,
        holds::held_until(),
        holds::OPERATOR,
        now,
    )
    .fetch_one(ex)
    .await?)
}

/// Ends the operator's pause of `scope`: the pause it was, or `None` when the operator
/// had not paused it.
pub async fn release(ex: impl PgExecutor<'_>, scope: &str) -> Result<Option<PauseRecord>> {
    Ok(sqlx::query_as!(
        PauseRecord,
        "DELETE FROM pauses WHERE scope = $1 AND reason = $2 RETURNING scope, until, reason, created_at",
        scope,
        holds::OPERATOR,
    )
    .fetch_optional(ex)
    .await?)
}

/// What [`retry_job`] did.
#[derive(Debug)]
pub enum Retried {
    /// Queued again: as many attempts as it had before, its deadline moved as far from
    /// now as it was from its submission when it has passed.
    Queued,
    /// Not failed or cancelled (the state it is in).
    NotFailedOrCancelled(JobState),
    /// A line of a batch: the batch accounts for its lines, so they are not retried one by one.
    InBatch,
    /// Cancelled while its call was in flight: that call still holds its reservation.
    CallInFlight,
    NotFound,
}

/// Queues a failed or cancelled job of `tenant` (any tenant's when `None`) again.
pub async fn retry_job(
    pool: &PgPool,
    tenant: Option<&str>,
    id: JobId,
    now: DateTime<Utc>,
) -> Result<Retried> {
    let retried = sqlx::query_scalar!(
        r#"UPDATE jobs SET state = 'queued', not_before = $3::timestamptz, max_attempts = attempt + max_attempts,
                           deadline = GREATEST(deadline, $3::timestamptz + (deadline - created_at)),
                           error_code = NULL, error_message = NULL, result = NULL, finished_at = NULL,
                           admitted_at = NULL, started_at = NULL, admission = NULL, failed_targets = NULL,
                           lease_owner = NULL, lease_expires_at = NULL, provider_batch_id = NULL
           WHERE id = $1 AND ($2::text IS NULL OR tenant = $2)
             AND state IN ('failed', 'cancelled') AND batch_id IS NULL AND reserved_buckets IS NULL
           RETURNING id"#,
        id.0,
        tenant,
        now,
    )
    .fetch_optional(pool)
    .await?;
    if retried.is_some() {
        super::notify_gate(pool).await?;
        return Ok(Retried::Queued);
    }
    let row = sqlx::query!(
        r#"SELECT state AS "state: JobState", batch_id, reserved_buckets IS NOT NULL AS "in_flight!"
           FROM jobs WHERE id = $1 AND ($2::text IS NULL OR tenant = $2)"#,
        id.0,
        tenant,
    )
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        None => Retried::NotFound,
        Some(r) if !matches!(r.state, JobState::Failed | JobState::Cancelled) => {
            Retried::NotFailedOrCancelled(r.state)
        }
        Some(r) if r.batch_id.is_some() => Retried::InBatch,
        Some(_) => Retried::CallInFlight,
    })
}

/// One provider call of a job (a `job_attempts` row).
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    pub attempt: i32,
    pub provider: String,
    pub provider_model: String,
    pub key_name: String,
    pub status: Option<i32>,
    pub outcome: String,
    pub error_code: Option<String>,
    pub provider_request_id: Option<String>,
    pub input_tokens: Option<i32>,
    pub output_tokens: Option<i32>,
    pub cached_tokens: Option<i32>,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    /// What the provider's headers said of its limits (what the call taught the buckets).
    pub rate_limit: Option<serde_json::Value>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
}

/// The provider calls of job `id` of `tenant` (any tenant's when `None`), first first.
pub async fn job_attempts(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    id: JobId,
) -> Result<Vec<AttemptRecord>> {
    Ok(sqlx::query_as!(
        AttemptRecord,
        r#"SELECT attempt, provider, provider_model, key_name, status, outcome,
                  error_code, provider_request_id, input_tokens, output_tokens,
                  cached_tokens, estimated_input_tokens, estimated_output_tokens, rate_limit, started_at, finished_at
           FROM job_attempts WHERE job_id = $1 AND ($2::text IS NULL OR tenant = $2) ORDER BY attempt"#,
        id.0,
        tenant,
    )
    .fetch_all(ex)
    .await?)
}

/// One sample of the dashboard's history (`status_samples`).
#[derive(Debug, Clone)]
pub struct StatusSample {
    pub at: DateTime<Utc>,
    /// Seconds since the sample before, which `traffic` covers.
    pub interval_secs: f64,
    /// `{"<tenant>/<class>": queued}`.
    pub queued: serde_json::Value,
    /// `{"<tenant>": {succeeded, failed, tokens, status_429, status_5xx}}`.
    pub traffic: serde_json::Value,
}

/// When the newest sample was taken.
pub async fn last_status_sample(ex: impl PgExecutor<'_>) -> Result<Option<DateTime<Utc>>> {
    Ok(sqlx::query_scalar!("SELECT max(at) FROM status_samples")
        .fetch_one(ex)
        .await?)
}

/// Stores `sample` unless another process took its slot first (then `false`), and forgets
/// samples taken before `keep_after`.
pub async fn put_status_sample(
    pool: &PgPool,
    sample: &StatusSample,
    keep_after: DateTime<Utc>,
) -> Result<bool> {
    let mut tx = pool.begin().await?;
    let stored = sqlx::query!(
        "INSERT INTO status_samples (at, interval_secs, queued, traffic) VALUES ($1, $2, $3, $4)
         ON CONFLICT ON CONSTRAINT status_samples_pkey DO NOTHING",
        sample.at,
        sample.interval_secs,
        sample.queued,
        sample.traffic,
    )
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1;
    sqlx::query!("DELETE FROM status_samples WHERE at < $1", keep_after)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(stored)
}

/// The samples taken after `after`, oldest first.
pub async fn status_samples(ex: impl PgExecutor<'_>, after: DateTime<Utc>) -> Result<Vec<StatusSample>> {
    Ok(sqlx::query_as!(
        StatusSample,
        "SELECT at, interval_secs, queued, traffic FROM status_samples WHERE at > $1 ORDER BY at",
        after,
    )
    .fetch_all(ex)
    .await?)
}
