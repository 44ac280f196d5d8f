//! Webhook endpoints and the delivery outbox. Events are written in the transaction of
//! the state change they announce (jobs: the `jobs_webhook_events` trigger; batches:
//! finalization calls [`enqueue_event`]); the sender claims due deliveries with a lease
//! and writes each attempt's outcome guarded by its attempt number.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, PgExecutor, Postgres};

use super::Result;

/// A tenant's endpoint as the config names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    pub tenant: String,
    pub url: String,
    pub secret: String,
    pub events: Vec<String>,
}

/// Makes the tenant endpoints in the database those of the config: new ones are added,
/// changed ones updated (a 410-disabled endpoint stays disabled until its URL changes),
/// removed ones deleted with their pending deliveries.
pub async fn sync_endpoints(
    conn: &mut PgConnection,
    specs: &[EndpointSpec],
    now: DateTime<Utc>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant, url, secret, events, created_at)
         SELECT t.tenant, t.url, t.secret, string_to_array(t.events, ','), $5
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS t(tenant, url, secret, events)
         ON CONFLICT (tenant, url) WHERE batch_id IS NULL
         DO UPDATE SET secret = excluded.secret, events = excluded.events",
    )
    .bind(specs.iter().map(|s| s.tenant.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.url.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.secret.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.events.join(",")).collect::<Vec<_>>())
    .bind(now)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "DELETE FROM webhook_endpoints e WHERE e.batch_id IS NULL
           AND NOT EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) AS t(tenant, url)
                           WHERE t.tenant = e.tenant AND t.url = e.url)",
    )
    .bind(specs.iter().map(|s| s.tenant.as_str()).collect::<Vec<_>>())
    .bind(specs.iter().map(|s| s.url.as_str()).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Registers a batch's own endpoint (in the transaction that creates the batch).
pub async fn add_batch_endpoint(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    batch_id: &str,
    url: &str,
    secret: &str,
    events: &[String],
    now: DateTime<Utc>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO webhook_endpoints (tenant, batch_id, url, secret, events, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(tenant)
    .bind(batch_id)
    .bind(url)
    .bind(secret)
    .bind(events)
    .bind(now)
    .execute(ex)
    .await?;
    Ok(())
}

/// Queues `body` for every live endpoint of the tenant (and of the batch) subscribed to
/// `event_type`. Call in the transaction of the state change it announces.
pub async fn enqueue_event(
    ex: impl PgExecutor<'_>,
    tenant: &str,
    batch_id: Option<&str>,
    event_type: &str,
    body: &str,
    now: DateTime<Utc>,
) -> Result<u64> {
    Ok(sqlx::query(
        "INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
         SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, $3, $4, $5, $5
         FROM webhook_endpoints e
         WHERE e.tenant = $1 AND (e.batch_id IS NULL OR e.batch_id = $2)
           AND e.disabled_at IS NULL AND $3 = ANY (e.events)",
    )
    .bind(tenant)
    .bind(batch_id)
    .bind(event_type)
    .bind(body)
    .bind(now)
    .execute(ex)
    .await?
    .rows_affected())
}

/// A delivery claimed for one attempt.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Delivery {
    pub id: String,
    pub endpoint_id: i64,
    pub url: String,
    pub secret: String,
    pub event_type: String,
    pub body: String,
    /// This attempt's number (1 = the first).
    pub attempts: i32,
}

/// Claims up to `limit` due deliveries: bumps their attempt and pushes `next_attempt_at`
/// to `now + lease`, so a sender that dies mid-attempt has them retried after the lease.
pub async fn claim_deliveries(
    ex: impl PgExecutor<'_>,
    now: DateTime<Utc>,
    limit: i64,
    lease: std::time::Duration,
) -> Result<Vec<Delivery>> {
    Ok(sqlx::query_as::<Postgres, Delivery>(
        "WITH due AS (
             SELECT id FROM webhook_deliveries
             WHERE state = 'pending' AND next_attempt_at <= $1
             ORDER BY next_attempt_at LIMIT $2
             FOR UPDATE SKIP LOCKED)
         UPDATE webhook_deliveries d SET attempts = d.attempts + 1, next_attempt_at = $3
         FROM due, webhook_endpoints e
         WHERE d.id = due.id AND e.id = d.endpoint_id
         RETURNING d.id, d.endpoint_id, e.url, e.secret, d.event_type, d.body, d.attempts",
    )
    .bind(now)
    .bind(limit)
    .bind(now + lease)
    .fetch_all(ex)
    .await?)
}

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Attempted {
    Delivered {
        status: i32,
    },
    /// Try again at `at`.
    Retry {
        at: DateTime<Utc>,
        status: Option<i32>,
        error: String,
    },
    /// Out of attempts (or refused for good).
    Failed {
        status: Option<i32>,
        error: String,
    },
    /// The receiver answered 410 Gone: disable the endpoint and fail what waits for it.
    Gone,
}

/// Writes an attempt's outcome if the delivery is still at that attempt (a sender whose
/// lease ran out does not overwrite the next one). Returns whether it was written.
pub async fn record_attempt(
    conn: &mut PgConnection,
    d: &Delivery,
    outcome: &Attempted,
    now: DateTime<Utc>,
) -> Result<bool> {
    let (state, next, status, error): (&str, Option<DateTime<Utc>>, Option<i32>, Option<&str>) = match outcome
    {
        Attempted::Delivered { status } => ("delivered", None, Some(*status), None),
        Attempted::Retry { at, status, error } => ("pending", Some(*at), *status, Some(error)),
        Attempted::Failed { status, error } => ("failed", None, *status, Some(error)),
        Attempted::Gone => ("failed", None, Some(410), Some("the receiver answered 410 Gone")),
    };
    let written = sqlx::query(
        "UPDATE webhook_deliveries SET state = $3, next_attempt_at = COALESCE($4, next_attempt_at),
                last_status = $5, last_error = $6,
                delivered_at = CASE WHEN $3 = 'delivered' THEN $7 END
         WHERE id = $1 AND attempts = $2 AND state = 'pending'",
    )
    .bind(&d.id)
    .bind(d.attempts)
    .bind(state)
    .bind(next)
    .bind(status)
    .bind(error)
    .bind(now)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        > 0;
    if written && *outcome == Attempted::Gone {
        sqlx::query("UPDATE webhook_endpoints SET disabled_at = $2 WHERE id = $1 AND disabled_at IS NULL")
            .bind(d.endpoint_id)
            .bind(now)
            .execute(&mut *conn)
            .await?;
        sqlx::query(
            "UPDATE webhook_deliveries SET state = 'failed', last_error = 'the endpoint was disabled (410 Gone)'
             WHERE endpoint_id = $1 AND state = 'pending'",
        )
        .bind(d.endpoint_id)
        .execute(&mut *conn)
        .await?;
    }
    Ok(written)
}

/// Deletes up to `limit` delivered or failed deliveries created before `before`.
pub async fn prune_deliveries(ex: impl PgExecutor<'_>, before: DateTime<Utc>, limit: i64) -> Result<u64> {
    Ok(sqlx::query(
        "DELETE FROM webhook_deliveries WHERE id IN (
             SELECT id FROM webhook_deliveries WHERE state <> 'pending' AND created_at < $1 LIMIT $2)",
    )
    .bind(before)
    .bind(limit)
    .execute(ex)
    .await?
    .rows_affected())
}

/// When the next pending delivery is due (for the sender's sleep), if any.
pub async fn next_delivery_due(ex: impl PgExecutor<'_>) -> Result<Option<DateTime<Utc>>> {
    Ok(
        sqlx::query_scalar("SELECT min(next_attempt_at) FROM webhook_deliveries WHERE state = 'pending'")
            .fetch_one(ex)
            .await?,
    )
}
