//! All SQL. Small functions over `impl PgExecutor`, so each runs on a pool or inside a
//! transaction. Time is a parameter (`now`) so tests pin the clock instead of sleeping.
//!
//! Every write to a running job is guarded by ownership — `state = 'running' AND attempt
//! = $n AND lease_owner = $owner` — so a dispatcher whose lease was rescued, or whose job
//! was cancelled, writes nothing: zero rows is an answer, not an error.

use chrono::{DateTime, Utc};
use sqlx::{PgExecutor, Postgres};

use crate::model::{Job, JobId, JobState, NewJob, Usage};

/// Channel on which a job's id is announced when it reaches a terminal state.
pub const CHANNEL_JOB_DONE: &str = "tollgate_job_done";
/// Channel on which new claimable work is announced (payload empty).
pub const CHANNEL_JOBS_READY: &str = "tollgate_jobs_ready";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("stored value could not be encoded: {0}")]
    Encode(#[from] serde_json::Error),
}

pub type Result<T> = std::result::Result<T, StoreError>;

/// The outcome of an insert with an idempotency key.
#[derive(Debug)]
pub enum Inserted {
    /// A new row was committed.
    New(Job),
    /// The tenant already used that key: the job it created.
    Existing(Job),
}

pub async fn insert_job(ex: impl PgExecutor<'_> + Copy, job: &NewJob) -> Result<Inserted> {
    let row = sqlx::query_as::<Postgres, Job>(
        "INSERT INTO jobs (id, tenant, class, priority, request, model, idempotency_key, metadata,
                           deadline, not_before, max_attempts, estimated_input_tokens,
                           estimated_output_tokens, created_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $10)
         ON CONFLICT ON CONSTRAINT jobs_tenant_idempotency_key DO NOTHING
         RETURNING *",
    )
    .bind(job.id)
    .bind(&job.tenant)
    .bind(job.class)
    .bind(job.priority)
    .bind(&job.request)
    .bind(&job.model)
    .bind(&job.idempotency_key)
    .bind(&job.metadata)
    .bind(job.deadline)
    .bind(job.created_at)
    .bind(job.max_attempts)
    .bind(job.estimated_input_tokens)
    .bind(job.estimated_output_tokens)
    .fetch_optional(ex)
    .await?;
    if let Some(row) = row {
        return Ok(Inserted::New(row));
    }
    let existing =
        sqlx::query_as::<Postgres, Job>("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
            .bind(&job.tenant)
            .bind(&job.idempotency_key)
            .fetch_one(ex)
            .await?;
    Ok(Inserted::Existing(existing))
}

/// Tells idle dispatchers that work is waiting. Cheap; call after the insert commits.
pub async fn notify_jobs_ready(ex: impl PgExecutor<'_>) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL_JOBS_READY)
        .execute(ex)
        .await?;
    Ok(())
}

/// A tenant's job, or `None` (also when it belongs to another tenant).
pub async fn get_job(ex: impl PgExecutor<'_>, tenant: &str, id: JobId) -> Result<Option<Job>> {
    Ok(
        sqlx::query_as::<Postgres, Job>("SELECT * FROM jobs WHERE id = $1 AND tenant = $2")
            .bind(id)
            .bind(tenant)
            .fetch_optional(ex)
            .await?,
    )
}

/// Any job by id: for workers and operators, never for tenant-facing paths.
pub async fn get_job_any_tenant(ex: impl PgExecutor<'_>, id: JobId) -> Result<Option<Job>> {
    Ok(
        sqlx::query_as::<Postgres, Job>("SELECT * FROM jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(ex)
            .await?,
    )
}

/// A tenant's jobs, newest first; `after` is the last id of the previous page.
pub async fn list_jobs(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    state: Option<JobState>,
    after: Option<JobId>,
    limit: i64,
) -> Result<Vec<Job>> {
    Ok(sqlx::query_as::<Postgres, Job>(
        "SELECT * FROM jobs
         WHERE tenant = $1 AND ($2::job_state IS NULL OR state = $2) AND ($3::uuid IS NULL OR id < $3)
         ORDER BY id DESC LIMIT $4",
    )
    .bind(tenant)
    .bind(state)
    .bind(after)
    .bind(limit)
    .fetch_all(ex)
    .await?)
}

#[derive(Debug)]
pub enum Cancelled {
    /// The job is now cancelled (a running attempt's result will be discarded).
    Now(Job),
    /// It had already finished; its terminal row.
    AlreadyFinished(Job),
    NotFound,
}

pub async fn cancel_job(
    ex: impl PgExecutor<'_> + Copy,
    tenant: &str,
    id: JobId,
    now: DateTime<Utc>,
) -> Result<Cancelled> {
    let row = sqlx::query_as::<Postgres, Job>(
        "WITH done AS (
             UPDATE jobs SET state = 'cancelled', finished_at = $3, lease_owner = NULL,
                             lease_expires_at = NULL, error_code = 'cancelled',
                             error_message = 'cancelled by the client'
             WHERE id = $1 AND tenant = $2 AND state IN ('queued', 'running')
             RETURNING *)
         SELECT done.*, pg_notify($4, done.id::text) IS NULL AS notified FROM done",
    )
    .bind(id)
    .bind(tenant)
    .bind(now)
    .bind(CHANNEL_JOB_DONE)
    .fetch_optional(ex)
    .await?;
    if let Some(job) = row {
        return Ok(Cancelled::Now(job));
    }
    Ok(match get_job(ex, tenant, id).await? {
        Some(job) => Cancelled::AlreadyFinished(job),
        None => Cancelled::NotFound,
    })
}

/// Claims up to `limit` runnable jobs for `owner` in one short statement and commits:
/// the provider is called only after this returns, with no lock held.
pub async fn claim_jobs(
    ex: impl PgExecutor<'_>,
    owner: &str,
    limit: i64,
    now: DateTime<Utc>,
    lease: std::time::Duration,
) -> Result<Vec<Job>> {
    let lease_until = now + lease;
    Ok(sqlx::query_as::<Postgres, Job>(
        "WITH picked AS (
             SELECT id FROM jobs
             WHERE state = 'queued' AND not_before <= $3 AND deadline > $3
             ORDER BY class, priority DESC, not_before, id
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j
         SET state = 'running', attempt = j.attempt + 1, lease_owner = $1,
             lease_expires_at = $4, started_at = COALESCE(j.started_at, $3)
         FROM picked WHERE j.id = picked.id
         RETURNING j.*",
    )
    .bind(owner)
    .bind(limit)
    .bind(now)
    .bind(lease_until)
    .fetch_all(ex)
    .await?)
}

/// Who holds a running job: the guard of every write to it.
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    pub id: JobId,
    pub attempt: i32,
    pub owner: &'a str,
}

/// The provider and model an attempt went to, stored on the job with its outcome.
#[derive(Debug, Clone, Copy)]
pub struct Served<'a> {
    pub provider: &'a str,
    pub model: &'a str,
}

/// Stores the result once: only the holder of the current attempt can, and only once.
pub async fn complete_job(
    ex: impl PgExecutor<'_>,
    holder: Holder<'_>,
    served: Served<'_>,
    result: &serde_json::Value,
    usage: Usage,
    provider_request_id: Option<&str>,
    now: DateTime<Utc>,
) -> Result<bool> {
    let usage = serde_json::to_value(usage)?;
    let row: Option<(JobId,)> = sqlx::query_as(
        "WITH done AS (
             UPDATE jobs SET state = 'succeeded', result = $4, usage = $5, provider_request_id = $6,
                             finished_at = $7, lease_owner = NULL, lease_expires_at = NULL,
                             error_code = NULL, error_message = NULL, provider = $9, provider_model = $10
             WHERE id = $1 AND state = 'running' AND attempt = $2 AND lease_owner = $3
             RETURNING id)
         SELECT id FROM done WHERE pg_notify($8, id::text) IS NOT NULL",
    )
    .bind(holder.id)
    .bind(holder.attempt)
    .bind(holder.owner)
    .bind(result)
    .bind(usage)
    .bind(provider_request_id)
    .bind(now)
    .bind(CHANNEL_JOB_DONE)
    .bind(served.provider)
    .bind(served.model)
    .fetch_optional(ex)
    .await?;
    Ok(row.is_some())
}

/// Ends the job as failed with a reason code.
pub async fn fail_job(
    ex: impl PgExecutor<'_>,
    holder: Holder<'_>,
    served: Option<Served<'_>>,
    code: &str,
    message: &str,
    now: DateTime<Utc>,
) -> Result<bool> {
    let row: Option<(JobId,)> = sqlx::query_as(
        "WITH done AS (
             UPDATE jobs SET state = 'failed', error_code = $4, error_message = $5, finished_at = $6,
                             lease_owner = NULL, lease_expires_at = NULL,
                             provider = COALESCE($8, provider), provider_model = COALESCE($9, provider_model)
             WHERE id = $1 AND state = 'running' AND attempt = $2 AND lease_owner = $3
             RETURNING id)
         SELECT id FROM done WHERE pg_notify($7, id::text) IS NOT NULL",
    )
    .bind(holder.id)
    .bind(holder.attempt)
    .bind(holder.owner)
    .bind(code)
    .bind(message)
    .bind(now)
    .bind(CHANNEL_JOB_DONE)
    .bind(served.map(|s| s.provider))
    .bind(served.map(|s| s.model))
    .fetch_optional(ex)
    .await?;
    Ok(row.is_some())
}

/// Puts the job back in the queue, not to be claimed before `not_before`; the last error
/// stays visible on the job while it waits.
pub async fn requeue_job(
    ex: impl PgExecutor<'_>,
    holder: Holder<'_>,
    not_before: DateTime<Utc>,
    code: &str,
    message: &str,
) -> Result<bool> {
    let done = sqlx::query(
        "UPDATE jobs SET state = 'queued', not_before = $4, error_code = $5, error_message = $6,
                         lease_owner = NULL, lease_expires_at = NULL
         WHERE id = $1 AND state = 'running' AND attempt = $2 AND lease_owner = $3",
    )
    .bind(holder.id)
    .bind(holder.attempt)
    .bind(holder.owner)
    .bind(not_before)
    .bind(code)
    .bind(message)
    .execute(ex)
    .await?;
    Ok(done.rows_affected() == 1)
}

/// One provider call, for the record (estimate vs actual, status, rate-limit headers).
#[derive(Debug, Clone)]
pub struct AttemptRecord<'a> {
    pub job_id: JobId,
    pub attempt: i32,
    pub provider: &'a str,
    pub provider_model: &'a str,
    pub key_name: &'a str,
    pub status: Option<i32>,
    pub outcome: &'a str,
    pub error_code: Option<&'a str>,
    pub provider_request_id: Option<&'a str>,
    pub usage: Option<Usage>,
    pub estimated_input_tokens: i32,
    pub estimated_output_tokens: i32,
    pub rate_limit: Option<serde_json::Value>,
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
}

pub async fn record_attempt(ex: impl PgExecutor<'_>, a: &AttemptRecord<'_>) -> Result<()> {
    sqlx::query(
        "INSERT INTO job_attempts (job_id, attempt, provider, provider_model, key_name, status, outcome,
                                   error_code, provider_request_id, input_tokens, output_tokens,
                                   cached_tokens, estimated_input_tokens, estimated_output_tokens,
                                   rate_limit, started_at, finished_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
         ON CONFLICT ON CONSTRAINT job_attempts_pkey DO NOTHING",
    )
    .bind(a.job_id)
    .bind(a.attempt)
    .bind(a.provider)
    .bind(a.provider_model)
    .bind(a.key_name)
    .bind(a.status)
    .bind(a.outcome)
    .bind(a.error_code)
    .bind(a.provider_request_id)
    .bind(a.usage.map(|u| u.input_tokens))
    .bind(a.usage.map(|u| u.output_tokens))
    .bind(a.usage.map(|u| u.cached_tokens))
    .bind(a.estimated_input_tokens)
    .bind(a.estimated_output_tokens)
    .bind(&a.rate_limit)
    .bind(a.started_at)
    .bind(a.finished_at)
    .execute(ex)
    .await?;
    Ok(())
}

/// The heartbeat: extends the leases of every job `owner` still runs.
pub async fn extend_leases(
    ex: impl PgExecutor<'_>,
    owner: &str,
    now: DateTime<Utc>,
    lease: std::time::Duration,
) -> Result<u64> {
    let done =
        sqlx::query("UPDATE jobs SET lease_expires_at = $2 WHERE state = 'running' AND lease_owner = $1")
            .bind(owner)
            .bind(now + lease)
            .execute(ex)
            .await?;
    Ok(done.rows_affected())
}

/// On shutdown: what `owner` did not finish goes back to the queue at once.
pub async fn release_leases(ex: impl PgExecutor<'_>, owner: &str, now: DateTime<Utc>) -> Result<u64> {
    let done = sqlx::query(
        "UPDATE jobs SET state = 'queued', not_before = $2, lease_owner = NULL, lease_expires_at = NULL
         WHERE state = 'running' AND lease_owner = $1",
    )
    .bind(owner)
    .bind(now)
    .execute(ex)
    .await?;
    Ok(done.rows_affected())
}

/// Counts of what one maintenance pass changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Rescued {
    /// Expired leases put back in the queue.
    pub requeued: u64,
    /// Expired leases whose job had no attempts left: failed with `lease_expired`.
    pub failed: u64,
}

/// Re-queues jobs whose holder stopped heartbeating (it died or lost the database);
/// a job that has used all its attempts fails instead.
pub async fn rescue_expired_leases(ex: impl PgExecutor<'_>, now: DateTime<Utc>) -> Result<Rescued> {
    let rows: Vec<(bool,)> = sqlx::query_as(
        "WITH expired AS (
             SELECT id FROM jobs WHERE state = 'running' AND lease_expires_at < $1
             FOR UPDATE SKIP LOCKED),
         changed AS (
             UPDATE jobs j SET
                 state = CASE WHEN j.attempt >= j.max_attempts THEN 'failed'::job_state ELSE 'queued' END,
                 error_code = CASE WHEN j.attempt >= j.max_attempts THEN 'lease_expired' ELSE j.error_code END,
                 error_message = CASE WHEN j.attempt >= j.max_attempts
                     THEN 'the dispatcher holding the job stopped and no attempts are left'
                     ELSE j.error_message END,
                 finished_at = CASE WHEN j.attempt >= j.max_attempts THEN $1 ELSE NULL END,
                 lease_owner = NULL, lease_expires_at = NULL
             FROM expired WHERE j.id = expired.id
             RETURNING j.id, j.state = 'failed' AS failed)
         SELECT failed FROM changed WHERE NOT failed OR pg_notify($2, id::text) IS NOT NULL",
    )
    .bind(now)
    .bind(CHANNEL_JOB_DONE)
    .fetch_all(ex)
    .await?;
    let failed = rows.iter().filter(|(f,)| *f).count() as u64;
    Ok(Rescued {
        requeued: rows.len() as u64 - failed,
        failed,
    })
}

/// Fails queued jobs whose deadline has passed: they must never be dispatched late.
pub async fn expire_deadlines(ex: impl PgExecutor<'_>, now: DateTime<Utc>) -> Result<u64> {
    let rows: Vec<(JobId,)> = sqlx::query_as(
        "WITH late AS (
             SELECT id FROM jobs WHERE state = 'queued' AND deadline <= $1
             FOR UPDATE SKIP LOCKED),
         changed AS (
             UPDATE jobs j SET state = 'failed', finished_at = $1,
                 error_code = 'deadline_exceeded',
                 error_message = CASE WHEN j.error_code IS NULL
                     THEN 'the deadline passed before the job could be sent'
                     ELSE 'the deadline passed before the job could be sent; last error: ' || j.error_code END
             FROM late WHERE j.id = late.id
             RETURNING j.id)
         SELECT id FROM changed WHERE pg_notify($2, id::text) IS NOT NULL",
    )
    .bind(now)
    .bind(CHANNEL_JOB_DONE)
    .fetch_all(ex)
    .await?;
    Ok(rows.len() as u64)
}

/// Queue depth by state, for summaries and status.
pub async fn count_by_state(ex: impl PgExecutor<'_>) -> Result<Vec<(JobState, i64)>> {
    Ok(
        sqlx::query_as("SELECT state, count(*) FROM jobs GROUP BY state ORDER BY state")
            .fetch_all(ex)
            .await?,
    )
}
