//! What operators and tenants watch, read from the database: queue depth and oldest age by
//! tenant and class, recent provider traffic, recent failures, tenant shares. `tenant = None` reads every tenant; `Some(t)` only `t`'s jobs.

use chrono::{DateTime, Utc};
use sqlx::PgExecutor;

use super::Result;
use crate::model::JobClass;

/// Unfinished jobs of one (tenant, class).
#[derive(Debug, Clone, PartialEq)]
pub struct QueueDepth {
    pub tenant: String,
    pub class: JobClass,
    pub queued: i64,
    pub admitted: i64,
    pub running: i64,
    /// When the oldest queued job was submitted (none queued: `None`).
    pub oldest_queued: Option<DateTime<Utc>>,
}

pub async fn queue_depths(ex: impl PgExecutor<'_>, tenant: Option<&str>) -> Result<Vec<QueueDepth>> {
    Ok(sqlx::query_as!(
        QueueDepth,
        // One branch per state, each matching its partial index (`jobs_gate`,
        // `jobs_admitted`, `jobs_running_lease`), so finished rows are never read. Every
        // class is named so that one tenant's queued jobs are found in `jobs_gate` (class,
        // tenant, …) without passing other tenants' (admitted and running jobs are few:
        // the gate's batch and the dispatchers' room bound them).
        r#"SELECT tenant AS "tenant!", class AS "class!: JobClass", sum(queued)::bigint AS "queued!",
                sum(admitted)::bigint AS "admitted!", sum(running)::bigint AS "running!",
                min(oldest) AS oldest_queued
         FROM (
             SELECT tenant, class, count(*) AS queued, 0 AS admitted, 0 AS running, min(created_at) AS oldest
             FROM jobs WHERE state = 'queued' AND class = ANY(enum_range(NULL::job_class))
                         AND ($1::text IS NULL OR tenant = $1)
             GROUP BY tenant, class
             UNION ALL
             SELECT tenant, class, 0, count(*), 0, NULL
             FROM jobs WHERE state = 'admitted' AND ($1::text IS NULL OR tenant = $1) GROUP BY tenant, class
             UNION ALL
             SELECT tenant, class, 0, 0, count(*), NULL
             FROM jobs WHERE state = 'running' AND ($1::text IS NULL OR tenant = $1) GROUP BY tenant, class
         ) q
         GROUP BY tenant, class ORDER BY tenant, class"#,
        tenant,
    )
    .fetch_all(ex)
    .await?)
}

/// Jobs of each (tenant, class) that finished (however) after `since`: the rate a queue
/// drains at. Reads the finished jobs of the window only (`jobs_finished_at`).
pub async fn finished_by_queue(
    ex: impl PgExecutor<'_>,
    since: DateTime<Utc>,
    tenant: Option<&str>,
) -> Result<Vec<(String, JobClass, i64)>> {
    let rows = sqlx::query!(
        r#"SELECT tenant, class AS "class: JobClass", count(*) AS "finished!"
           FROM jobs
           WHERE state IN ('succeeded', 'failed', 'cancelled') AND finished_at > $1
             AND ($2::text IS NULL OR tenant = $2)
           GROUP BY tenant, class"#,
        since,
        tenant,
    )
    .fetch_all(ex)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.tenant, r.class, r.finished))
        .collect())
}

/// Provider calls of one tenant that finished in a window.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Traffic {
    pub tenant: String,
    /// Attempts that succeeded (jobs done).
    pub succeeded: i64,
    /// Attempts that failed (retried or final).
    pub failed: i64,
    /// Input + output tokens the provider reported.
    pub tokens: i64,
    pub status_429: i64,
    pub status_5xx: i64,
}

/// Provider calls finished in `(since, until]`, per tenant.
pub async fn traffic(
    ex: impl PgExecutor<'_>,
    since: DateTime<Utc>,
    until: DateTime<Utc>,
    tenant: Option<&str>,
) -> Result<Vec<Traffic>> {
    Ok(sqlx::query_as!(
        Traffic,
        r#"SELECT tenant,
                  count(*) FILTER (WHERE outcome = 'succeeded') AS "succeeded!",
                  count(*) FILTER (WHERE outcome <> 'succeeded') AS "failed!",
                  coalesce(sum(coalesce(input_tokens, 0)::bigint + coalesce(output_tokens, 0)), 0)::bigint AS "tokens!",
                  count(*) FILTER (WHERE status = 429) AS "status_429!",
                  count(*) FILTER (WHERE status >= 500) AS "status_5xx!"
           FROM job_attempts
           WHERE finished_at > $1 AND finished_at <= $2 AND ($3::text IS NULL OR tenant = $3)
           GROUP BY tenant ORDER BY tenant"#,
        since,
        until,
        tenant,
    )
    .fetch_all(ex)
    .await?)
}

/// A failed job, for the list of recent failures.
#[derive(Debug, Clone, PartialEq)]
pub struct RecentFailure {
    pub id: uuid::Uuid,
    pub tenant: String,
    pub model: String,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub attempts: i32,
    pub finished_at: Option<DateTime<Utc>>,
}

pub async fn recent_failures(
    ex: impl PgExecutor<'_>,
    tenant: Option<&str>,
    limit: i64,
) -> Result<Vec<RecentFailure>> {
    Ok(sqlx::query_as!(
        RecentFailure,
        "SELECT id, tenant, model, error_code, error_message, attempt AS attempts, finished_at
         FROM jobs WHERE state = 'failed' AND ($1::text IS NULL OR tenant = $1)
         ORDER BY finished_at DESC NULLS LAST LIMIT $2",
        tenant,
        limit,
    )
    .fetch_all(ex)
    .await?)
}

/// Estimated tokens each tenant holds in admitted and running jobs: its share of the
/// capacity in use.
pub async fn tenant_holdings(ex: impl PgExecutor<'_>) -> Result<Vec<(String, i64)>> {
    let holdings = sqlx::query!(
        r#"SELECT tenant AS "tenant!", sum(tokens)::bigint AS "tokens!" FROM (
               SELECT tenant, estimated_input_tokens::bigint + estimated_output_tokens AS tokens
               FROM jobs WHERE state = 'admitted'
               UNION ALL
               SELECT tenant, estimated_input_tokens::bigint + estimated_output_tokens
               FROM jobs WHERE state = 'running'
           ) held GROUP BY tenant ORDER BY tenant"#,
    )
    .fetch_all(ex)
    .await?;
    Ok(holdings.into_iter().map(|h| (h.tenant, h.tokens)).collect())
}
