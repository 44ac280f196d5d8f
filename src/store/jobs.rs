//! Job rows: insert, read, list, cancel, claim, finish, rescue, expire.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool, Postgres};

use super::buckets::{Reservation, Settlement, reservation, settle};
use super::{CHANNEL_GATE, CHANNEL_JOB_DONE, Result};
use crate::model::{Job, JobId, JobState, NewJob, Usage};

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
                           estimated_output_tokens, created_at, stream)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $10, $14)
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
    .bind(job.stream)
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

/// Tells the gate that work is waiting. Cheap; call after the insert commits.
pub async fn notify_gate(ex: impl PgExecutor<'_>) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL_GATE)
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
    /// The job is now cancelled. A running attempt's result will be discarded; its
    /// reservation is settled by its holder (or by maintenance if the holder died).
    Now(Job),
    /// It had already finished; its terminal row.
    AlreadyFinished(Job),
    NotFound,
}

/// Old values of a row a guarded update changed.
#[derive(sqlx::FromRow)]
struct Previous {
    id: JobId,
    old_state: JobState,
    old_buckets: Option<Vec<i64>>,
    old_amounts: Option<Vec<f64>>,
}

pub async fn cancel_job(pool: &PgPool, tenant: &str, id: JobId, now: DateTime<Utc>) -> Result<Cancelled> {
    let mut tx = pool.begin().await?;
    // A running job keeps its lease fields and reservation: the call is still in flight.
    let prev = sqlx::query_as::<Postgres, Previous>(
        "UPDATE jobs j SET state = 'cancelled', finished_at = $3, error_code = 'cancelled',
                           error_message = 'cancelled by the client',
                           reserved_buckets = CASE WHEN old.state = 'running' THEN j.reserved_buckets END,
                           reserved_amounts = CASE WHEN old.state = 'running' THEN j.reserved_amounts END
         FROM (SELECT id, state, reserved_buckets, reserved_amounts FROM jobs
               WHERE id = $1 AND tenant = $2 FOR UPDATE) old
         WHERE j.id = old.id AND old.state IN ('queued', 'admitted', 'running')
         RETURNING j.id, old.state AS old_state, old.reserved_buckets AS old_buckets,
                   old.reserved_amounts AS old_amounts",
    )
    .bind(id)
    .bind(tenant)
    .bind(now)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(prev) = prev else {
        tx.rollback().await?;
        return Ok(match get_job(pool, tenant, id).await? {
            Some(job) => Cancelled::AlreadyFinished(job),
            None => Cancelled::NotFound,
        });
    };
    if prev.old_state == JobState::Admitted
        && let Some(r) = reservation(prev.old_buckets, prev.old_amounts)
    {
        settle(&mut tx, &[(prev.id, r, Settlement::UNSENT)]).await?;
    }
    notify_done(&mut tx, &[prev.id]).await?;
    tx.commit().await?;
    let job = get_job(pool, tenant, id).await?;
    Ok(job.map_or(Cancelled::NotFound, Cancelled::Now))
}

async fn notify_done(conn: &mut PgConnection, ids: &[JobId]) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    sqlx::query("SELECT pg_notify($1, id::text) FROM unnest($2::uuid[]) AS t(id)")
        .bind(CHANNEL_JOB_DONE)
        .bind(ids.iter().map(|i| i.0).collect::<Vec<_>>())
        .execute(conn)
        .await?;
    Ok(())
}

/// Claims up to `limit` admitted jobs for `owner` in one short statement and commits:
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
             WHERE state = 'admitted' AND deadline > $3 AND NOT stream
             ORDER BY class, priority DESC, admitted_at, id
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

/// Claims one admitted streaming job for the process holding its client's connection.
pub async fn claim_stream_job(
    ex: impl PgExecutor<'_>,
    id: JobId,
    owner: &str,
    now: DateTime<Utc>,
    lease: std::time::Duration,
) -> Result<Option<Job>> {
    Ok(sqlx::query_as::<Postgres, Job>(
        "UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_owner = $2, lease_expires_at = $4,
                         started_at = COALESCE(started_at, $3)
         WHERE id = $1 AND state = 'admitted' AND stream
         RETURNING *",
    )
    .bind(id)
    .bind(owner)
    .bind(now)
    .bind(now + lease)
    .fetch_optional(ex)
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

/// How an attempt ended.
#[derive(Debug, Clone, Copy)]
pub enum Finish<'a> {
    Succeeded {
        result: &'a serde_json::Value,
        usage: Usage,
        provider_request_id: Option<&'a str>,
    },
    Failed {
        code: &'a str,
        message: &'a str,
    },
    /// Back to the queue, not to be admitted again before `not_before`.
    Retry {
        not_before: DateTime<Utc>,
        code: &'a str,
        message: &'a str,
    },
}

/// Writes an attempt's outcome and settles its reservation, in one transaction (with the
/// attempt's record, if given), if `holder` still holds the job. `false` means the job was cancelled or rescued
/// meanwhile: the outcome is discarded (and a cancelled job's reservation is settled).
pub async fn finish_attempt(
    pool: &PgPool,
    holder: Holder<'_>,
    served: Option<Served<'_>>,
    finish: Finish<'_>,
    settlement: Settlement,
    record: Option<&AttemptRecord<'_>>,
    now: DateTime<Utc>,
) -> Result<bool> {
    let (state, result, usage, request_id, code, message, not_before) = match finish {
        Finish::Succeeded {
            result,
            usage,
            provider_request_id,
        } => (
            JobState::Succeeded,
            Some(result),
            Some(serde_json::to_value(usage)?),
            provider_request_id,
            None,
            None,
            None,
        ),
        Finish::Failed { code, message } => (
            JobState::Failed,
            None,
            None,
            None,
            Some(code),
            Some(message),
            None,
        ),
        Finish::Retry {
            not_before,
            code,
            message,
        } => (
            JobState::Queued,
            None,
            None,
            None,
            Some(code),
            Some(message),
            Some(not_before),
        ),
    };
    let mut tx = pool.begin().await?;
    if let Some(record) = record {
        record_attempt(&mut *tx, record).await?;
    }
    let prev = sqlx::query_as::<Postgres, Previous>(
        "UPDATE jobs j SET state = $4, result = COALESCE($5, j.result), usage = COALESCE($6, j.usage),
                           provider_request_id = COALESCE($7, j.provider_request_id),
                           error_code = $8, error_message = $9,
                           not_before = COALESCE($10, j.not_before),
                           finished_at = CASE WHEN $4 = 'queued'::job_state THEN NULL ELSE $11 END,
                           provider = COALESCE($12, j.provider), provider_model = COALESCE($13, j.provider_model),
                           lease_owner = NULL, lease_expires_at = NULL,
                           reserved_buckets = NULL, reserved_amounts = NULL, admission = NULL
         FROM (SELECT id, state, reserved_buckets, reserved_amounts FROM jobs WHERE id = $1 FOR UPDATE) old
         WHERE j.id = old.id AND j.state = 'running' AND j.attempt = $2 AND j.lease_owner = $3
         RETURNING j.id, old.state AS old_state, old.reserved_buckets AS old_buckets,
                   old.reserved_amounts AS old_amounts",
    )
    .bind(holder.id)
    .bind(holder.attempt)
    .bind(holder.owner)
    .bind(state)
    .bind(result)
    .bind(usage)
    .bind(request_id)
    .bind(code)
    .bind(message)
    .bind(not_before)
    .bind(now)
    .bind(served.map(|s| s.provider))
    .bind(served.map(|s| s.model))
    .fetch_optional(&mut *tx)
    .await?;
    let written = prev.is_some();
    let prev = match prev {
        Some(p) => Some(p),
        // Not ours any more. If it was cancelled while we ran, the reservation is still ours
        // to settle; if it was rescued, the rescuer settled it.
        None => {
            sqlx::query_as::<Postgres, Previous>(
                "UPDATE jobs j SET reserved_buckets = NULL, reserved_amounts = NULL,
                                   lease_owner = NULL, lease_expires_at = NULL
                 FROM (SELECT id, state, reserved_buckets, reserved_amounts FROM jobs WHERE id = $1 FOR UPDATE) old
                 WHERE j.id = old.id AND j.state = 'cancelled' AND j.attempt = $2 AND j.lease_owner = $3
                 RETURNING j.id, old.state AS old_state, old.reserved_buckets AS old_buckets,
                           old.reserved_amounts AS old_amounts",
            )
            .bind(holder.id)
            .bind(holder.attempt)
            .bind(holder.owner)
            .fetch_optional(&mut *tx)
            .await?
        }
    };
    if let Some(r) = prev.and_then(|p| reservation(p.old_buckets, p.old_amounts)) {
        settle(&mut tx, &[(holder.id, r, settlement)]).await?;
    }
    if written {
        if state.is_terminal() {
            notify_done(&mut tx, &[holder.id]).await?;
        } else {
            notify_gate_in(&mut tx).await?;
        }
    } else {
        notify_gate_in(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(written)
}

async fn notify_gate_in(conn: &mut PgConnection) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(CHANNEL_GATE)
        .execute(conn)
        .await?;
    Ok(())
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

async fn record_attempt(ex: impl PgExecutor<'_>, a: &AttemptRecord<'_>) -> Result<()> {
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
    let done = sqlx::query(
        "UPDATE jobs SET lease_expires_at = $2
         WHERE lease_owner = $1 AND (state = 'running' OR (state = 'cancelled' AND reserved_buckets IS NOT NULL))",
    )
    .bind(owner)
    .bind(now + lease)
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
    /// Reservations of finished jobs whose holder died before settling them.
    pub orphans_settled: u64,
}

/// A finished job's id and its reservation columns, as a query returns them.
type OrphanReservation = (JobId, Option<Vec<i64>>, Option<Vec<f64>>);

#[derive(sqlx::FromRow)]
struct Released {
    id: JobId,
    failed: bool,
    old_buckets: Option<Vec<i64>>,
    old_amounts: Option<Vec<f64>>,
}

/// Takes back what `owner`'s jobs hold (shutdown after the drain timeout) or what holders
/// whose lease expired held (they died or lost the database): the jobs return to the
/// queue — or fail with `lease_expired` when no attempts are left — and their reservations
/// are settled as sent with an unknown outcome.
async fn release_running(pool: &PgPool, owner: Option<&str>, now: DateTime<Utc>) -> Result<Rescued> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as::<Postgres, Released>(
        "WITH gone AS (
             SELECT id, reserved_buckets, reserved_amounts FROM jobs
             WHERE state = 'running' AND (lease_owner = $2 OR ($2 IS NULL AND lease_expires_at < $1))
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET
             state = CASE WHEN j.attempt >= j.max_attempts THEN 'failed'::job_state ELSE 'queued' END,
             error_code = CASE WHEN j.attempt >= j.max_attempts THEN 'lease_expired' ELSE j.error_code END,
             error_message = CASE WHEN j.attempt >= j.max_attempts
                 THEN 'the dispatcher holding the job stopped and no attempts are left'
                 ELSE j.error_message END,
             finished_at = CASE WHEN j.attempt >= j.max_attempts THEN $1 END,
             lease_owner = NULL, lease_expires_at = NULL,
             reserved_buckets = NULL, reserved_amounts = NULL
         FROM gone WHERE j.id = gone.id
         RETURNING j.id, j.state = 'failed' AS failed, gone.reserved_buckets AS old_buckets,
                   gone.reserved_amounts AS old_amounts",
    )
    .bind(now)
    .bind(owner)
    .fetch_all(&mut *tx)
    .await?;
    let mut rescued = Rescued::default();
    let mut ended = Vec::new();
    let mut done = Vec::new();
    for row in rows {
        if row.failed {
            rescued.failed += 1;
            done.push(row.id);
        } else {
            rescued.requeued += 1;
        }
        if let Some(r) = reservation(row.old_buckets, row.old_amounts) {
            ended.push((row.id, r, Settlement::SENT_UNKNOWN));
        }
    }
    // Finished jobs (cancelled while running) whose holder died before settling.
    if owner.is_none() {
        let orphans: Vec<OrphanReservation> = sqlx::query_as(
            "WITH gone AS (
                 SELECT id, reserved_buckets, reserved_amounts FROM jobs
                 WHERE reserved_buckets IS NOT NULL AND state IN ('succeeded', 'failed', 'cancelled')
                   AND lease_expires_at < $1
                 FOR UPDATE SKIP LOCKED)
             UPDATE jobs j SET reserved_buckets = NULL, reserved_amounts = NULL,
                               lease_owner = NULL, lease_expires_at = NULL
             FROM gone WHERE j.id = gone.id
             RETURNING j.id, gone.reserved_buckets, gone.reserved_amounts",
        )
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        for (id, ids, amounts) in orphans {
            if let Some(r) = reservation(ids, amounts) {
                rescued.orphans_settled += 1;
                ended.push((id, r, Settlement::SENT_UNKNOWN));
            }
        }
    }
    settle(&mut tx, &ended).await?;
    notify_done(&mut tx, &done).await?;
    if rescued.requeued > 0 {
        notify_gate_in(&mut tx).await?;
    }
    tx.commit().await?;
    Ok(rescued)
}

/// On shutdown: what `owner` did not finish goes back to the queue at once.
pub async fn release_leases(pool: &PgPool, owner: &str, now: DateTime<Utc>) -> Result<u64> {
    Ok(release_running(pool, Some(owner), now).await?.requeued)
}

/// Re-queues jobs whose holder stopped heartbeating; see [`release_running`].
pub async fn rescue_expired_leases(pool: &PgPool, now: DateTime<Utc>) -> Result<Rescued> {
    release_running(pool, None, now).await
}

/// Fails queued and admitted jobs whose deadline has passed: they must never be
/// dispatched late. An admitted job's reservation goes back whole (it was never sent).
pub async fn expire_deadlines(pool: &PgPool, now: DateTime<Utc>) -> Result<u64> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query_as::<Postgres, Previous>(
        "WITH late AS (
             SELECT id, state, reserved_buckets, reserved_amounts FROM jobs
             WHERE state IN ('queued', 'admitted') AND deadline <= $1
             FOR UPDATE SKIP LOCKED)
         UPDATE jobs j SET state = 'failed', finished_at = $1,
             error_code = 'deadline_exceeded',
             error_message = CASE WHEN j.error_code IS NULL
                 THEN 'the deadline passed before the job could be sent'
                 ELSE 'the deadline passed before the job could be sent; last error: ' || j.error_code END,
             reserved_buckets = NULL, reserved_amounts = NULL
         FROM late WHERE j.id = late.id
         RETURNING j.id, late.state AS old_state, late.reserved_buckets AS old_buckets,
                   late.reserved_amounts AS old_amounts",
    )
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    let ids: Vec<JobId> = rows.iter().map(|r| r.id).collect();
    let ended: Vec<(JobId, Reservation, Settlement)> = rows
        .into_iter()
        .filter_map(|r| reservation(r.old_buckets, r.old_amounts).map(|res| (r.id, res, Settlement::UNSENT)))
        .collect();
    settle(&mut tx, &ended).await?;
    notify_done(&mut tx, &ids).await?;
    tx.commit().await?;
    Ok(ids.len() as u64)
}

/// Queue depth by state, for summaries and status.
pub async fn count_by_state(ex: impl PgExecutor<'_>) -> Result<Vec<(JobState, i64)>> {
    Ok(
        sqlx::query_as("SELECT state, count(*) FROM jobs GROUP BY state ORDER BY state")
            .fetch_all(ex)
            .await?,
    )
}

/// Jobs a tenant has waiting (queued or admitted) in a class: the submit-time cap.
pub async fn waiting_count(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    class: crate::model::JobClass,
) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM jobs WHERE tenant = $1 AND class = $2 AND state IN ('queued', 'admitted')",
    )
    .bind(tenant)
    .bind(class)
    .fetch_one(ex)
    .await?)
}
