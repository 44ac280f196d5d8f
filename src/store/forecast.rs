//! What a forecast reads (the `forecast` module): the work queued ahead on a job's routes,
//! the buckets on its path, how long calls have taken, how past forecasts came out — and
//! the lock that makes a deadline check and the insert it allows one step across
//! processes.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor};

use super::Result;
use crate::buckets::Bucket;
use crate::model::{JobClass, JobId};
use crate::vocab::{Dimension, Rule};

/// Namespace of the forecast locks (`pg_advisory_xact_lock(ns, hashtext(scope))`).
const FORECAST_LOCKS: i32 = 0x666f_7265; // "fore"

/// The span of submission times [`queued_around`] sums queued jobs over: a queue's jobs
/// pass their guard as they came, and one sum from its oldest to its newest would spread
/// them evenly — a queue of a few old jobs and many new ones would seem to pass its guard
/// all along.
const AGE_BAND_SECS: f64 = 10.0;
/// Jobs submitted longer ago than this are summed together, however long they have
/// waited: past every usual guard already, when each came no longer matters, and a read
/// of a day's backlog stays a few hundred rows.
const BANDED_FOR_SECS: f64 = 3_600.0;

/// Queued jobs of one (class, tenant, requested model), summed; and of them, those due
/// by the deadline of the job forecast.
#[derive(Debug, Clone, PartialEq)]
pub struct Queued {
    pub class: JobClass,
    pub tenant: String,
    pub model: String,
    pub jobs: f64,
    pub input_tokens: f64,
    pub output_tokens: f64,
    pub due_jobs: f64,
    pub due_input_tokens: f64,
    pub due_output_tokens: f64,
    /// When the first and the last of them were submitted.
    pub oldest: DateTime<Utc>,
    pub newest: DateTime<Utc>,
}

/// Whose queued work stands behind the job forecast rather than ahead of it: its own
/// tenant's jobs of its class that the gate serves after it (lower priority, or the same
/// priority and a later deadline), and the lines of its own batch (they are the work).
#[derive(Debug, Clone, Copy)]
pub struct Behind<'a> {
    pub tenant: &'a str,
    pub class: JobClass,
    pub priority: i32,
    pub deadline: DateTime<Utc>,
    pub batch_id: Option<&'a str>,
}

/// The queued jobs (not held by a paused batch) asking for any of `models`, by class,
/// tenant and model: those ahead of the job forecast, and those [`Behind`] it of its own
/// tenant and class (they go before it only once they have waited past their class's
/// guard). The lines of its own batch are in neither.
pub async fn queued_around(
    ex: impl PgExecutor<'_>,
    models: &[String],
    behind: Behind<'_>,
) -> Result<(Vec<Queued>, Vec<Queued>)> {
    let rows = sqlx::query!(
        r#"SELECT class AS "class!: JobClass", tenant AS "tenant!", model AS "model!",
                  (tenant = $2 AND class = $3
                   AND (priority < $4 OR (priority = $4 AND deadline > $5))) AS "behind!",
                  count(*)::float8 AS "jobs!",
                  sum(estimated_input_tokens)::float8 AS "input_tokens!",
                  sum(estimated_output_tokens)::float8 AS "output_tokens!",
                  count(*) FILTER (WHERE deadline <= $5)::float8 AS "due_jobs!",
                  COALESCE(sum(estimated_input_tokens) FILTER (WHERE deadline <= $5), 0)::float8
                      AS "due_input_tokens!",
                  COALESCE(sum(estimated_output_tokens) FILTER (WHERE deadline <= $5), 0)::float8
                      AS "due_output_tokens!",
                  min(created_at) AS "oldest!", max(created_at) AS "newest!"
           FROM jobs
           WHERE state = 'queued' AND NOT held AND model = ANY($1)
             AND ($6::text IS NULL OR batch_id IS DISTINCT FROM $6)
           GROUP BY 1, 2, 3, 4,
                    CASE WHEN created_at >= now() - make_interval(secs => $8)
                         THEN floor(extract(epoch FROM created_at)::float8 / $7::float8) END"#,
        models,
        behind.tenant,
        behind.class as JobClass,
        behind.priority,
        behind.deadline,
        behind.batch_id,
        AGE_BAND_SECS,
        BANDED_FOR_SECS,
    )
    .fetch_all(ex)
    .await?;
    let (mut ahead, mut after) = (Vec::new(), Vec::new());
    for r in rows {
        let queued = Queued {
            class: r.class,
            tenant: r.tenant,
            model: r.model,
            jobs: r.jobs,
            input_tokens: r.input_tokens,
            output_tokens: r.output_tokens,
            due_jobs: r.due_jobs,
            due_input_tokens: r.due_input_tokens,
            due_output_tokens: r.due_output_tokens,
            oldest: r.oldest,
            newest: r.newest,
        };
        match r.behind {
            true => after.push(queued),
            false => ahead.push(queued),
        }
    }
    Ok((ahead, after))
}

/// Replaces the leading gate's fairness lags with `lags`: (class, tenant, lag) each.
pub async fn save_fairness_lags(
    pool: &sqlx::PgPool,
    lags: &[(JobClass, String, f64)],
    now: DateTime<Utc>,
) -> Result<()> {
    let classes: Vec<JobClass> = lags.iter().map(|l| l.0).collect();
    let tenants: Vec<&str> = lags.iter().map(|l| l.1.as_str()).collect();
    let values: Vec<f64> = lags.iter().map(|l| l.2).collect();
    let mut tx = pool.begin().await?;
    sqlx::query!(
        "INSERT INTO fairness_lags (class, tenant, lag, updated_at)
         SELECT c, t, l, $4 FROM unnest($1::job_class[], $2::text[], $3::float8[]) AS u(c, t, l)
         ON CONFLICT ON CONSTRAINT fairness_lags_pkey DO UPDATE SET lag = excluded.lag, updated_at = $4",
        &classes as &[JobClass],
        &tenants as &[&str],
        &values,
        now,
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query!("DELETE FROM fairness_lags WHERE updated_at < $1", now)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// The leading gate's fairness lags, by class and tenant: how far (estimated tokens per
/// unit of weight) each queue is behind its class's clock.
pub async fn fairness_lags(ex: impl PgExecutor<'_>) -> Result<HashMap<(JobClass, String), f64>> {
    let rows = sqlx::query!(r#"SELECT class AS "class: JobClass", tenant, lag FROM fairness_lags"#)
        .fetch_all(ex)
        .await?;
    Ok(rows.into_iter().map(|r| ((r.class, r.tenant), r.lag)).collect())
}

/// How many queued jobs (not held) asking for any of `models`, of `class` or a class
/// served before it, were submitted before job `id` (ids grow with time).
pub async fn queued_before(
    ex: impl PgExecutor<'_>,
    models: &[String],
    class: JobClass,
    id: JobId,
) -> Result<i64> {
    Ok(sqlx::query_scalar!(
        r#"SELECT count(*) AS "n!" FROM jobs
           WHERE state = 'queued' AND NOT held AND class <= $2 AND model = ANY($1) AND id < $3"#,
        models,
        class as JobClass,
        id.0,
    )
    .fetch_one(ex)
    .await?)
}

/// The buckets of `keys` as they are, without locking them.
pub async fn buckets_by_key(ex: impl PgExecutor<'_>, keys: &[String]) -> Result<Vec<Bucket>> {
    Ok(sqlx::query_as!(
        Bucket,
        r#"SELECT id, key, dimension AS "dimension: Dimension", rule AS "rule: Rule", capacity, window_secs,
                  level, updated_at, resets_at, ramp_step, configured_capacity, learned_at
           FROM buckets WHERE key = ANY($1)"#,
        keys,
    )
    .fetch_all(ex)
    .await?)
}

/// Takes the forecast lock of each of `scopes` (provider models), in order, until the
/// transaction ends: deadline checks on the same provider model wait for each other, so
/// each reads the queue with the jobs the checks before it accepted.
pub async fn lock_forecasts(conn: &mut PgConnection, scopes: &[String]) -> Result<()> {
    let mut scopes = scopes.to_vec();
    scopes.sort();
    scopes.dedup();
    sqlx::query!(
        "SELECT pg_advisory_xact_lock($1, hashtext(s)) FROM unnest($2::text[]) WITH ORDINALITY AS t(s, n) ORDER BY n",
        FORECAST_LOCKS,
        &scopes,
    )
    .execute(conn)
    .await?;
    Ok(())
}

/// How long successful calls took, start to end, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallLatency {
    pub p50: f64,
    pub p90: f64,
    pub calls: i64,
}

/// The most recent calls whose durations are read: enough for a p90 by model, and a read
/// that stays small however many calls a busy broker makes.
const LATENCY_SAMPLE: i64 = 5_000;

/// Of the last [`LATENCY_SAMPLE`] calls since `since`, those that succeeded: their
/// duration's p50 and p90 by (provider, model).
pub async fn call_latencies(
    ex: impl PgExecutor<'_>,
    since: DateTime<Utc>,
) -> Result<HashMap<(String, String), CallLatency>> {
    let rows = sqlx::query!(
        r#"SELECT provider, provider_model,
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at))::float8 AS "p50!",
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at))::float8 AS "p90!",
                  count(*) AS "calls!"
           FROM (SELECT provider, provider_model, started_at, finished_at, outcome FROM job_attempts
                 WHERE finished_at > $1 ORDER BY finished_at DESC LIMIT $2) recent
           WHERE outcome = 'succeeded'
           GROUP BY provider, provider_model"#,
        since,
        LATENCY_SAMPLE,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| {
            (
                (r.provider, r.provider_model),
                CallLatency {
                    p50: r.p50,
                    p90: r.p90,
                    calls: r.calls,
                },
            )
        })
        .collect())
}

/// How the forecasts of the jobs that finished since `since` came out, and of which tenant
/// (`None`: every tenant's).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ForecastRecord {
    /// Finished jobs that carried a forecast.
    pub jobs: i64,
    /// The p50 and p90 of each one's relative error: |actual − forecast p50| over the
    /// forecast p50's time from submission (at least a second).
    pub p50_error: Option<f64>,
    pub p90_error: Option<f64>,
    /// The p90 of actual over forecast p50 time from submission (at least a second): how
    /// far beyond its p50 a job finishes, one time in ten.
    pub p90_overrun: Option<f64>,
    /// Of them, those that finished after their forecast p90.
    pub late: i64,
    /// Of them, those that failed for a deadline (`deadline_exceeded`, `deadline_unmeetable`).
    pub missed_deadline: i64,
}

/// How the forecasts of jobs finished since `since` came out.
pub async fn forecast_record(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    since: DateTime<Utc>,
) -> Result<ForecastRecord> {
    let r = sqlx::query!(
        r#"WITH f AS (
               SELECT extract(epoch FROM finished_at - created_at) AS actual,
                      greatest(extract(epoch FROM eta_p50 - created_at), 1.0) AS forecast,
                      finished_at > eta_p90 AS late,
                      error_code IN ('deadline_exceeded', 'deadline_unmeetable') AS missed
               FROM jobs
               WHERE finished_at > $1 AND eta_p50 IS NOT NULL AND ($2::text IS NULL OR tenant = $2))
           SELECT count(*) AS "jobs!",
                  percentile_cont(0.5) WITHIN GROUP (ORDER BY abs(actual - forecast) / forecast)::float8 AS p50_error,
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY abs(actual - forecast) / forecast)::float8 AS p90_error,
                  percentile_cont(0.9) WITHIN GROUP (ORDER BY actual / forecast)::float8 AS p90_overrun,
                  count(*) FILTER (WHERE late) AS "late!",
                  count(*) FILTER (WHERE missed) AS "missed!"
           FROM f"#,
        since,
        tenant,
    )
    .fetch_one(ex)
    .await?;
    Ok(ForecastRecord {
        jobs: r.jobs,
        p50_error: r.p50_error,
        p90_error: r.p90_error,
        p90_overrun: r.p90_overrun,
        late: r.late,
        missed_deadline: r.missed,
    })
}

/// Records the forecast of batch `id` (for all its lines).
pub async fn set_batch_eta(
    ex: impl PgExecutor<'_>,
    id: &str,
    p50: DateTime<Utc>,
    p90: DateTime<Utc>,
) -> Result<()> {
    sqlx::query!(
        "UPDATE batches SET eta_p50 = $2, eta_p90 = $3 WHERE id = $1",
        id,
        p50,
        p90
    )
    .execute(ex)
    .await?;
    Ok(())
}

/// The queued lines of batch `id` by model: how many, and their estimated tokens.
pub async fn batch_lines_by_model(ex: impl PgExecutor<'_>, id: &str) -> Result<Vec<Queued>> {
    // Every line is due: the due fields are the totals.
    Ok(sqlx::query_as!(
        Queued,
        r#"SELECT class AS "class!: JobClass", tenant AS "tenant!", model AS "model!",
                  count(*)::float8 AS "jobs!",
                  sum(estimated_input_tokens)::float8 AS "input_tokens!",
                  sum(estimated_output_tokens)::float8 AS "output_tokens!",
                  count(*)::float8 AS "due_jobs!",
                  sum(estimated_input_tokens)::float8 AS "due_input_tokens!",
                  sum(estimated_output_tokens)::float8 AS "due_output_tokens!",
                  min(created_at) AS "oldest!", max(created_at) AS "newest!"
           FROM jobs WHERE batch_id = $1 AND state = 'queued'
           GROUP BY class, tenant, model"#,
        id,
    )
    .fetch_all(ex)
    .await?)
}

/// Jobs submitted lately of one (class, tenant, requested model, priority) whose deadlines
/// stood about as far from their submission (within 5 %): how the gate will order what
/// arrives next against work already queued ([`arrived_since`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Arrived {
    /// Their count and tokens; the due fields are their totals.
    pub queued: Queued,
    pub priority: i32,
    /// Seconds from submission to deadline, the shortest of them.
    pub lead: f64,
}

/// The jobs submitted since `since` (by their time-ordered ids), by class, tenant,
/// requested model, priority and how far their deadline stood ([`Arrived`]).
pub async fn arrived_since(ex: impl PgExecutor<'_>, since: DateTime<Utc>) -> Result<Vec<Arrived>> {
    // The smallest UUIDv7 of `since`'s millisecond: every id made from then on sorts after it.
    let millis = u128::try_from(since.timestamp_millis()).unwrap_or(0);
    let first = uuid::Uuid::from_u128(millis << 80);
    let rows = sqlx::query!(
        r#"SELECT class AS "class!: JobClass", tenant AS "tenant!", model AS "model!", priority AS "priority!",
                  count(*)::float8 AS "jobs!",
                  sum(estimated_input_tokens)::float8 AS "input_tokens!",
                  sum(estimated_output_tokens)::float8 AS "output_tokens!",
                  min(extract(epoch FROM deadline - created_at))::float8 AS "lead!",
                  min(created_at) AS "oldest!", max(created_at) AS "newest!"
           FROM jobs WHERE id >= $1
           GROUP BY class, tenant, model, priority,
                    round(20 * ln(greatest(extract(epoch FROM deadline - created_at)::float8, 1.0)))"#,
        first,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| Arrived {
            queued: Queued {
                class: r.class,
                tenant: r.tenant,
                model: r.model,
                jobs: r.jobs,
                input_tokens: r.input_tokens,
                output_tokens: r.output_tokens,
                due_jobs: r.jobs,
                due_input_tokens: r.input_tokens,
                due_output_tokens: r.output_tokens,
                oldest: r.oldest,
                newest: r.newest,
            },
            priority: r.priority,
            lead: r.lead,
        })
        .collect())
}
