//! Batch rows, the bulk insert of a batch's jobs, and what finalization reads and writes.
//!
//! A batch's lines become jobs in chunks (one `INSERT … SELECT FROM unnest(…)` per
//! chunk, never one statement per line) inside the transaction that creates the batch,
//! so a batch exists with all its jobs or not at all. Finalization locks the batch row,
//! reads its jobs, writes the output and error files and the terminal status in one
//! transaction: a crash in between leaves the batch open and the next pass redoes it.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};

use super::Result;
use super::buckets::{Settlement, reservation, settle};
use super::jobs::notify_done;
use crate::batches::{BatchRow, ERROR_RATE_MIN_LINES, ResultsCursor};
use crate::model::{JobClass, JobId, JobState};
use crate::vocab::{BatchStatus, Endpoint, ReasonCode};

/// `sqlx::query_as!` of [`BatchJobResult`]s: the result columns of a batch's jobs, then
/// `$tail`.
macro_rules! query_batch_results {
    ($tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            BatchJobResult,
            r#"SELECT id AS "id: JobId", custom_id AS "custom_id!", batch_line AS "batch_line!",
                      state AS "state: JobState", result, usage, error_code, error_message,
                      provider_request_id, result_xid::text::int8 AS result_xid "#
                + $tail
            $(, $arg)*
        )
    };
}

/// `sqlx::query_as!` of [`BatchRow`]s: the statement is `$head`, the batch's columns, then
/// `$tail`.
macro_rules! query_batches {
    ($head:expr, $tail:expr $(, $arg:expr)* $(,)?) => {
        sqlx::query_as!(
            BatchRow,
            $head
                + r#" id, tenant, endpoint AS "endpoint: Endpoint", input_file_id, completion_window, status, class AS "class: JobClass",
                      output_file_id, error_file_id, metadata, errors, total, rejected, completed, failed, cancelled, expired, usage,
                      output_expires_secs, created_at, in_progress_at, expires_at, finalizing_at, completed_at,
                      failed_at, expired_at, cancelling_at, cancelled_at, api_key, paused_at, priority, max_cost_usd,
                      max_error_rate, eta_p50, eta_p90 "#
                + $tail
            $(, $arg)*
        )
    };
}

pub async fn insert_batch(ex: impl PgExecutor<'_>, b: &BatchRow) -> Result<()> {
    sqlx::query!(
        "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, class, metadata,
                              total, rejected, output_expires_secs, created_at, in_progress_at, expires_at,
                              api_key, priority, max_cost_usd, max_error_rate)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18)",
        &b.id,
        &b.tenant,
        b.endpoint as Endpoint,
        b.input_file_id.as_deref(),
        &b.completion_window,
        &b.status,
        b.class as JobClass,
        b.metadata.as_ref(),
        b.total,
        b.rejected,
        b.output_expires_secs,
        b.created_at,
        b.in_progress_at,
        b.expires_at,
        b.api_key,
        b.priority,
        b.max_cost_usd,
        b.max_error_rate,
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// One chunk of a batch's valid lines, column by column, ready for `unnest`.
#[derive(Debug, Default)]
pub struct BatchJobs {
    pub ids: Vec<uuid::Uuid>,
    pub requests: Vec<serde_json::Value>,
    pub models: Vec<String>,
    pub custom_ids: Vec<String>,
    pub lines: Vec<i32>,
    pub estimated_input_tokens: Vec<i32>,
    pub estimated_output_tokens: Vec<i32>,
}

impl BatchJobs {
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

/// Inserts a chunk of the batch's jobs in one statement (state `queued`, deadline the
/// batch's expiry). Returns the rows inserted.
pub async fn insert_batch_jobs(
    ex: impl PgExecutor<'_>,
    batch: &BatchRow,
    jobs: &BatchJobs,
    max_attempts: i32,
) -> Result<u64> {
    Ok(sqlx::query!(
        "INSERT INTO jobs (id, tenant, class, priority, request, model, deadline, not_before, max_attempts,
                           estimated_input_tokens, estimated_output_tokens, created_at,
                           batch_id, custom_id, batch_line, endpoint, api_key)
         SELECT t.id, $1, $2, $16, t.request, t.model, $3, $4, $5, t.ein, t.eout, $4, $6, t.custom_id, t.line, $14, $15
         FROM unnest($7::uuid[], $8::jsonb[], $9::text[], $10::int[], $11::int[], $12::text[], $13::int[])
             AS t(id, request, model, ein, eout, custom_id, line)",
        &batch.tenant,
        batch.class as JobClass,
        batch.expires_at,
        batch.created_at,
        max_attempts,
        &batch.id,
        &jobs.ids,
        &jobs.requests,
        &jobs.models,
        &jobs.estimated_input_tokens,
        &jobs.estimated_output_tokens,
        &jobs.custom_ids,
        &jobs.lines,
        batch.endpoint as Endpoint,
        batch.api_key,
        batch.priority,
    )
    .execute(ex)
    .await?
    .rows_affected())
}

/// An input line rejected at ingest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    pub line: i32,
    pub custom_id: Option<String>,
    pub code: String,
    pub message: String,
}

pub async fn insert_line_errors(ex: impl PgExecutor<'_>, batch_id: &str, errors: &[LineError]) -> Result<()> {
    if errors.is_empty() {
        return Ok(());
    }
    let lines: Vec<i32> = errors.iter().map(|e| e.line).collect();
    let custom_ids: Vec<Option<&str>> = errors.iter().map(|e| e.custom_id.as_deref()).collect();
    let codes: Vec<&str> = errors.iter().map(|e| e.code.as_str()).collect();
    let messages: Vec<&str> = errors.iter().map(|e| e.message.as_str()).collect();
    sqlx::query!(
        "INSERT INTO batch_line_errors (batch_id, line, custom_id, code, message)
         SELECT $1, * FROM unnest($2::int[], $3::text[], $4::text[], $5::text[])",
        batch_id,
        &lines,
        &custom_ids as &[Option<&str>],
        &codes as &[&str],
        &messages as &[&str],
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// Records the ingest's totals: every line of the input, and those rejected.
pub async fn set_batch_totals(ex: impl PgExecutor<'_>, id: &str, total: i32, rejected: i32) -> Result<()> {
    sqlx::query!(
        "UPDATE batches SET total = $2, rejected = $3 WHERE id = $1",
        id,
        total,
        rejected
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// A tenant's batch (any tenant's for `None`: the operators'), or `None` (also when it
/// belongs to another tenant).
pub async fn get_batch(ex: impl PgExecutor<'_>, tenant: Option<&str>, id: &str) -> Result<Option<BatchRow>> {
    Ok(query_batches!(
        "SELECT",
        "FROM batches WHERE id = $1 AND ($2::text IS NULL OR tenant = $2)",
        id,
        tenant
    )
    .fetch_optional(ex)
    .await?)
}

/// Where a page of a list starts.
#[derive(Debug, Clone, Copy)]
pub enum Cursor<'a> {
    /// The newest.
    Newest,
    /// Older than this id (the previous page's last).
    After(&'a str),
    /// Newer than this id (the next page's first).
    Before(&'a str),
}

/// Up to `limit` of a tenant's batches whose ids begin with `prefix` (each API lists the
/// batches made through it), newest first, from `cursor`.
pub async fn list_batches(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    prefix: &str,
    cursor: Cursor<'_>,
    limit: i64,
) -> Result<Vec<BatchRow>> {
    if let Cursor::Before(before) = cursor {
        let mut rows = query_batches!(
            "SELECT",
            "FROM batches WHERE ($1::text IS NULL OR tenant = $1) AND starts_with(id, $2) AND id > $3
             ORDER BY id LIMIT $4",
            tenant,
            prefix,
            before,
            limit,
        )
        .fetch_all(ex)
        .await?;
        rows.reverse();
        return Ok(rows);
    }
    let after = match cursor {
        Cursor::After(after) => Some(after),
        _ => None,
    };
    Ok(query_batches!(
        "SELECT",
        "FROM batches WHERE ($1::text IS NULL OR tenant = $1) AND starts_with(id, $2) AND ($3::text IS NULL OR id < $3)
         ORDER BY id DESC LIMIT $4",
        tenant,
        prefix,
        after,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// Open batches (`in_progress`, `cancelling`), of one tenant or of all, newest first.
pub async fn open_batches(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    limit: i64,
) -> Result<Vec<BatchRow>> {
    Ok(query_batches!(
        "SELECT",
        "FROM batches WHERE status IN ('in_progress', 'cancelling')
           AND ($1::text IS NULL OR tenant = $1)
         ORDER BY id DESC LIMIT $2",
        tenant,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// Succeeded and failed-or-cancelled jobs of each batch (for batches still running).
pub async fn job_counts(ex: impl PgExecutor<'_>, batch_ids: &[&str]) -> Result<HashMap<String, (i64, i64)>> {
    if batch_ids.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = sqlx::query!(
        r#"SELECT batch_id AS "batch_id!", count(*) FILTER (WHERE state = 'succeeded') AS "succeeded!",
                  count(*) FILTER (WHERE state IN ('failed', 'cancelled')) AS "failed!"
           FROM jobs WHERE batch_id = ANY($1) GROUP BY batch_id"#,
        batch_ids as &[&str],
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.batch_id, (r.succeeded, r.failed)))
        .collect())
}

/// Cancels every unfinished job of a batch with `code`, as cancelling one job does: a
/// running attempt's late result is discarded and its holder settles its reservation; an
/// admitted job's reservation goes back whole. Returns how many were cancelled.
pub async fn cancel_batch_jobs(
    conn: &mut PgConnection,
    batch_id: &str,
    code: &str,
    message: &str,
    now: DateTime<Utc>,
) -> Result<u64> {
    let rows = sqlx::query!(
        r#"WITH old AS (
             SELECT id, state, reserved_buckets, reserved_amounts FROM jobs
             WHERE batch_id = $1 AND state IN ('queued', 'admitted', 'running')
             ORDER BY id FOR NO KEY UPDATE)
         UPDATE jobs j SET state = 'cancelled', finished_at = $2, error_code = $3, error_message = $4,
                           reserved_buckets = CASE WHEN old.state = 'running' THEN j.reserved_buckets END,
                           reserved_amounts = CASE WHEN old.state = 'running' THEN j.reserved_amounts END
         FROM old WHERE j.id = old.id
         RETURNING j.id AS "id: JobId", old.state AS "old_state: JobState", old.reserved_buckets AS old_buckets,
                   old.reserved_amounts AS old_amounts"#,
        batch_id,
        now,
        code,
        message,
    )
    .fetch_all(&mut *conn)
    .await?;
    let ids: Vec<JobId> = rows.iter().map(|r| r.id).collect();
    let unsent: Vec<_> = rows
        .into_iter()
        .filter(|r| r.old_state == JobState::Admitted)
        .filter_map(|r| reservation(r.old_buckets, r.old_amounts).map(|res| (r.id, res, Settlement::UNSENT)))
        .collect();
    settle(&mut *conn, &unsent).await?;
    notify_done(&mut *conn, &ids).await?;
    Ok(ids.len() as u64)
}

/// Moves a running batch to `cancelling` and cancels its unfinished jobs, in one
/// transaction; finalization then writes its files and marks it `cancelled`.
pub async fn cancel_batch(
    conn: &mut PgConnection,
    tenant: Option<&str>,
    id: &str,
    now: DateTime<Utc>,
) -> Result<BatchControl> {
    let Some(batch) = lock_tenant_batch(&mut *conn, tenant, id).await? else {
        return Ok(BatchControl::NotFound);
    };
    match batch.status() {
        BatchStatus::Cancelling => return Ok(BatchControl::Changed(batch)),
        BatchStatus::Validating | BatchStatus::InProgress => {}
        _ => return Ok(BatchControl::Finished(batch)),
    }
    let batch = stop_batch(
        conn,
        id,
        ReasonCode::BatchCancelled,
        "the batch was cancelled",
        false,
        now,
    )
    .await?;
    Ok(BatchControl::Changed(batch))
}

/// Moves batch `id` (locked, open) to `cancelling` and cancels its unfinished jobs with
/// `code`; with `report`, `code` and `message` are its `errors` too (what stopped it).
async fn stop_batch(
    conn: &mut PgConnection,
    id: &str,
    code: ReasonCode,
    message: &str,
    report: bool,
    now: DateTime<Utc>,
) -> Result<BatchRow> {
    let errors = report.then(
        || serde_json::json!({"object": "list", "data": [{"code": code.as_str(), "message": message}]}),
    );
    let batch = query_batches!(
        "UPDATE batches SET status = 'cancelling', cancelling_at = $2, errors = COALESCE($3, errors)
         WHERE id = $1 RETURNING",
        "",
        id,
        now,
        errors,
    )
    .fetch_one(&mut *conn)
    .await?;
    cancel_batch_jobs(conn, id, code.as_str(), message, now).await?;
    Ok(batch)
}

/// Stops each running batch whose finished lines' error rate passed its `max_error_rate`
/// (once [`ERROR_RATE_MIN_LINES`] of them succeeded or failed): cancelled, its unfinished
/// lines cancelled with `batch_error_rate_exceeded`, which its `errors` name. Returns how
/// many it stopped. Its lines are read by the index of ended lines (each has a
/// `result_xid`).
pub async fn stop_failing_batches(conn: &mut PgConnection, now: DateTime<Utc>) -> Result<u64> {
    let over = sqlx::query!(
        r#"SELECT b.id, b.max_error_rate AS "max_error_rate!", n.failed AS "failed!", n.ended AS "ended!"
           FROM batches b,
           LATERAL (SELECT count(*) FILTER (WHERE j.state = 'failed') AS failed,
                           count(*) FILTER (WHERE j.state IN ('succeeded', 'failed')) AS ended
                    FROM jobs j WHERE j.batch_id = b.id AND j.result_xid IS NOT NULL) n
           WHERE b.status = 'in_progress' AND b.max_error_rate IS NOT NULL
             AND n.ended >= $1 AND n.failed > b.max_error_rate * n.ended"#,
        ERROR_RATE_MIN_LINES,
    )
    .fetch_all(&mut *conn)
    .await?;
    let mut stopped = 0;
    for batch in over {
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        // Still running once locked (a cancel or the finalizer may have come first).
        if lock_open_batch(&mut tx, &batch.id)
            .await?
            .is_some_and(|b| b.status() == BatchStatus::InProgress)
        {
            let message = format!(
                "{} of its {} finished lines failed, more than its max_error_rate of {}: the batch was stopped",
                batch.failed, batch.ended, batch.max_error_rate
            );
            stop_batch(
                &mut tx,
                &batch.id,
                ReasonCode::BatchErrorRateExceeded,
                &message,
                true,
                now,
            )
            .await?;
            stopped += 1;
        }
        tx.commit().await?;
    }
    Ok(stopped)
}

/// A tenant's batch (any tenant's for `None`), locked for the rest of the transaction;
/// `None` when it has none of that id.
async fn lock_tenant_batch(
    conn: &mut PgConnection,
    tenant: Option<&str>,
    id: &str,
) -> Result<Option<BatchRow>> {
    Ok(query_batches!(
        "SELECT",
        "FROM batches WHERE id = $1 AND ($2::text IS NULL OR tenant = $2) FOR UPDATE",
        id,
        tenant,
    )
    .fetch_optional(&mut *conn)
    .await?)
}

/// What a batch control (a cancel, a pause, a change) found: the batch as changed, one
/// already finished (unchanged), or none of the tenant's.
#[derive(Debug)]
pub enum BatchControl {
    Changed(BatchRow),
    Finished(BatchRow),
    NotFound,
}

/// A change of a running batch: what [`control_batch`] writes.
#[derive(Debug, Clone, Default)]
pub struct BatchChange {
    /// Pause (`true`) or resume (`false`).
    pub paused: Option<bool>,
    pub priority: Option<i32>,
    pub class: Option<JobClass>,
    /// Its lines' deadline (the batch's `expires_at`).
    pub deadline: Option<DateTime<Utc>>,
}

/// Changes an open batch (validating or in progress) of `tenant` (any tenant's for
/// `None`) and its queued jobs, in one transaction: paused, its queued jobs are held out
/// of admission (jobs admitted or running go on); resumed, they are released and the gate
/// told; a new priority, class or deadline is its queued jobs' from now on (jobs in flight
/// keep theirs).
pub async fn control_batch(
    conn: &mut PgConnection,
    tenant: Option<&str>,
    id: &str,
    change: &BatchChange,
    now: DateTime<Utc>,
) -> Result<BatchControl> {
    let Some(batch) = lock_tenant_batch(&mut *conn, tenant, id).await? else {
        return Ok(BatchControl::NotFound);
    };
    if !matches!(batch.status(), BatchStatus::Validating | BatchStatus::InProgress) {
        return Ok(BatchControl::Finished(batch));
    }
    let paused_at = match change.paused {
        Some(true) => Some(batch.paused_at.unwrap_or(now)),
        Some(false) => None,
        None => batch.paused_at,
    };
    let batch = query_batches!(
        "UPDATE batches SET paused_at = $2, priority = COALESCE($3, priority), class = COALESCE($4, class),
                            expires_at = COALESCE($5, expires_at)
         WHERE id = $1 RETURNING",
        "",
        id,
        paused_at,
        change.priority,
        change.class as Option<JobClass>,
        change.deadline,
    )
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query!(
        "UPDATE jobs SET held = $2, priority = COALESCE($3, priority), class = COALESCE($4, class),
                         deadline = COALESCE($5, deadline)
         WHERE batch_id = $1 AND state = 'queued'",
        id,
        paused_at.is_some(),
        change.priority,
        change.class as Option<JobClass>,
        change.deadline,
    )
    .execute(&mut *conn)
    .await?;
    if paused_at.is_none() {
        sqlx::query!("SELECT pg_notify($1, '')", super::CHANNEL_GATE)
            .execute(&mut *conn)
            .await?;
    }
    Ok(BatchControl::Changed(batch))
}

/// How many of a batch's jobs are queued.
pub async fn queued_batch_lines(ex: impl PgExecutor<'_>, batch_id: &str) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM jobs WHERE batch_id = $1 AND state = 'queued'"#,
        batch_id
    )
    .fetch_one(ex)
    .await?)
}

/// Holds again the queued jobs of paused batches that came back to the queue by a way
/// that does not look at their batch (a rescued lease, a provider batch's line sent back
/// online). Returns how many.
///
/// The paused batches are read first, and their lines by their batch: with none paused
/// (nearly always) nothing of `jobs` is read, and with some, no plan can read every queued
/// job to find theirs.
pub async fn hold_paused_lines(pool: &PgPool) -> Result<u64> {
    let paused = sqlx::query_scalar!(
        "SELECT id FROM batches WHERE paused_at IS NOT NULL AND status IN ('validating', 'in_progress')"
    )
    .fetch_all(pool)
    .await?;
    if paused.is_empty() {
        return Ok(0);
    }
    // `batch_id IS NOT NULL` lets the plan prove `jobs_batch_open`'s predicate.
    Ok(sqlx::query!(
        "UPDATE jobs SET held = true
         WHERE batch_id IS NOT NULL AND batch_id = ANY($1) AND state = 'queued' AND NOT held",
        &paused
    )
    .execute(pool)
    .await?
    .rows_affected())
}

/// Up to `limit` of a batch's finished lines after `after`, in the order of the
/// transactions that ended them (`result_xid`, set by a trigger whichever way a line ends;
/// about the order they ended), then by id. While the batch runs, only transactions
/// below the snapshot's xmin (the oldest running transaction that has written anything,
/// in any database of the server; readers hold no id) are read — every one before them has
/// ended — so no line can later commit behind a cursor: a line shows once every writing
/// transaction already running when it ended has ended too. Once the batch has `ended` (as
/// read before this), every line's ending has committed and none can come, so all are read.
pub async fn batch_results_after(
    ex: impl PgExecutor<'_>,
    batch_id: &str,
    after: ResultsCursor,
    limit: i64,
    ended: bool,
) -> Result<Vec<BatchJobResult>> {
    Ok(query_batch_results!(
        "FROM jobs WHERE batch_id = $1 AND result_xid IS NOT NULL
           AND (result_xid, id) > ($2::int8::text::xid8, $3)
           AND ($5 OR result_xid < pg_snapshot_xmin(pg_current_snapshot()))
         ORDER BY result_xid, id LIMIT $4",
        batch_id,
        after.xid,
        after.id.0,
        limit,
        ended,
    )
    .fetch_all(ex)
    .await?)
}

/// Open batches that finalization should look at now: cancelling ones, expired ones, and
/// running ones with no unfinished job left.
pub async fn batches_to_finalize(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    limit: i64,
) -> Result<Vec<String>> {
    Ok(sqlx::query_scalar!(
        "SELECT b.id FROM batches b
         WHERE b.status IN ('in_progress', 'finalizing', 'cancelling')
           AND (b.status <> 'in_progress' OR b.expires_at <= $1
                OR NOT EXISTS (SELECT 1 FROM jobs j WHERE j.batch_id = b.id
                               AND j.state IN ('queued', 'admitted', 'running')))
         ORDER BY b.id LIMIT $2",
        now,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// Locks an open batch for finalization; `None` if another process holds it or it is
/// no longer open.
pub async fn lock_open_batch(conn: &mut PgConnection, id: &str) -> Result<Option<BatchRow>> {
    Ok(query_batches!(
        "SELECT",
        "FROM batches WHERE id = $1 AND status IN ('in_progress', 'finalizing', 'cancelling')
         FOR UPDATE SKIP LOCKED",
        id,
    )
    .fetch_optional(conn)
    .await?)
}

/// Whether any job of the batch is unfinished.
pub async fn batch_has_open_jobs(ex: impl PgExecutor<'_>, batch_id: &str) -> Result<bool> {
    Ok(sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM jobs WHERE batch_id = $1 AND state IN ('queued', 'admitted', 'running'))
               AS "open!""#,
        batch_id,
    )
    .fetch_one(ex)
    .await?)
}

/// What the output and error files say about one job.
#[derive(Debug, Clone)]
pub struct BatchJobResult {
    pub id: JobId,
    pub custom_id: String,
    pub batch_line: i32,
    pub state: JobState,
    pub result: Option<serde_json::Value>,
    pub usage: Option<serde_json::Value>,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub provider_request_id: Option<String>,
    /// The transaction that ended it, its place among the batch's results
    /// ([`batch_results_after`]); `None` until it ends.
    pub result_xid: Option<i64>,
}

/// A page of a batch's jobs in input order, after input line `after_line`.
pub async fn batch_results_page(
    ex: impl PgExecutor<'_>,
    batch_id: &str,
    after_line: i32,
    limit: i64,
) -> Result<Vec<BatchJobResult>> {
    // A batch's jobs have a custom_id and line (set by `insert_batch_jobs`).
    Ok(query_batch_results!(
        "FROM jobs WHERE batch_id = $1 AND batch_line > $2 ORDER BY batch_line LIMIT $3",
        batch_id,
        after_line,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

pub async fn line_errors(ex: impl PgExecutor<'_>, batch_id: &str) -> Result<Vec<LineError>> {
    Ok(sqlx::query_as!(
        LineError,
        "SELECT line, custom_id, code, message FROM batch_line_errors WHERE batch_id = $1 ORDER BY line",
        batch_id,
    )
    .fetch_all(ex)
    .await?)
}

/// How a batch ended, written by finalization.
#[derive(Debug, Clone)]
pub struct BatchEnd {
    pub status: BatchStatus,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub completed: i32,
    pub failed: i32,
    /// Of `failed`: cancelled, and expired.
    pub cancelled: i32,
    pub expired: i32,
    pub usage: serde_json::Value,
    pub errors: Option<serde_json::Value>,
}

/// Writes the terminal status, its timestamp, the files and the frozen counts.
pub async fn finish_batch(
    conn: &mut PgConnection,
    id: &str,
    end: &BatchEnd,
    now: DateTime<Utc>,
) -> Result<BatchRow> {
    Ok(query_batches!(
        "UPDATE batches SET status = $2, output_file_id = $3, error_file_id = $4, completed = $5, failed = $6,
                            usage = $7, errors = COALESCE($8, errors),
                            finalizing_at = COALESCE(finalizing_at, $9),
                            completed_at = CASE WHEN $2 = 'completed' THEN $9 END,
                            failed_at = CASE WHEN $2 = 'failed' THEN $9 END,
                            expired_at = CASE WHEN $2 = 'expired' THEN $9 END,
                            cancelled_at = CASE WHEN $2 = 'cancelled' THEN $9 END,
                            cancelled = $10, expired = $11
         WHERE id = $1 RETURNING",
        "",
        id,
        end.status as BatchStatus,
        end.output_file_id.as_deref(),
        end.error_file_id.as_deref(),
        end.completed,
        end.failed,
        &end.usage,
        end.errors.as_ref(),
        now,
        end.cancelled,
        end.expired,
    )
    .fetch_one(conn)
    .await?)
}

/// Deletes a tenant's finished batch with its output and error files and its webhook;
/// `false` if it has no such batch (or it has not finished).
pub async fn delete_finished_batch(ex: impl PgExecutor<'_>, tenant: &str, id: &str) -> Result<bool> {
    let deleted = sqlx::query_scalar!(
        r#"WITH gone AS (
             DELETE FROM batches WHERE id = $1 AND tenant = $2
               AND status IN ('completed', 'failed', 'expired', 'cancelled')
             RETURNING id, output_file_id, error_file_id),
         endpoints AS (DELETE FROM webhook_endpoints WHERE batch_id IN (SELECT id FROM gone)),
         files AS (DELETE FROM files WHERE tenant = $2
                     AND id IN (SELECT output_file_id FROM gone UNION ALL SELECT error_file_id FROM gone))
         SELECT count(*) AS "deleted!" FROM gone"#,
        id,
        tenant,
    )
    .fetch_one(ex)
    .await?;
    Ok(deleted > 0)
}

/// Deletes up to `limit` finished jobs that finished before `before`, keeping those of
/// batches that are still open (their output file is not written yet).
pub async fn prune_finished_jobs(ex: impl PgExecutor<'_>, before: DateTime<Utc>, limit: i64) -> Result<u64> {
    // Attempt records go with their job (deleted here: they have no foreign key to their job).
    let n = sqlx::query_scalar!(
        r#"WITH gone AS (
             DELETE FROM jobs WHERE id IN (
                 SELECT j.id FROM jobs j
                 WHERE j.state IN ('succeeded', 'failed', 'cancelled') AND j.finished_at < $1
                   AND j.reserved_buckets IS NULL
                   AND (j.batch_id IS NULL OR NOT EXISTS (
                       SELECT 1 FROM batches b WHERE b.id = j.batch_id
                         AND b.status IN ('validating', 'in_progress', 'finalizing', 'cancelling')))
                 LIMIT $2)
             RETURNING id),
         attempts AS (DELETE FROM job_attempts WHERE job_id IN (SELECT id FROM gone))
         SELECT count(*) AS "deleted!" FROM gone"#,
        before,
        limit,
    )
    .fetch_one(ex)
    .await?;
    Ok(n.max(0) as u64)
}

/// Deletes up to `limit` finished batches created before `before`, with their own webhook
/// endpoints (their files expire on their own schedule).
pub async fn prune_finished_batches(
    ex: impl PgExecutor<'_>,
    before: DateTime<Utc>,
    limit: i64,
) -> Result<u64> {
    let n = sqlx::query_scalar!(
        r#"WITH gone AS (
             DELETE FROM batches WHERE id IN (
                 SELECT id FROM batches WHERE status IN ('completed', 'failed', 'expired', 'cancelled')
                   AND created_at < $1 LIMIT $2)
             RETURNING id),
         endpoints AS (DELETE FROM webhook_endpoints WHERE batch_id IN (SELECT id FROM gone)),
         -- Their cost caps' buckets (`buckets::batch_cap_key`).
         caps AS (DELETE FROM buckets WHERE key IN (SELECT 'batch:' || id || ':max_cost' FROM gone))
         SELECT count(*) AS "deleted!" FROM gone"#,
        before,
        limit,
    )
    .fetch_one(ex)
    .await?;
    Ok(n.max(0) as u64)
}
